"""`weighted-random-picker`: endpoints drawn at random in proportion to their score.

Weighted sampling without replacement by the A-Res method: each endpoint draws
`key = U ** (1 / score)` with U uniform in (0, 1), and the highest keys win. An
endpoint scoring 0 is only chosen after every endpoint with a positive score;
when all score 0 the choice is uniform.
"""

from __future__ import annotations

from collections.abc import Sequence

from epp.datastore import Endpoint
from epp.scheduling import CycleState, PickerParameters, PluginContext, ScoredEndpoint


class WeightedRandomPicker:
    Parameters = PickerParameters

    def __init__(self, params: PickerParameters, context: PluginContext) -> None:
        self.max_endpoints = params.max_num_of_endpoints
        self._rng = context.rng(params.seed)

    def pick(self, cycle: CycleState, scored: Sequence[ScoredEndpoint]) -> Sequence[Endpoint]:
        rng = self._rng

        def key(item: ScoredEndpoint) -> tuple[int, float]:
            u = 1.0 - rng.random()  # (0, 1]
            if item.score > 0:
                return (1, u ** (1.0 / item.score))
            return (0, u)

        ranked = sorted(scored, key=key, reverse=True)
        return [s.endpoint for s in ranked[: self.max_endpoints]]
