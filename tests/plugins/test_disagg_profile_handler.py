"""`disagg-profile-handler` with llm-d's parameters (`profiles`, `deciders`,
`stageOrder`), and llm-d's deprecated `pd-profile-handler` with its own: decode
first, always; the deciders, asked about the decode pick; encode and prefill only
when theirs say yes; decode primary; `x-prefiller-host-port` only on a
disaggregated pick and `x-encoder-hosts-ports` on an encoded one; prefill first
when asked; the aggregated fallback; the decisions in /debug/explain's notes;
clear errors for bad parameters; `always-disagg-multimodal-decider`."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Mapping
from typing import Any

import msgspec
import pytest
import yaml
from epp.plugins.always_disagg_multimodal_decider import AlwaysDisaggMultimodalDecider
from epp.plugins.always_disagg_pd_decider import AlwaysDisaggPdDecider
from epp.plugins.disagg_profile_handler import DisaggProfileHandler, PdProfileHandler
from prometheus_client import CollectorRegistry

from epp.config import InvalidConfig, load_config
from epp.datastore import Datastore, Endpoint, EndpointSpec
from epp.director import Director
from epp.requests import InferenceRequest, parse_request
from epp.scheduling import (
    EXPLAIN_NOTES,
    CycleState,
    DisaggDecision,
    PluginContext,
    ProfileResult,
    ScoredEndpoint,
)
from epp.scheduling.registry import PluginRegistry
from epp.scheduling.scheduler import Scheduler, SchedulerProfile, Slot
from epp.scheduling.types import ResponseInfo
from epp.telemetry import Telemetry
from tests.plugins.helpers import context, make_endpoints, make_request
from tests.plugins.llmd_helpers import load

HEADER = "x-prefiller-host-port"
ENCODERS = "x-encoder-hosts-ports"


class Decider:
    """Says what it is told, and remembers what it was asked about."""

    def __init__(self, answer: bool) -> None:
        self.answer = answer
        self.asked: list[Endpoint | None] = []

    def disaggregate(
        self, request: InferenceRequest, cycle: CycleState, decode: Endpoint | None
    ) -> DisaggDecision:
        self.asked.append(decode)
        return DisaggDecision(self.answer, "told so", {"answer": self.answer})


def handler(
    decider: object | None = None, encoder: object | None = None, **params: Any
) -> DisaggProfileHandler:
    plugins: dict[str, object] = {}
    deciders = params.setdefault("deciders", {})
    if decider is not None:
        plugins["decider"] = decider
        deciders.setdefault("prefill", "decider")
    if encoder is not None:
        plugins["encoder"] = encoder
        deciders.setdefault("encode", "encoder")
    return DisaggProfileHandler(
        msgspec.convert(params, DisaggProfileHandler.Parameters), _context(plugins)
    )


def _context(plugins: dict[str, object]) -> PluginContext:
    base = context("disagg-profile-handler")
    return PluginContext(
        "disagg-profile-handler", "disagg-profile-handler", base.datastore, base.metrics, plugins
    )


def schedule(
    plugin: object,
    decode: Endpoint | None,
    prefill: Endpoint | None,
    endpoints: list[Endpoint],
    **more: list[Endpoint],
) -> tuple[Any, CycleState, list[str]]:
    """Run the real scheduler with profiles that pick the given endpoints (decode,
    prefill, and any named in `more`: encode, fallback); the result, the cycle and
    the profiles run, in order."""
    ran: list[str] = []

    class Recording:
        def __init__(self, name: str, targets: list[Endpoint]) -> None:
            self.name, self.targets = name, targets

        def pick(self, cycle: CycleState, scored: Any) -> list[Endpoint]:
            ran.append(self.name)
            return self.targets

    picks = {
        "prefill": [] if prefill is None else [prefill],
        "decode": [] if decode is None else [decode],
        **more,
    }
    profiles = {
        name: SchedulerProfile(name, (), (), Slot("picker", "picker", Recording(name, targets)))
        for name, targets in picks.items()
    }
    scheduler = Scheduler(profiles, Slot("h", "disagg-profile-handler", plugin))
    cycle = CycleState()
    result = scheduler.schedule(make_request(), cycle, endpoints)
    return result, cycle, ran


def note(cycle: CycleState) -> Mapping[str, Any]:
    notes = cycle.get(EXPLAIN_NOTES)
    assert notes is not None
    return notes["disagg-profile-handler"]


def test_decode_runs_first_then_prefill_when_the_decider_says_so() -> None:
    d, p = make_endpoints(2)
    decider = Decider(True)
    result, cycle, ran = schedule(handler(decider), d, p, [d, p])
    assert ran == ["decode", "prefill"]
    assert decider.asked == [d]  # about the decode pick, once
    assert result.primary_profile == "decode"
    assert result.targets == (d,)
    assert set(result.profiles) == {"decode", "prefill"}
    assert result.request_headers == {HEADER: p.address}
    assert result.kv_holders == (d, p)  # the prefix indexes record both
    assert note(cycle) == {
        "decider": "decider",
        "decode": d.address,
        "decision": True,
        "reason": "told so",
        "facts": {"answer": True},
        "disaggregated": True,
        "prefill": p.address,
    }


def test_no_prefill_profile_and_no_header_when_the_decider_says_no() -> None:
    d, p = make_endpoints(2)
    result, cycle, ran = schedule(handler(Decider(False)), d, p, [d, p])
    assert ran == ["decode"]
    assert result.targets == (d,)
    assert set(result.profiles) == {"decode"}
    assert result.request_headers == {}
    assert result.kv_holders == (d,)
    assert note(cycle)["decision"] is False
    assert note(cycle)["disaggregated"] is False


def test_without_deciders_only_decode_runs(caplog: pytest.LogCaptureFixture) -> None:
    d, p = make_endpoints(2)
    plugin = handler()
    with caplog.at_level(logging.WARNING):
        plugin.check_profiles(("prefill", "decode"))
    assert "'prefill' never run" in caplog.text
    result, _, ran = schedule(plugin, d, p, [d, p])
    assert ran == ["decode"]
    assert (result.targets, result.request_headers) == ((d,), {})


def test_nothing_is_decided_when_decode_picks_nothing() -> None:
    (p,) = make_endpoints(1)
    decider = Decider(True)
    result, cycle, ran = schedule(handler(decider), None, p, [p])
    assert ran == ["decode"]
    assert decider.asked == []
    assert result.targets == ()  # the request fails as any request with no endpoint
    assert result.request_headers == {}
    assert note(cycle)["disaggregated"] is False


def test_the_fallback_profile_serves_whole_when_decode_picks_nothing() -> None:
    p, whole = make_endpoints(2)
    decider = Decider(True)
    plugin = handler(decider, profiles={"fallback": "aggregated"})
    plugin.check_profiles(("prefill", "decode", "aggregated"))
    result, cycle, ran = schedule(plugin, None, p, [p, whole], aggregated=[whole])
    assert ran == ["decode", "aggregated"]
    assert decider.asked == []
    assert result.primary_profile == "aggregated"
    assert (result.targets, result.request_headers) == ((whole,), {})
    assert set(result.profiles) == {"aggregated"}
    assert "serves the request whole" in note(cycle)["fallback"]


def test_without_a_prefill_endpoint_the_decode_endpoint_serves_it_whole() -> None:
    (d,) = make_endpoints(1)
    result, cycle, ran = schedule(handler(Decider(True)), d, None, [d])
    assert ran == ["decode", "prefill"]
    assert result.targets == (d,)
    assert set(result.profiles) == {"decode"}  # nothing charged to a prefill pick
    assert result.request_headers == {}
    assert result.kv_holders == (d,)
    assert note(cycle)["decision"] is True
    assert note(cycle)["disaggregated"] is False
    assert "no prefill endpoint" in note(cycle)["fallback"]


def test_a_prefill_pick_on_the_decode_endpoint_is_no_disaggregation() -> None:
    (both,) = make_endpoints(1)
    result, cycle, _ = schedule(handler(Decider(True)), both, both, [both])
    assert set(result.profiles) == {"decode"}
    assert result.request_headers == {}
    assert "is the decode endpoint" in note(cycle)["fallback"]


def test_profile_names_are_parameters() -> None:
    d, p = make_endpoints(2)
    plugin = handler(Decider(True), profiles={"decode": "d", "prefill": "p"})
    plugin.check_profiles(("p", "d"))
    cycle = CycleState()
    req = make_request()
    assert plugin.select_profiles(req, cycle, ("p", "d"), {}) == ("d",)
    decode = ProfileResult("d", (d,), (ScoredEndpoint(d, 1.0),))
    assert plugin.select_profiles(req, cycle, ("p", "d"), {"d": decode}) == ("p",)
    prefill = ProfileResult("p", (p,), (ScoredEndpoint(p, 1.0),))
    result = plugin.process_results(req, cycle, {"d": decode, "p": prefill})
    assert result.primary_profile == "d"
    assert result.request_headers == {HEADER: p.address}


def test_encode_runs_after_decode_and_before_prefill_and_names_every_encoder() -> None:
    d, p, e1, e2 = make_endpoints(4)
    encoder, decider = Decider(True), Decider(True)
    plugin = handler(decider, encoder)
    plugin.check_profiles(("prefill", "decode", "encode"))
    result, cycle, ran = schedule(plugin, d, p, [d, p, e1, e2], encode=[e1, e2])
    assert ran == ["decode", "encode", "prefill"]
    assert encoder.asked == [d]
    assert set(result.profiles) == {"decode", "encode", "prefill"}
    assert result.request_headers == {
        HEADER: p.address,
        ENCODERS: f"{e1.address},{e2.address}",
    }
    assert note(cycle)["encode"]["encoders"] == [e1.address, e2.address]
    # The encoder says no: no encode profile, no header; prefill still decided.
    result, _, ran = schedule(handler(Decider(True), Decider(False)), d, p, [d, p], encode=[e1])
    assert ran == ["decode", "prefill"]
    assert result.request_headers == {HEADER: p.address}


def test_prefill_first_runs_prefill_for_every_request_then_decode() -> None:
    d, p, e = make_endpoints(3)
    encoder = Decider(True)
    plugin = handler(None, encoder, stageOrder="Prefill_First")
    plugin.check_profiles(("prefill", "decode", "encode"))
    result, cycle, ran = schedule(plugin, d, p, [d, p, e], encode=[e])
    assert ran == ["prefill", "encode", "decode"]
    assert encoder.asked == [None]  # no decode pick yet
    assert result.primary_profile == "decode"
    assert result.request_headers == {HEADER: p.address, ENCODERS: e.address}
    assert result.kv_holders == (d, p)  # not the encoder
    assert note(cycle)["reason"] == "stageOrder prefill-first: prefill always runs"


@pytest.mark.parametrize(
    ("kwargs", "profiles", "message"),
    [
        ({}, ("prefill",), re.escape("'decode' (profiles.decode)")),
        ({}, ("decode",), re.escape("'prefill' (profiles.prefill)")),
        (
            {"encoder": Decider(True)},
            ("decode", "prefill"),
            re.escape("'encode' (profiles.encode)"),
        ),
        (
            {"profiles": {"fallback": "agg"}},
            ("decode", "prefill"),
            re.escape("'agg' (profiles.fallback)"),
        ),
    ],
)
def test_the_profiles_are_checked(
    kwargs: dict[str, Any], profiles: tuple[str, ...], message: str
) -> None:
    plugin = handler(Decider(True), **kwargs)
    with pytest.raises(ValueError, match=message):
        plugin.check_profiles(profiles)


def test_the_deprecated_handler_takes_its_own_parameters_and_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    d, p = make_endpoints(2)
    with caplog.at_level(logging.WARNING):
        plugin = PdProfileHandler(
            msgspec.convert(
                {"deciderPluginName": "always", "prefixPluginName": "unused"},
                PdProfileHandler.Parameters,
            ),
            _context({"always": AlwaysDisaggPdDecider(None, context("a"))}),
        )
    assert "deprecated" in caplog.text
    result, _, _ = schedule(plugin, d, p, [d, p])
    assert result.request_headers == {HEADER: p.address}


# -- through the config loader: what a config gets wrong ---------------------------


def config(
    handler_params: Mapping[str, Any],
    decider_first: bool = True,
    handler_type: str = "disagg-profile-handler",
) -> str:
    decider = {"type": "always-disagg-pd-decider"}
    handler_decl = {"type": handler_type, "parameters": dict(handler_params)}
    plugins: list[dict[str, Any]] = [
        {"type": "decode-filter"},
        {"type": "prefill-filter"},
        {"type": "max-score-picker"},
    ]
    plugins += [decider, handler_decl] if decider_first else [handler_decl, decider]
    return yaml.safe_dump(
        {
            "apiVersion": "llm-d.ai/v1alpha1",
            "kind": "EndpointPickerConfig",
            "plugins": plugins,
            "schedulingProfiles": [
                {"name": "decode", "plugins": [{"pluginRef": "decode-filter"}]},
                {"name": "prefill", "plugins": [{"pluginRef": "prefill-filter"}]},
            ],
        }
    )


PREFILL = {"deciders": {"prefill": "always-disagg-pd-decider"}}


@pytest.mark.parametrize("decider_first", [True, False])
def test_a_valid_config_loads_whatever_the_order_of_its_plugins(decider_first: bool) -> None:
    built = load(config(PREFILL, decider_first))
    assert set(built.scheduler.profiles) == {"decode", "prefill"}
    handler = built.plugins["disagg-profile-handler"]
    assert isinstance(handler, DisaggProfileHandler)
    assert isinstance(handler.engine.prefill.decider, AlwaysDisaggPdDecider)


def test_the_deprecated_handler_loads_with_its_default_decider() -> None:
    built = load(
        config({}, decider_first=False, handler_type="pd-profile-handler").replace(
            "always-disagg-pd-decider", "prefix-based-pd-decider"
        )
    )
    assert set(built.scheduler.profiles) == {"decode", "prefill"}


@pytest.mark.parametrize(
    ("params", "handler_type", "message"),
    [
        ({"deciders": {"prefill": "nope"}}, "disagg", "'nope': no plugin of that name"),
        ({"deciders": {"prefill": "max-score-picker"}}, "disagg", "not a disaggregation decider"),
        ({"deciderPluginName": "always-disagg-pd-decider"}, "disagg", "deciders: {prefill"),
        ({**PREFILL, "stageOrder": "sideways"}, "disagg", "stageOrder 'sideways'"),
        ({**PREFILL, "stageOrder": "prefill-first"}, "disagg", "cannot be used with stageOrder"),
        (
            {**PREFILL, "profiles": {"fallback": "decode"}},
            "disagg",
            "must differ from profiles.decode",
        ),
        ({**PREFILL, "profiles": {"prefill": "decode"}}, "disagg", "each stage needs a profile"),
        ({**PREFILL, "profiles": {"extra": "x"}}, "disagg", "extra"),
        ({**PREFILL, "threshold": 5}, "disagg", "threshold"),
        (
            {"deciderPluginName": "always-disagg-pd-decider", "primaryPort": 8000},
            "pd",
            "primaryPort 8000",
        ),
        ({"deciderPluginName": "nope"}, "pd", "'nope': no plugin of that name"),
        ({"deciders": {"prefill": "always-disagg-pd-decider"}}, "pd", "deciders"),
    ],
)
def test_bad_parameters_are_config_errors(
    params: dict[str, Any], handler_type: str, message: str
) -> None:
    with pytest.raises(InvalidConfig, match=message):
        load(config(params, handler_type=f"{handler_type}-profile-handler"))


def test_a_decider_without_its_profile_is_a_config_error() -> None:
    text = config(PREFILL).replace("name: prefill", "name: prefill-stage")
    with pytest.raises(InvalidConfig, match=re.escape("'prefill' (profiles.prefill)")):
        load(text)


# -- always-disagg-multimodal-decider ------------------------------------------------


def _chat(*contents: object) -> InferenceRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": c} for c in contents]}
    return parse_request(
        request_id="r",
        method="POST",
        path="/v1/chat/completions",
        headers={},
        body=msgspec.json.encode(body),
    )


def test_the_multimodal_decider_encodes_requests_with_media_only() -> None:
    decider = AlwaysDisaggMultimodalDecider(None, context("m"))
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    media = decider.disaggregate(
        _chat([{"type": "text", "text": "what is this?"}, image, image], [audio]),
        CycleState(),
        None,
    )
    assert media.disaggregate is True
    assert media.facts == {"mediaParts": {"image_url": 2, "input_audio": 1}}
    text = decider.disaggregate(
        _chat("plain", [{"type": "text", "text": "parts"}]), CycleState(), None
    )
    assert text.disaggregate is False
    assert decider.disaggregate(make_request(), CycleState(), None).disaggregate is False


def test_routed_decisions_are_counted_and_explains_are_not() -> None:
    """llm-d's decision counter: one per routed request, by the stages it got."""
    datastore = Datastore()
    datastore.replace_all(
        [
            EndpointSpec("decode-0", "10.0.0.1:8000", labels={"llm-d.ai/role": "decode"}),
            EndpointSpec("prefill-0", "10.0.0.2:8000", labels={"llm-d.ai/role": "prefill"}),
        ]
    )
    metrics = CollectorRegistry()
    text = config(PREFILL).replace("always-disagg-pd-decider", "prefix-based-pd-decider")
    text = text.replace(
        "- type: prefix-based-pd-decider\n",
        "- type: prefix-based-pd-decider\n  parameters: {nonCachedTokens: 100}\n",
    )
    # The decider reads the approximate producer's match.
    text = text.replace("plugins:\n", "plugins:\n- type: approx-prefix-cache-producer\n", 1)
    built = load_config(
        text, PluginRegistry.from_entry_points(), datastore=datastore, metrics=metrics
    )
    director = Director(datastore, built, Telemetry(datastore))

    def count(decision: str) -> float:
        value = metrics.get_sample_value(
            "epp_disagg_decision_total",
            {
                "plugin_name": "disagg-profile-handler",
                "plugin_type": "disagg-profile-handler",
                "model_name": "m",
                "decision_type": decision,
            },
        )
        return value or 0.0

    def route(prompt: str) -> None:
        request = parse_request(
            request_id="r",
            method="POST",
            path="/v1/completions",
            headers={},
            body=msgspec.json.encode({"model": "m", "prompt": prompt}),
        )
        decision = asyncio.run(director.pick_endpoint(request))
        director.finish(decision, ResponseInfo(completed=True))

    route("short")
    route("a long new document " * 100)
    route("another long new document " * 100)
    asyncio.run(
        director.explain(
            parse_request(
                request_id="e",
                method="POST",
                path="/v1/completions",
                headers={},
                body=msgspec.json.encode({"model": "m", "prompt": "yet another " * 200}),
            )
        )
    )
    assert (count("decode-only"), count("prefill-decode")) == (1.0, 2.0)
