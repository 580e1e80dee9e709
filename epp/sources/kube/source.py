"""The Kubernetes endpoint source: the pods of an InferencePool (or of a label
selector, standalone), kept in the datastore by list + watch.

Two modes (exactly one; docs/architecture.md, "Processes, ports, the endpoints file"):
- InferencePool (`--pool-name`, `--pool-namespace`, `--pool-group`): the pool object
  is watched too, so a change of its selector re-targets the pod watch (a fresh
  list with the new selector) and a change of its ports rebuilds the endpoints,
  both without a restart.
- Standalone (`--endpoint-selector k=v,... --endpoint-target-ports 8000[,8001]`): no
  CRD needed.

What the datastore holds, at any moment:
- before the first complete view (pool found and its pods listed): nothing, and
  `Datastore.synced` is False, so the EPP is not ready; `not_ready_reason` says
  what it is waiting for or what failed (unreachable API server, RBAC, no pool);
- afterwards: one endpoint per (pod with an IP, not being deleted) x target port,
  ready iff the pod's `Ready` condition is True. When the API server goes away
  after that, the last view keeps serving (and the watch keeps retrying), as an
  informer's cache would;
- if the pool is deleted: nothing, and not ready, like GIE (its datastore is
  cleared): the pool is the declaration of what may be routed to, and without it
  a gateway that honours `failureMode` can fail open. The pool watch goes on, and a
  re-created pool is picked up.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.config.config_exception import ConfigException
from kubernetes.utils.keepalive import tcp_keepalive_socket_options
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from epp.datastore import Datastore, EndpointSpec
from epp.sources.kube.objects import (
    POOL_PLURAL,
    POOL_VERSIONS,
    InvalidPool,
    PodInfo,
    PoolSpec,
    check_ports,
    check_selector,
    parse_pool,
    pod_endpoints,
    pod_info,
    port_problem,
)
from epp.sources.kube.options import KubeConfigError, KubeOptions
from epp.sources.kube.reflector import (
    Collection,
    Reflector,
    WatchState,
    WatchStatus,
)

log = logging.getLogger(__name__)

# At most this many pods' port problems are logged one by one at once; the rest
# are counted in one line (a pool retargeted to a port no pod declares would
# otherwise log once per pod).
MAX_PROBLEMS_LOGGED: Final = 3

# TCP keepalive on API connections: an idle watch to a vanished peer is dropped
# after about 15 + 3 x 5 s, well before its read timeout.
KEEPALIVE_IDLE_S: Final = 15
KEEPALIVE_INTERVAL_S: Final = 5
KEEPALIVE_COUNT: Final = 3


def load_client_configuration(kubeconfig: str | None = None) -> k8s.Configuration:
    """The API client's configuration: an explicit kubeconfig, else the in-cluster
    service account, else $KUBECONFIG or ~/.kube/config. `KubeConfigError` if none
    is usable."""
    configuration = k8s.Configuration()
    try:
        if kubeconfig:
            k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=kubeconfig, client_configuration=configuration
            )
        elif os.environ.get("KUBERNETES_SERVICE_HOST"):
            # Also re-reads the projected service-account token as it rotates.
            k8s_config.load_incluster_config(  # type: ignore[no-untyped-call]
                client_configuration=configuration
            )
        else:
            # Read here, not at import: the client's own default is frozen when the
            # module is imported.
            path = os.environ.get("KUBECONFIG") or str(Path("~/.kube/config").expanduser())
            if not any(Path(p).expanduser().is_file() for p in path.split(os.pathsep) if p):
                raise KubeConfigError(
                    "not running in a cluster (KUBERNETES_SERVICE_HOST is unset) and no"
                    f" kubeconfig at {path}: give --kubeconfig FILE or set KUBECONFIG"
                )
            k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=path, client_configuration=configuration
            )
    except (ConfigException, OSError, ValueError) as exc:
        raise KubeConfigError(f"cannot configure the Kubernetes client: {exc}") from exc
    configuration.socket_options = tcp_keepalive_socket_options(
        KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_COUNT
    )
    # Retries are the reflector's (with backoff and a state you can see), not
    # urllib3's silent ones.
    configuration.retries = False
    return configuration


@dataclass(frozen=True, slots=True)
class _PoolItem:
    """An InferencePool as the watch thread decoded it: its spec or why it is unusable."""

    name: str
    spec: PoolSpec | None
    error: str | None


def _decode_pool(obj: Mapping[str, Any]) -> _PoolItem:
    name = str((obj.get("metadata") or {}).get("name", ""))
    try:
        return _PoolItem(name, parse_pool(obj), None)
    except InvalidPool as exc:
        return _PoolItem(name, None, str(exc))


class _PoolHandler:
    def __init__(self, source: KubernetesEndpointSource) -> None:
        self.source = source

    def replace(self, items: list[_PoolItem]) -> None:
        self.source._pool_seen(items[0] if items else None, "listed")

    def apply(self, event_type: str, item: _PoolItem) -> None:
        self.source._pool_seen(None if event_type == "DELETED" else item, event_type.lower())


class _PodHandler:
    """Pod events for one pod reflector; a replaced reflector's late calls are
    ignored (its generation is no longer the source's)."""

    def __init__(self, source: KubernetesEndpointSource, generation: int) -> None:
        self.source = source
        self.generation = generation

    def replace(self, items: list[PodInfo]) -> None:
        if self.generation == self.source._generation:
            self.source._pods_listed(items)

    def apply(self, event_type: str, item: PodInfo) -> None:
        if self.generation == self.source._generation:
            self.source._pod_event(event_type, item)


class _Metrics:
    def __init__(self, registry: CollectorRegistry, source: KubernetesEndpointSource) -> None:
        self.events = Counter(
            "epp_kubernetes_watch_events",
            "Watch events applied, by resource (pods, inferencepools) and type"
            " (ADDED, MODIFIED, DELETED).",
            ["resource", "type"],
            registry=registry,
        )
        self.lists = Counter(
            "epp_kubernetes_lists",
            "Complete lists of a resource, by why: initial, expired (410 Gone on resume),"
            " selector (the pool's selector changed), error (after an unexpected error).",
            ["resource", "reason"],
            registry=registry,
        )
        self.errors = Counter(
            "epp_kubernetes_errors",
            "Failed lists and watches, by resource, operation and reason (unreachable,"
            " timeout, forbidden, unauthorized, not_found, expired, server_error,"
            " bad_response).",
            ["resource", "operation", "reason"],
            registry=registry,
        )
        registry.register(_StateCollector(source))


class _StateCollector(Collector):
    def __init__(self, source: KubernetesEndpointSource) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "epp_kubernetes_watch_state",
            "1 for the state each watched resource is in (listing, watching, backing_off).",
            labels=["resource", "state"],
        )
        for resource, status in self.source.statuses().items():
            for state in (WatchState.LISTING, WatchState.WATCHING, WatchState.BACKING_OFF):
                family.add_metric([resource, state.value], 1.0 if status.state is state else 0.0)
        yield family
        pods = GaugeMetricFamily(
            "epp_kubernetes_pods",
            "Pods the selector matches, by state: ready (routed), not_ready, no_ip (not"
            " scheduled or not started yet), terminating (being deleted).",
            labels=["state"],
        )
        for pod_state, count in self.source.pod_states().items():
            pods.add_metric([pod_state], float(count))
        yield pods


class KubernetesEndpointSource:
    def __init__(
        self,
        options: KubeOptions,
        datastore: Datastore,
        *,
        configuration: k8s.Configuration | None = None,
        registry: CollectorRegistry | None = None,
        on_status: Callable[[], None] | None = None,
        rng: random.Random | None = None,
    ) -> None:
        """`configuration`: the API client's (default: `load_client_configuration`,
        which raises `KubeConfigError`). `on_status`: called when readiness may
        have changed (synced or not)."""
        problems = options.check()
        if problems:
            raise ValueError("; ".join(problems))
        self.options = options
        self.datastore = datastore
        self.configuration = configuration or load_client_configuration(options.kubeconfig)
        self.api_client = k8s.ApiClient(self.configuration)
        # Made here, at start-up: the client imports each API's module on first use,
        # and the core one takes about a second, which must not stall the event
        # loop later (when a pool appears, say).
        self._core_api = k8s.CoreV1Api(self.api_client)
        self._custom_api = k8s.CustomObjectsApi(self.api_client)
        self.on_status = on_status
        self._rng = rng or random.Random()
        self._metrics = _Metrics(registry if registry is not None else CollectorRegistry(), self)
        # The pool's spec (standalone: the flags'); None while there is none.
        self.pool: PoolSpec | None = None
        self._pool_problem: str | None = None  # why there is no usable pool
        self._pool_reflector: Reflector[_PoolItem] | None = None
        self._pod_reflector: Reflector[PodInfo] | None = None
        self._pod_task: asyncio.Task[None] | None = None
        self._generation = 0
        self._pods: dict[str, PodInfo] = {}
        # Each pod's endpoints and readiness, recomputed only when the pod changes.
        self._endpoints: dict[str, tuple[list[EndpointSpec], bool]] = {}
        self._pods_synced = False
        self._flush_scheduled = False
        # Each pod's port problem (see `port_problem`), so it is logged once.
        self._problems: dict[str, str] = {}
        self._selector_changes = 0
        if options.pool_name:
            self._pool_reflector = self._reflector(
                self._pool_collection(), _decode_pool, _PoolHandler(self)
            )
        else:
            self.pool = PoolSpec(
                check_selector(options.endpoint_selector or {}),
                check_ports(options.endpoint_target_ports),
            )

    # -- what it is doing --------------------------------------------------------

    def statuses(self) -> dict[str, WatchStatus]:
        out: dict[str, WatchStatus] = {}
        if self._pool_reflector is not None:
            out[POOL_PLURAL] = self._pool_reflector.status
        if self._pod_reflector is not None:
            out["pods"] = self._pod_reflector.status
        return out

    def pod_states(self) -> dict[str, int]:
        """How many of the selected pods are ready, not_ready, no_ip, terminating."""
        counts = dict.fromkeys(("ready", "not_ready", "no_ip", "terminating"), 0)
        for pod in self._pods.values():
            if pod.terminating:
                counts["terminating"] += 1
            elif pod.ip is None:
                counts["no_ip"] += 1
            else:
                counts["ready" if pod.ready else "not_ready"] += 1
        return counts

    def not_ready_reason(self) -> str | None:
        """Why the source has no complete view of the pool yet (None: it has)."""
        if self.datastore.synced:
            return None
        pool_reflector = self._pool_reflector
        if self.options.pool_name:
            where = f"InferencePool {self.options.pool_namespace}/{self.options.pool_name}"
            if pool_reflector is None:
                return f"Kubernetes: {where}: not started"
            status = pool_reflector.status
            if not status.synced:
                return "Kubernetes: " + _waiting(status, f"listing {where}")
            if self.pool is None:
                return f"Kubernetes: {self._pool_problem or where + ' not found'}"
        pods = self._pod_reflector
        if pods is None:
            return "Kubernetes: the pod watch has not started"
        selector = self.pool.label_selector if self.pool is not None else ""
        return "Kubernetes: " + _waiting(
            pods.status, f"listing pods ({selector}) in namespace {self.options.pool_namespace!r}"
        )

    # -- running -----------------------------------------------------------------

    async def run(self) -> None:
        try:
            if self._pool_reflector is not None:
                await self._pool_reflector.run()
            else:
                self._start_pods()
                await asyncio.Event().wait()
        finally:
            await self._stop_pods()
            self.api_client.close()  # type: ignore[no-untyped-call]

    def _reflector(
        self, collection: Collection, decode: Any, handler: Any, first_list: str = "initial"
    ) -> Reflector[Any]:
        resource = collection.resource
        return Reflector(
            collection,
            decode,
            handler,
            self.options.watch,
            on_error=lambda op, error: self._metrics.errors.labels(
                resource, op, error.reason
            ).inc(),
            on_event=lambda event_type: self._metrics.events.labels(resource, event_type).inc(),
            on_list=lambda reason: self._metrics.lists.labels(resource, reason).inc(),
            first_list=first_list,
            rng=self._rng,
        )

    def _pool_collection(self) -> Collection:
        o = self.options
        return Collection(
            self._custom_api.list_namespaced_custom_object,
            (o.pool_group, POOL_VERSIONS[o.pool_group], o.pool_namespace, POOL_PLURAL),
            {"field_selector": f"metadata.name={o.pool_name}"},
            POOL_PLURAL,
            o.pool_group,
            o.pool_namespace,
            self.configuration.host,
        )

    def _pod_collection(self, pool: PoolSpec) -> Collection:
        return Collection(
            self._core_api.list_namespaced_pod,
            (self.options.pool_namespace,),
            {"label_selector": pool.label_selector},
            "pods",
            "",
            self.options.pool_namespace,
            self.configuration.host,
        )

    def _start_pods(self) -> None:
        """(Re)start the pod watch for the current pool's selector."""
        assert self.pool is not None
        self._generation += 1
        self._pods_synced = False
        reflector = self._reflector(
            self._pod_collection(self.pool),
            pod_info,
            _PodHandler(self, self._generation),
            # The first list of a new selector is a re-target, not a start.
            first_list="selector" if self._selector_changes else "initial",
        )
        self._pod_reflector = reflector
        self._pod_task = asyncio.get_running_loop().create_task(reflector.run(), name="k8s-pods")

    async def _stop_pods(self) -> None:
        task, self._pod_task = self._pod_task, None
        self._generation += 1  # late events of the old watch are dropped from now on
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _stop_pods_now(self) -> None:
        """Stop the pod watch from a synchronous callback (its task ends on its own)."""
        task, self._pod_task = self._pod_task, None
        self._generation += 1
        if task is not None:
            task.cancel()

    # -- the pool ----------------------------------------------------------------

    def _pool_seen(self, item: _PoolItem | None, how: str) -> None:
        where = f"InferencePool {self.options.pool_namespace}/{self.options.pool_name}"
        if item is None:
            if self.pool is not None or how == "deleted":
                log.warning(
                    "kubernetes: %s was deleted: no endpoints until it is re-created", where
                )
                self._pool_problem = f"{where} was deleted; waiting for it to be re-created"
            else:
                log.warning("kubernetes: %s not found; waiting for it", where)
                self._pool_problem = f"{where} not found; waiting for it to be created"
            self._set_pool(None)
            return
        if item.spec is None:
            # Keep serving the last valid spec: an invalid edit (which CRD validation
            # should have refused) must not take the pool down.
            log.error("kubernetes: %s is invalid: %s", where, item.error)
            if self.pool is None:
                self._pool_problem = f"{where} is invalid: {item.error}"
            return
        self._pool_problem = None
        self._set_pool(item.spec)

    def _set_pool(self, pool: PoolSpec | None) -> None:
        old = self.pool
        if pool == old:
            return
        self.pool = pool
        if pool is None:
            self._stop_pods_now()
            self._pods.clear()
            self._endpoints.clear()
            self._problems.clear()
            was_synced = self.datastore.synced
            self.datastore.replace_all([])
            # No pool is not an empty pool: the EPP is not ready.
            self.datastore.synced = False
            if was_synced:
                self._status_changed()
            return
        log.info(
            "kubernetes: InferencePool %s/%s: %s%s",
            self.options.pool_namespace,
            self.options.pool_name,
            pool.describe(),
            f", endpoint picker {pool.picker_ref} ({pool.failure_mode})" if pool.picker_ref else "",
        )
        if old is None or old.selector != pool.selector:
            # The endpoints of the old selector keep serving until the new list
            # replaces them: a re-target never empties the pool in between.
            if old is not None:
                self._selector_changes += 1
            self._stop_pods_now()
            self._start_pods()
        else:
            # Same pods, other ports: every pod's endpoints change.
            self._endpoints = {
                name: pod_endpoints(pod, pool.target_ports, self.options.kv_events)
                for name, pod in self._pods.items()
            }
            self._check_ports(self._pods.values(), reset=True)
            self._flush()

    # -- pods --------------------------------------------------------------------

    def _pods_listed(self, pods: list[PodInfo]) -> None:
        assert self.pool is not None
        ports, kv = self.pool.target_ports, self.options.kv_events
        self._pods = {pod.name: pod for pod in pods}
        self._endpoints = {pod.name: pod_endpoints(pod, ports, kv) for pod in pods}
        self._pods_synced = True
        self._check_ports(pods, reset=True)
        self._flush()

    def _pod_event(self, event_type: str, pod: PodInfo) -> None:
        assert self.pool is not None
        if event_type == "DELETED":
            self._pods.pop(pod.name, None)
            self._endpoints.pop(pod.name, None)
            self._problems.pop(pod.name, None)
        else:
            if self._pods.get(pod.name) == pod:
                return  # a change the endpoints do not depend on (a status heartbeat)
            self._pods[pod.name] = pod
            self._endpoints[pod.name] = pod_endpoints(
                pod, self.pool.target_ports, self.options.kv_events
            )
            self._check_ports((pod,))
        # A burst of events (a rollout) becomes one datastore update.
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _check_ports(self, pods: Iterable[PodInfo], reset: bool = False) -> None:
        """Log the port problems of `pods` that are new (`reset`: `pods` is every
        pod, so problems of pods not among them are forgotten)."""
        assert self.pool is not None
        ports = self.pool.target_ports
        if reset:
            old, self._problems = self._problems, {}
        else:
            old = self._problems
        new: list[str] = []
        for pod in pods:
            problem = port_problem(pod, ports)
            if problem is None:
                self._problems.pop(pod.name, None)
                continue
            if old.get(pod.name) != problem:
                new.append(problem)
            self._problems[pod.name] = problem
        for problem in new[:MAX_PROBLEMS_LOGGED]:
            log.warning("kubernetes: %s", problem)
        if len(new) > MAX_PROBLEMS_LOGGED:
            log.warning(
                "kubernetes: %d more pods have port problems like these",
                len(new) - MAX_PROBLEMS_LOGGED,
            )

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._pods_synced or self.pool is None:
            return
        specs: list[EndpointSpec] = []
        not_ready: set[str] = set()
        for endpoints, ready in self._endpoints.values():
            specs.extend(endpoints)
            if not ready:
                not_ready.update(e.name for e in endpoints)
        was_synced = self.datastore.synced
        self.datastore.replace_all(specs, not_ready=not_ready)
        if not was_synced:
            log.info(
                "kubernetes: synced %s: %d endpoints (%d ready)",
                self.options.describe(),
                len(specs),
                len(specs) - len(not_ready),
            )
            self._status_changed()

    def _status_changed(self) -> None:
        if self.on_status is not None:
            self.on_status()


def _waiting(status: WatchStatus, doing: str) -> str:
    if status.error is None:
        return doing
    retry = f"; retrying in {status.retry_in_s:.1f}s" if status.retry_in_s is not None else ""
    return f"{status.error.message}{retry}"
