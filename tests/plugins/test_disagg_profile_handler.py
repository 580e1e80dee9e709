"""`disagg-profile-handler` (and its deprecated name `pd-profile-handler`): decode
first, always; the decider, asked about the decode pick; the prefill profile only
when it says yes; decode primary; `x-prefiller-host-port` only on a disaggregated
pick; the decision in /debug/explain's notes; clear errors for bad parameters."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import msgspec
import pytest
import yaml
from epp.plugins.always_disagg_pd_decider import AlwaysDisaggPdDecider
from epp.plugins.disagg_profile_handler import DisaggProfileHandler, PdProfileHandler

from epp.config import InvalidConfig
from epp.datastore import Endpoint
from epp.requests import InferenceRequest
from epp.scheduling import (
    EXPLAIN_NOTES,
    CycleState,
    DisaggDecision,
    PluginContext,
    ProfileResult,
    ScoredEndpoint,
)
from epp.scheduling.scheduler import Scheduler, SchedulerProfile, Slot
from tests.plugins.helpers import context, make_endpoints, make_request
from tests.plugins.llmd_helpers import load

HEADER = "x-prefiller-host-port"


class Decider:
    """Says what it is told, and remembers what it was asked about."""

    def __init__(self, answer: bool) -> None:
        self.answer = answer
        self.asked: list[Endpoint] = []

    def disaggregate(
        self, request: InferenceRequest, cycle: CycleState, decode: Endpoint
    ) -> DisaggDecision:
        self.asked.append(decode)
        return DisaggDecision(self.answer, "told so", {"answer": self.answer})


def handler(
    decider: object, cls: type[DisaggProfileHandler] = DisaggProfileHandler, **params: Any
) -> DisaggProfileHandler:
    params.setdefault("deciderPluginName", "decider")
    base = context("disagg-profile-handler")
    ctx = PluginContext(
        "disagg-profile-handler",
        "disagg-profile-handler",
        base.datastore,
        base.metrics,
        {"decider": decider},
    )
    return cls(msgspec.convert(params, DisaggProfileHandler.Parameters), ctx)


def schedule(
    plugin: DisaggProfileHandler,
    decode: Endpoint | None,
    prefill: Endpoint | None,
    endpoints: list[Endpoint],
) -> tuple[Any, CycleState, list[str]]:
    """Run the real scheduler with a decode and a prefill profile that pick the
    given endpoints; the result, the cycle and the profiles run, in order."""
    ran: list[str] = []

    class Recording:
        def __init__(self, name: str, endpoint: Endpoint | None) -> None:
            self.name, self.endpoint = name, endpoint

        def pick(self, cycle: CycleState, scored: Any) -> list[Endpoint]:
            ran.append(self.name)
            return [] if self.endpoint is None else [self.endpoint]

    profiles = {
        name: SchedulerProfile(name, (), (), Slot("picker", "picker", Recording(name, target)))
        for name, target in (("prefill", prefill), ("decode", decode))
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
    assert note(cycle)["decision"] is False
    assert note(cycle)["disaggregated"] is False


def test_nothing_is_decided_when_decode_picks_nothing() -> None:
    (p,) = make_endpoints(1)
    decider = Decider(True)
    result, cycle, ran = schedule(handler(decider), None, p, [p])
    assert ran == ["decode"]
    assert decider.asked == []
    assert result.targets == ()  # the request fails as any request with no endpoint
    assert result.request_headers == {}
    assert note(cycle)["disaggregated"] is False


def test_without_a_prefill_endpoint_the_decode_endpoint_serves_it_whole() -> None:
    (d,) = make_endpoints(1)
    result, cycle, ran = schedule(handler(Decider(True)), d, None, [d])
    assert ran == ["decode", "prefill"]
    assert result.targets == (d,)
    assert set(result.profiles) == {"decode"}  # nothing charged to a prefill pick
    assert result.request_headers == {}
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
    plugin = handler(Decider(True), decodeProfile="d", prefillProfile="p")
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


@pytest.mark.parametrize(
    ("profiles", "message"),
    [
        (("decode",), "missing: 'prefill'"),
        (("default",), "missing: 'decode', 'prefill'"),
        (("decode", "prefill", "encode"), "never runs 'encode'"),
    ],
)
def test_the_profiles_are_checked(profiles: tuple[str, ...], message: str) -> None:
    plugin = handler(Decider(True))
    with pytest.raises(ValueError, match=message):
        plugin.check_profiles(profiles)


def test_the_deprecated_name_works_the_same_and_warns(caplog: pytest.LogCaptureFixture) -> None:
    d, p = make_endpoints(2)
    with caplog.at_level(logging.WARNING):
        plugin = handler(AlwaysDisaggPdDecider(None, context("a")), cls=PdProfileHandler)
    assert "deprecated" in caplog.text
    result, _, _ = schedule(plugin, d, p, [d, p])
    assert result.request_headers == {HEADER: p.address}


# -- through the config loader: what a config gets wrong ---------------------------


def config(handler_params: Mapping[str, Any], decider_first: bool = True) -> str:
    decider = {"type": "always-disagg-pd-decider"}
    handler_decl = {"type": "disagg-profile-handler", "parameters": dict(handler_params)}
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


def test_a_valid_config_loads() -> None:
    built = load(config({"deciderPluginName": "always-disagg-pd-decider"}))
    assert set(built.scheduler.profiles) == {"decode", "prefill"}


@pytest.mark.parametrize(
    ("params", "decider_first", "message"),
    [
        ({}, True, "deciderPluginName is required"),
        ({"deciderPluginName": "nope"}, True, "'nope': no plugin of that name"),
        ({"deciderPluginName": "max-score-picker"}, True, "is not a disaggregation decider"),
        ({"deciderPluginName": "always-disagg-pd-decider"}, False, "list the decider first"),
        (
            {"deciderPluginName": "always-disagg-pd-decider", "primaryPort": 8000},
            True,
            "primaryPort 8000 is not supported",
        ),
        (
            {"deciderPluginName": "always-disagg-pd-decider", "prefillProfile": "decode"},
            True,
            "must name two profiles",
        ),
        ({"deciderPluginName": "always-disagg-pd-decider", "threshold": 5}, True, "threshold"),
    ],
)
def test_bad_parameters_are_config_errors(
    params: dict[str, Any], decider_first: bool, message: str
) -> None:
    with pytest.raises(InvalidConfig, match=message):
        load(config(params, decider_first))


def test_profiles_the_handler_does_not_run_are_config_errors() -> None:
    text = config({"deciderPluginName": "always-disagg-pd-decider"}).replace(
        "name: prefill", "name: prefill-stage"
    )
    with pytest.raises(InvalidConfig, match="missing: 'prefill'"):
        load(text)
