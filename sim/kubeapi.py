"""A simulated Kubernetes API server: the part of the real protocol an informer uses.

No kube-apiserver can run here, so the EPP's Kubernetes source is tested (and its
churn latency measured) against this one, through the official `kubernetes`
client. It speaks HTTP like the real server:

- collections: core pods (`/api/v1/namespaces/{ns}/pods`) and namespaced custom
  resources (`/apis/{group}/{version}/namespaces/{ns}/{plural}`, the InferencePool
  CRDs of both API versions installed by default; a collection whose CRD is not
  installed answers 404 like the real server);
- list: `labelSelector` (=, ==, !=, in, notin, exists, !exists), `fieldSelector`
  (metadata.name, metadata.namespace), the list's `metadata.resourceVersion`;
- watch (`watch=true`): events after `resourceVersion` replayed from a bounded
  history, then live, as newline-delimited JSON over a chunked response; an object
  that starts or stops matching the selector is ADDED or DELETED for that watcher;
  `allowWatchBookmarks` gets periodic BOOKMARK events; `timeoutSeconds` ends the
  watch; a resourceVersion older than the history gives the real server's
  `ERROR` event with a 410 `Expired` Status;
- writes: POST (create), PUT (replace) and DELETE of pods and custom objects, each
  with a fresh resourceVersion from one counter, like etcd's;
- errors as `Status` bodies: 401 without the expected bearer token, 403 for a
  verb/resource the test forbids (RBAC), 404 unknown object or collection, 409
  on create of an existing name.

And fault injection for tests: `compact()` (every resourceVersion so far becomes
too old), `drop_watches()` (abort the open watch connections mid-stream),
`stall_watches()` (new watches send headers and then nothing, ever: a dead
connection only a client read timeout can notice), `forbid(verb, resource)`.

Run alone: `python -m sim kubeapi --port 8001 --pods 3 --pool pool --kubeconfig kc`
(see `main`). The `python -m bench churn` benchmark runs it in its own process.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import copy
import itertools
import json
import logging
import re
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar

from aiohttp import web

log = logging.getLogger(__name__)

R = TypeVar("R")
Obj = dict[str, Any]
# (group, version, plural): "" group is the core API.
Kind = tuple[str, str, str]

PODS: Final[Kind] = ("", "v1", "pods")
POOLS_V1: Final[Kind] = ("inference.networking.k8s.io", "v1", "inferencepools")
POOLS_V1ALPHA2: Final[Kind] = ("inference.networking.x-k8s.io", "v1alpha2", "inferencepools")
_KIND_NAMES: Final = {
    "pods": ("Pod", "PodList"),
    "inferencepools": ("InferencePool", "InferencePoolList"),
}


def status_body(code: int, reason: str, message: str, details: Obj | None = None) -> Obj:
    """A `Status` object, as the real API server puts in error responses."""
    body: Obj = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details is not None:
        body["details"] = details
    return body


# ---------------------------------------------------------------------------
# Selectors


@dataclass(frozen=True)
class _Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!exists"
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        if self.op == "exists":
            return present
        if self.op == "!exists":
            return not present
        if self.op in ("=", "in"):
            return present and labels[self.key] in self.values
        # "!=" and "notin" match objects without the key, as in Kubernetes.
        return not present or labels[self.key] not in self.values


_SET_REQ = re.compile(r"^\s*([^\s!=(),]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_top_level(text: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    depth = 0
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p for p in (p.strip() for p in parts) if p]


def parse_label_selector(text: str) -> list[_Requirement]:
    """ValueError for a selector the real server would refuse (400)."""
    requirements: list[_Requirement] = []
    for part in _split_top_level(text or ""):
        match = _SET_REQ.match(part)
        if match:
            values = frozenset(v.strip() for v in match.group(3).split(",") if v.strip())
            requirements.append(_Requirement(match.group(1), match.group(2), values))
        elif "!=" in part:
            key, value = part.split("!=", 1)
            requirements.append(_Requirement(key.strip(), "!=", frozenset({value.strip()})))
        elif "=" in part:
            key, value = part.split("==", 1) if "==" in part else part.split("=", 1)
            requirements.append(_Requirement(key.strip(), "=", frozenset({value.strip()})))
        elif part.startswith("!"):
            requirements.append(_Requirement(part[1:].strip(), "!exists"))
        elif re.fullmatch(r"[A-Za-z0-9./_-]+", part):
            requirements.append(_Requirement(part, "exists"))
        else:
            raise ValueError(f"unable to parse requirement: {part!r}")
    return requirements


def parse_field_selector(text: str) -> list[tuple[str, bool, str]]:
    """(field path, equal?, value) requirements; ValueError for unsupported fields."""
    out: list[tuple[str, bool, str]] = []
    for part in _split_top_level(text or ""):
        if "!=" in part:
            path, value = part.split("!=", 1)
            equal = False
        elif "=" in part:
            path, value = part.split("==", 1) if "==" in part else part.split("=", 1)
            equal = True
        else:
            raise ValueError(f"invalid field selector: {part!r}")
        path = path.strip()
        if path not in ("metadata.name", "metadata.namespace"):
            raise ValueError(f'field label not supported: "{path}"')
        out.append((path, equal, value.strip()))
    return out


@dataclass(frozen=True)
class _Selector:
    labels: list[_Requirement]
    fields: list[tuple[str, bool, str]]

    def matches(self, obj: Obj | None) -> bool:
        if obj is None:
            return False
        metadata = obj.get("metadata") or {}
        labels = metadata.get("labels") or {}
        if not all(r.matches(labels) for r in self.labels):
            return False
        for path, equal, value in self.fields:
            actual = metadata.get(path.split(".", 1)[1], "")
            if (actual == value) != equal:
                return False
        return True


# ---------------------------------------------------------------------------
# The server


@dataclass
class _Event:
    rv: int
    kind: Kind
    namespace: str
    type: str  # ADDED, MODIFIED, DELETED
    obj: Obj
    old: Obj | None


@dataclass
class _Watcher:
    kind: Kind
    namespace: str
    selector: _Selector
    queue: asyncio.Queue[_Event | None]
    request: web.Request


@dataclass
class RequestRecord:
    """One request the server received (for tests to check what the client sent)."""

    method: str
    path: str
    query: dict[str, str]
    at: float = field(default_factory=time.monotonic)

    @property
    def watch(self) -> bool:
        return self.query.get("watch") in ("true", "1", "True")


class FakeKubeApi:
    def __init__(
        self,
        *,
        token: str | None = None,
        history_limit: int = 10_000,
        bookmark_interval_s: float | None = 1.0,
    ) -> None:
        """`token`: the bearer token requests must carry (None: no authentication).
        `history_limit`: watch events kept for resuming; older rvs expire (410).
        `bookmark_interval_s`: how often a quiet watch that asked for bookmarks gets
        one (None: never)."""
        self.token = token
        self.history_limit = history_limit
        self.bookmark_interval_s = bookmark_interval_s
        self.crds: set[Kind] = {POOLS_V1, POOLS_V1ALPHA2}
        self.objects: dict[Kind, dict[tuple[str, str], Obj]] = collections.defaultdict(dict)
        self.history: collections.deque[_Event] = collections.deque()
        self.rv = 1000
        # rvs at or below this are too old to watch from (a compaction).
        self.compacted_rv = 0
        self.requests: list[RequestRecord] = []
        self.forbidden: set[tuple[str, str]] = set()  # (verb, plural)
        self.stalled = False
        self._watchers: list[_Watcher] = []
        self._uids = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self._stall_released = asyncio.Event()
        self.port = 0
        app = web.Application()
        app.router.add_route("*", "/api/v1/namespaces/{ns}/{plural}", self._collection)
        app.router.add_route("*", "/api/v1/namespaces/{ns}/{plural}/{name}", self._item)
        app.router.add_route(
            "*", "/apis/{group}/{version}/namespaces/{ns}/{plural}", self._collection
        )
        app.router.add_route(
            "*", "/apis/{group}/{version}/namespaces/{ns}/{plural}/{name}", self._item
        )
        self.app = app

    # -- lifecycle -------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        """Serve on host:port (0: a free port); the bound port."""
        self._runner = web.AppRunner(self.app, access_log=None, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self.port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        self.drop_watches()
        self._stall_released.set()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """Write a kubeconfig that points the official client at this server."""
        user: Obj = {"token": self.token} if self.token else {}
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "epp", "user": user}],
            "contexts": [
                {
                    "name": "fake",
                    "context": {"cluster": "fake", "user": "epp", "namespace": namespace},
                }
            ],
            "current-context": "fake",
        }
        path.write_text(json.dumps(config), encoding="utf-8")
        return path

    # -- fault injection ---------------------------------------------------------------

    def forbid(self, verb: str, plural: str) -> None:
        self.forbidden.add((verb, plural))

    def allow(self, verb: str, plural: str) -> None:
        self.forbidden.discard((verb, plural))

    def compact(self) -> None:
        """Forget the history: every rv before the current one is too old to watch
        from (410)."""
        self.history.clear()
        self.compacted_rv = self.rv

    def drop_watches(self) -> None:
        """Abort every open watch connection, as a crashed server or a dropped
        network path would."""
        for watcher in list(self._watchers):
            transport = watcher.request.transport
            if transport is not None:
                transport.abort()
            watcher.queue.put_nowait(None)
        self._watchers.clear()

    def stall_watches(self, stalled: bool = True) -> None:
        """Stalled: new watches get their headers and then no byte, ever."""
        self.stalled = stalled
        if stalled:
            self._stall_released = asyncio.Event()
        else:
            self._stall_released.set()

    def watchers(self, plural: str | None = None) -> int:
        return sum(1 for w in self._watchers if plural is None or w.kind[2] == plural)

    # -- the store -----------------------------------------------------------------------

    def get(self, kind: Kind, namespace: str, name: str) -> Obj | None:
        obj = self.objects[kind].get((namespace, name))
        return copy.deepcopy(obj) if obj is not None else None

    def write(self, kind: Kind, obj: Obj, *, create_only: bool = False) -> Obj:
        """Create or replace an object (its metadata.namespace and name); the stored
        object with its new resourceVersion."""
        metadata = obj.setdefault("metadata", {})
        namespace = metadata.setdefault("namespace", "default")
        name = metadata["name"]
        old = self.objects[kind].get((namespace, name))
        if old is not None and create_only:
            raise KeyError(name)
        self.rv += 1
        stored = copy.deepcopy(obj)
        group, version, plural = kind
        stored["apiVersion"] = f"{group}/{version}" if group else version
        stored["kind"] = _KIND_NAMES.get(plural, (plural, ""))[0]
        md = stored["metadata"]
        md["resourceVersion"] = str(self.rv)
        md["uid"] = (old or {}).get("metadata", {}).get("uid") or f"uid-{next(self._uids)}"
        md.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
        self.objects[kind][(namespace, name)] = stored
        self._record(_Event(self.rv, kind, namespace, "MODIFIED" if old else "ADDED", stored, old))
        return copy.deepcopy(stored)

    def delete(self, kind: Kind, namespace: str, name: str) -> Obj | None:
        old = self.objects[kind].pop((namespace, name), None)
        if old is None:
            return None
        self.rv += 1
        gone = copy.deepcopy(old)
        gone["metadata"]["resourceVersion"] = str(self.rv)
        self._record(_Event(self.rv, kind, namespace, "DELETED", gone, old))
        return gone

    def _record(self, event: _Event) -> None:
        self.history.append(event)
        while len(self.history) > self.history_limit:
            dropped = self.history.popleft()
            self.compacted_rv = max(self.compacted_rv, dropped.rv)
        for watcher in self._watchers:
            if watcher.kind == event.kind and watcher.namespace == event.namespace:
                watcher.queue.put_nowait(event)

    # -- helpers for pods and pools ------------------------------------------------------

    def put_pod(
        self,
        name: str,
        *,
        labels: Mapping[str, str],
        ip: str | None = None,
        ready: bool = False,
        terminating: bool = False,
        annotations: Mapping[str, str] | None = None,
        container_ports: Sequence[int] = (),
        namespace: str = "default",
    ) -> Obj:
        """Create or replace a pod in the shape the kubelet reports it: `ip` None is a
        pod not started yet; `terminating` one being deleted (still listed)."""
        conditions = [
            {"type": "PodScheduled", "status": "True"},
            {"type": "Initialized", "status": "True"},
            {"type": "ContainersReady", "status": "True" if ready else "False"},
            {"type": "Ready", "status": "True" if ready else "False"},
        ]
        status: Obj = {"phase": "Running" if ip else "Pending", "conditions": conditions}
        if ip:
            status["podIP"] = ip
            status["podIPs"] = [{"ip": ip}]
        metadata: Obj = {"name": name, "namespace": namespace, "labels": dict(labels)}
        if annotations:
            metadata["annotations"] = dict(annotations)
        if terminating:
            metadata["deletionTimestamp"] = "2026-01-01T00:00:30Z"
            metadata["deletionGracePeriodSeconds"] = 30
        container: Obj = {"name": "vllm", "image": "vllm/vllm-openai:latest"}
        if container_ports:
            container["ports"] = [{"containerPort": p, "protocol": "TCP"} for p in container_ports]
        pod = {"metadata": metadata, "spec": {"containers": [container]}, "status": status}
        return self.write(PODS, pod)

    def update_pod(self, name: str, namespace: str = "default", **changes: Any) -> Obj:
        """Re-put a pod with some of `put_pod`'s arguments changed."""
        current = self.objects[PODS][(namespace, name)]
        md, st = current["metadata"], current.get("status", {})
        args: dict[str, Any] = {
            "labels": md.get("labels", {}),
            "ip": st.get("podIP"),
            "ready": any(
                c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions", [])
            ),
            "terminating": "deletionTimestamp" in md,
            "annotations": md.get("annotations"),
            "container_ports": [
                port["containerPort"]
                for container in current.get("spec", {}).get("containers", [])
                for port in container.get("ports", [])
            ],
        }
        args.update(changes)
        return self.put_pod(name, namespace=namespace, **args)

    def delete_pod(self, name: str, namespace: str = "default") -> Obj | None:
        return self.delete(PODS, namespace, name)

    def put_pool(
        self,
        name: str,
        *,
        selector: Mapping[str, str],
        ports: Sequence[int],
        kind: Kind = POOLS_V1,
        namespace: str = "default",
        picker: str = "epp",
    ) -> Obj:
        if kind == POOLS_V1:
            spec: Obj = {
                "selector": {"matchLabels": dict(selector)},
                "targetPorts": [{"number": p} for p in ports],
                "endpointPickerRef": {
                    "name": picker,
                    "port": {"number": 9002},
                    "failureMode": "FailClose",
                },
            }
        else:
            spec = {
                "selector": dict(selector),
                "targetPortNumber": ports[0],
                "extensionRef": {"name": picker, "portNumber": 9002, "failureMode": "FailClose"},
            }
        return self.write(kind, {"metadata": {"name": name, "namespace": namespace}, "spec": spec})

    # -- HTTP ------------------------------------------------------------------------------

    def _kind(self, request: web.Request) -> Kind:
        info = request.match_info
        return (info.get("group", ""), info.get("version", "v1"), info["plural"])

    def _check(self, request: web.Request, verb: str) -> web.Response | None:
        """An error response for an unauthenticated, forbidden or unknown request."""
        self.requests.append(
            RequestRecord(request.method, request.path, dict(request.query.items()))
        )
        if self.token is not None and (
            request.headers.get("Authorization") != f"Bearer {self.token}"
        ):
            return _json(401, status_body(401, "Unauthorized", "Unauthorized"))
        kind = self._kind(request)
        group, _, plural = kind
        if kind != PODS and kind not in self.crds:
            return _json(
                404,
                status_body(404, "NotFound", "the server could not find the requested resource"),
            )
        if (verb, plural) in self.forbidden:
            ns = request.match_info["ns"]
            message = (
                f"{plural}{'.' + group if group else ''} is forbidden: User"
                f' "system:serviceaccount:{ns}:epp" cannot {verb} resource "{plural}" in API'
                f' group "{group}" in the namespace "{ns}"'
            )
            return _json(
                403, status_body(403, "Forbidden", message, {"kind": plural, "group": group})
            )
        return None

    async def _collection(self, request: web.Request) -> web.StreamResponse:
        if request.method == "GET":
            watch = request.query.get("watch") in ("true", "1", "True")
            denied = self._check(request, "watch" if watch else "list")
            if denied is not None:
                return denied
            try:
                selector = _Selector(
                    parse_label_selector(request.query.get("labelSelector", "")),
                    parse_field_selector(request.query.get("fieldSelector", "")),
                )
            except ValueError as exc:
                return _json(400, status_body(400, "BadRequest", str(exc)))
            if watch:
                return await self._watch(request, selector)
            return self._list(request, selector)
        if request.method == "POST":
            denied = self._check(request, "create")
            if denied is not None:
                return denied
            obj = await request.json()
            obj.setdefault("metadata", {})["namespace"] = request.match_info["ns"]
            try:
                stored = self.write(self._kind(request), obj, create_only=True)
            except KeyError:
                name = obj["metadata"].get("name")
                return _json(409, status_body(409, "AlreadyExists", f'"{name}" already exists'))
            return _json(201, stored)
        return _json(405, status_body(405, "MethodNotAllowed", "method not allowed"))

    async def _item(self, request: web.Request) -> web.StreamResponse:
        kind = self._kind(request)
        ns, name = request.match_info["ns"], request.match_info["name"]
        verb = {"GET": "get", "PUT": "update", "DELETE": "delete"}.get(request.method)
        if verb is None:
            return _json(405, status_body(405, "MethodNotAllowed", "method not allowed"))
        denied = self._check(request, verb)
        if denied is not None:
            return denied
        not_found = _json(
            404, status_body(404, "NotFound", f'{kind[2]} "{name}" not found', {"name": name})
        )
        if verb == "get":
            obj = self.get(kind, ns, name)
            return _json(200, obj) if obj is not None else not_found
        if verb == "update":
            obj = await request.json()
            obj.setdefault("metadata", {}).update(namespace=ns, name=name)
            return _json(200, self.write(kind, obj))
        gone = self.delete(kind, ns, name)
        return _json(200, gone) if gone is not None else not_found

    def _list(self, request: web.Request, selector: _Selector) -> web.Response:
        kind = self._kind(request)
        ns = request.match_info["ns"]
        items = []
        for (namespace, _), obj in sorted(self.objects[kind].items()):
            if namespace == ns and selector.matches(obj):
                item = copy.deepcopy(obj)
                # Items of a typed list carry no apiVersion/kind of their own.
                item.pop("apiVersion", None)
                item.pop("kind", None)
                items.append(item)
        group, version, plural = kind
        body = {
            "apiVersion": f"{group}/{version}" if group else version,
            "kind": _KIND_NAMES.get(plural, (plural, plural + "List"))[1],
            "metadata": {"resourceVersion": str(self.rv)},
            "items": items,
        }
        return _json(200, body)

    async def _watch(self, request: web.Request, selector: _Selector) -> web.StreamResponse:
        kind = self._kind(request)
        ns = request.match_info["ns"]
        query = request.query
        bookmarks = query.get("allowWatchBookmarks") in ("true", "1", "True")
        timeout = float(query["timeoutSeconds"]) if "timeoutSeconds" in query else None
        raw_rv = query.get("resourceVersion", "")
        response = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        if self.stalled:
            # Headers, then silence: the client's read timeout must notice.
            await self._stall_released.wait()
            return response
        queue: asyncio.Queue[_Event | None] = asyncio.Queue()
        watcher = _Watcher(kind, ns, selector, queue, request)
        start_rv = int(raw_rv) if raw_rv.isdigit() else 0
        # Resuming from rv needs the events after it: too old only below the
        # compaction point (a list taken right after a compaction can be watched).
        if raw_rv and raw_rv != "0" and start_rv < self.compacted_rv:
            await _send(
                response,
                {
                    "type": "ERROR",
                    "object": status_body(
                        410,
                        "Expired",
                        f"too old resource version: {start_rv} ({self.compacted_rv})",
                    ),
                },
            )
            return response
        if not raw_rv or raw_rv == "0":
            # No rv: the current state as ADDED events, then changes (a watch
            # without a list, as kubectl get -w does).
            for (namespace, _), obj in sorted(self.objects[kind].items()):
                if namespace == ns and selector.matches(obj):
                    queue.put_nowait(_Event(self.rv, kind, ns, "ADDED", obj, None))
        else:
            for past in self.history:
                if past.rv > start_rv and past.kind == kind and past.namespace == ns:
                    queue.put_nowait(past)
        self._watchers.append(watcher)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout is not None else None
        next_bookmark = (
            loop.time() + self.bookmark_interval_s
            if bookmarks and self.bookmark_interval_s is not None
            else None
        )
        try:
            while True:
                now = loop.time()
                # The server ends a watch at its timeout, busy or not.
                if deadline is not None and now >= deadline:
                    return response
                if not queue.empty():
                    event = queue.get_nowait()
                elif next_bookmark is not None and now >= next_bookmark:
                    # Only with nothing queued: a bookmark's rv tells the client it has
                    # seen everything up to it, so it must not overtake an event.
                    await _send(response, self._bookmark(kind))
                    next_bookmark = now + (self.bookmark_interval_s or 1.0)
                    continue
                else:
                    # Both times are ahead of `now` here: the wait is never zero (a
                    # zero wait_for would give up before the queue's getter ran).
                    waits = [t - now for t in (deadline, next_bookmark) if t is not None]
                    try:
                        event = await asyncio.wait_for(
                            queue.get(), timeout=min(waits) if waits else None
                        )
                    except TimeoutError:
                        continue
                if event is None:
                    return response  # dropped
                out = _watch_event(event, selector)
                if out is not None:
                    await _send(response, out)
        except (ConnectionResetError, asyncio.CancelledError):
            return response
        finally:
            if watcher in self._watchers:
                self._watchers.remove(watcher)

    def _bookmark(self, kind: Kind) -> Obj:
        group, version, plural = kind
        return {
            "type": "BOOKMARK",
            "object": {
                "kind": _KIND_NAMES.get(plural, (plural, ""))[0],
                "apiVersion": f"{group}/{version}" if group else version,
                "metadata": {"resourceVersion": str(self.rv)},
            },
        }


class KubeApiThread:
    """A `FakeKubeApi` on its own event loop in a daemon thread, for callers that
    are not on an event loop (end-to-end tests driving real processes). The
    server's methods touch its asyncio state, so they run on its loop: `call`.

        with KubeApiThread(token="t") as kube:
            kube.call(kube.api.put_pod, "vllm-0", labels={"app": "vllm"}, ip="10.0.0.1")
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, **options: Any) -> None:
        """`options`: `FakeKubeApi`'s."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._host, self._port = host, port
        self._options = options
        self._api: FakeKubeApi | None = None

    @property
    def api(self) -> FakeKubeApi:
        assert self._api is not None, "not started"
        return self._api

    def start(self) -> KubeApiThread:
        self._thread.start()

        async def start() -> FakeKubeApi:
            api = FakeKubeApi(**self._options)
            await api.start(self._host, self._port)
            return api

        self._api = asyncio.run_coroutine_threadsafe(start(), self._loop).result(10)
        return self

    def call(self, fn: Callable[..., R], *args: Any, **kwargs: Any) -> R:
        """`fn(*args, **kwargs)` run on the server's loop; its result."""

        async def run() -> R:
            return fn(*args, **kwargs)

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def stop(self) -> None:
        if self._api is not None:
            asyncio.run_coroutine_threadsafe(self._api.stop(), self._loop).result(10)
            self._api = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
        self._loop.close()

    def __enter__(self) -> KubeApiThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _watch_event(event: _Event, selector: _Selector) -> Obj | None:
    """What a watcher with `selector` sees of `event` (None: nothing). An object
    moving into the selection is ADDED, one moving out is DELETED."""
    now, before = selector.matches(event.obj), selector.matches(event.old)
    if event.type == "DELETED":
        kind = "DELETED" if before else None
    elif now and before:
        kind = "MODIFIED"
    elif now:
        kind = "ADDED"
    elif before:
        kind = "DELETED"
    else:
        kind = None
    if kind is None:
        return None
    return {"type": kind, "object": event.obj}


async def _send(response: web.StreamResponse, event: Obj) -> None:
    await response.write(json.dumps(event, separators=(",", ":")).encode() + b"\n")


def _json(status: int, body: object) -> web.Response:
    return web.Response(status=status, text=json.dumps(body), content_type="application/json")


# ---------------------------------------------------------------------------
# Standalone: `python -m sim kubeapi`, with an optional pod churn for benchmarks.


ROLE_LABEL = "llm-d.ai/role"


def pod_labels(labels: Mapping[str, str], index: int, prefill_pods: int) -> dict[str, str]:
    """Pod `index`'s labels: `labels`, and in a P/D pool (`prefill_pods` > 0) its
    llm-d.ai/role: prefill for the first `prefill_pods` pods, decode for the others."""
    out = dict(labels)
    if prefill_pods > 0:
        out[ROLE_LABEL] = "prefill" if index < prefill_pods else "decode"
    return out


async def _serve(args: argparse.Namespace) -> None:
    api = FakeKubeApi(
        token=args.token,
        bookmark_interval_s=args.bookmark_interval,
        history_limit=args.history_limit,
    )
    port = await api.start(args.host, args.port)
    labels = dict(kv.split("=", 1) for kv in args.labels.split(",") if kv)
    for i in range(args.pods):
        ip = f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{(i & 255) + 1}"
        api.put_pod(f"pod-{i}", labels=pod_labels(labels, i, args.prefill_pods), ip=ip, ready=True)
    if args.pool:
        api.put_pool(args.pool, selector=labels, ports=[args.target_port])
    if args.kubeconfig:
        api.kubeconfig(Path(args.kubeconfig))
    print(f"fake kube-apiserver on {args.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await api.stop()


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sim kubeapi",
        description="A simulated Kubernetes API server (list/watch of pods and"
        " InferencePools), for trying `epp serve --pool-name` by hand; change its pods through"
        " the official client (create, replace, delete; no PATCH, no discovery).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token", default=None, help="bearer token to require")
    parser.add_argument("--kubeconfig", default=None, help="write a kubeconfig for it here")
    parser.add_argument("--bookmark-interval", type=float, default=1.0)
    parser.add_argument("--history-limit", type=int, default=100_000)
    parser.add_argument("--labels", default="app=vllm", help="the pods' labels, k=v,...")
    parser.add_argument("--pool", default=None, help="create an InferencePool of this name")
    parser.add_argument("--target-port", type=int, default=8000, help="the pool's target port")
    parser.add_argument("--pods", type=int, default=0, help="Ready pods to create")
    parser.add_argument(
        "--prefill-pods",
        type=int,
        default=0,
        metavar="N",
        help="a P/D pool: the first N pods get llm-d.ai/role=prefill, the others decode"
        " (the pool's selector stays --labels)",
    )
    args = parser.parse_args(argv)
    if not 0 <= args.prefill_pods < max(args.pods, 1):
        parser.error("--prefill-pods must be in 0..pods-1 (a P/D pool needs a decode pod)")
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(_serve(args))
    return 0


__all__ = [
    "PODS",
    "POOLS_V1",
    "POOLS_V1ALPHA2",
    "FakeKubeApi",
    "KubeApiThread",
    "RequestRecord",
    "main",
    "parse_label_selector",
    "pod_labels",
    "status_body",
]
