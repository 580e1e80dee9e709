"""Bad input over real gRPC: every error is an ImmediateResponse with the right
status and an OpenAI-shaped JSON body, nothing leaks, and the EPP keeps serving."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from tests.epp.conftest import Epp, HandledMessages, StartEpp
from tests.epp.extproc import envoy_client as ec
from tests.epp.extproc.sample_plugins import MODULE, SCORER_SECRET, config

GOOD_BODY = json.dumps({"model": "base-model", "prompt": "hello"}).encode()
ERROR_TYPES = {
    400: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_error",
    503: "service_unavailable",
}


def assert_error(reply: ec.Reply, status: int) -> str:
    """An ImmediateResponse with `status` and the OpenAI error shape; its message."""
    assert reply.kind == "immediate_response", f"expected an error, got {reply.message}"
    assert reply.status == status
    assert reply.set_headers.get("content-type") == "application/json"
    document = json.loads(reply.body)
    assert set(document) == {"error"}
    error = document["error"]
    assert set(error) >= {"message", "type", "code"}
    assert isinstance(error["message"], str)
    assert error["message"]
    assert error["type"] == ERROR_TYPES[status]
    assert error["code"] == status
    message: str = error["message"]
    return message


async def assert_serving(epp: Epp) -> None:
    """A normal request right after succeeds, and nothing is left in flight."""
    stream = epp.stream()
    routed = await ec.route(stream, GOOD_BODY)
    assert routed.destination in epp.addresses
    assert routed.body == GOOD_BODY
    await ec.respond(stream, [b"{}"])
    assert await stream.close() == grpc.StatusCode.OK
    assert await epp.wait_in_flight(0) == 0


async def outcome(epp: Epp, name: str) -> float:
    return await epp.metric("epp_requests_total", {"outcome": name})


# -- 400 ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "content_type", "mentions"),
    [
        pytest.param("/v1/completions", b'{"model": "m", "prompt": ', "application/json",
                     "JSON", id="malformed-json"),
        pytest.param("/v1/completions", b'{"model": 5, "prompt": "x"}', "application/json",
                     "model", id="model-not-a-string"),
        pytest.param("/v1/completions", b'{"prompt": "x"}', "application/json",
                     "model", id="missing-model"),
        pytest.param("/v1/chat/completions", b'{"messages": [{"role": "user"}]}',
                     "application/json", "model", id="chat-missing-model"),
        pytest.param("/v1/completions", b'{"model": "m", "prompt": "\xff\xfe"}',
                     "application/json", "UTF-8", id="not-utf8"),
        pytest.param("/v1/completions", b'{"model": "m", "prompt": "x"}', "text/plain",
                     "content type", id="text-plain"),
        pytest.param("/v1/completions", b"", "application/json", "body", id="empty-body"),
        pytest.param("/v1/completions", b'[1, 2]', "application/json", "", id="json-array"),
    ],
)  # fmt: skip
async def test_bad_request(
    epp: Epp, path: str, body: bytes, content_type: str, mentions: str
) -> None:
    stream = epp.stream()
    reply = await ec.send_request(stream, body, path=path, content_type=content_type, chunk_size=7)
    message = assert_error(reply, 400)
    assert mentions.lower() in message.lower()
    assert await stream.close() == grpc.StatusCode.OK
    assert await outcome(epp, "bad_request") == 1
    assert await epp.total_in_flight() == 0
    await assert_serving(epp)


async def test_bad_request_in_buffered_mode(epp: Epp) -> None:
    stream = epp.stream()
    await stream.send(ec.request_headers(request_body_mode=ec.BUFFERED))
    assert (await stream.expect()).is_continue
    await stream.send(ec.request_body(b"{nope", end_of_stream=True))
    assert_error(await stream.expect(), 400)
    assert await stream.close() == grpc.StatusCode.OK
    await assert_serving(epp)


async def test_unknown_path_with_a_non_json_body_passes_through(epp: Epp) -> None:
    body = b"\x00\x01 not json at all \xff"
    stream = epp.stream()
    routed = await ec.route(
        stream, body, path="/tokenize/raw", content_type="application/octet-stream"
    )
    assert routed.destination in epp.addresses
    assert routed.body == body
    await ec.respond(stream, [b"ok"], content_type="text/plain")
    assert await stream.close() == grpc.StatusCode.OK
    assert await outcome(epp, "bad_request") == 0


def nested_body(depth: int) -> bytes:
    nested = b"[" * depth + b"]" * depth
    return b'{"model": "m", "prompt": "x", "deep": ' + nested + b"}"


async def exchange(epp: Epp, body: bytes, extra: dict[str, str]) -> int:
    """One whole request: 200 if it was routed (and its response played through),
    else the status it was answered with."""
    stream = epp.stream()
    reply = await ec.send_request(stream, body, extra=extra)
    if reply.kind == "immediate_response":
        assert_error(reply, reply.status or 0)
        assert await stream.close() == grpc.StatusCode.OK
        return reply.status or 0
    assert reply.destination in epp.addresses
    _, returned = await stream.recv_body("request_body")
    if "x-gateway-model-name-rewrite" in extra:
        assert json.loads(returned)["model"] == extra["x-gateway-model-name-rewrite"]
    await ec.respond(stream, [b"{}"])
    assert await stream.close() == grpc.StatusCode.OK
    return 200


async def test_a_body_that_parses_but_cannot_be_rewritten_never_leaks(epp: Epp) -> None:
    """Near the nesting depth where JSON decoding gives up, a body can pass the
    parse and still fail the model rewrite, which decodes it once more a little
    deeper in the stack. Whatever each request gets, no in-flight count may stay."""
    # The deepest body that still parses (found, not assumed: it depends on the
    # stack depth the EPP decodes at).
    low, high = 1, 5000
    assert await exchange(epp, nested_body(low), {}) == 200
    assert await exchange(epp, nested_body(high), {}) != 200
    while high - low > 1:
        middle = (low + high) // 2
        if await exchange(epp, nested_body(middle), {}) == 200:
            low = middle
        else:
            high = middle
    statuses = {}
    for depth in range(low - 8, low + 3):
        statuses[depth] = await exchange(
            epp, nested_body(depth), {"x-gateway-model-name-rewrite": "other"}
        )
        assert await epp.total_in_flight() == 0, f"in-flight leaked at depth {depth}"
    # The scan crossed the boundary: some were routed and rewritten, some refused.
    assert 200 in statuses.values()
    assert set(statuses.values()) - {200} == {400}
    assert set(statuses.values()) != {200}
    await assert_serving(epp)


# -- 413 ------------------------------------------------------------------------------


async def test_body_over_the_limit_is_413(start_epp: StartEpp) -> None:
    epp = await start_epp(max_body_bytes=1000)
    body = json.dumps({"model": "m", "prompt": "x" * 2000}).encode()
    stream = epp.stream()
    await stream.send(ec.request_headers())
    # The 413 comes as soon as the limit is passed, before the body ends.
    await stream.send(ec.request_body(body[:600]), ec.request_body(body[600:1200]))
    message = assert_error(await stream.expect(), 413)
    assert "1000" in message
    # The EPP ends the stream with its answer: Envoy stops processing the request
    # there, and what it still had on the way is dropped with the stream.
    assert await stream.ended() == grpc.StatusCode.OK
    assert await outcome(epp, "payload_too_large") == 1
    assert await epp.metric("epp_extproc_stream_errors_total", {"reason": "protocol"}) == 0
    await assert_serving(epp)


async def test_body_at_the_limit_is_routed(start_epp: StartEpp) -> None:
    epp = await start_epp(max_body_bytes=1000)
    document = {"model": "m", "prompt": ""}
    document["prompt"] = "x" * (1000 - len(json.dumps(document)))
    body = json.dumps(document).encode()
    assert len(body) == 1000
    stream = epp.stream()
    routed = await ec.route(stream, body, chunk_size=300)
    assert routed.body == body
    await ec.respond(stream, [])
    assert await stream.close() == grpc.StatusCode.OK


async def test_buffered_body_over_the_limit_is_413(start_epp: StartEpp) -> None:
    epp = await start_epp(max_body_bytes=1000)
    body = json.dumps({"model": "m", "prompt": "x" * 2000}).encode()
    stream = epp.stream()
    await stream.send(ec.request_headers(request_body_mode=ec.BUFFERED))
    assert (await stream.expect()).is_continue
    await stream.send(ec.request_body(body, end_of_stream=True))
    assert_error(await stream.expect(), 413)
    assert await stream.close() == grpc.StatusCode.OK
    await assert_serving(epp)


async def test_buffered_body_far_over_a_small_limit_is_413(start_epp: StartEpp) -> None:
    # A whole BUFFERED body comes in one gRPC message: one much larger than the
    # EPP's limit must still get a 413, not a broken stream.
    epp = await start_epp(max_body_bytes=1000)
    body = json.dumps({"model": "m", "prompt": "x" * 1_500_000}).encode()
    stream = epp.stream()
    await stream.send(ec.request_headers(request_body_mode=ec.BUFFERED))
    assert (await stream.expect()).is_continue
    await stream.send(ec.request_body(body, end_of_stream=True))
    assert_error(await stream.expect(), 413)
    assert await stream.close() == grpc.StatusCode.OK
    await assert_serving(epp)


async def test_buffered_partial_without_end_of_stream_is_413(epp: Epp) -> None:
    # Envoy's buffer filled before the body ended: the rest would go upstream
    # without passing here, so the EPP cannot read the request.
    stream = epp.stream()
    await stream.send(ec.request_headers(request_body_mode=ec.BUFFERED_PARTIAL))
    assert (await stream.expect()).is_continue
    await stream.send(ec.request_body(GOOD_BODY[:20], end_of_stream=False))
    assert_error(await stream.expect(), 413)
    assert await stream.close() == grpc.StatusCode.OK
    assert await epp.total_in_flight() == 0
    await assert_serving(epp)


async def test_buffered_partial_with_the_whole_body_is_routed(epp: Epp) -> None:
    stream = epp.stream()
    await stream.send(ec.request_headers(request_body_mode=ec.BUFFERED_PARTIAL))
    assert (await stream.expect()).is_continue
    await stream.send(ec.request_body(GOOD_BODY, end_of_stream=True))
    decision = await stream.expect()
    assert decision.kind == "request_body"
    assert decision.destination in epp.addresses
    await ec.respond(stream, [b"{}"])
    assert await stream.close() == grpc.StatusCode.OK


async def test_buffered_body_followed_by_trailers_is_routed(epp: Epp) -> None:
    # With request trailers, Envoy sends the whole BUFFERED body with
    # end_of_stream false, then the trailers: the body is complete all the same.
    stream = epp.stream()
    await stream.send(ec.request_headers(request_body_mode=ec.BUFFERED))
    assert (await stream.expect()).is_continue
    await stream.send(ec.request_body(GOOD_BODY, end_of_stream=False))
    decision = await stream.expect()
    assert decision.kind == "request_body"
    assert decision.destination in epp.addresses
    await stream.send(ec.request_trailers())
    assert (await stream.expect()).kind == "request_trailers"
    await ec.respond(stream, [b"{}"])
    assert await stream.close() == grpc.StatusCode.OK
    assert await epp.metric("epp_extproc_stream_errors_total", {"reason": "protocol"}) == 0
    assert await epp.total_in_flight() == 0


# -- 503, 429, 500 ------------------------------------------------------------------------


async def test_no_ready_endpoint_is_503(start_epp: StartEpp) -> None:
    epp = await start_epp(endpoints={})
    for _ in range(3):
        stream = epp.stream()
        assert_error(await ec.send_request(stream, GOOD_BODY), 503)
        assert await stream.close() == grpc.StatusCode.OK
    # A header-only request too.
    stream = epp.stream()
    await stream.send(ec.request_headers("/v1/models", method="GET", end_of_stream=True))
    assert_error(await stream.expect(), 503)
    assert await stream.close() == grpc.StatusCode.OK
    assert await outcome(epp, "unavailable") == 4


async def test_every_endpoint_filtered_out_is_429(start_epp: StartEpp) -> None:
    epp = await start_epp(config_text=config(("reject-all", f"{MODULE}:RejectAll")))
    stream = epp.stream()
    message = assert_error(await ec.send_request(stream, GOOD_BODY), 429)
    assert "reject-all" in message
    assert await stream.close() == grpc.StatusCode.OK
    assert await epp.total_in_flight() == 0
    assert await outcome(epp, "no_capacity") == 1


async def test_a_failing_scorer_is_500_and_the_epp_keeps_serving(start_epp: StartEpp) -> None:
    epp = await start_epp(config_text=config(("exploding", f"{MODULE}:ExplodingScorer")))
    for _ in range(3):
        stream = epp.stream()
        body = json.dumps({"model": "explode", "prompt": "x"}).encode()
        reply = await ec.send_request(stream, body, request_id="boom-1")
        message = assert_error(reply, 500)
        assert SCORER_SECRET not in message
        assert "scorer-secret" not in reply.body.decode()
        assert "RuntimeError" not in message
        assert "boom-1" in message  # the request id, to find the log line
        assert await stream.close() == grpc.StatusCode.OK
    assert await epp.metric("epp_extproc_stream_errors_total", {"reason": "internal"}) == 3
    assert await epp.total_in_flight() == 0
    await assert_serving(epp)


# -- streams that end badly --------------------------------------------------------------------


@pytest.mark.parametrize("mode", [ec.FULL_DUPLEX_STREAMED, ec.BUFFERED])
async def test_client_cancels_mid_body(
    start_epp: StartEpp, handled: HandledMessages, mode: int
) -> None:
    epp = await start_epp(config_text=config(("recorder", f"{MODULE}:Recorder")))
    stream = epp.stream()
    await stream.send(ec.request_headers(request_body_mode=mode))
    if mode == ec.BUFFERED:
        assert (await stream.expect()).is_continue
    else:
        await stream.send(ec.request_body(GOOD_BODY[:10]))
        await handled.wait_for("request_body")
    await handled.wait_for("request_headers")
    stream.cancel()

    assert await epp.wait_metric("epp_requests_total", {"outcome": "abandoned"}, 1) == 1
    assert await outcome(epp, "routed") == 0
    assert await epp.total_in_flight() == 0
    assert epp.plugin("recorder").records == []
    await assert_serving(epp)


async def test_truncated_stream(epp: Epp) -> None:
    """Envoy half-closes before the body ended (the client went away)."""
    stream = epp.stream()
    await stream.send(ec.request_headers(), ec.request_body(GOOD_BODY[:10]))
    await stream.call.done_writing()
    # No decision: the stream just ends, cleanly.
    assert await stream.recv() is None
    assert await stream.call.code() == grpc.StatusCode.OK
    assert await outcome(epp, "abandoned") == 1
    assert await outcome(epp, "routed") == 0
    assert await epp.total_in_flight() == 0
    await assert_serving(epp)


async def test_stream_with_no_message(epp: Epp) -> None:
    stream = epp.stream()
    await stream.call.done_writing()
    assert await stream.recv() is None
    assert await stream.call.code() == grpc.StatusCode.OK
    assert await outcome(epp, "abandoned") == 0
    await assert_serving(epp)


# -- protocol violations by the proxy ----------------------------------------------------------


async def protocol_errors(epp: Epp) -> float:
    return await epp.metric("epp_extproc_stream_errors_total", {"reason": "protocol"})


async def test_response_headers_before_any_request(epp: Epp) -> None:
    stream = epp.stream()
    await stream.send(ec.response_headers(200))
    reply = await stream.expect()
    assert reply.kind == "response_headers"
    assert reply.is_continue
    assert await protocol_errors(epp) == 1
    # The stream still works: a request on it is routed as usual.
    routed = await ec.route(stream, GOOD_BODY)
    assert routed.destination in epp.addresses
    await ec.respond(stream, [b"{}"])
    assert await stream.close() == grpc.StatusCode.OK
    assert await epp.total_in_flight() == 0
    await assert_serving(epp)


async def test_request_body_after_the_body_ended(epp: Epp) -> None:
    stream = epp.stream()
    routed = await ec.route(stream, GOOD_BODY)
    assert await epp.total_in_flight() == 1
    await stream.send(ec.request_body(b"again", end_of_stream=True))
    extra = await stream.expect()
    assert extra.kind == "request_body"
    assert extra.body == b"again"  # handed back, never lost or mixed into the request
    await stream.send(ec.request_headers())
    assert (await stream.expect()).kind == "request_headers"
    assert await protocol_errors(epp) == 2
    # The routed request goes on: its response ends it.
    assert await epp.in_flight() == {a: int(a == routed.destination) for a in epp.addresses}
    await ec.respond(stream, [b"{}"])
    assert await stream.close() == grpc.StatusCode.OK
    assert await epp.total_in_flight() == 0
    await assert_serving(epp)


async def test_messages_out_of_phase_never_break_the_stream(epp: Epp) -> None:
    stream = epp.stream()
    violations = [
        ec.response_body(b"early", end_of_stream=True),
        ec.response_trailers(),
        ec.request_body(b"no headers yet"),
        ec.request_trailers(),
        ec.empty_message(),
    ]
    for message in violations:
        await stream.send(message)
    replies = [await stream.expect() for _ in range(4)]
    assert [r.kind for r in replies] == [
        "response_body",
        "response_trailers",
        "request_body",
        "request_trailers",
    ]
    assert all(r.kind != "immediate_response" for r in replies)
    # After all that, a request on the same stream is still routed.
    routed = await ec.route(stream, GOOD_BODY)
    assert routed.destination in epp.addresses
    await ec.respond(stream, [b"{}"])
    assert await stream.close() == grpc.StatusCode.OK
    assert await protocol_errors(epp) == len(violations)
    assert await epp.total_in_flight() == 0
    await assert_serving(epp)


async def test_the_stream_ends_with_the_response(epp: Epp) -> None:
    stream = epp.stream()
    await ec.route(stream, GOOD_BODY)
    await ec.respond(stream, [b"{}"])
    # Nothing can come after the response's end: the EPP has ended the stream.
    assert await stream.ended() == grpc.StatusCode.OK
    with pytest.raises(asyncio.InvalidStateError):
        await stream.send(ec.response_body(b"late", end_of_stream=True))
    assert await epp.metric("epp_responses_total", {"result": "completed"}) == 1
    assert await epp.total_in_flight() == 0
    await assert_serving(epp)
