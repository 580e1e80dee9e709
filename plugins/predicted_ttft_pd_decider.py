"""`predicted-ttft-pd-decider`: disaggregate a request when that is predicted to
cost less time than the decode endpoint prefilling it itself, by the
predicted-TTFT model (this EPP's; llm-d's deciders use a token threshold).

Asked by `disagg-profile-handler` once the decode profile has picked endpoint D.
It compares two ways of serving the request, each the request's own predicted
TTFT plus the delay its prefill adds to the requests decoding beside it:

- **whole on D**: D's predicted TTFT (D's prefill queue, the prompt tokens D
  does not hold, D's batch), plus `streamDelayWeight` x (requests decoding on D)
  x (the prefill's own compute time on D): with chunked prefill every decode step
  that carries a chunk of this prompt is longer by that chunk, so each stream on
  D is delayed by about the whole prefill;
- **prefill on P, decode on D**, for each prefill candidate P (an endpoint whose
  `llm-d.ai/role` `prefill-filter` keeps, other than D): P's queue and P's own
  prefill, the KV transfer of the tokens D does not hold, D's first decode step,
  (`TtftPredictions.predict_disaggregated`), plus `streamDelayWeight` x (requests
  decoding on P) x (the prefill's compute time on P); a prefill pod decodes
  nothing, so that part is usually 0.

It disaggregates iff the best P costs less than D alone by at least `minGainMs`
and by at least `minGainFraction` of D alone's cost.
So a prompt D mostly holds stays on D (nothing to prefill, nothing to ship); a
long uncached prompt moves to a prefill pod when one has room, and stays when
every prefill pod is backed up or the transfer would cost more than it saves.
The prefill profile then picks P itself (its own filters and scorers); with
`predicted-ttft-scorer` in it, it ranks prefill pods by the same prediction.

Parameters: `predictedTtftProducerName` (default `predicted-ttft-producer`, which
must be in the config: without its predictions nothing is disaggregated, and a
warning says so once); `streamDelayWeight` (1.0: another stream's second of delay
counts as much as this request's; 0 compares TTFT alone); `minGainMs` (0);
`minGainFraction` (0.25: the predictions' error is that large, so a smaller
predicted gain is no gain).

The decision's numbers (both costs and their parts, the best prefill pod) go to
/debug/explain through the profile handler's note.
"""

from __future__ import annotations

import logging
import math
from typing import Annotated, Final

import msgspec

from epp.datastore import Endpoint
from epp.requests import InferenceRequest
from epp.scheduling import CycleState, DisaggDecision, PluginContext

from .predicted_ttft_producer import DEFAULT_PRODUCER, TtftPrediction, predicted_ttft_key
from .role_filter import ROLE_LABEL, PrefillFilter

log = logging.getLogger(__name__)

# A split must be predicted this much cheaper than the decode endpoint alone: the
# predictions err by 10-60% at p90 (docs/routing.md), and a split made on a gain
# inside that error moves a conversation's next turn off the pod that holds it for
# nothing (multi-turn, 16 pods, load 0.8: TTFT p90 28.7 ms with no margin against
# 23.6 ms whole; 23.6 with this one).
MIN_GAIN_FRACTION: Final = 0.25


class PredictedTtftPdDecider:
    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        predicted_ttft_producer_name: str = DEFAULT_PRODUCER
        stream_delay_weight: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
        min_gain_ms: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
        min_gain_fraction: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = MIN_GAIN_FRACTION

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        for name, value in (
            ("streamDelayWeight", params.stream_delay_weight),
            ("minGainMs", params.min_gain_ms),
        ):
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number >= 0, got {value}")
        self.name = context.name
        self.producer = params.predicted_ttft_producer_name
        self.key = predicted_ttft_key(self.producer)
        self.weight = params.stream_delay_weight
        self.min_gain_s = params.min_gain_ms / 1e3
        self.min_gain_fraction = params.min_gain_fraction
        self._warned = False

    def _cost(self, prediction: TtftPrediction, decoding: int) -> float:
        return prediction.seconds + self.weight * decoding * prediction.own_work_s

    def disaggregate(
        self, request: InferenceRequest, cycle: CycleState, decode: Endpoint | None
    ) -> DisaggDecision:
        if decode is None:
            return DisaggDecision(False, "no decode endpoint to judge")
        predictions = cycle.get(self.key)
        if predictions is None:
            self._warn_once()
            return DisaggDecision(False, f"no predictions from {self.producer!r}")
        whole = predictions.predict(decode)
        whole_cost = self._cost(whole, predictions.decoding(decode))
        facts: dict[str, object] = {
            "whole": {
                **whole.describe(),
                "decodingBeside": predictions.decoding(decode),
                "costMs": _ms(whole_cost),
            },
            "minGainMs": _ms(self.min_gain_s),
            "minGainFraction": self.min_gain_fraction,
            "streamDelayWeight": self.weight,
        }
        best: tuple[float, Endpoint, TtftPrediction] | None = None
        for endpoint in predictions.candidates:
            if endpoint is decode or endpoint.labels.get(ROLE_LABEL) not in PrefillFilter.roles:
                continue
            split = predictions.predict_disaggregated(endpoint, decode)
            cost = self._cost(split, predictions.decoding(endpoint))
            if best is None or cost < best[0]:
                best = (cost, endpoint, split)
        if best is None:
            return DisaggDecision(False, "no prefill endpoint among the candidates", facts)
        cost, prefill, split = best
        facts["split"] = {
            **split.describe(),
            "prefill": prefill.name,
            "decodingBeside": predictions.decoding(prefill),
            "costMs": _ms(cost),
        }
        gain = whole_cost - cost
        if gain > 0 and gain >= max(self.min_gain_s, self.min_gain_fraction * whole_cost):
            return DisaggDecision(
                True,
                f"prefill on {prefill.name} predicted to cost {_ms(gain)} ms less than"
                " the decode endpoint alone",
                facts,
            )
        return DisaggDecision(
            False,
            f"the decode endpoint alone is predicted to cost {_ms(-gain)} ms less than the"
            f" best prefill endpoint ({prefill.name})"
            if gain <= 0
            else f"prefill on {prefill.name} would save {_ms(gain)} ms, less than minGainMs"
            f" or minGainFraction of {_ms(whole_cost)} ms",
            facts,
        )

    def _warn_once(self) -> None:
        # Logged, not raised: the request is still served, by the decode endpoint alone.
        if not self._warned:
            self._warned = True
            log.warning(
                "%s: no predictions from producer %r: requests are not disaggregated"
                " (declare a predicted-ttft-producer, or name it with"
                " predictedTtftProducerName)",
                self.name,
                self.producer,
            )


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)
