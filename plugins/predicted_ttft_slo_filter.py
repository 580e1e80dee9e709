"""`predicted-ttft-slo-filter`: keeps the pods predicted to meet a request's time-to-
first-token objective, from the predictions of `predicted-ttft-producer` (the
producer named by `predictedTtftProducerName`).

The objective comes in a request header, in milliseconds: `x-slo-ttft-ms`, or
llm-d's `x-llm-d-slo-ttft-ms` (the first one wins when both are sent). Then:

- some pods are predicted to meet it: only those stay (the scorer then picks the
  fastest of them);
- none is, and the request is sheddable (its objective's priority is below 0, as
  for GIE's saturation shedding): it is refused with 429 and a body that says the
  objective and the best prediction, so the client can retry elsewhere or later;
- none is, and the request is not sheddable: every pod stays (best effort), and
  /debug/explain says that none was predicted to meet it.

Without the header every pod stays. A header that is not a positive number of
milliseconds is refused with 400.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Final

import msgspec

from epp.datastore import Endpoint
from epp.errors import BadRequest, Shed
from epp.requests import InferenceRequest
from epp.scheduling import PRIORITY, CycleState, PluginContext, explain_note

from .predicted_ttft_producer import DEFAULT_PRODUCER, predicted_ttft_key

SLO_HEADERS: Final = ("x-slo-ttft-ms", "x-llm-d-slo-ttft-ms")


def ttft_objective_s(request: InferenceRequest) -> float | None:
    """The request's TTFT objective in seconds, or None without one."""
    for header in SLO_HEADERS:
        value = request.headers.get(header)
        if value is None:
            continue
        try:
            ms = float(value)
        except ValueError:
            ms = math.nan
        if not (ms > 0 and math.isfinite(ms)):
            raise BadRequest(f"{header} must be a positive number of milliseconds, got {value!r}")
        return ms / 1e3
    return None


class PredictedTtftSloFilter:
    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        predicted_ttft_producer_name: str = ""

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        self.name = context.name
        self.key = predicted_ttft_key(params.predicted_ttft_producer_name or DEFAULT_PRODUCER)

    def filter(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Sequence[Endpoint]:
        objective = ttft_objective_s(request)
        predictions = cycle.get(self.key)
        if objective is None or predictions is None or not endpoints:
            return endpoints
        seconds = {e: p.seconds for e, p in predictions.predict_all(endpoints).items()}
        kept = [e for e in endpoints if seconds[e] <= objective]
        if kept:
            return kept
        best = min(seconds.values())
        explain_note(
            cycle,
            self.name,
            {"objectiveMs": objective * 1e3, "bestPredictedMs": round(best * 1e3, 3), "met": False},
        )
        if (cycle.get(PRIORITY) or 0) < 0:
            raise Shed(
                f"no endpoint is predicted to meet the time-to-first-token objective of"
                f" {objective * 1e3:g} ms (the best is predicted at {best * 1e3:.0f} ms);"
                " the request is sheddable, so it is refused: retry later or with a"
                " larger objective"
            )
        return endpoints
