"""`always-disagg-pd-decider`: disaggregate every request (llm-d's decider of the
same name).

For a pool where every prompt is worth a prefill endpoint (llm-d's P/D guide uses
it with long prompts and few decode pods). A request still runs whole on its
decode endpoint when no prefill endpoint can be picked: that is the profile
handler's fallback, not the decider's. No parameters.
"""

from __future__ import annotations

from epp.datastore import Endpoint
from epp.requests import InferenceRequest
from epp.scheduling import CycleState, DisaggDecision, PluginContext


class AlwaysDisaggPdDecider:
    def __init__(self, params: object, context: PluginContext) -> None:
        pass

    def disaggregate(
        self, request: InferenceRequest, cycle: CycleState, decode: Endpoint | None
    ) -> DisaggDecision:
        return DisaggDecision(True, "always")
