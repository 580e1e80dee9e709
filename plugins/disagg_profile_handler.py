"""`disagg-profile-handler`: prefill/decode disaggregation (llm-d's profile handler
of the same name; `pd-profile-handler`, its deprecated former name, is accepted
too and warns).

Per request:

1. the decode profile (`decodeProfile`, default `decode`) runs, always: it picks
   the endpoint the request goes to, and the decision below is about that
   endpoint;
2. the decider (the plugin named by `deciderPluginName`: `prefix-based-pd-decider`,
   `always-disagg-pd-decider` or any plugin with a `disaggregate` method, see
   `epp.scheduling.DisaggregationDecider`) says whether the prefill runs elsewhere;
3. if so, the prefill profile (`prefillProfile`, default `prefill`) runs and its
   pick is the prefill endpoint.

The decode profile is the primary one: its targets are the request's destination
(`x-gateway-destination-endpoint`). When a prefill endpoint was picked, the
result carries the request header `x-prefiller-host-port: <its ip:port>`, which
tells the sidecar on the decode pod to run the prefill there first and then the
decode locally with the transferred KV cache (docs/disaggregation.md has the
contract). Without the header the decode pod runs both stages.

The request is not disaggregated, and its result holds the decode profile only,
when the decider says no, when the decode profile picked nothing (the request
fails as any request with no endpoint does), when the prefill profile picked
nothing (no prefill endpoint is ready: the decode endpoint serves the request
whole rather than the request failing), or when the prefill pick is the decode
endpoint itself (a pod with both roles: a transfer to itself gains nothing).
So `result.profiles` holds the prefill profile exactly when the header is set,
and plugins that charge or record every picked endpoint (in-flight load, prefix
indexes) see the prefill endpoint only when it really gets the prefill.

The decision, its reason and the decider's numbers go to /debug/explain under
this plugin's name in `notes`.

Parameters:
- `deciderPluginName` (required): the decider, declared in `plugins` before this
  handler (plugins are built in the file's order);
- `decodeProfile`, `prefillProfile`: the two profiles, which must be the config's
  only ones;
- `primaryPort` (llm-d's, 0): a port to send the decode request to instead of the
  pool's target port; refused unless 0, since this EPP does not rewrite the
  destination: point the pool's target port at the decode pods' sidecar instead.

Not yet: the encode stage (`encodeProfile`, an encode decider, the
`x-encoder-hosts-ports` header).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Final

import msgspec

from epp.requests import PREFILLER_HEADER, InferenceRequest
from epp.scheduling import (
    CycleState,
    DisaggDecision,
    DisaggregationDecider,
    PluginContext,
    ProfileResult,
    SchedulingResult,
    StateKey,
    explain_note,
)

log = logging.getLogger(__name__)

DEFAULT_DECODE_PROFILE: Final = "decode"
DEFAULT_PREFILL_PROFILE: Final = "prefill"


class DisaggProfileHandler:
    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        decider_plugin_name: str = ""
        decode_profile: str = DEFAULT_DECODE_PROFILE
        prefill_profile: str = DEFAULT_PREFILL_PROFILE
        primary_port: int = 0

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        if params.primary_port != 0:
            raise ValueError(
                f"primaryPort {params.primary_port} is not supported: this EPP sends the"
                " request to the decode endpoint's own address; point the pool's target"
                " port at the decode pods' sidecar and leave primaryPort out"
            )
        if not params.decode_profile or not params.prefill_profile:
            raise ValueError("decodeProfile and prefillProfile must not be empty")
        if params.decode_profile == params.prefill_profile:
            raise ValueError(
                f"decodeProfile and prefillProfile are both {params.decode_profile!r}:"
                " they must name two profiles"
            )
        self.name = context.name
        self.decode = params.decode_profile
        self.prefill = params.prefill_profile
        self.decider_name, self.decider = _decider(params.decider_plugin_name, context)
        # The decider's answer for the request, from select_profiles to process_results.
        self._decided: StateKey[DisaggDecision] = StateKey(f"disagg-decision/{context.name}")

    def check_profiles(self, profiles: Sequence[str]) -> None:
        missing = [p for p in (self.decode, self.prefill) if p not in profiles]
        if missing:
            raise ValueError(
                f"needs the scheduling profiles {self.decode!r} (decode) and {self.prefill!r}"
                f" (prefill); missing: {', '.join(repr(p) for p in missing)}"
            )
        extra = [p for p in profiles if p not in (self.decode, self.prefill)]
        if extra:
            raise ValueError(
                f"runs only the profiles {self.decode!r} and {self.prefill!r}; never runs"
                f" {', '.join(repr(p) for p in extra)}"
            )

    def select_profiles(
        self,
        request: InferenceRequest,
        cycle: CycleState,
        profiles: Sequence[str],
        results: Mapping[str, ProfileResult],
    ) -> Sequence[str]:
        decode = results.get(self.decode)
        if decode is None:
            return (self.decode,)  # always first
        if self.prefill in results or not decode.targets:
            return ()
        decision = self.decider.disaggregate(request, cycle, decode.targets[0])
        cycle.put(self._decided, decision)
        return (self.prefill,) if decision.disaggregate else ()

    def process_results(
        self, request: InferenceRequest, cycle: CycleState, results: Mapping[str, ProfileResult]
    ) -> SchedulingResult:
        decode = results[self.decode]
        used = {self.decode: decode}
        headers: dict[str, str] = {}
        note: dict[str, Any] = {
            "decider": self.decider_name,
            "decode": decode.targets[0].address if decode.targets else None,
        }
        decision = cycle.get(self._decided)
        if decision is None:
            note.update(disaggregated=False, reason="the decode profile picked no endpoint")
        else:
            note.update(decision=decision.disaggregate, reason=decision.reason)
            if decision.facts:
                note["facts"] = dict(decision.facts)
            prefill = results.get(self.prefill)
            if prefill is None:
                note["disaggregated"] = False
            elif not prefill.targets:
                note.update(
                    disaggregated=False,
                    fallback="no prefill endpoint could be picked: the decode endpoint"
                    " runs both stages",
                )
            elif prefill.targets[0] is decode.targets[0]:
                note.update(
                    disaggregated=False,
                    fallback="the prefill pick is the decode endpoint: it runs both stages",
                )
            else:
                used[self.prefill] = prefill
                headers[PREFILLER_HEADER] = prefill.targets[0].address
                note.update(disaggregated=True, prefill=prefill.targets[0].address)
        explain_note(cycle, self.name, note)
        return SchedulingResult(self.decode, used, headers)


class PdProfileHandler(DisaggProfileHandler):
    """`pd-profile-handler`: llm-d's former name of `disagg-profile-handler`."""

    def __init__(self, params: DisaggProfileHandler.Parameters, context: PluginContext) -> None:
        log.warning(
            "%s: plugin type %r is deprecated (as in llm-d): use disagg-profile-handler,"
            " which takes the same parameters",
            context.name,
            context.type_name,
        )
        super().__init__(params, context)


def _decider(name: str, context: PluginContext) -> tuple[str, DisaggregationDecider]:
    """The decider plugin `name`, built before the handler, or ValueError saying why not."""
    if not name:
        raise ValueError(
            "deciderPluginName is required: the name of a decider plugin declared before"
            " this handler (prefix-based-pd-decider, always-disagg-pd-decider)"
        )
    plugin = context.plugins.get(name)
    if plugin is None:
        declared = ", ".join(sorted(context.plugins)) or "none"
        raise ValueError(
            f"deciderPluginName {name!r}: no plugin of that name is declared before this"
            f" handler (declared before it: {declared}); plugins are built in the file's"
            " order, so list the decider first"
        )
    if not isinstance(plugin, DisaggregationDecider):
        raise ValueError(
            f"deciderPluginName {name!r}: that plugin ({type(plugin).__name__}) is not a"
            " disaggregation decider (it has no disaggregate method)"
        )
    return name, plugin
