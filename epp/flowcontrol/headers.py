"""Which priority and flow a request belongs to, read from its headers the same way
by the director and by the policies that track flows (program-aware-fairness).

The objective (its priority comes from the config's `inferenceObjectives`):
`x-llm-d-inference-objective`, or GIE's older `x-gateway-inference-objective`.
The fairness id (the flow within a band): `x-llm-d-inference-fairness-id`, or
`x-gateway-inference-fairness-id`; without one, llm-d's `default-flow`. The newer
name wins when both are sent. Both pairs are control headers: removed before the
request goes upstream.
"""

from __future__ import annotations

from typing import Final

from epp.requests import InferenceRequest

DEFAULT_FLOW_ID: Final = "default-flow"


def objective_of(request: InferenceRequest) -> str | None:
    """The request parser reads both header names (epp.requests)."""
    return request.objective or None


def fairness_id_of(request: InferenceRequest) -> str:
    return request.fairness_id or DEFAULT_FLOW_ID
