"""Lean mode end to end: a real Envoy with manifests/envoy/envoy-lean.yaml sends
the EPP the request phase over ext_proc and, once each request has ended, an entry
on its gRPC access log. Routing and bodies are as in GIE's mode; the response goes
from the upstream to the client without passing through the EPP."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import yaml

from bench.stack import ENVOY_LEAN_YAML, ENVOY_YAML
from tests.integration.conftest import MAX_BODY_BYTES, Stack
from tests.integration.test_envoy import SELECT, error_of, metric, post
from tests.integration.upstream import NAME_HEADER, sse_events

DEADLINE_S = 10.0


async def in_flight(stack: Stack) -> dict[str, int]:
    """`inFlight` per endpoint name, from the EPP's /debug/endpoints."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(stack.admin_url + "/debug/endpoints") as response,
    ):
        endpoints: list[dict[str, Any]] = await response.json()
    return {e["name"]: e["inFlight"] for e in endpoints}


async def eventually(check: Callable[[], Awaitable[bool]], what: str) -> None:
    deadline = asyncio.get_running_loop().time() + DEADLINE_S
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, f"never happened: {what}"
        await asyncio.sleep(0.02)


async def nothing_in_flight(stack: Stack) -> bool:
    return not any((await in_flight(stack)).values())


@pytest.fixture
async def lean(clean_lean_stack: Stack) -> Stack:
    """The lean stack once Envoy's access-log stream is open. Envoy opens it at its
    first flush, after the first request ended; requests before that can only be
    ended when their ext_proc stream ends (the EPP's fallback)."""
    stack = clean_lean_stack
    if await metric(stack, "epp_access_log_streams_total") == 0:
        async with aiohttp.ClientSession() as session, session.get(stack.url + "/v1/models") as r:
            assert r.status == 200

        async def connected() -> bool:
            return await metric(stack, "epp_access_log_streams_total") >= 1

        await eventually(connected, "Envoy opens its access-log stream")
    await eventually(lambda: nothing_in_flight(stack), "nothing in flight")
    stack.upstreams.clear()
    return stack


def _hcm(config: dict[str, Any]) -> dict[str, Any]:
    (listener,) = config["static_resources"]["listeners"]
    hcm: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm


def test_the_lean_config_differs_from_envoy_yaml_only_in_the_response_path() -> None:
    full = yaml.safe_load(ENVOY_YAML.read_text())
    lean = yaml.safe_load(ENVOY_LEAN_YAML.read_text())
    hcm = _hcm(lean)
    (access_log,) = hcm.pop("access_log")
    common = access_log["typed_config"]["common_config"]
    assert access_log["name"] == "envoy.access_loggers.http_grpc"
    assert common["grpc_service"] == {"envoy_grpc": {"cluster_name": "epp"}}
    assert common["transport_api_version"] == "V3"
    ext_proc = hcm["http_filters"][0]["typed_config"]
    assert ext_proc["processing_mode"] == {
        "request_header_mode": "SEND",
        "request_body_mode": "FULL_DUPLEX_STREAMED",
        "request_trailer_mode": "SEND",
        "response_header_mode": "SKIP",
        "response_body_mode": "NONE",
        "response_trailer_mode": "SKIP",
    }
    full_ext_proc = _hcm(full)["http_filters"][0]["typed_config"]
    ext_proc["processing_mode"] = full_ext_proc["processing_mode"]
    assert lean == full


async def test_a_streaming_response_holds_its_in_flight_count_until_it_ends(lean: Stack) -> None:
    target = lean.upstreams[1]
    handoffs = await metric(lean, "epp_lean_handoffs_total")
    ended = await metric(lean, "epp_lean_request_ends_total", 'how="access_log"')
    body = {"model": "m", "prompt": "hi", "stream": True, "max_tokens": 6, "hold": "long-1"}
    events = sse_events(6)
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            lean.url + "/v1/completions",
            json=body,
            headers={SELECT: target.address, "x-request-id": "lean-e2e-1"},
        ) as response,
    ):
        assert response.status == 200
        received = b""
        while len(received) < len(events[0]):
            received += await response.content.readany()

        # The EPP's part of the exchange is over (Envoy ended the ext_proc stream)
        # while the response is still streaming: the request is still in flight.
        async def handed_off() -> bool:
            return await metric(lean, "epp_lean_handoffs_total") >= handoffs + 1

        await eventually(handed_off, "the ext_proc stream ends before the response")
        assert await in_flight(lean) == {"up-0": 0, "up-1": 1, "up-2": 0}

        lean.upstreams.release("long-1")
        received += await response.read()
    assert received == b"".join(events)
    await eventually(lambda: nothing_in_flight(lean), "the access log ends the request")
    assert await metric(lean, "epp_lean_request_ends_total", 'how="access_log"') == ended + 1
    assert await metric(lean, "epp_lean_request_ends_total", 'how="timeout"') == 0
    (request,) = target.received
    assert request.headers["x-request-id"] == "lean-e2e-1"


async def test_routing_and_bodies_work_as_in_full_mode(lean: Stack) -> None:
    for upstream in lean.upstreams:
        body = {"model": "m", "prompt": f"for {upstream.name}", "max_tokens": 3}
        status, headers, _ = await post(lean, "/v1/completions", body, {SELECT: upstream.address})
        assert status == 200
        assert headers[NAME_HEADER] == upstream.name
        (received,) = upstream.received
        assert json.loads(received.body) == body
        assert received.headers["x-gateway-destination-endpoint"] == upstream.address

    target = lean.upstreams[2]
    target.received.clear()
    raw = b'{"prompt" : "keep   me",\n "model":"m",  "temperature": 0.5}'
    status, _, _ = await post(
        lean,
        "/v1/completions",
        raw,
        {SELECT: target.address, "x-gateway-inference-objective": "batch"},
    )
    assert status == 200
    prompt = "".join(f"word{i} " for i in range(150_000))[: MAX_BODY_BYTES - 1000]
    large = json.dumps({"model": "m", "prompt": prompt}).encode()
    status, _, _ = await post(lean, "/v1/completions", large, {SELECT: target.address})
    assert status == 200
    rewrite = {"model": "public-name", "prompt": "hi"}
    status, _, _ = await post(
        lean,
        "/v1/completions",
        rewrite,
        {SELECT: target.address, "x-gateway-model-name-rewrite": "internal-name"},
    )
    assert status == 200
    as_sent, big, rewritten = target.received
    assert as_sent.body == raw
    assert "x-gateway-inference-objective" not in as_sent.headers
    assert big.body == large
    assert json.loads(rewritten.body) == {**rewrite, "model": "internal-name"}

    async with aiohttp.ClientSession() as session, session.get(lean.url + "/v1/models") as r:
        assert r.status == 200
        assert r.headers[NAME_HEADER] in {u.name for u in lean.upstreams}
    await eventually(lambda: nothing_in_flight(lean), "every request ended")


async def test_a_streamed_response_passes_intact_but_its_usage_is_not_read(lean: Stack) -> None:
    # What lean mode gives up: the EPP never sees the response body.
    cached = await metric(lean, "epp_cached_prompt_tokens_total")
    target = lean.upstreams[0]
    body = {"model": "m", "prompt": "hi", "stream": True, "max_tokens": 40, "big_event": 100_000}
    status, headers, payload = await post(lean, "/v1/completions", body, {SELECT: target.address})
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    assert payload == b"".join(sse_events(40, 100_000))
    await eventually(lambda: nothing_in_flight(lean), "the request ended")
    assert await metric(lean, "epp_cached_prompt_tokens_total") == cached


async def test_errors_are_answered_by_the_epp_and_leave_nothing_in_flight(lean: Stack) -> None:
    unknown = await metric(lean, "epp_access_log_entries_total", 'result="unknown"')
    status, _, payload = await post(lean, "/v1/completions", b'{"model": "m", "prompt": ')
    assert status == 400
    assert error_of(payload)["code"] == 400
    status, _, payload = await post(
        lean, "/v1/completions", {"model": "m", "prompt": "x"}, {SELECT: "10.9.9.9:1"}
    )
    assert status == 429
    assert not any(u.received for u in lean.upstreams)

    # Their entries come too, for requests nothing waits for.
    async def logged() -> bool:
        return await metric(lean, "epp_access_log_entries_total", 'result="unknown"') >= (
            unknown + 2
        )

    await eventually(logged, "the errors' access-log entries arrive")
    assert await nothing_in_flight(lean)
