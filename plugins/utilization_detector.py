"""`utilization-detector`: GIE's saturation detector; also a filter.

Per endpoint, with q its waiting requests, u its KV cache usage, Q =
`queueDepthThreshold` (default 5) and K = `kvCacheUtilThreshold` (default 0.8):

    load = max(q / Q, u / K)

where q is the scraped waiting count plus the requests this EPP sent there after
that scrape was sent (`Endpoint.unseen_routed`). Without them, everything sent in
the time a request takes to reach the engine and the next scrape to come back is
invisible: a gate that opens lets requests through faster than it can see them,
the engines' queues grow far past the threshold, and the gate then stays shut
while they drain (docs/flow-control.md, "Semantics"). Most of them are still
waiting when counted; those the engine admitted at once are over-counted until
the next scrape, which errs towards holding back for one scrape interval. GIE's
detector reads the scraped count alone.

An endpoint whose metrics are older than `metricsStalenessThreshold` (default
200ms, GIE's; metrics are scraped every 50 ms) counts as fully loaded (1.0): it is
not known to have room. A fact the engine does not report (KV usage on Triton) is
left out of the max; an endpoint with neither counts as 1.0.

- As the saturation detector (the config's `saturationDetector`, or the default
  one when some objective is sheddable): pool saturation = mean load over the
  request's candidates (no candidate: 1.0). At 1.0 or more, requests whose
  objective has a negative priority are shed with a 429; others are admitted.
- As flow control's dispatch gate (`dispatch_saturation`, asked only when the
  `flowControl` feature gate is on): the same mean, except that an endpoint whose
  metrics are stale or unreachable is judged by the requests this EPP has in flight
  there, `in_flight / staleMaxConcurrency` (default 100, the `maxConcurrency` of
  llm-d's concurrency detector), instead of counting as fully loaded. The EPP's own
  count is always current, so a scrape outage degrades the gate to a concurrency
  limit instead of freezing dispatch (llm-d's detector reads stale as saturated,
  which halts every queued request until its TTL). Admission with the gate off
  (`saturation`) is unchanged: stale still counts as 1.0 there.
- As a filter (in a profile): keeps endpoints with fresh metrics and
  q < Q * (1 + headroom) and u < K * (1 + headroom); `headroom` (default 0) lets
  affinity push a pod past its ideal load before it is avoided. If that would drop
  every endpoint, all are kept (fail open) and the scorers choose.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import msgspec

from epp.datastore import KV_CACHE_USAGE, WAITING, Endpoint
from epp.durations import Duration, parse_duration
from epp.requests import InferenceRequest
from epp.scheduling import METRICS, CycleState, PluginContext


class UtilizationDetector:
    consumes = frozenset({METRICS})

    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        queue_depth_threshold: Annotated[int, msgspec.Meta(gt=0)] = 5
        kv_cache_util_threshold: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 0.8
        metrics_staleness_threshold: Duration = "200ms"
        headroom: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
        # This EPP's: the concurrency an endpoint with stale metrics is judged by
        # (see `dispatch_saturation`).
        stale_max_concurrency: Annotated[int, msgspec.Meta(ge=1)] = 100

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        self.clock = context.clock
        self.queue_threshold = params.queue_depth_threshold
        self.kv_threshold = params.kv_cache_util_threshold
        self.staleness_s = parse_duration(params.metrics_staleness_threshold)
        if self.staleness_s <= 0:
            raise ValueError("metricsStalenessThreshold must be positive")
        self.headroom = params.headroom
        self.stale_max_concurrency = params.stale_max_concurrency

    def load(self, endpoint: Endpoint, now: float) -> float:
        """The endpoint's load, 1.0 = at its thresholds; 1.0 when unknown."""
        metrics = endpoint.metrics
        if metrics.unreachable or metrics.age(now) > self.staleness_s:
            return 1.0
        ratios = []
        if WAITING not in metrics.missing:
            waiting = metrics.waiting_requests + endpoint.unseen_routed
            ratios.append(waiting / self.queue_threshold)
        if KV_CACHE_USAGE not in metrics.missing:
            ratios.append(metrics.kv_cache_usage / self.kv_threshold)
        return max(ratios) if ratios else 1.0

    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        if not endpoints:
            return 1.0
        now = self.clock()
        return sum(self.load(e, now) for e in endpoints) / len(endpoints)

    def dispatch_saturation(self, endpoints: Sequence[Endpoint]) -> float:
        """Saturation for flow control's dispatch gate: stale endpoints judged by
        this EPP's in-flight count (see the module's docstring)."""
        if not endpoints:
            return 1.0
        now = self.clock()
        total = 0.0
        for e in endpoints:
            metrics = e.metrics
            if metrics.unreachable or metrics.age(now) > self.staleness_s:
                total += e.in_flight / self.stale_max_concurrency
            else:
                total += self.load(e, now)
        return total / len(endpoints)

    def filter(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Sequence[Endpoint]:
        now = self.clock()
        queue_limit = self.queue_threshold * (1.0 + self.headroom)
        kv_limit = self.kv_threshold * (1.0 + self.headroom)
        kept = []
        for e in endpoints:
            metrics = e.metrics
            if metrics.unreachable or metrics.age(now) > self.staleness_s:
                continue
            if WAITING in metrics.missing and KV_CACHE_USAGE in metrics.missing:
                continue  # nothing known about its load
            if (
                WAITING not in metrics.missing
                and metrics.waiting_requests + e.unseen_routed >= queue_limit
            ):
                continue
            if KV_CACHE_USAGE not in metrics.missing and metrics.kv_cache_usage >= kv_limit:
                continue
            kept.append(e)
        return kept or endpoints
