"""`random-picker`: endpoints chosen uniformly at random, scores ignored."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Annotated

import msgspec

from epp.datastore import Endpoint
from epp.scheduling import CycleState, PluginContext, ScoredEndpoint


class RandomPicker:
    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        max_num_of_endpoints: Annotated[int, msgspec.Meta(ge=1)] = 1

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        self.max_endpoints = params.max_num_of_endpoints
        self._rng = random.Random()

    def pick(self, cycle: CycleState, scored: Sequence[ScoredEndpoint]) -> Sequence[Endpoint]:
        count = min(self.max_endpoints, len(scored))
        return [s.endpoint for s in self._rng.sample(list(scored), count)]
