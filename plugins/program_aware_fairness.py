"""`program-aware-fairness`: llm-d's fairness between programs (fairness ids) by
least attained service (LAS), in weighted tokens.

A FairnessPolicy and a PostResponse hook. When a request ends, its program (the
fairness id, `x-llm-d-inference-fairness-id`) is charged `prompt + 2 * completion`
tokens from the response's usage (output costs more to produce), its total
decaying with a half-life of `lasHalfLifeSeconds` (60; 0: no decay), so a program
that went idle comes back on near-equal terms. When a band dispatches, each
program with waiting requests scores

    lasWeightService * (1 - service / max service) + lasWeightHeadWait * (head wait / max head wait)

over the band's waiting programs, and the highest score goes (ties: the first by
id). So the least-served program goes first, and the head-wait term breaks ties on
a cold start. Programs with no completion for `evictionTtlSeconds` (3600) are
forgotten; the sweep runs at most every `evictionSweepSeconds` (300), on the
request path (no task of its own). `strategy`: only `las`.

Differences from llm-d: no Prometheus series of its own (Jain's index, per-program
waits); its queue waits are in `epp_flow_control_request_queue_duration_seconds`.
A request without usage in its response (lean mode, or an engine that does not
report it) charges nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Literal

import msgspec

from epp.clock import Clock
from epp.flowcontrol.headers import fairness_id_of
from epp.flowcontrol.interfaces import FlowView
from epp.requests import InferenceRequest
from epp.scheduling import CycleState, PluginContext, ResponseInfo, SchedulingResult

OUTPUT_TOKEN_WEIGHT = 2.0


@dataclass(slots=True)
class _Program:
    service: float  # weighted tokens, as of `at`
    at: float  # when `service` was last brought up to date
    last_completion: float


class ProgramAwareFairness:
    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        strategy: Literal["las"] = "las"
        las_weight_service: Annotated[float, msgspec.Meta(ge=0.0)] = 0.8
        las_weight_head_wait: Annotated[float, msgspec.Meta(ge=0.0)] = 0.2
        las_half_life_seconds: Annotated[float, msgspec.Meta(ge=0.0)] = 60.0
        eviction_ttl_seconds: Annotated[float, msgspec.Meta(gt=0.0)] = 3600.0
        eviction_sweep_seconds: Annotated[float, msgspec.Meta(gt=0.0)] = 300.0

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        self.clock: Clock = context.clock
        self.weight_service = params.las_weight_service
        self.weight_wait = params.las_weight_head_wait
        self.half_life_s = params.las_half_life_seconds
        self.eviction_ttl_s = params.eviction_ttl_seconds
        self.sweep_s = params.eviction_sweep_seconds
        self.programs: dict[str, _Program] = {}
        self._swept_at = self.clock()

    def attained_service(self, program: str, now: float) -> float:
        """The program's decayed service in weighted tokens (0 for one never seen)."""
        state = self.programs.get(program)
        if state is None:
            return 0.0
        return self._decayed(state, now)

    def _decayed(self, state: _Program, now: float) -> float:
        if self.half_life_s <= 0 or now <= state.at:
            return state.service
        return float(state.service * 0.5 ** ((now - state.at) / self.half_life_s))

    # -- FairnessPolicy -----------------------------------------------------------------

    def new_state(self) -> None:
        return None  # the programs' service is the plugin's own, shared by every band

    def pick_flow(self, flows: Sequence[FlowView], state: object, now: float) -> FlowView | None:
        if not flows:
            return None
        services = [self.attained_service(f.flow_id, now) for f in flows]
        waits = [max(0.0, now - f.head().enqueued_at) for f in flows]
        top_service = max(services)
        top_wait = max(waits)
        best: FlowView | None = None
        best_score = -1.0
        for flow, service, wait in zip(flows, services, waits, strict=True):
            score = self.weight_service * (1.0 - service / top_service if top_service else 1.0)
            score += self.weight_wait * (wait / top_wait if top_wait else 0.0)
            if score > best_score:
                best, best_score = flow, score
        return best

    # -- PostResponse -------------------------------------------------------------------

    def post_response(
        self,
        request: InferenceRequest,
        cycle: CycleState,
        result: SchedulingResult,
        response: ResponseInfo,
    ) -> None:
        now = self.clock()
        self._sweep(now)
        usage = response.usage
        tokens = (
            usage.prompt_tokens + OUTPUT_TOKEN_WEIGHT * usage.completion_tokens
            if usage is not None
            else 0.0
        )
        program = fairness_id_of(request)
        state = self.programs.get(program)
        if state is None:
            self.programs[program] = _Program(tokens, now, now)
            return
        state.service = self._decayed(state, now) + tokens
        state.at = now
        state.last_completion = now

    def _sweep(self, now: float) -> None:
        if now - self._swept_at < self.sweep_s:
            return
        self._swept_at = now
        for program in [
            p for p, s in self.programs.items() if now - s.last_completion > self.eviction_ttl_s
        ]:
            del self.programs[program]
