"""`random-picker`: endpoints chosen uniformly at random, scores ignored."""

from __future__ import annotations

from collections.abc import Sequence

from epp.datastore import Endpoint
from epp.scheduling import CycleState, PickerParameters, PluginContext, ScoredEndpoint


class RandomPicker:
    Parameters = PickerParameters

    def __init__(self, params: PickerParameters, context: PluginContext) -> None:
        self.max_endpoints = params.max_num_of_endpoints
        self._rng = context.rng(params.seed)

    def pick(self, cycle: CycleState, scored: Sequence[ScoredEndpoint]) -> Sequence[Endpoint]:
        count = min(self.max_endpoints, len(scored))
        return [s.endpoint for s in self._rng.sample(list(scored), count)]
