"""`max-score-picker`: the endpoints with the highest total score.

Ties are broken at random, so equal scores (a cold start, a burst between two
metric scrapes) spread over the tied endpoints instead of piling onto the first.
With `maxNumOfEndpoints` > 1 the next best follow as fallbacks for Envoy's retries.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import attrgetter

from epp.datastore import Endpoint
from epp.scheduling import CycleState, PickerParameters, PluginContext, ScoredEndpoint

# The sort key: the same scores as a lambda reads, without a Python call for each.
_score = attrgetter("score")


class MaxScorePicker:
    Parameters = PickerParameters

    def __init__(self, params: PickerParameters, context: PluginContext) -> None:
        self.max_endpoints = params.max_num_of_endpoints
        self._rng = context.rng(params.seed)

    def pick(self, cycle: CycleState, scored: Sequence[ScoredEndpoint]) -> Sequence[Endpoint]:
        if len(scored) == 1:
            return [scored[0].endpoint]
        shuffled = list(scored)
        self._rng.shuffle(shuffled)
        shuffled.sort(key=_score, reverse=True)  # stable: ties stay shuffled
        return [s.endpoint for s in shuffled[: self.max_endpoints]]
