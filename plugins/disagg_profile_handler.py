"""`disagg-profile-handler`: prefill/decode (and encode) disaggregation, llm-d's
profile handler of the same name and parameters; `pd-profile-handler`, llm-d's
deprecated former handler, with its own parameters (see `PdProfileHandler`).

Stages, in the default order (`stageOrder: decode-first`), per request:

1. **decode** (profile `profiles.decode`, default `decode`), always: its pick is
   where the request goes (the primary profile), and the deciders below judge
   that endpoint;
2. **encode** (`profiles.encode`, default `encode`): if the config has that
   profile and the decider named by `deciders.encode` (e.g.
   `always-disagg-multimodal-decider`) says yes; every endpoint it picks goes in
   the header `x-encoder-hosts-ports: <ip:port>,<ip:port>`;
3. **prefill** (`profiles.prefill`, default `prefill`): if the config has that
   profile and the decider named by `deciders.prefill` (`prefix-based-pd-decider`,
   `always-disagg-pd-decider`, `predicted-ttft-pd-decider`, or any plugin with a
   `disaggregate` method: `epp.scheduling.DisaggregationDecider`) says yes; its
   pick goes in the header `x-prefiller-host-port: <ip:port>`, which tells the
   sidecar on the decode pod to run the prefill there first and then decode with
   the transferred KV cache (docs/disaggregation.md has the contract).

A stage without its decider never runs (no `deciders` at all: decode only, as in
llm-d). With `stageOrder: prefill-first` the prefill profile runs first, for
every request, then encode (its decider judges no decode endpoint yet), then
decode; a prefill decider is refused there, as in llm-d.

Where this handler differs from llm-d's, on purpose:
- when the prefill profile picks nothing (no prefill endpoint ready), the decode
  endpoint serves the request whole instead of the request failing; and when the
  prefill pick is the decode endpoint itself (a pod with both roles), the header
  is left out (a transfer to itself gains nothing). So `result.profiles` holds the
  prefill profile exactly when the header is set, and plugins that charge or
  record every picked endpoint (in-flight load, prefix indexes) see the prefill
  endpoint only when it really gets the prefill;
- `profiles.fallback` (llm-d's experimental aggregated fallback) therefore only
  runs when the decode profile picks nothing: its pick then serves the request
  whole, as the primary profile;
- a configured profile that no stage can run is a warning at start-up, and a
  decider named without its profile an error.

The deciders are looked up by name among all the config's plugins, declared
before or after this handler. The decisions, their reasons and numbers go to
/debug/explain under this plugin's name in `notes`; every routed request's outcome
is counted in `epp_disagg_decision_total{plugin_name, plugin_type, model_name,
decision_type}` (llm-d's labels and decision types: decode-only, prefill-decode,
encode-decode, encode-prefill-decode, aggregated-fallback), at its pre-request
step, so /debug/explain's dry runs do not count.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any, Final

import msgspec
from prometheus_client import Counter

from epp.datastore import Endpoint
from epp.promutil import shared
from epp.requests import ENCODERS_HEADER, PREFILLER_HEADER, InferenceRequest
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
DEFAULT_ENCODE_PROFILE: Final = "encode"
DECISION_METRIC: Final = "epp_disagg_decision_total"
DECODE_FIRST: Final = "decode-first"
PREFILL_FIRST: Final = "prefill-first"
# The parameters of llm-d's older pd-profile-handler, refused here with a hint.
_PD_HANDLER_KEYS: Final = ("deciderPluginName", "decodeProfile", "prefillProfile", "primaryPort")


def parse_stage_order(text: str) -> str:
    """llm-d's spellings of the stage order: case, '-' and '_' do not matter."""
    key = text.lower().replace("-", "").replace("_", "")
    if key in ("", "decodefirst", "decode"):
        return DECODE_FIRST
    if key in ("prefillfirst", "prefill"):
        return PREFILL_FIRST
    raise ValueError(f"stageOrder {text!r} is not {DECODE_FIRST!r} or {PREFILL_FIRST!r}")


class _Stage:
    """An optional stage: its profile and, once resolved, its decider."""

    __slots__ = ("decided", "decider", "decider_name", "param", "profile")

    def __init__(self, handler: str, param: str, profile: str, decider_name: str) -> None:
        self.param = param  # deciders.<param>, for messages
        self.profile = profile
        self.decider_name = decider_name
        self.decider: DisaggregationDecider | None = None
        # The decider's answer for a request, from select_profiles to process_results.
        self.decided: StateKey[DisaggDecision] = StateKey(f"disagg-{param}/{handler}")


class _Engine:
    """What both handlers do, given their resolved settings."""

    def __init__(
        self,
        context: PluginContext,
        *,
        stage_order: str,
        decode: str,
        prefill: str,
        encode: str,
        fallback: str,
        prefill_decider: str,
        encode_decider: str,
    ) -> None:
        names = {"decode": decode, "prefill": prefill, "encode": encode}
        for stage, profile in names.items():
            others = [s for s, p in names.items() if p == profile and s != stage]
            if others:
                raise ValueError(
                    f"the {stage} and {others[0]} profiles are both {profile!r}:"
                    " each stage needs a profile of its own"
                )
        if stage_order == PREFILL_FIRST and prefill_decider:
            raise ValueError(
                f"a prefill decider ({prefill_decider!r}) cannot be used with stageOrder"
                f" {PREFILL_FIRST}: the prefill profile runs first, for every request"
            )
        if fallback:
            if stage_order != DECODE_FIRST:
                raise ValueError(f"profiles.fallback needs stageOrder {DECODE_FIRST}")
            for stage, profile in names.items():
                if fallback == profile:
                    raise ValueError(f"profiles.fallback must differ from profiles.{stage}")
        self.name = context.name
        self.type_name = context.type_name
        self._plugins = context.plugins
        registry = context.metrics
        self._decisions = shared(
            registry,
            DECISION_METRIC,
            lambda: Counter(
                DECISION_METRIC,
                "Routed requests by the stages a disaggregating profile handler gave them.",
                ["plugin_name", "plugin_type", "model_name", "decision_type"],
                registry=registry,
            ),
        )
        self.stage_order = stage_order
        self.decode = decode
        self.fallback = fallback
        self.prefill = _Stage(context.name, "prefill", prefill, prefill_decider)
        self.encode = _Stage(context.name, "encode", encode, encode_decider)
        self._fallback_used: StateKey[bool] = StateKey(f"disagg-fallback/{context.name}")
        # Deciders declared before the handler are resolved now, the others once
        # every plugin is built (check_profiles).
        for optional in (self.prefill, self.encode):
            if optional.decider_name and optional.decider_name in self._plugins:
                self._resolve(optional)

    def _resolve(self, stage: _Stage) -> None:
        plugin = self._plugins.get(stage.decider_name)
        if plugin is None:
            declared = ", ".join(sorted(p for p in self._plugins if p != self.name)) or "none"
            raise ValueError(
                f"deciders.{stage.param} {stage.decider_name!r}: no plugin of that name in"
                f" the config (its plugins: {declared})"
            )
        if not isinstance(plugin, DisaggregationDecider):
            raise ValueError(
                f"deciders.{stage.param} {stage.decider_name!r}: that plugin"
                f" ({type(plugin).__name__}) is not a disaggregation decider (it has no"
                " disaggregate method)"
            )
        stage.decider = plugin

    # -- start-up ------------------------------------------------------------------------

    def check_profiles(self, profiles: Sequence[str]) -> None:
        for stage in (self.prefill, self.encode):
            if stage.decider_name and stage.decider is None:
                self._resolve(stage)
        required = {self.decode: "profiles.decode"}
        if self.prefill.decider_name or self.stage_order == PREFILL_FIRST:
            required[self.prefill.profile] = "profiles.prefill"
        if self.encode.decider_name:
            required[self.encode.profile] = "profiles.encode"
        if self.fallback:
            required[self.fallback] = "profiles.fallback"
        missing = [f"{p!r} ({why})" for p, why in required.items() if p not in profiles]
        if missing:
            raise ValueError(
                f"needs the scheduling profiles {', '.join(missing)}; the config has"
                f" {', '.join(repr(p) for p in profiles) or 'none'}"
            )
        unused = [p for p in profiles if p not in required]
        if unused:
            log.warning(
                "%s: the scheduling profiles %s never run (no decider for their stage)",
                self.name,
                ", ".join(repr(p) for p in unused),
            )

    # -- per request ---------------------------------------------------------------------

    def _ask(
        self,
        stage: _Stage,
        request: InferenceRequest,
        cycle: CycleState,
        decode: Endpoint | None,
    ) -> bool:
        """Whether `stage` runs for the request; asks its decider once."""
        decided = cycle.get(stage.decided)
        if decided is None:
            assert stage.decider is not None
            decided = stage.decider.disaggregate(request, cycle, decode)
            cycle.put(stage.decided, decided)
        return decided.disaggregate

    def select_profiles(
        self,
        request: InferenceRequest,
        cycle: CycleState,
        profiles: Sequence[str],
        results: Mapping[str, ProfileResult],
    ) -> Sequence[str]:
        if cycle.get(self._fallback_used):
            return ()
        prefill, encode = self.prefill, self.encode
        if self.stage_order == PREFILL_FIRST:
            if prefill.profile in profiles and prefill.profile not in results:
                return (prefill.profile,)
            if (
                encode.decider is not None
                and encode.profile not in results
                and self._ask(encode, request, cycle, None)
            ):
                return (encode.profile,)
            return () if self.decode in results else (self.decode,)
        decode = results.get(self.decode)
        if decode is None:
            return (self.decode,)
        if not decode.targets:
            if self.fallback:
                cycle.put(self._fallback_used, True)
                return (self.fallback,)
            return ()
        for stage in (encode, prefill):
            if (
                stage.decider is not None
                and stage.profile not in results
                and self._ask(stage, request, cycle, decode.targets[0])
            ):
                return (stage.profile,)
        return ()

    def process_results(
        self, request: InferenceRequest, cycle: CycleState, results: Mapping[str, ProfileResult]
    ) -> SchedulingResult:
        note: dict[str, Any] = {}
        if cycle.get(self._fallback_used):
            fallback = results[self.fallback]
            note.update(
                disaggregated=False,
                fallback=f"the decode profile picked no endpoint: the {self.fallback!r}"
                " profile serves the request whole",
                pick=fallback.targets[0].address if fallback.targets else None,
            )
            explain_note(cycle, self.name, note)
            return SchedulingResult(self.fallback, {self.fallback: fallback})
        decode = results[self.decode]
        used = {self.decode: decode}
        headers: dict[str, str] = {}
        note["decode"] = decode.targets[0].address if decode.targets else None
        if not decode.targets:
            note.update(disaggregated=False, reason="the decode profile picked no endpoint")
        encode = results.get(self.encode.profile)
        if self.encode.decider is not None:
            note["encode"] = self._stage_note(self.encode, cycle, encode)
        if encode is not None and encode.targets:
            used[self.encode.profile] = encode
            headers[ENCODERS_HEADER] = ",".join(e.address for e in encode.targets)
        prefill = results.get(self.prefill.profile)
        stage_note = self._stage_note(self.prefill, cycle, prefill)
        if prefill is not None and decode.targets:
            if not prefill.targets:
                stage_note["fallback"] = (
                    "no prefill endpoint could be picked: the decode endpoint runs both stages"
                )
            elif prefill.targets[0] is decode.targets[0]:
                stage_note["fallback"] = (
                    "the prefill pick is the decode endpoint: it runs both stages"
                )
            else:
                used[self.prefill.profile] = prefill
                headers[PREFILLER_HEADER] = prefill.targets[0].address
                stage_note["prefill"] = prefill.targets[0].address
        if self.prefill.decider is not None or self.stage_order == PREFILL_FIRST:
            # Kept flat, as for a P/D-only config (the common case).
            note.update(stage_note)
        note["disaggregated"] = PREFILLER_HEADER in headers
        explain_note(cycle, self.name, note)
        return SchedulingResult(
            self.decode,
            used,
            headers,
            prefill_profile=self.prefill.profile if PREFILLER_HEADER in headers else None,
        )

    def count(self, request: InferenceRequest, result: SchedulingResult) -> None:
        """Count a routed request's decision (llm-d's decision types)."""
        used = result.profiles
        if self.fallback and result.primary_profile == self.fallback:
            decision = "aggregated-fallback"
        else:
            encode = self.encode.profile in used
            prefill = self.prefill.profile in used
            decision = (
                "encode-prefill-decode"
                if encode and prefill
                else "encode-decode"
                if encode
                else "prefill-decode"
                if prefill
                else "decode-only"
            )
        model = request.target_model or request.model or "unknown"
        self._decisions.labels(self.name, self.type_name, model, decision).inc()

    def _stage_note(
        self, stage: _Stage, cycle: CycleState, result: ProfileResult | None
    ) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if stage.decider is not None:
            out["decider"] = stage.decider_name
        decision = cycle.get(stage.decided)
        if decision is not None:
            out.update(decision=decision.disaggregate, reason=decision.reason)
            if decision.facts:
                out["facts"] = dict(decision.facts)
        elif self.stage_order == PREFILL_FIRST and stage is self.prefill:
            out.update(decision=True, reason=f"stageOrder {PREFILL_FIRST}: prefill always runs")
        if stage is self.encode and result is not None and result.targets:
            out["encoders"] = [e.address for e in result.targets]
        return out


class _Profiles(msgspec.Struct, forbid_unknown_fields=True):
    decode: str = ""
    prefill: str = ""
    encode: str = ""
    fallback: str = ""


class _Deciders(msgspec.Struct, forbid_unknown_fields=True):
    prefill: str = ""
    encode: str = ""


class _Handler:
    """The profile handler's methods, done by the handler's engine."""

    engine: _Engine

    def check_profiles(self, profiles: Sequence[str]) -> None:
        self.engine.check_profiles(profiles)

    def select_profiles(
        self,
        request: InferenceRequest,
        cycle: CycleState,
        profiles: Sequence[str],
        results: Mapping[str, ProfileResult],
    ) -> Sequence[str]:
        return self.engine.select_profiles(request, cycle, profiles, results)

    def process_results(
        self, request: InferenceRequest, cycle: CycleState, results: Mapping[str, ProfileResult]
    ) -> SchedulingResult:
        return self.engine.process_results(request, cycle, results)

    def pre_request(
        self, request: InferenceRequest, cycle: CycleState, result: SchedulingResult
    ) -> None:
        if result.targets:
            self.engine.count(request, result)


class DisaggProfileHandler(_Handler):
    """llm-d's `disagg-profile-handler` (the module docstring says what it does)."""

    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        stage_order: str = ""
        profiles: _Profiles = msgspec.field(default_factory=_Profiles)
        deciders: _Deciders = msgspec.field(default_factory=_Deciders)
        # pd-profile-handler's: refused with a hint (llm-d ignores them silently,
        # which leaves P/D off without a word).
        decider_plugin_name: str | None = None
        decode_profile: str | None = None
        prefill_profile: str | None = None
        primary_port: int | None = None

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        old = [
            key
            for key, value in zip(
                _PD_HANDLER_KEYS,
                (
                    params.decider_plugin_name,
                    params.decode_profile,
                    params.prefill_profile,
                    params.primary_port,
                ),
                strict=True,
            )
            if value is not None
        ]
        if old:
            raise ValueError(
                f"{', '.join(old)}: parameters of pd-profile-handler, llm-d's former P/D"
                " handler; disagg-profile-handler takes `deciders: {prefill: <decider>}`"
                " and `profiles: {decode: ..., prefill: ...}` (or use type"
                " pd-profile-handler with these parameters)"
            )
        profiles = params.profiles
        self.name = context.name
        self.engine = _Engine(
            context,
            stage_order=parse_stage_order(params.stage_order),
            decode=profiles.decode or DEFAULT_DECODE_PROFILE,
            prefill=profiles.prefill or DEFAULT_PREFILL_PROFILE,
            encode=profiles.encode or DEFAULT_ENCODE_PROFILE,
            fallback=profiles.fallback,
            prefill_decider=params.deciders.prefill,
            encode_decider=params.deciders.encode,
        )


class PdProfileHandler(_Handler):
    """`pd-profile-handler`: llm-d's deprecated P/D handler, with its parameters:
    `decodeProfile` (`decode`), `prefillProfile` (`prefill`), `deciderPluginName`
    (default `prefix-based-pd-decider`, which must then be in the config),
    `primaryPort` (refused unless 0: this EPP sends the request to the decode
    endpoint's own address, so point the pool's target port at the sidecar), and
    `prefixPluginType`/`prefixPluginName`/`prefixMatchInfoProducerName`, accepted
    and unused (llm-d never used the first two; the third only declares which
    producer's match info the decider reads, which the decider names itself here).
    Decode first, no encode stage. Logs a deprecation warning."""

    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        decode_profile: str = DEFAULT_DECODE_PROFILE
        prefill_profile: str = DEFAULT_PREFILL_PROFILE
        decider_plugin_name: str = "prefix-based-pd-decider"
        primary_port: int = 0
        prefix_plugin_type: str = ""
        prefix_plugin_name: str = ""
        prefix_match_info_producer_name: str = ""

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        log.warning(
            "%s: plugin type %r is deprecated (as in llm-d): use disagg-profile-handler"
            " with deciders: {prefill: %s}",
            context.name,
            context.type_name,
            params.decider_plugin_name,
        )
        if params.primary_port != 0:
            raise ValueError(
                f"primaryPort {params.primary_port} is not supported: this EPP sends the"
                " request to the decode endpoint's own address; point the pool's target"
                " port at the decode pods' sidecar and leave primaryPort out"
            )
        if not params.decider_plugin_name:
            raise ValueError("deciderPluginName must not be empty")
        self.name = context.name
        self.engine = _Engine(
            context,
            stage_order=DECODE_FIRST,
            decode=params.decode_profile or DEFAULT_DECODE_PROFILE,
            prefill=params.prefill_profile or DEFAULT_PREFILL_PROFILE,
            encode=DEFAULT_ENCODE_PROFILE,
            fallback="",
            prefill_decider=params.decider_plugin_name,
            encode_decider="",
        )
