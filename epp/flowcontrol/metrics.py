"""Flow control's Prometheus metrics (llm-d's `flow_control_*` names, with this
EPP's `epp_` prefix), registered in the registry of the config that runs the
controller, so a reload swaps them with it.

Label values are bounded: priorities come from the config's objectives, outcomes
are a fixed set, and a fairness id (which comes from a request header) keeps its
own label only for the first `MAX_FLOW_LABELS` ids seen; later ones are counted
under `other`. Queue sizes are read from the queues at scrape time, so a flow that
has emptied disappears from them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

MAX_FLOW_LABELS: Final = 64
OTHER_FLOWS: Final = "other"

# Queue waits: from a few milliseconds (a pass while the pool has room) to the
# default TTL and past it.
_WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

QueueSnapshot = Callable[[], Iterable[tuple[int, str, int, int]]]
"""(priority, fairness id, requests, bytes) of every non-empty flow."""


class FlowControlMetrics:
    def __init__(self, registry: CollectorRegistry, snapshot: QueueSnapshot) -> None:
        self._flows: set[str] = set()
        registry.register(_QueueCollector(snapshot))
        self.requests = Counter(
            "epp_flow_control_requests",
            "Requests that left flow control, by outcome: dispatched, rejected"
            " (a bound was full), ttl_expired, no_endpoints (TTL ran out with no"
            " endpoint), cancelled (the client went away while queued).",
            ["outcome", "priority", "fairness_id"],
            registry=registry,
        )
        self.queue_duration = Histogram(
            "epp_flow_control_request_queue_duration_seconds",
            "Time requests spent in flow control, from arrival to their outcome.",
            ["outcome", "priority"],
            buckets=_WAIT_BUCKETS,
            registry=registry,
        )
        self.saturation = Gauge(
            "epp_flow_control_pool_saturation",
            "The pool's saturation as the last dispatch pass read it (1.0 = saturated).",
            registry=registry,
        )
        self.passes = Counter(
            "epp_flow_control_dispatch_passes",
            "Dispatch passes, each started by an event (an arrival, a request's end or"
            " first chunk, a finished pick, a TTL timer, a metrics-refresh recheck while"
            " requests wait): an idle EPP runs none.",
            registry=registry,
        )

    def flow_label(self, flow_id: str) -> str:
        if flow_id in self._flows:
            return flow_id
        if len(self._flows) < MAX_FLOW_LABELS:
            self._flows.add(flow_id)
            return flow_id
        return OTHER_FLOWS

    def left(self, outcome: str, priority: int, flow_id: str, waited_s: float) -> None:
        self.requests.labels(outcome, str(priority), self.flow_label(flow_id)).inc()
        self.queue_duration.labels(outcome, str(priority)).observe(max(0.0, waited_s))


class _QueueCollector(Collector):
    def __init__(self, snapshot: QueueSnapshot) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        size = GaugeMetricFamily(
            "epp_flow_control_queue_size",
            "Requests waiting in flow control now, by priority band and fairness id.",
            labels=["priority", "fairness_id"],
        )
        size_bytes = GaugeMetricFamily(
            "epp_flow_control_queue_bytes",
            "Bytes of the requests waiting in flow control now, by priority band and fairness id.",
            labels=["priority", "fairness_id"],
        )
        totals: dict[tuple[str, str], list[int]] = {}
        for priority, flow_id, requests, byte_size in self.snapshot():
            # Label values bounded as in FlowControlMetrics: ids past the first
            # MAX_FLOW_LABELS in the queue now are summed under `other`.
            key = (str(priority), flow_id)
            if key not in totals and len(totals) >= MAX_FLOW_LABELS:
                key = (str(priority), OTHER_FLOWS)
            entry = totals.setdefault(key, [0, 0])
            entry[0] += requests
            entry[1] += byte_size
        for (band, flow_id), (requests, byte_size) in totals.items():
            size.add_metric([band, flow_id], requests)
            size_bytes.add_metric([band, flow_id], byte_size)
        yield size
        yield size_bytes
