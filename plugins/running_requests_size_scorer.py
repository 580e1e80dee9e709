"""`running-requests-size-scorer`: prefers endpoints with fewer requests in the model
server's running batch (GIE's scorer of the same name).

Formula, over the candidates whose running count is known, with r the running
requests and rmin, rmax their smallest and largest:

    score = (rmax - r) / (rmax - rmin)        1.0 for all when rmax == rmin

An endpoint whose metrics are stale or lack the running count scores 0.5 (neutral)
and is left out of rmin/rmax. No parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from epp.datastore import RUNNING, Endpoint
from epp.requests import InferenceRequest
from epp.scheduling import METRICS, CycleState, PluginContext, fewer_is_better


class RunningRequestsSizeScorer:
    consumes = frozenset({METRICS})

    def __init__(self, params: object, context: PluginContext) -> None:
        self.clock = context.clock

    def score(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Mapping[Endpoint, float]:
        now = self.clock()
        running = {
            e: e.metrics.running_requests for e in endpoints if e.metrics.known(RUNNING, now)
        }
        return fewer_is_better(endpoints, running)
