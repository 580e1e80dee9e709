"""`round-robin-fairness-policy`: llm-d's turn-taking between the flows of a band.

Flows take turns in the order of their ids, one dispatch each, skipping flows with
nothing waiting: a flow that bursts gets one turn per round like any other, so it
cannot starve the rest of its band (it can still delay them by one request per
round). The cursor, the id of the flow served last, is kept per band. Takes no
parameters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epp.flowcontrol.interfaces import FlowView
from epp.scheduling import PluginContext


@dataclass(slots=True)
class Cursor:
    last: str | None = None  # the flow served last in this band


class RoundRobinFairnessPolicy:
    def __init__(self, params: object, context: PluginContext) -> None:
        pass

    def new_state(self) -> Cursor:
        return Cursor()

    def pick_flow(self, flows: Sequence[FlowView], state: object, now: float) -> FlowView | None:
        assert isinstance(state, Cursor)
        if not flows:
            return None
        # `flows` is sorted by id: the next one after the cursor, wrapping round.
        chosen = flows[0]
        if state.last is not None:
            chosen = next((f for f in flows if f.flow_id > state.last), flows[0])
        state.last = chosen.flow_id
        return chosen
