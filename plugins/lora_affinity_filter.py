"""`lora-affinity-filter`: keeps the endpoints best placed to serve the request's
LoRA adapter (GIE's filter of the same name, from its filter-based scheduler).

The adapter is the request's target model; endpoints' adapters come from
`vllm:lora_requests_info`. Two groups:
- affinity: the adapter is running or waiting to load there;
- available: it is not, but the endpoint has a free adapter slot.

If both groups are non-empty, the affinity group is kept with probability
`threshold` (default 0.999) and the available group otherwise: a small share of an
adapter's traffic goes to new endpoints, so a hot adapter spreads. If only one is
non-empty it is kept. If neither is (the model is not an adapter anywhere, or no
endpoint reports LoRA state, or every slot is taken), every endpoint is kept: the
request may be for a base model, and the scorers decide. Endpoints with stale
metrics or without LoRA state are in neither group.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import msgspec

from epp.datastore import LORA, Endpoint
from epp.requests import InferenceRequest
from epp.scheduling import METRICS, CycleState, PluginContext


class LoraAffinityFilter:
    consumes = frozenset({METRICS})

    class Parameters(msgspec.Struct, forbid_unknown_fields=True):
        threshold: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.999
        # This EPP's: seed the draw between the groups (none: afresh at every start).
        seed: int | None = None

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        self.clock = context.clock
        self.threshold = params.threshold
        self._rng = context.rng(params.seed)

    def filter(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Sequence[Endpoint]:
        now = self.clock()
        adapter = request.target_model
        affinity: list[Endpoint] = []
        available: list[Endpoint] = []
        for e in endpoints:
            metrics = e.metrics
            if not metrics.known(LORA, now):
                continue
            if adapter in metrics.running_adapters or adapter in metrics.waiting_adapters:
                affinity.append(e)
            elif len(metrics.running_adapters) + len(metrics.waiting_adapters) < (
                metrics.max_adapters
            ):
                available.append(e)
        if affinity and available:
            return affinity if self._rng.random() < self.threshold else available
        return affinity or available or endpoints
