"""`load-aware-scorer`: scores each endpoint by its waiting queue against a fixed
threshold (llm-d's scorer of the same name), so it needs no other endpoint to
compare with.

Formula, with q the waiting requests and T = `threshold` (default 128):

    q == 0       -> 0.5
    0 < q < T    -> 0.5 * (1 - q / T)
    q >= T       -> 0.0

The top score is 0.5 by design (llm-d's): an empty queue says the endpoint is not
overloaded, not that it has room to spare. Weigh it accordingly. An endpoint whose
metrics are stale or lack the queue length scores 0.25, the middle of that range
(neutral).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Final

import msgspec

from epp.datastore import WAITING, Endpoint
from epp.requests import InferenceRequest
from epp.scheduling import METRICS, CycleState, PluginContext

NEUTRAL: Final = 0.25


class LoadAwareScorer:
    consumes = frozenset({METRICS})

    class Parameters(msgspec.Struct, forbid_unknown_fields=True):
        threshold: Annotated[int, msgspec.Meta(gt=0)] = 128

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        self.clock = context.clock
        self.threshold = params.threshold

    def score(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Mapping[Endpoint, float]:
        now = self.clock()
        threshold = self.threshold
        scores: dict[Endpoint, float] = {}
        for e in endpoints:
            if not e.metrics.known(WAITING, now):
                scores[e] = NEUTRAL
                continue
            queue = e.metrics.waiting_requests
            scores[e] = 0.5 if queue == 0 else 0.5 * max(0.0, 1.0 - queue / threshold)
        return scores
