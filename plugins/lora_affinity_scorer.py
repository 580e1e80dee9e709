"""`lora-affinity-scorer`: prefers endpoints that already serve the request's LoRA
adapter, or can load it (GIE's scorer of the same name).

The adapter is the request's target model (after any model rewrite); the
endpoints' adapters come from vLLM's `vllm:lora_requests_info`. Tiers:

    1.0  the adapter is running on the endpoint
    0.8  it is not, but the endpoint has a free adapter slot
         (running + waiting adapters < max_lora)
    0.6  it is waiting to be loaded there
    0.0  the endpoint's adapter slots are full and it is neither running nor waiting

An endpoint whose metrics are stale, or that reports no LoRA state (a server
without LoRA, or an engine without the metric), scores 0.5 (neutral). No parameters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final

from epp.datastore import LORA, Endpoint
from epp.requests import InferenceRequest
from epp.scheduling import METRICS, CycleState, PluginContext

NEUTRAL: Final = 0.5


def lora_tier(endpoint: Endpoint, adapter: str) -> float:
    metrics = endpoint.metrics
    if adapter in metrics.running_adapters:
        return 1.0
    if len(metrics.running_adapters) + len(metrics.waiting_adapters) < metrics.max_adapters:
        return 0.8
    if adapter in metrics.waiting_adapters:
        return 0.6
    return 0.0


class LoraAffinityScorer:
    consumes = frozenset({METRICS})

    def __init__(self, params: object, context: PluginContext) -> None:
        self.clock = context.clock

    def score(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Mapping[Endpoint, float]:
        now = self.clock()
        adapter = request.target_model
        return {
            e: lora_tier(e, adapter) if e.metrics.known(LORA, now) else NEUTRAL for e in endpoints
        }
