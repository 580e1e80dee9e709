"""End to end through a real Envoy: client -> Envoy -> `epp serve` -> upstream."""

from __future__ import annotations

import json
import re
from typing import Any

import aiohttp
import pytest

from tests.integration.conftest import MAX_BODY_BYTES, Stack
from tests.integration.upstream import NAME_HEADER, sse_events

SELECT = "test-epp-endpoint-selection"


async def post(
    stack: Stack,
    path: str,
    body: bytes | dict[str, Any],
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            stack.url + path,
            data=data,
            headers={"content-type": "application/json", **(headers or {})},
        ) as response,
    ):
        return response.status, dict(response.headers), await response.read()


async def metric(stack: Stack, name: str, labels: str = "") -> float:
    async with aiohttp.ClientSession() as session, session.get(stack.admin_url + "/metrics") as r:
        text = await r.text()
    pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else "") + r" (\S+)"
    found = re.search(r"^" + pattern + r"$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


async def envoy_stat(stack: Stack, name: str) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            stack.envoy_admin_url + "/stats", params={"filter": f"^{re.escape(name)}$"}
        ) as r,
    ):
        text = await r.text()
    return int(text.split(":")[1]) if ":" in text else 0


def error_of(body: bytes) -> dict[str, Any]:
    document = json.loads(body)
    assert set(document) == {"error"}
    assert set(document["error"]) == {"message", "type", "code"}
    error: dict[str, Any] = document["error"]
    return error


async def test_each_request_reaches_the_endpoint_the_picker_chose(clean_stack: Stack) -> None:
    for upstream in clean_stack.upstreams:
        body = {"model": "m", "prompt": f"for {upstream.name}", "max_tokens": 3}
        status, headers, _ = await post(
            clean_stack, "/v1/completions", body, {SELECT: upstream.address}
        )
        assert status == 200
        assert headers[NAME_HEADER] == upstream.name
        (received,) = upstream.received
        assert json.loads(received.body) == body
        assert received.headers["x-gateway-destination-endpoint"] == upstream.address
    assert all(len(u.received) == 1 for u in clean_stack.upstreams)


async def test_body_and_headers_arrive_upstream_as_sent_minus_control_headers(
    clean_stack: Stack,
) -> None:
    target = clean_stack.upstreams[1]
    # Odd spacing and key order: the EPP must forward the bytes, not a re-serialisation.
    raw = b'{"prompt" : "keep   me",\n "model":"m",  "temperature": 0.5}'
    status, _, _ = await post(
        clean_stack,
        "/v1/completions",
        raw,
        {
            SELECT: target.address,
            "x-gateway-inference-objective": "batch",
            "x-gateway-inference-fairness-id": "tenant-a",
            "x-request-id": "req-123",
        },
    )
    assert status == 200
    (received,) = target.received
    assert received.body == raw
    assert "x-gateway-inference-objective" not in received.headers
    assert "x-gateway-inference-fairness-id" not in received.headers
    assert received.headers["x-request-id"] == "req-123"


async def test_model_rewrite_header_rewrites_the_body_upstream(clean_stack: Stack) -> None:
    target = clean_stack.upstreams[0]
    body = {"model": "public-name", "prompt": "hi", "n": 1}
    status, _, _ = await post(
        clean_stack,
        "/v1/completions",
        body,
        {SELECT: target.address, "x-gateway-model-name-rewrite": "internal-name"},
    )
    assert status == 200
    (received,) = target.received
    assert json.loads(received.body) == {**body, "model": "internal-name"}
    assert "x-gateway-model-name-rewrite" not in received.headers


async def test_large_body_arrives_intact(clean_stack: Stack) -> None:
    target = clean_stack.upstreams[2]
    prompt = "".join(f"word{i} " for i in range(150_000))[: MAX_BODY_BYTES - 1000]
    raw = json.dumps({"model": "m", "prompt": prompt}).encode()
    assert len(raw) > 10 * 62_000
    status, _, _ = await post(clean_stack, "/v1/completions", raw, {SELECT: target.address})
    assert status == 200
    (received,) = target.received
    assert received.body == raw


async def test_streamed_sse_response_passes_through_intact_and_usage_is_read(
    clean_stack: Stack,
) -> None:
    before = await metric(clean_stack, "epp_cached_prompt_tokens_total")
    target = clean_stack.upstreams[0]
    # One event larger than a 62,000-byte ext_proc chunk, then many small ones.
    body = {"model": "m", "prompt": "hi", "stream": True, "max_tokens": 40, "big_event": 100_000}
    status, headers, payload = await post(
        clean_stack, "/v1/completions", body, {SELECT: target.address}
    )
    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    assert payload == b"".join(sse_events(40, 100_000))
    # The usage line (cached_tokens 64) was parsed on the way through.
    assert await metric(clean_stack, "epp_cached_prompt_tokens_total") == before + 64


async def test_header_only_request_is_routed(clean_stack: Stack) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.get(clean_stack.url + "/v1/models") as response,
    ):
        assert response.status == 200
        name = response.headers[NAME_HEADER]
    (received,) = clean_stack.upstreams.by_name(name).received
    assert received.method == "GET"
    assert received.path == "/v1/models"


async def test_unknown_path_with_a_non_json_body_passes_through(clean_stack: Stack) -> None:
    target = clean_stack.upstreams[1]
    status, headers, _ = await post(
        clean_stack,
        "/tokenize?x=1",
        b"plain words",
        {SELECT: target.address, "content-type": "text/plain"},
    )
    assert status == 200
    assert headers[NAME_HEADER] == target.name
    assert target.received[0].body == b"plain words"


@pytest.mark.parametrize(
    ("body", "content_type", "status", "message"),
    [
        (b'{"model": "m", "prompt": ', "application/json", 400, "not valid JSON"),
        (b'{"model": 5, "prompt": "x"}', "application/json", 400, "body.model"),
        (b'{"prompt": "x"}', "application/json", 400, "no `model`"),
        (b'{"model": "m", "prompt": "\xff\xfe"}', "application/json", 400, "UTF-8"),
        (b'{"model": "m", "prompt": "x"}', "text/plain", 400, "content type"),
        (b'{"model": "m", "prompt": []}', "application/json", 400, "empty"),
    ],
    ids=[
        "truncated-json",
        "model-not-a-string",
        "no-model",
        "not-utf8",
        "text-plain",
        "empty-prompt",
    ],
)
async def test_bad_request_bodies_get_a_clear_openai_error_from_envoy(
    clean_stack: Stack, body: bytes, content_type: str, status: int, message: str
) -> None:
    got, headers, payload = await post(
        clean_stack, "/v1/completions", body, {"content-type": content_type}
    )
    assert got == status
    assert headers["Content-Type"] == "application/json"
    error = error_of(payload)
    assert error["code"] == status
    assert message in error["message"]
    assert not any(u.received for u in clean_stack.upstreams)


async def test_body_over_the_limit_gets_413(clean_stack: Stack) -> None:
    raw = json.dumps({"model": "m", "prompt": "x" * (MAX_BODY_BYTES + 10)}).encode()
    status, _, payload = await post(clean_stack, "/v1/completions", raw)
    assert status == 413
    assert error_of(payload)["code"] == 413
    assert not any(u.received for u in clean_stack.upstreams)


async def test_every_endpoint_filtered_out_gets_429(clean_stack: Stack) -> None:
    status, _, payload = await post(
        clean_stack, "/v1/completions", {"model": "m", "prompt": "x"}, {SELECT: "10.9.9.9:1"}
    )
    assert status == 429
    assert "filtered out" in error_of(payload)["message"]


async def test_envoy_and_epp_keep_working_after_errors(clean_stack: Stack) -> None:
    failed_before = await envoy_stat(clean_stack, "http.inference.ext_proc.streams_failed")
    started_before = await envoy_stat(clean_stack, "http.inference.ext_proc.streams_started")
    for _ in range(5):
        status, _, _ = await post(clean_stack, "/v1/completions", b"{not json")
        assert status == 400
    for upstream in clean_stack.upstreams:
        status, headers, _ = await post(
            clean_stack,
            "/v1/completions",
            {"model": "m", "prompt": "ok"},
            {SELECT: upstream.address},
        )
        assert status == 200
        assert headers[NAME_HEADER] == upstream.name
    # Errors were answered inside the protocol: no gRPC stream broke.
    assert await envoy_stat(clean_stack, "http.inference.ext_proc.streams_started") == (
        started_before + 5 + len(clean_stack.upstreams.upstreams)
    )
    assert await envoy_stat(clean_stack, "http.inference.ext_proc.streams_failed") == failed_before
    # Every routed request finished: nothing is left counted in flight.
    async with (
        aiohttp.ClientSession() as session,
        session.get(clean_stack.admin_url + "/debug/endpoints") as response,
    ):
        endpoints = await response.json()
    assert [e["inFlight"] for e in endpoints] == [0, 0, 0]
