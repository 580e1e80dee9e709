"""`global-strict-fairness-policy`: llm-d's default "fairness" between the flows of
a band, which is none: the flow whose head comes first by the band's ordering
policy dispatches, so the band behaves as one queue (FCFS across every flow, or
EDF). A flow that sends more gets more. Stateless; takes no parameters."""

from __future__ import annotations

from collections.abc import Sequence

from epp.flowcontrol.interfaces import FlowView
from epp.scheduling import PluginContext


class GlobalStrictFairnessPolicy:
    def __init__(self, params: object, context: PluginContext) -> None:
        pass

    def new_state(self) -> None:
        return None

    def pick_flow(self, flows: Sequence[FlowView], state: object, now: float) -> FlowView | None:
        return min(flows, key=lambda flow: flow.head_key(), default=None)
