"""`queue-scorer`: prefers endpoints with fewer requests waiting in the model
server's queue (GIE's scorer of the same name).

Formula, over the candidates whose waiting count is known (fresh metrics that
report it), with q the waiting requests and qmin, qmax their smallest and largest:

    score = (qmax - q) / (qmax - qmin)        1.0 for all when qmax == qmin

An endpoint whose metrics are stale or lack the queue length scores 0.5 (neutral):
neither preferred over a known short queue nor avoided like a known long one, and
left out of qmin/qmax so it cannot distort the others' scale. No parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from epp.datastore import WAITING, Endpoint
from epp.requests import InferenceRequest
from epp.scheduling import METRICS, CycleState, PluginContext, fewer_is_better


class QueueScorer:
    consumes = frozenset({METRICS})

    def __init__(self, params: object, context: PluginContext) -> None:
        self.clock = context.clock

    def score(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Mapping[Endpoint, float]:
        now = self.clock()
        queues = {e: e.metrics.waiting_requests for e in endpoints if e.metrics.known(WAITING, now)}
        return fewer_is_better(endpoints, queues)
