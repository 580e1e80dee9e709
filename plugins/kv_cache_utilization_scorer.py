"""`kv-cache-utilization-scorer`: prefers endpoints with more free KV cache (GIE's
scorer of the same name).

Formula, with u the KV cache usage the model server reports (a fraction in [0, 1]):

    score = 1 - u

An endpoint whose metrics are stale or lack a valid usage scores 0.5 (neutral).
No parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from epp.datastore import KV_CACHE_USAGE, Endpoint
from epp.requests import InferenceRequest
from epp.scheduling import METRICS, CycleState, PluginContext

NEUTRAL: Final = 0.5


class KvCacheUtilizationScorer:
    consumes = frozenset({METRICS})

    def __init__(self, params: object, context: PluginContext) -> None:
        self.clock = context.clock

    def score(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Mapping[Endpoint, float]:
        now = self.clock()
        return {
            e: 1.0 - e.metrics.kv_cache_usage if e.metrics.known(KV_CACHE_USAGE, now) else NEUTRAL
            for e in endpoints
        }
