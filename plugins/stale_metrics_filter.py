"""`stale-metrics-filter`: drops endpoints that are not ready or whose model-server
metrics are stale (not scraped successfully within the staleness threshold), so a
pod that stopped answering its /metrics (overloaded, hung, restarting) is not
chosen on numbers from before; one whose server refuses connections (killed,
restarting) is dropped at the next scrape, without waiting for the threshold.
(The director leaves endpoints whose server is down, unreachable or silent past
the threshold, out of every config's candidates already, unless every one is;
then this filter, with `failOpen: false`, refuses.)

Parameters:
- `metricsStalenessThreshold` (duration, optional): the age past which metrics are
  stale; default: each snapshot's own, i.e. `--metrics-staleness-threshold` (2s).
- `failOpen` (default true): if every candidate would be dropped, keep them all.
  When no endpoint's metrics are fresh the cause is usually the scraping (a
  network policy, a wrong metrics path) rather than every pod at once, and refusing
  all traffic over it would turn a monitoring problem into an outage; the scorers
  then score those endpoints neutrally. `false` refuses the request (429) instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from epp.datastore import Endpoint
from epp.durations import Duration, parse_duration
from epp.requests import InferenceRequest
from epp.scheduling import METRICS, CycleState, PluginContext


class StaleMetricsFilter:
    consumes = frozenset({METRICS})

    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        metrics_staleness_threshold: Duration | None = None
        fail_open: bool = True

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        self.clock = context.clock
        self.threshold_s = (
            parse_duration(params.metrics_staleness_threshold)
            if params.metrics_staleness_threshold
            else None
        )
        self.fail_open = params.fail_open

    def fresh(self, endpoint: Endpoint, now: float) -> bool:
        metrics = endpoint.metrics
        if self.threshold_s is None:
            return not metrics.stale(now)
        return not metrics.unreachable and metrics.age(now) <= self.threshold_s

    def filter(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Sequence[Endpoint]:
        now = self.clock()
        kept = [e for e in endpoints if e.ready and self.fresh(e, now)]
        if not kept and self.fail_open:
            return endpoints
        return kept
