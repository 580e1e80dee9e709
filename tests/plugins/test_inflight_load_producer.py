"""`inflight-load-producer`: charges a routed request's uncached prompt tokens (and
optional output estimate) to each profile's target, takes exactly that back at the
end (a disaggregated pick's prefill endpoint: at the first chunk), and leaves what
it knows for the consumers."""

from __future__ import annotations

from typing import Any

import pytest
from epp.plugins.inflight_load_producer import InFlightLoad, in_flight_load_key

from epp.config import InvalidConfig
from epp.datastore import Datastore, EndpointSpec
from epp.scheduling import CycleState, ResponseInfo
from tests.plugins.helpers import make_endpoints
from tests.plugins.llmd_helpers import (
    charge,
    load,
    one_plugin_config,
    prepared,
    producer,
    request,
    routed,
    with_match,
)

DONE = ResponseInfo(completed=True)


def test_a_routed_request_is_charged_until_it_ends() -> None:
    plugin = producer()
    a, b = make_endpoints(2)
    first = charge(plugin, a, 300)
    charge(plugin, a, 200)
    assert plugin.load(a) == InFlightLoad(requests=2, tokens=500)
    assert plugin.load(b) == InFlightLoad()
    plugin.post_response(request(), first, routed(("default", a)), DONE)
    assert plugin.load(a) == InFlightLoad(requests=1, tokens=200)
    # An end reported twice releases once.
    plugin.post_response(request(), first, routed(("default", a)), DONE)
    assert plugin.load(a) == InFlightLoad(requests=1, tokens=200)


def test_an_aborted_request_is_released_too() -> None:
    plugin = producer()
    (a,) = make_endpoints(1)
    cycle = charge(plugin, a, 50)
    plugin.post_response(request(), cycle, routed(("default", a)), ResponseInfo(completed=False))
    assert plugin.load(a) == InFlightLoad()


def test_the_prefix_an_endpoint_holds_is_not_charged() -> None:
    plugin = producer()
    a, b = make_endpoints(2)
    # 100 tokens in 10 blocks of 10: a holds 4 of them, b none.
    cycle = with_match(CycleState(), {a: 4.0})
    req = request("x" * 100)
    plugin.pre_request(req, cycle, routed(("default", a)))
    assert plugin.load(a).tokens == 100 - 4 * 10
    info = prepared(plugin, req, cycle).get(in_flight_load_key("inflight-load-producer"))
    assert info is not None
    assert info.request_tokens(a) == 60
    assert info.request_tokens(b) == 100
    # A whole-prompt match costs nothing.
    assert info.request_tokens(a) == 60
    full = with_match(CycleState(), {b: 10.0})
    assert plugin.request_tokens(req, full, b) == 0


def test_the_discount_sees_a_prefix_producer_that_runs_later() -> None:
    plugin = producer()
    (a,) = make_endpoints(1)
    req = request("x" * 100)
    cycle = prepared(plugin, req, CycleState())  # before the prefix producer
    with_match(cycle, {a: 4.0})
    info = cycle.get(in_flight_load_key("inflight-load-producer"))
    assert info is not None
    assert info.request_tokens(a) == 60


def test_the_discount_reads_the_named_producer() -> None:
    plugin = producer(prefixMatchInfoProducerName="precise")
    (a,) = make_endpoints(1)
    cycle = with_match(CycleState(), {a: 10.0})  # the approximate producer's: ignored
    assert plugin.request_tokens(request("x" * 100), cycle, a) == 100
    with_match(cycle, {a: 3.0}, producer="precise")
    assert plugin.request_tokens(request("x" * 100), cycle, a) == 70


def test_every_profile_target_is_charged() -> None:
    plugin = producer()
    prefill, decode = make_endpoints(2)
    cycle = CycleState()
    result = routed(("decode", decode), ("prefill", prefill))
    plugin.pre_request(request("x" * 80), cycle, result)
    assert plugin.load(prefill) == InFlightLoad(1, 80)
    assert plugin.load(decode) == InFlightLoad(1, 80)
    plugin.post_response(request(), cycle, result, DONE)
    assert plugin.load(prefill) == plugin.load(decode) == InFlightLoad()


def test_a_prefill_endpoint_is_released_at_the_first_chunk_the_decode_one_at_the_end() -> None:
    """A disaggregated pick: the prefill endpoint's part is over once the decode
    endpoint sends its first token; the decode endpoint holds the request to its end."""
    plugin = producer()
    prefill, decode = make_endpoints(2)
    cycle = CycleState()
    result = routed(("decode", decode), ("prefill", prefill))
    plugin.pre_request(request("x" * 80), cycle, result)
    plugin.response_first_chunk(request(), cycle, result, 0.2)
    assert plugin.load(prefill) == InFlightLoad()
    assert plugin.load(decode) == InFlightLoad(1, 80)
    plugin.response_first_chunk(request(), cycle, result, 0.3)  # once only
    plugin.post_response(request(), cycle, result, DONE)
    plugin.post_response(request(), cycle, result, DONE)
    assert plugin.load(prefill) == plugin.load(decode) == InFlightLoad()


def test_a_prefill_endpoint_is_not_charged_the_output_estimate() -> None:
    plugin = producer(addEstimatedOutputTokens=True, outputRatio=0.5)
    prefill, decode = make_endpoints(2)
    result = routed(("decode", decode), ("prefill", prefill))
    plugin.pre_request(request("x" * 80), CycleState(), result)
    assert plugin.load(prefill) == InFlightLoad(1, 80)
    assert plugin.load(decode) == InFlightLoad(1, 80 + 40)


def test_a_single_profile_pick_is_held_past_the_first_chunk() -> None:
    plugin = producer()
    (a,) = make_endpoints(1)
    cycle = charge(plugin, a, 30)
    plugin.response_first_chunk(request(), cycle, routed(("default", a)), 0.1)
    assert plugin.load(a) == InFlightLoad(1, 30)


def test_text_is_counted_at_chars_per_token_and_token_ids_exactly() -> None:
    plugin = producer(charsPerToken=4.0)
    (a,) = make_endpoints(1)
    assert plugin.request_tokens(request("x" * 101), CycleState(), a) == 26  # ceil(101 / 4)
    ids = request([1, 2, 3, 4, 5])
    assert plugin.request_tokens(ids, CycleState(), a) == 5
    batch = request(["x" * 8, "y" * 12])
    assert plugin.request_tokens(batch, CycleState(), a) == 5


def test_the_output_estimate_is_a_ratio_of_the_whole_prompt_capped() -> None:
    (a,) = make_endpoints(1)
    plain = producer(addEstimatedOutputTokens=True)
    # 100 prompt tokens, 40 of them cached on a: 60 + round(100 * 1.5).
    assert plain.request_tokens(request("x" * 100), with_match(CycleState(), {a: 4.0}), a) == 210
    ratio = producer(addEstimatedOutputTokens=True, outputRatio=0.25)
    assert ratio.request_tokens(request("x" * 10), CycleState(), a) == 10 + 2  # round(2.5)
    capped = producer(addEstimatedOutputTokens=True, maxEstimatedOutputTokens=30)
    assert capped.request_tokens(request("x" * 100), CycleState(), a) == 130
    # The client's own limit, whichever field its API uses, caps it too.
    for field in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        asked = request("x" * 100, **{field: 7})
        assert plain.request_tokens(asked, CycleState(), a) == 107
    # Off by default.
    assert producer().request_tokens(request("x" * 100), CycleState(), a) == 100


def test_an_endpoint_that_leaves_takes_its_counters() -> None:
    datastore = Datastore()
    datastore.replace_all([EndpointSpec("a", "10.0.0.1:8000")])
    plugin = producer(datastore)
    (old,) = datastore.ready_endpoints()
    running = charge(plugin, old, 500)
    datastore.replace_all([EndpointSpec("a", "10.0.0.9:8000")])  # same name, new pod
    (new,) = datastore.ready_endpoints()
    assert plugin.load(old) == InFlightLoad()
    charge(plugin, new, 100)
    # The request on the old pod ends: the new pod's count is untouched.
    plugin.post_response(request(), running, routed(("default", old)), DONE)
    assert plugin.load(new) == InFlightLoad(1, 100)
    assert plugin.describe_endpoint(new) == {"inFlightLoad": {"requests": 1, "tokens": 100}}


def test_preparing_a_request_charges_nothing() -> None:
    plugin = producer()
    (a,) = make_endpoints(1)
    info = prepared(plugin, request("x" * 100), CycleState()).get(
        in_flight_load_key("inflight-load-producer")
    )
    assert info is not None
    assert info.request_tokens(a) == 100
    assert info.load(a) == InFlightLoad()
    assert plugin.load(a) == InFlightLoad()


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"outputRatio": -0.5}, "outputRatio"),
        ({"outputRatio": float("inf")}, "outputRatio must be a finite number"),
        ({"maxEstimatedOutputTokens": -1}, "maxEstimatedOutputTokens"),
        ({"addEstimatedOutputTokens": "yes"}, "addEstimatedOutputTokens"),
        ({"charsPerToken": 0}, "charsPerToken"),
        ({"includeOutputTokens": True}, "includeOutputTokens"),
    ],
)
def test_bad_parameters_are_config_errors(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        load(one_plugin_config("inflight-load-producer", parameters))


def test_llm_d_parameters_load() -> None:
    config = load(
        one_plugin_config(
            "inflight-load-producer",
            {
                "addEstimatedOutputTokens": True,
                "outputRatio": 0.2,
                "maxEstimatedOutputTokens": 1000,
                "prefixMatchInfoProducerName": "precise-prefix-cache-producer",
                "syncCrossReplicaState": False,
            },
        )
    )
    assert "inflight-load-producer" in config.plugins
