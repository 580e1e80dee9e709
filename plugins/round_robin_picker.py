"""`round-robin-picker`: the candidates in turn, scores ignored.

A baseline for benchmarks (what a plain load balancer does). The turn advances in
`pre_request`, once a request is really sent, so /debug/explain does not move it.
"""

from __future__ import annotations

from collections.abc import Sequence

from epp.datastore import Endpoint
from epp.requests import InferenceRequest
from epp.scheduling import (
    CycleState,
    PickerParameters,
    PluginContext,
    SchedulingResult,
    ScoredEndpoint,
)


class RoundRobinPicker:
    Parameters = PickerParameters

    def __init__(self, params: PickerParameters, context: PluginContext) -> None:
        self.max_endpoints = params.max_num_of_endpoints
        self._turn = 0

    def pick(self, cycle: CycleState, scored: Sequence[ScoredEndpoint]) -> Sequence[Endpoint]:
        if not scored:
            return []
        start = self._turn % len(scored)
        ordered = [*scored[start:], *scored[:start]]
        return [s.endpoint for s in ordered[: self.max_endpoints]]

    def pre_request(
        self, request: InferenceRequest, cycle: CycleState, result: SchedulingResult
    ) -> None:
        self._turn += 1
