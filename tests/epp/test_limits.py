"""Resource limits, each with its documented answer (docs/security.md):

- `--max-concurrent-streams`: a request beyond it is answered 503 at once, with an
  OpenAI-shaped error, counted as `overloaded`; the streams already open go on;
- the prompt length considered for prefix matching (`maxPrefixBlocksToMatch` /
  `maxPrefixTokensToMatch` of both prefix scorers): only the first blocks count,
  and /debug/explain says so (`notes.<plugin>.truncated`);
- `--max-body-bytes` (413) is tested in extproc/test_stream_errors.py and, through
  Envoy, in integration/test_envoy.py.

All against a real EPP over real gRPC and its real admin HTTP server."""

from __future__ import annotations

import json
from typing import Any

import grpc
import yaml

from epp.datastore import Endpoint
from tests.epp.conftest import Epp, StartEpp
from tests.epp.extproc import envoy_client as ec
from tests.epp.extproc.test_stream_errors import assert_error
from tests.plugins.engine_events import feed, stored_payload

BODY = json.dumps({"model": "m", "prompt": "hello"}).encode()


def one_scorer_config(plugin: dict[str, Any]) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
            "kind": "EndpointPickerConfig",
            "plugins": [plugin, {"type": "max-score-picker"}],
            "schedulingProfiles": [
                {
                    "name": "default",
                    "plugins": [{"pluginRef": plugin["name"]}, {"pluginRef": "max-score-picker"}],
                }
            ],
        }
    )


async def explain(epp: Epp, body: dict[str, Any], **headers: str) -> dict[str, Any]:
    query = {"path": "/v1/completions", "headers": headers, "body": body}
    async with epp.http.post(f"{epp.admin_url}/debug/explain", json=query) as response:
        assert response.status == 200, await response.text()
        result: dict[str, Any] = await response.json()
        return result


def scores_of(explained: dict[str, Any], plugin: str) -> dict[str, float]:
    return {c["name"]: c["scores"][plugin] for c in explained["candidates"]}


# -- concurrent streams -----------------------------------------------------------------


async def test_a_request_beyond_max_concurrent_streams_is_answered_503(
    start_epp: StartEpp,
) -> None:
    epp = await start_epp(max_concurrent_streams=2)
    # Two requests routed, their responses not finished: both streams stay open.
    held = [epp.stream(), epp.stream()]
    for stream in held:
        routed = await ec.route(stream, BODY)
        assert routed.destination in epp.addresses
    assert await epp.metric("epp_extproc_active_streams") == 2

    refused = epp.stream()
    reply = await ec.send_request(refused, BODY)
    message = assert_error(reply, 503)
    assert "--max-concurrent-streams" in message
    assert "2 concurrent requests" in message
    assert await refused.close() == grpc.StatusCode.OK
    assert await epp.metric("epp_requests_total", {"outcome": "overloaded"}) == 1
    # The refused request never held an endpoint; the open ones are untouched.
    assert await epp.total_in_flight() == 2

    # One of the open requests finishes: a new one is served again.
    await ec.respond(held[0], [b"{}"])
    assert await held[0].close() == grpc.StatusCode.OK
    assert await epp.wait_metric("epp_extproc_active_streams", None, 1) <= 1
    again = epp.stream()
    routed = await ec.route(again, BODY)
    assert routed.destination in epp.addresses
    for stream in (held[1], again):
        await ec.respond(stream, [b"{}"])
        assert await stream.close() == grpc.StatusCode.OK
    assert await epp.wait_in_flight(0) == 0
    assert await epp.metric("epp_requests_total", {"outcome": "overloaded"}) == 1


async def test_header_only_requests_are_refused_the_same_way(start_epp: StartEpp) -> None:
    epp = await start_epp(max_concurrent_streams=1)
    held = epp.stream()
    await ec.route(held, BODY)
    refused = epp.stream()
    await refused.send(ec.request_headers("/v1/models", method="GET", end_of_stream=True))
    assert_error(await refused.expect(), 503)
    assert await refused.close() == grpc.StatusCode.OK
    held.cancel()
    assert await epp.wait_in_flight(0) == 0


async def test_no_limit_by_default(epp: Epp) -> None:
    streams = [epp.stream() for _ in range(20)]
    for stream in streams:
        assert (await ec.route(stream, BODY)).destination in epp.addresses
    for stream in streams:
        stream.cancel()
    assert await epp.wait_in_flight(0) == 0


# -- prompt length considered for prefix matching --------------------------------------


async def test_the_approximate_scorer_matches_only_the_first_blocks(
    start_epp: StartEpp,
) -> None:
    plugin = {
        "type": "prefix-cache-scorer",
        "name": "approx",
        # 2 tokens x 4 characters: a block is 8 characters; 4 blocks are matched.
        "parameters": {"autoTune": False, "blockSizeTokens": 2, "maxPrefixBlocksToMatch": 4},
    }
    epp = await start_epp(config_text=one_scorer_config(plugin))
    prompt = "0123456789abcdef" * 10  # 20 blocks
    stream = epp.stream()
    routed = await ec.route(stream, json.dumps({"model": "m", "prompt": prompt}).encode())
    stream.cancel()
    by_address = {a: n for n, a in epp.endpoints.items()}
    chosen = by_address[routed.destination]

    # Another prompt with the same first 32 characters: past the cap nothing counts,
    # so it scores as a full match.
    explained = await explain(epp, {"model": "m", "prompt": prompt[:32] + "Z" * 100})
    assert scores_of(explained, "approx")[chosen] == 1.0
    assert explained["notes"]["approx"] == {
        "promptBlocks": 17,
        "consideredBlocks": 4,
        "truncated": True,
        "maxPrefixBlocksToMatch": 4,
        "blockSizeTokens": 2,
    }
    # A short prompt is not truncated.
    short = await explain(epp, {"model": "m", "prompt": "0123"})
    assert short["notes"]["approx"]["truncated"] is False


async def test_the_precise_scorer_matches_only_the_first_blocks(start_epp: StartEpp) -> None:
    plugin = {
        "type": "precise-prefix-cache-scorer",
        "name": "precise",
        "parameters": {"blockSize": 4, "hashSeed": "0", "maxPrefixTokensToMatch": 12},
    }
    epp = await start_epp(config_text=one_scorer_config(plugin), endpoints={"pod-a": "10.0.0.1:1"})
    (endpoint,) = epp.app.datastore.all_endpoints()
    assert isinstance(endpoint, Endpoint)
    # The engine caches the first 3 blocks (12 tokens) of a 40-token prompt.
    tokens = list(range(100, 140))
    feed(epp.plugin("precise").service, endpoint, stored_payload(tokens[:12]))

    explained = await explain(epp, {"model": "m", "prompt": tokens})
    assert scores_of(explained, "precise") == {"pod-a": 1.0}  # 3 of the 3 considered
    assert explained["notes"]["precise"] == {
        "promptBlocks": 10,
        "consideredBlocks": 3,
        "truncated": True,
        "maxPrefixBlocksToMatch": 3,
    }


async def test_without_a_cap_the_whole_prompt_counts(start_epp: StartEpp) -> None:
    plugin = {
        "type": "precise-prefix-cache-scorer",
        "name": "precise",
        "parameters": {"blockSize": 4, "hashSeed": "0", "maxPrefixBlocksToMatch": 0},
    }
    epp = await start_epp(config_text=one_scorer_config(plugin), endpoints={"pod-a": "10.0.0.1:1"})
    (endpoint,) = epp.app.datastore.all_endpoints()
    tokens = list(range(100, 140))
    assert isinstance(endpoint, Endpoint)
    feed(epp.plugin("precise").service, endpoint, stored_payload(tokens[:12]))
    explained = await explain(epp, {"model": "m", "prompt": tokens})
    assert scores_of(explained, "precise") == {"pod-a": 0.3}
    assert explained["notes"]["precise"]["truncated"] is False
