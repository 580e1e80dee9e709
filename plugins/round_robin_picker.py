"""`round-robin-picker`: the candidates in turn, scores ignored.

A baseline for benchmarks (what a plain load balancer does). The turn advances in
`pre_request`, once a request is really sent, so /debug/explain does not move it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import msgspec

from epp.datastore import Endpoint
from epp.requests import InferenceRequest
from epp.scheduling import CycleState, PluginContext, SchedulingResult, ScoredEndpoint


class RoundRobinPicker:
    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        max_num_of_endpoints: Annotated[int, msgspec.Meta(ge=1)] = 1

    def __init__(self, params: Parameters, context: PluginContext) -> None:
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
