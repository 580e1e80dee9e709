"""List + watch of one Kubernetes collection, with the official (synchronous)
`kubernetes` client run in worker threads, so no API call ever blocks the event
loop that serves requests.

The state machine, one per watched collection:

    LISTING ──ok──▶ WATCHING ──server timeout / clean end──▶ WATCHING (from the last rv)
       │  ▲            │  │
       │  │            │  └──ERROR 410 Gone (rv too old)──▶ LISTING (at once)
       │  │            └──dropped, read timeout, 5xx, 403…──▶ BACKING_OFF ──▶ WATCHING (last rv)
       │  └─────────────────────────────────────────────────── (or LISTING if never listed)
       └──error──▶ BACKING_OFF ──▶ LISTING

- A list returns the whole collection and its resourceVersion (rv); the handler
  gets it with `replace`, which is the only place a deletion missed while not
  watching can show up.
- A watch resumes from the last rv seen: an event's object's rv, or a BOOKMARK's
  (`allowWatchBookmarks`), so a quiet collection still moves its rv forward and a
  resume after a long quiet spell does not fall out of the server's window.
- `timeoutSeconds` (jittered in [T, 2T), like client-go, so replicas do not
  re-watch in step) makes the server end every watch; the client's read timeout is
  that plus a grace period, so a connection that died without a FIN (a node gone,
  a NAT entry dropped) is noticed even when the server cannot end it. TCP
  keepalive (set on the client configuration) notices a dead peer sooner.
- Errors back off exponentially with jitter (reset by a successful list, or a watch
  that delivered something), so a down API server is not hammered by every replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import json
import logging
import random
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from kubernetes.client.exceptions import ApiException
from kubernetes.watch.watch import iter_resp_lines

from epp.sources.kube.errors import Expired, KubeError, classify
from epp.sources.kube.options import WatchSettings

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class WatchState(enum.Enum):
    STARTING = "starting"
    LISTING = "listing"
    WATCHING = "watching"
    BACKING_OFF = "backing_off"
    STOPPED = "stopped"


class Backoff:
    """Exponential backoff with jitter: initial, 2x, 4x, ... up to `max_s`; each
    delay is drawn from [d/2, d] so retries of many clients spread out."""

    def __init__(self, initial_s: float, max_s: float, rng: random.Random | None = None) -> None:
        self.initial_s = initial_s
        self.max_s = max_s
        self.failures = 0
        self._rng = rng or random.Random()

    def next_delay(self) -> float:
        delay = min(self.max_s, self.initial_s * (2**self.failures))
        self.failures += 1
        return self._rng.uniform(delay / 2, delay)

    def reset(self) -> None:
        self.failures = 0


@dataclass
class WatchStatus:
    """What a reflector is doing, for /readyz, the logs and tests."""

    state: WatchState = WatchState.STARTING
    since: float = field(default_factory=time.monotonic)
    synced: bool = False  # a list has completed
    resource_version: str | None = None
    error: KubeError | None = None  # the last failure, until something succeeds
    retry_in_s: float | None = None
    lists: int = 0
    watches: int = 0
    events: int = 0


class Handler(Protocol[T]):
    """Receives a collection's state on the event loop, in order."""

    def replace(self, items: list[T]) -> None:
        """The whole collection, from a list."""

    def apply(self, event_type: str, item: T) -> None:
        """ADDED, MODIFIED or DELETED."""


@dataclass(frozen=True)
class Collection:
    """One collection the API serves: a list function of the official client
    (`CoreV1Api.list_namespaced_pod`, `CustomObjectsApi.list_namespaced_custom_object`)
    with its fixed arguments, and names for messages."""

    list_fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    resource: str  # plural, e.g. "pods"
    group: str  # "" for the core API
    namespace: str
    server: str  # the API server's address, for messages

    def describe(self) -> str:
        selector = self.kwargs.get("label_selector") or self.kwargs.get("field_selector")
        where = f" ({selector})" if selector else ""
        return f"{self.resource}{where} in namespace {self.namespace!r}"


class _Stream:
    """A watch in progress, so another thread can end it."""

    def __init__(self) -> None:
        self.cancelled = threading.Event()
        self.response: Any = None

    def cancel(self) -> None:
        self.cancelled.set()
        response = self.response
        if response is None:
            return
        # Unblock the worker's read at once (the official client's Watch.stop does
        # the same): shut the socket down; the worker then closes the response.
        try:
            sock = getattr(getattr(response, "connection", None), "sock", None)
            if sock is not None:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _in_thread(
    loop: asyncio.AbstractEventLoop, fn: Callable[[], R], name: str
) -> asyncio.Future[R]:
    """Run blocking `fn` in a daemon thread. Not the default executor: watches hold
    a thread for minutes, and a daemon thread never delays the process's exit."""
    future: asyncio.Future[R] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if future.done():
            return  # cancelled meanwhile
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value)

    def target() -> None:
        try:
            result: Any = fn()
            ok = True
        except BaseException as exc:  # handed to the awaiting task, never lost
            result, ok = exc, False
        # A closed loop (RuntimeError): nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(settle, ok, result)

    threading.Thread(target=target, name=name, daemon=True).start()
    return future


class Reflector(Generic[T]):
    """Keeps `handler` in step with one collection until cancelled."""

    def __init__(
        self,
        collection: Collection,
        decode: Callable[[Mapping[str, Any]], T],
        handler: Handler[T],
        settings: WatchSettings,
        *,
        on_status: Callable[[WatchStatus], None] | None = None,
        on_error: Callable[[str, KubeError], None] | None = None,
        on_event: Callable[[str], None] | None = None,
        on_list: Callable[[str], None] | None = None,
        first_list: str = "initial",
        rng: random.Random | None = None,
    ) -> None:
        """`on_list(reason)`: after each complete list, `first_list` (initial) for the
        first, `expired` after a 410."""
        self.collection = collection
        self.decode = decode
        self.handler = handler
        self.settings = settings
        self.status = WatchStatus()
        self._on_status = on_status
        self._on_error = on_error
        self._on_event = on_event
        self._on_list = on_list
        self._first_list = first_list
        self._rng = rng or random.Random()
        self._backoff = Backoff(settings.backoff_initial_s, settings.backoff_max_s, self._rng)
        self._stream: _Stream | None = None
        # The rv the last delivered event carried (written by the watch thread).
        self._rv: str | None = None
        self._stopped = False

    # -- state ---------------------------------------------------------------------

    def _set_state(self, state: WatchState) -> None:
        if self.status.state is not state:
            self.status.state = state
            self.status.since = time.monotonic()
        if self._on_status is not None:
            self._on_status(self.status)

    def _failed(self, operation: str, error: KubeError) -> None:
        previous = self.status.error
        self.status.error = error
        if self._on_error is not None:
            self._on_error(operation, error)
        # Logged when the failure changes, not on every retry of the same one.
        if previous is None or previous.message != error.message:
            log.warning("kubernetes: %s", error.message)

    def _succeeded(self) -> None:
        if self.status.error is not None:
            log.info("kubernetes: %s: recovered", self.collection.describe())
        self.status.error = None
        self.status.retry_in_s = None

    # -- the loop ------------------------------------------------------------------

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            reason = self._first_list
            while True:
                try:
                    rv = await self._list(loop, reason)
                    if rv is None:
                        continue  # failed, backed off: list again
                    reason = await self._watch_until_expired(loop, rv)
                except Exception:
                    # A bug, not the API's doing: a dead reflector would leave the
                    # endpoints frozen without a word, so say it and start over.
                    log.exception(
                        "kubernetes: %s: unexpected error; listing again",
                        self.collection.describe(),
                    )
                    reason = "error"
                    await self._back_off()
        finally:
            self._stopped = True
            if self._stream is not None:
                self._stream.cancel()
            self._set_state(WatchState.STOPPED)

    async def _list(self, loop: asyncio.AbstractEventLoop, reason: str) -> str | None:
        """List the collection into the handler; its rv, or None after a failure
        (and its backoff)."""
        self._set_state(WatchState.LISTING)
        try:
            items, rv = await _in_thread(
                loop, self._list_blocking, f"list {self.collection.resource}"
            )
        except KubeError as error:
            self._failed("list", error)
            await self._back_off()
            return None
        self.status.lists += 1
        if self._on_list is not None:
            self._on_list(reason)
        self.handler.replace(items)
        self.status.synced = True
        self.status.resource_version = rv
        self._rv = rv
        self._succeeded()
        self._backoff.reset()
        return rv

    async def _watch_until_expired(self, loop: asyncio.AbstractEventLoop, rv: str) -> str:
        """Watch from `rv`, resuming after every end, until the server says the rv
        expired; the reason to list again."""
        while True:
            self._set_state(WatchState.WATCHING)
            timeout = int(self._rng.uniform(1.0, 2.0) * self.settings.watch_timeout_s) or 1
            stream = self._stream = _Stream()
            events_before = self.status.events
            started = time.monotonic()
            try:
                await _in_thread(
                    loop,
                    functools.partial(self._watch_blocking, loop, stream, rv, timeout),
                    f"watch {self.collection.resource}",
                )
            except Expired as error:
                # The server no longer has our rv: only a fresh list is consistent.
                log.info("kubernetes: %s; listing again", error.message)
                if self._on_error is not None:
                    self._on_error("watch", error)
                return "expired"
            except KubeError as error:
                rv = self._rv or rv
                self._failed("watch", error)
                if self.status.events > events_before:
                    self._backoff.reset()
                await self._back_off()
                continue
            finally:
                stream.cancel()
                self._stream = None
            rv = self._rv or rv
            self.status.resource_version = rv
            self._succeeded()
            if self.status.events > events_before:
                self._backoff.reset()
            elif time.monotonic() - started < self.settings.min_watch_s:
                # Ended at once with nothing in it: do not spin.
                await self._back_off()

    async def _back_off(self) -> None:
        delay = self._backoff.next_delay()
        self.status.retry_in_s = delay
        self._set_state(WatchState.BACKING_OFF)
        await asyncio.sleep(delay)

    # -- worker threads (blocking; never touch the handler directly) --------------

    def _call(self, **kwargs: Any) -> Any:
        c = self.collection
        return c.list_fn(*c.args, **c.kwargs, **kwargs)

    def _error(self, exc: BaseException, verb: str) -> KubeError:
        c = self.collection
        return classify(
            exc,
            verb=verb,
            resource=c.resource,
            group=c.group,
            namespace=c.namespace,
            server=c.server,
        )

    def _list_blocking(self) -> tuple[list[T], str]:
        s = self.settings
        try:
            response = self._call(
                _preload_content=False,
                _request_timeout=(s.connect_timeout_s, s.list_timeout_s),
            )
            try:
                body = json.loads(response.data)
            finally:
                response.release_conn()
        except BaseException as exc:
            raise self._error(exc, "list") from exc
        if not isinstance(body, dict) or not isinstance(body.get("items", []), list):
            raise self._error(ValueError("the list is not a Kubernetes List object"), "list")
        # Decoded here, off the event loop.
        items = [self.decode(obj) for obj in body.get("items") or ()]
        rv = str((body.get("metadata") or {}).get("resourceVersion") or "")
        return items, rv

    def _watch_blocking(
        self, loop: asyncio.AbstractEventLoop, stream: _Stream, rv: str, timeout: int
    ) -> None:
        s = self.settings
        try:
            response = self._call(
                watch=True,
                resource_version=rv,
                allow_watch_bookmarks=True,
                timeout_seconds=timeout,
                _preload_content=False,
                _request_timeout=(s.connect_timeout_s, timeout + s.read_grace_s),
            )
        except BaseException as exc:
            raise self._error(exc, "watch") from exc
        stream.response = response
        try:
            if stream.cancelled.is_set():
                return
            try:
                loop.call_soon_threadsafe(self._connected, stream)
            except RuntimeError:
                return  # the loop is gone
            for line in iter_resp_lines(response):  # type: ignore[no-untyped-call]
                if stream.cancelled.is_set():
                    return
                if line:
                    self._watch_line(loop, stream, line)
        except KubeError:
            raise
        except BaseException as exc:
            if stream.cancelled.is_set():
                return  # our own shutdown of the socket
            raise self._error(exc, "watch") from exc
        finally:
            response.close()
            response.release_conn()

    def _watch_line(self, loop: asyncio.AbstractEventLoop, stream: _Stream, line: str) -> None:
        event = json.loads(line)
        event_type = event.get("type")
        obj = event.get("object") or {}
        if event_type == "ERROR":
            # A Status object: 410 when our rv is older than the server's window.
            code = int(obj.get("code") or 0)
            error = ApiException(status=code, reason=obj.get("reason"))
            error.body = json.dumps(obj)
            raise self._error(error, "watch")
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        if event_type == "BOOKMARK":
            # Only the rv is meaningful in a bookmark's object.
            if rv and not stream.cancelled.is_set():
                self._rv = str(rv)
            return
        if event_type not in ("ADDED", "MODIFIED", "DELETED"):
            return
        item = self.decode(obj)
        try:
            loop.call_soon_threadsafe(self._deliver, stream, event_type, item)
        except RuntimeError:
            stream.cancelled.set()  # the loop is gone
            return
        # Set here, in the thread, before the event is applied on the loop: the
        # reflector reads it only after this watch's end has been handed over, which
        # call_soon_threadsafe orders after every event of the watch.
        if rv and not stream.cancelled.is_set():
            self._rv = str(rv)

    # -- back on the event loop ----------------------------------------------------

    def _connected(self, stream: _Stream) -> None:
        # A watch that connects clears the last failure at once, not when it ends.
        if not (self._stopped or stream.cancelled.is_set()):
            self._succeeded()

    def _deliver(self, stream: _Stream, event_type: str, item: T) -> None:
        # Events of a watch that was cancelled (a selector change replaced this
        # reflector, or shutdown) are dropped.
        if self._stopped or stream.cancelled.is_set():
            return
        self.status.events += 1
        if self._on_event is not None:
            self._on_event(event_type)
        self.handler.apply(event_type, item)
