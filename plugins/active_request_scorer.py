"""`active-request-scorer`: prefers endpoints with fewer requests in flight from this
EPP (llm-d's scorer of the same name).

The count is the director's own `Endpoint.in_flight`: raised when a request is
routed, lowered when it ends. It is always current, so a burst that arrives between
two metric scrapes still spreads (every pick of the burst sees the ones before it),
which no scraped queue length can do. It only knows this replica's traffic.

Formula, with c an endpoint's in-flight count and cmax the largest among the
candidates, I = `idleThreshold` (default 0) and B = `maxBusyScore` (default 1.0):

    c <= I   -> 1.0
    c >  I   -> B * (cmax - c) / cmax

so idle endpoints score 1, the busiest 0. Never stale: no neutral case.
`requestTimeout` is accepted for llm-d configs and ignored (a request's count ends
with the request).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated

import msgspec

from epp.datastore import Endpoint
from epp.requests import InferenceRequest
from epp.scheduling import CycleState, PluginContext


class ActiveRequestScorer:
    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        idle_threshold: Annotated[int, msgspec.Meta(ge=0)] = 0
        max_busy_score: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 1.0
        request_timeout: str | None = None

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        self.idle_threshold = params.idle_threshold
        self.max_busy_score = params.max_busy_score

    def score(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Mapping[Endpoint, float]:
        busiest = max((e.in_flight for e in endpoints), default=0)
        scores: dict[Endpoint, float] = {}
        for e in endpoints:
            count = e.in_flight
            if count <= self.idle_threshold:
                scores[e] = 1.0
            else:
                scores[e] = self.max_busy_score * (busiest - count) / busiest
        return scores
