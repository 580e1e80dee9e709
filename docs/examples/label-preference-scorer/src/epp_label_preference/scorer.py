"""`label-preference-scorer`: prefers endpoints by the value of one of their labels.

On Kubernetes an endpoint's labels are its pod's labels, so this steers traffic by
anything the pods are labelled with: a GPU generation, a node pool, a zone, a
canary flag. With

    parameters:
      labelKey: gpu
      scores: {h100: 1.0, a100: 0.6}
      defaultScore: 0.2

an endpoint whose pod has `gpu: h100` scores 1.0, `gpu: a100` 0.6, and any other
value, or no such label, 0.2. Weighted against the load and prefix scorers, it is a
preference, not a rule: a busy H100 pod still loses to an idle A100 one when the
other scorers say so.

Formula: score(e) = scores[e.labels[labelKey]] if that value is listed, else
defaultScore. Every score is in [0, 1], as the EPP's scorer contract asks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated

import msgspec

from epp.scheduling import CycleState, Endpoint, InferenceRequest, PluginContext

Score = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]


class LabelPreferenceScorer:
    """Scores each endpoint by the value of its `labelKey` label."""

    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        label_key: Annotated[str, msgspec.Meta(min_length=1)]  # `labelKey`
        scores: dict[str, Score] = {}
        default_score: Score = 0.0  # `defaultScore`

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        self.label_key = params.label_key
        self.scores = dict(params.scores)
        self.default_score = params.default_score

    def score(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Mapping[Endpoint, float]:
        return {e: self.score_of(e.labels.get(self.label_key)) for e in endpoints}

    def score_of(self, value: str | None) -> float:
        if value is None:
            return self.default_score
        return self.scores.get(value, self.default_score)
