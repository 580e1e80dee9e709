"""Session affinity: binding in pre_request, TTL, memory bound, sources."""

from __future__ import annotations

import base64

import msgspec
import pytest
from epp.plugins.session_affinity_scorer import SessionAffinityScorer

from epp.clock import SYSTEM_CLOCK, Clock, VirtualClock
from epp.requests import parse_request
from epp.scheduling import CycleState, SchedulingResult
from epp.scheduling.types import ProfileResult, ScoredEndpoint
from tests.plugins.helpers import context, make_endpoints


def scorer(clock: Clock = SYSTEM_CLOCK, **params: object) -> SessionAffinityScorer:
    parameters = msgspec.convert(params, SessionAffinityScorer.Parameters)
    return SessionAffinityScorer(parameters, context("session-affinity-scorer", clock))


def request(headers: dict[str, str] | None = None, body: dict[str, object] | None = None):  # type: ignore[no-untyped-def]
    return parse_request(
        request_id="r",
        method="POST",
        path="/v1/completions",
        headers=headers or {},
        body=msgspec.json.encode(body or {"model": "m", "prompt": "hi"}),
    )


def routed(endpoint) -> SchedulingResult:  # type: ignore[no-untyped-def]
    return SchedulingResult(
        "default",
        {"default": ProfileResult("default", (endpoint,), (ScoredEndpoint(endpoint, 1.0),))},
    )


SESSION = {"strategy": "session_id"}


def test_a_session_sticks_to_where_it_was_routed() -> None:
    plugin = scorer(**SESSION)
    endpoints = make_endpoints(3)
    first = request({"x-session-id": "abc"})
    cycle = CycleState()
    assert set(plugin.score(first, cycle, endpoints).values()) == {0.0}  # no binding yet
    plugin.pre_request(first, cycle, routed(endpoints[2]))
    again = plugin.score(request({"x-session-id": "abc"}), CycleState(), endpoints)
    assert [again[e] for e in endpoints] == [0.0, 0.0, 1.0]
    other = plugin.score(request({"x-session-id": "zzz"}), CycleState(), endpoints)
    assert set(other.values()) == {0.0}
    none = plugin.score(request(), CycleState(), endpoints)
    assert set(none.values()) == {0.0}


def test_scoring_alone_binds_nothing() -> None:
    plugin = scorer(**SESSION)
    endpoints = make_endpoints(2)
    for _ in range(3):
        plugin.score(request({"x-session-id": "abc"}), CycleState(), endpoints)
    assert len(plugin) == 0


def test_a_session_whose_endpoint_left_rebinds() -> None:
    plugin = scorer(**SESSION)
    a, b = make_endpoints(2)
    plugin.pre_request(request({"x-session-id": "s"}), CycleState(), routed(a))
    scores = plugin.score(request({"x-session-id": "s"}), CycleState(), [b])
    assert scores[b] == 0.0
    plugin.pre_request(request({"x-session-id": "s"}), CycleState(), routed(b))
    assert plugin.score(request({"x-session-id": "s"}), CycleState(), [a, b])[b] == 1.0


def test_bindings_expire_and_are_bounded() -> None:
    clock = VirtualClock(1000.0)
    plugin = scorer(
        clock, strategy="session_id", sessionIdConfig={"evictionTtlSeconds": 10, "maxSessions": 3}
    )
    endpoints = make_endpoints(2)
    for i in range(5):
        plugin.pre_request(request({"x-session-id": f"s{i}"}), CycleState(), routed(endpoints[0]))
    assert len(plugin) == 3  # the least recently used went first
    assert (
        plugin.score(request({"x-session-id": "s0"}), CycleState(), endpoints)[endpoints[0]] == 0.0
    )
    assert (
        plugin.score(request({"x-session-id": "s4"}), CycleState(), endpoints)[endpoints[0]] == 1.0
    )
    clock.advance(11)
    assert (
        plugin.score(request({"x-session-id": "s4"}), CycleState(), endpoints)[endpoints[0]] == 0.0
    )
    plugin.pre_request(request({"x-session-id": "new"}), CycleState(), routed(endpoints[1]))
    assert len(plugin) == 1  # the expired ones were dropped on the way


def test_session_id_from_a_body_field() -> None:
    plugin = scorer(
        strategy="session_id",
        sessionIdConfig={"sources": [{"header": "x-sess"}, {"bodyField": "user"}]},
    )
    a, b = make_endpoints(2)
    body = {"model": "m", "prompt": "hi", "user": "alice"}
    plugin.pre_request(request(body=body), CycleState(), routed(b))
    assert plugin.score(request(body=body), CycleState(), [a, b])[b] == 1.0
    # The header comes first when both are there.
    assert plugin.session_id(request({"x-sess": "h"}, body)) == "h"


def test_encoded_endpoint_header_is_read() -> None:
    plugin = scorer()
    a, b = make_endpoints(2)
    token = base64.b64encode(f"default/{b.name}".encode()).decode()
    scores = plugin.score(request({"x-session-token": token}), CycleState(), [a, b])
    assert [scores[a], scores[b]] == [0.0, 1.0]
    garbage = plugin.score(request({"x-session-token": "%%%"}), CycleState(), [a, b])
    assert set(garbage.values()) == {0.0}


def test_attribute_sources_are_refused() -> None:
    with pytest.raises(ValueError, match="request attributes are not supported"):
        scorer(strategy="session_id", sessionIdConfig={"sources": [{"attribute": "agent"}]})
    with pytest.raises(ValueError, match="exactly one"):
        scorer(strategy="session_id", sessionIdConfig={"sources": [{}]})
