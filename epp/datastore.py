"""The endpoint datastore: the pool's endpoints and what is known about each.

Who may write what (the whole EPP runs on one asyncio event loop, so no locks):
- endpoint sources (static file, Kubernetes) add, change and remove endpoints;
- the metrics source replaces an endpoint's `metrics` snapshot;
- the director counts in-flight requests (`acquire` at pick, `release` at the end).
Plugins only read, and only during a pick.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Final

from epp import defaults


@dataclass(frozen=True, slots=True)
class EndpointSpec:
    """Where an endpoint is and how to observe it; what endpoint sources produce."""

    name: str
    address: str  # ip:port, what Envoy connects to
    metrics_url: str | None = None  # None: http://<address>/metrics
    kv_events: str | None = None  # the engine's KV-event PUB socket, e.g. tcp://10.0.0.5:5557
    kv_events_replay: str | None = None  # its replay ROUTER socket
    labels: Mapping[str, str] = field(default_factory=dict)

    @property
    def effective_metrics_url(self) -> str:
        return self.metrics_url or f"http://{self.address}/metrics"


# Names of the facts in an `EndpointMetrics` snapshot, as /debug/endpoints shows them;
# `EndpointMetrics.missing` is keyed by these.
WAITING: Final = "waiting"
RUNNING: Final = "running"
KV_CACHE_USAGE: Final = "kvCacheUsage"
LORA: Final = "lora"
CACHE_INFO: Final = "cacheInfo"


@dataclass(frozen=True, slots=True)
class EndpointMetrics:
    """A snapshot of an endpoint's model-server metrics, replaced as a whole.

    `updated_at` is the source's clock (production: `time.monotonic()`) at the last
    scrape that produced these values (0.0: never scraped). A snapshot older than
    `staleness_s` is stale: plugins must not trust its values (they score it
    neutrally). So is one whose latest scrape found the server `unreachable`
    (connection refused, no route): nothing listens there any more, so the last
    good values, however recent, describe a pod that is gone, and waiting for them
    to age would send it requests that cannot succeed. A fact the page did not
    carry, or carried as NaN, infinity or a negative number, is in `missing` with
    the reason, and its field holds the default, which is not a fact either."""

    waiting_requests: int = 0
    running_requests: int = 0
    kv_cache_usage: float = 0.0  # 0..1
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    max_adapters: int = 0
    block_size: int = 0  # tokens per KV block (cache info); 0: not reported
    num_gpu_blocks: int = 0  # KV blocks in the pool (cache info); 0: not reported
    # Extra series a `core-metrics-extractor` engine config maps (`customMetrics`).
    custom: Mapping[str, float] = field(default_factory=dict)
    updated_at: float = 0.0
    # Set by the metrics source (--metrics-staleness-threshold).
    staleness_s: float = defaults.METRICS_STALENESS_THRESHOLD.seconds
    # Fact name (WAITING, ...) -> why it is not known.
    missing: Mapping[str, str] = field(default_factory=dict)
    # Why the latest scrape failed (timeout, HTTP error, unusable page), while the
    # values above are still those of the last good one; None after a good scrape.
    error: str | None = None
    # The latest scrape was refused (or had no route): stale now, whatever the age.
    unreachable: bool = False
    # The latest scrape got no answer (it timed out, or the connection broke): a
    # server that is hung, or too overloaded to answer, once it lasts (`down`).
    unanswered: bool = False
    # The endpoint's `routed` count when the scrape that read these values was sent:
    # the requests routed there since are not in `waiting_requests` yet
    # (`Endpoint.unseen_routed`).
    routed_seen: int = 0

    # `now` is always the caller's (its clock's): a snapshot's age is never read
    # from the wall clock behind a simulation's back.
    def age(self, now: float) -> float:
        if self.updated_at == 0.0:
            return float("inf")
        return now - self.updated_at

    def down(self, now: float) -> bool:
        """Whether the server is taken as gone or hung: it refused the latest scrape
        (`unreachable`), or has answered none for longer than the staleness
        threshold (`unanswered`, the last good scrape older than `staleness_s`). A
        server that answered, however badly (an HTTP error, a page that could not
        be read), is up; so is one whose first scrape has not ended yet."""
        return (self.unreachable or self.unanswered) and self.stale(now)

    def stale(self, now: float) -> bool:
        # `age` spelled out: a scorer asks this of every candidate in a pick.
        if self.unreachable:
            return True
        age = now - self.updated_at if self.updated_at != 0.0 else math.inf
        return age > self.staleness_s

    def known(self, fact: str, now: float) -> bool:
        """Whether `fact` (WAITING, ...) may be trusted: the snapshot is fresh and the
        page reported it with a valid value."""
        # `not self.stale(now)` spelled out: plugins ask this of every candidate.
        if fact in self.missing or self.unreachable:
            return False
        age = now - self.updated_at if self.updated_at != 0.0 else math.inf
        return not age > self.staleness_s

    def all_known(self, facts: Iterable[str], now: float) -> bool:
        """`known` for each of `facts`, the snapshot's age read once (a scorer reads
        several facts of every candidate in a pick)."""
        # `not self.stale(now)` spelled out, as in `known`.
        if self.unreachable:
            return False
        age = now - self.updated_at if self.updated_at != 0.0 else math.inf
        return not age > self.staleness_s and self.missing.keys().isdisjoint(facts)


@dataclass(slots=True)
class EndpointProgress:
    """What the director has seen of an engine's progress (epp/stalls.py decides
    from it whether the engine has stalled). Written by the director only."""

    # Requests routed here whose first response chunk is still to come, oldest
    # first: the decision's number -> the clock at its pick. Only requests whose stream
    # reports first chunks (not lean mode's).
    awaiting: dict[int, float] = field(default_factory=dict)
    # Since when nothing has progressed here: the latest first chunk from here, or
    # request completed here.
    quiet_since: float = 0.0
    # Stalled: no candidate until then.
    excluded_until: float = 0.0
    # Stalls in a row, without progress between them (the exclusion doubles).
    stalls: int = 0


class Endpoint:
    """One model-server endpoint. Compared and hashed by identity: a scorer's result
    maps `Endpoint` objects to scores."""

    __slots__ = ("in_flight", "metrics", "progress", "ready", "routed", "spec")

    def __init__(self, spec: EndpointSpec) -> None:
        self.spec = spec
        self.metrics = EndpointMetrics()
        self.ready = True
        # Requests the EPP sent here that have not finished yet: fresher than any
        # scraped queue length, so a burst between two scrapes is still seen.
        self.in_flight = 0
        # Requests the EPP ever sent here (never decreases): with
        # `metrics.routed_seen`, the ones its latest scrape cannot have counted.
        self.routed = 0
        self.progress = EndpointProgress()

    @property
    def unseen_routed(self) -> int:
        """Requests sent here after the scrape behind `metrics` was sent: not in its
        waiting count yet, though most are waiting (or just admitted) by now. What a
        reader adds to the scraped queue so that a burst dispatched between two
        scrapes counts at once (a new endpoint object starts from zero, as does its
        first snapshot)."""
        return max(0, self.routed - self.metrics.routed_seen)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def address(self) -> str:
        return self.spec.address

    @property
    def labels(self) -> Mapping[str, str]:
        return self.spec.labels

    def __repr__(self) -> str:
        return f"Endpoint({self.spec.name!r}, {self.spec.address!r})"


MembershipListener = Callable[[list[Endpoint], list[Endpoint]], None]
"""Called with (added, removed) endpoints after every change of the endpoint set."""


class Datastore:
    def __init__(self) -> None:
        self._by_name: dict[str, Endpoint] = {}
        self._ready: tuple[Endpoint, ...] = ()
        self._listeners: list[MembershipListener] = []
        # True once an endpoint source delivered its first complete view of the pool:
        # until then the EPP is not ready (an empty pool is not the same as unknown).
        self.synced = False

    # -- reads (plugins, the director, admin) --------------------------------

    def ready_endpoints(self) -> tuple[Endpoint, ...]:
        """The endpoints a request may be sent to, in a stable order."""
        return self._ready

    def all_endpoints(self) -> tuple[Endpoint, ...]:
        return tuple(self._by_name.values())

    def get(self, name: str) -> Endpoint | None:
        return self._by_name.get(name)

    def add_listener(self, listener: MembershipListener) -> None:
        self._listeners.append(listener)

    def listeners(self) -> tuple[MembershipListener, ...]:
        """The listeners, in the order they were added (to tell which ones a
        config's plugins added, so they go with the config)."""
        return tuple(self._listeners)

    def remove_listener(self, listener: MembershipListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    # -- writes (endpoint sources) ---------------------------------------------

    def replace_all(
        self, specs: Iterable[EndpointSpec], not_ready: AbstractSet[str] | None = None
    ) -> None:
        """Make the endpoint set exactly `specs` (a source's full view of the pool).

        Endpoints whose spec is unchanged keep their state (metrics, in-flight
        counts); a changed spec (new address, say) is a new endpoint. With
        `not_ready`, every endpoint's readiness is set in the same step (ready unless
        named there), so no reader ever sees a new endpoint ready before its time;
        without it, readiness is left as it is (new endpoints are ready)."""
        wanted = {spec.name: spec for spec in specs}
        added: list[Endpoint] = []
        removed: list[Endpoint] = []
        for name, endpoint in list(self._by_name.items()):
            if wanted.get(name) != endpoint.spec:
                removed.append(self._by_name.pop(name))
        for name, spec in wanted.items():
            if name not in self._by_name:
                endpoint = Endpoint(spec)
                self._by_name[name] = endpoint
                added.append(endpoint)
        if not_ready is not None:
            for name, endpoint in self._by_name.items():
                endpoint.ready = name not in not_ready
        self.synced = True
        self._changed(added, removed)

    def set_ready(self, name: str, ready: bool) -> None:
        endpoint = self._by_name.get(name)
        if endpoint is not None and endpoint.ready != ready:
            endpoint.ready = ready
            self._changed([], [])

    # -- writes (metrics source) -----------------------------------------------

    def set_metrics(self, name: str, metrics: EndpointMetrics) -> None:
        endpoint = self._by_name.get(name)
        if endpoint is not None:
            endpoint.metrics = metrics

    # -- writes (the director) ---------------------------------------------------

    @staticmethod
    def acquire(endpoint: Endpoint) -> None:
        endpoint.in_flight += 1
        endpoint.routed += 1

    @staticmethod
    def release(endpoint: Endpoint) -> None:
        # An endpoint removed meanwhile is still a valid object: the count simply
        # dies with it.
        endpoint.in_flight = max(0, endpoint.in_flight - 1)

    def _changed(self, added: list[Endpoint], removed: list[Endpoint]) -> None:
        self._ready = tuple(e for e in self._by_name.values() if e.ready)
        if added or removed:
            for listener in tuple(self._listeners):
                listener(added, removed)
