"""The ext_proc protocol (docs/architecture.md, "The ext_proc protocol"), spoken over
real gRPC to the real EPP by a client that sends what Envoy 1.40 sends."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from epp.scheduling import ResponseInfo, Usage
from tests.epp.conftest import ENDPOINTS, Epp, HandledMessages, StartEpp
from tests.epp.extproc import envoy_client as ec
from tests.epp.extproc.sample_plugins import MODULE, config

RECORDER_CONFIG = config(("recorder", f"{MODULE}:Recorder"))


def completion_body(size: int | None = None, **fields: object) -> bytes:
    """A /v1/completions JSON body; with `size`, padded to exactly that many bytes."""
    document: dict[str, object] = {"model": "base-model", "prompt": "", "max_tokens": 8}
    document.update(fields)
    body = json.dumps(document).encode()
    if size is None:
        return body
    document["prompt"] = "p" * (size - len(body))
    body = json.dumps(document).encode()
    assert len(body) == size
    return body


def assert_decision(epp: Epp, reply: ec.Reply) -> str:
    """The request-headers reply carries one consistent decision; its destination."""
    assert reply.kind == "request_headers"
    destination = reply.destination
    assert destination in epp.addresses
    assert reply.clear_route_cache is True
    assert reply.metadata == {"envoy.lb": {ec.DESTINATION: destination}}
    return destination


def assert_streamed_body(replies: list[ec.Reply], expected: bytes) -> None:
    """Body replies: streamed, each at most 62,000 bytes, end_of_stream only on the
    last, and together exactly `expected`."""
    assert all(r.streamed for r in replies)
    assert all(len(r.body) <= ec.MAX_CHUNK for r in replies)
    assert [r.end_of_stream for r in replies] == [False] * (len(replies) - 1) + [True]
    assert b"".join(r.body for r in replies) == expected


# -- the request phase, FULL_DUPLEX_STREAMED -------------------------------------


async def test_decision_comes_only_after_the_body_ends(epp: Epp, handled: HandledMessages) -> None:
    body = completion_body(prompt="The quick brown fox jumps over the lazy dog")
    stream = epp.stream()
    await stream.send(ec.request_headers())
    await stream.send(ec.request_body(body[:10]), ec.request_body(body[10:20]))
    # The server has handled the headers and two chunks before the last one is sent:
    # anything it answered to them would come before the decision.
    await handled.wait_for("request_body", 2)
    await stream.send(ec.request_body(body[20:], end_of_stream=True))

    first = await stream.expect()
    destination = assert_decision(epp, first)
    assert first.remove_headers == []
    replies, returned = await stream.recv_body("request_body")
    assert_streamed_body(replies, body)
    assert returned == body
    assert await epp.in_flight() == {a: int(a == destination) for a in epp.addresses}

    await ec.respond(stream, [b'{"choices": []}'])
    assert await stream.close() == grpc.StatusCode.OK


@pytest.mark.parametrize(
    ("size", "chunk_size", "empty_last"),
    [
        pytest.param(300, None, False, id="one-chunk"),
        pytest.param(300, None, True, id="empty-final-chunk"),
        pytest.param(3000, 1000, False, id="split-in-three"),
        pytest.param(3000, 1000, True, id="split-then-empty-final-chunk"),
        pytest.param(62_000, None, False, id="exactly-62000"),
        pytest.param(62_001, None, False, id="62001"),
        pytest.param(124_000, None, True, id="two-full-chunks"),
        pytest.param(200_000, None, False, id="200000"),
        pytest.param(200_000, 7_000, False, id="200000-in-7000-byte-chunks"),
    ],
)
async def test_body_is_returned_unchanged_in_bounded_chunks(
    epp: Epp, size: int, chunk_size: int | None, empty_last: bool
) -> None:
    body = completion_body(size)
    stream = epp.stream()
    routed = await ec.route(stream, body, chunk_size=chunk_size, empty_last=empty_last)
    assert_decision(epp, routed.headers_reply)
    assert_streamed_body(routed.body_replies, body)
    assert len(routed.body_replies) == max(1, -(-size // ec.MAX_CHUNK))
    await ec.respond(stream, [b"{}"])
    assert await stream.close() == grpc.StatusCode.OK


async def test_one_byte_chunks(epp: Epp) -> None:
    body = completion_body(2048)
    stream = epp.stream()
    routed = await ec.route(stream, body, chunk_size=1)
    assert_decision(epp, routed.headers_reply)
    assert routed.body == body
    await ec.respond(stream, [b"{}"])
    assert await stream.close() == grpc.StatusCode.OK


async def test_body_is_not_reserialised(epp: Epp) -> None:
    # Odd spacing, key order and escapes that any re-encoding would change.
    body = b'{ "prompt" : "caf\\u00e9  \\/ x",\n  "model":"base-model" ,"z":1.50 }'
    stream = epp.stream()
    routed = await ec.route(stream, body, chunk_size=5)
    assert routed.body == body
    await ec.respond(stream, [])
    assert await stream.close() == grpc.StatusCode.OK


async def test_control_headers_are_removed(epp: Epp) -> None:
    body = completion_body(prompt="hello")
    control = {
        "x-gateway-inference-objective": "premium",
        "x-gateway-inference-fairness-id": "tenant-7",
    }
    stream = epp.stream()
    routed = await ec.route(stream, body, extra=control)
    assert_decision(epp, routed.headers_reply)
    assert sorted(routed.headers_reply.remove_headers) == sorted(control)
    assert routed.body == body  # no rewrite asked for: the body is untouched
    await ec.respond(stream, [])
    assert await stream.close() == grpc.StatusCode.OK


async def test_model_rewrite_header_rewrites_the_body(epp: Epp) -> None:
    body = completion_body(prompt="hello", temperature=0.25, stop=["\n"])
    headers = {
        "x-gateway-model-name-rewrite": "served-model",
        "x-gateway-inference-objective": "batch",
        "content-length": str(len(body)),
    }
    stream = epp.stream()
    routed = await ec.route(stream, body, extra=headers, chunk_size=17)
    assert_decision(epp, routed.headers_reply)
    removed = routed.headers_reply.remove_headers
    assert "x-gateway-model-name-rewrite" in removed
    assert "x-gateway-inference-objective" in removed
    # The length changed: the old content-length must not go upstream.
    assert "content-length" in removed
    assert routed.headers_reply.set_headers.get("content-length") in (
        None,
        str(len(routed.body)),
    )
    rewritten = json.loads(routed.body)
    original = json.loads(body)
    assert rewritten["model"] == "served-model"
    assert {k: v for k, v in rewritten.items() if k != "model"} == {
        k: v for k, v in original.items() if k != "model"
    }
    assert list(rewritten) == list(original)  # key order kept
    assert_streamed_body(routed.body_replies, routed.body)
    await ec.respond(stream, [])
    assert await stream.close() == grpc.StatusCode.OK


async def test_chat_completions_route(epp: Epp) -> None:
    body = json.dumps(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    ).encode()
    stream = epp.stream()
    routed = await ec.route(stream, body, path="/v1/chat/completions")
    assert_decision(epp, routed.headers_reply)
    assert routed.body == body
    await ec.respond(stream, [b"data: [DONE]\n\n"], content_type="text/event-stream")
    assert await stream.close() == grpc.StatusCode.OK


async def test_missing_request_id_is_generated_and_set(epp: Epp) -> None:
    stream = epp.stream()
    routed = await ec.route(stream, completion_body(prompt="x"), request_id="")
    request_id = routed.headers_reply.set_headers.get("x-request-id")
    assert request_id
    await ec.respond(stream, [])
    assert await stream.close() == grpc.StatusCode.OK


# -- other request shapes ------------------------------------------------------------


async def test_header_only_request_is_routed_at_once(epp: Epp) -> None:
    stream = epp.stream()
    await stream.send(
        ec.request_headers("/v1/models", method="GET", content_type=None, end_of_stream=True)
    )
    assert_decision(epp, await stream.expect())
    assert await epp.total_in_flight() == 1
    await stream.send(ec.response_headers(200))
    assert (await stream.expect()).kind == "response_headers"
    await stream.send(ec.response_body(b'{"data": []}', end_of_stream=True))
    echo = await stream.expect()
    assert (echo.kind, echo.body, echo.end_of_stream) == ("response_body", b'{"data": []}', True)
    assert await stream.close() == grpc.StatusCode.OK
    assert await epp.wait_in_flight(0) == 0


async def test_header_only_response_ends_the_request(epp: Epp) -> None:
    stream = epp.stream()
    await stream.send(
        ec.request_headers("/health", method="GET", content_type=None, end_of_stream=True)
    )
    assert_decision(epp, await stream.expect())
    await stream.send(ec.response_headers(204, end_of_stream=True))
    assert (await stream.expect()).kind == "response_headers"
    assert await epp.total_in_flight() == 0
    assert await stream.ended() == grpc.StatusCode.OK


async def test_buffered_request_body(start_epp: StartEpp) -> None:
    epp = await start_epp(config_text=RECORDER_CONFIG)
    body = completion_body(prompt="buffered")
    stream = epp.stream()
    await stream.send(
        ec.request_headers(request_body_mode=ec.BUFFERED, response_body_mode=ec.BUFFERED)
    )
    # Envoy waits for this reply before it sends the buffered body: it comes at once.
    headers_reply = await stream.expect()
    assert headers_reply.kind == "request_headers"
    assert headers_reply.is_continue

    await stream.send(ec.request_body(body, end_of_stream=True))
    decision = await stream.expect()
    assert decision.kind == "request_body"
    assert decision.destination in epp.addresses
    assert decision.clear_route_cache is True
    assert decision.metadata == {"envoy.lb": {ec.DESTINATION: decision.destination}}
    assert decision.replaced_body is None  # unchanged: not sent back
    assert not decision.streamed
    assert await epp.in_flight() == {a: int(a == decision.destination) for a in epp.addresses}

    await stream.send(ec.response_headers(200))
    assert (await stream.expect()).kind == "response_headers"
    usage = b'{"usage": {"prompt_tokens": 9, "completion_tokens": 2}}'
    await stream.send(ec.response_body(usage, end_of_stream=True))
    reply = await stream.expect()
    assert reply.kind == "response_body"
    assert reply.is_continue  # BUFFERED: the body is not echoed
    assert await stream.close() == grpc.StatusCode.OK
    assert await epp.total_in_flight() == 0
    (info,) = epp.plugin("recorder").records
    assert info[1].completed
    assert info[1].usage == Usage(prompt_tokens=9, completion_tokens=2)


async def test_buffered_request_body_with_model_rewrite(epp: Epp) -> None:
    body = completion_body(prompt="buffered")
    stream = epp.stream()
    await stream.send(
        ec.request_headers(
            request_body_mode=ec.BUFFERED,
            extra={"x-gateway-model-name-rewrite": "other", "content-length": str(len(body))},
        )
    )
    assert (await stream.expect()).is_continue
    await stream.send(ec.request_body(body, end_of_stream=True))
    decision = await stream.expect()
    assert decision.kind == "request_body"
    assert decision.destination in epp.addresses
    assert decision.replaced_body is not None
    assert json.loads(decision.replaced_body) == {**json.loads(body), "model": "other"}
    assert decision.set_headers["content-length"] == str(len(decision.replaced_body))
    assert "x-gateway-model-name-rewrite" in decision.remove_headers
    await ec.respond(stream, [b"{}"])
    assert await stream.close() == grpc.StatusCode.OK


async def test_request_trailers_end_the_body(epp: Epp) -> None:
    body = completion_body(prompt="with trailers")
    stream = epp.stream()
    await stream.send(ec.request_headers())
    await stream.send(ec.request_body(body[:15]), ec.request_body(body[15:]))
    await stream.send(ec.request_trailers())
    assert_decision(epp, await stream.expect())
    returned = b""
    while True:
        reply = await stream.expect()
        if reply.kind == "request_trailers":
            break
        assert reply.kind == "request_body"
        assert reply.streamed
        assert not reply.end_of_stream  # the trailers end the request, not the body
        returned += reply.body
    assert returned == body
    await ec.respond(stream, [b"{}"])
    assert await stream.close() == grpc.StatusCode.OK


async def test_response_trailers_end_the_response(epp: Epp) -> None:
    stream = epp.stream()
    await ec.route(stream, completion_body(prompt="x"))
    await stream.send(ec.response_headers(200))
    assert (await stream.expect()).kind == "response_headers"
    await stream.send(ec.response_body(b"{}"))
    assert (await stream.expect()).body == b"{}"
    assert await epp.total_in_flight() == 1
    await stream.send(ec.response_trailers())
    assert (await stream.expect()).kind == "response_trailers"
    assert await epp.total_in_flight() == 0
    assert await stream.ended() == grpc.StatusCode.OK


# -- the response phase -------------------------------------------------------------


async def test_response_passes_through(epp: Epp) -> None:
    stream = epp.stream()
    await ec.route(stream, completion_body(prompt="x"))
    parts = [b'{"id": "cmpl-1", ', b'"choices": [{"text": "ok"}], ', b"", b'"x": 1}']
    returned = await ec.respond(stream, parts, status=200)
    assert returned == b"".join(parts)
    # The stream stayed open for every part of the response (`respond` checks each
    # echo); now the response is over, the EPP ends the stream itself, with OK,
    # rather than leave it to Envoy, whose end is a half-close and a reset.
    assert await stream.ended() == grpc.StatusCode.OK


async def test_the_first_chunk_of_a_successful_response_is_reported_once(
    start_epp: StartEpp,
) -> None:
    epp = await start_epp(config_text=RECORDER_CONFIG)
    recorder = epp.plugin("recorder")
    stream = epp.stream()
    await ec.route(stream, completion_body(prompt="x"), request_id="ok-1")
    await stream.send(ec.response_headers(200))
    assert (await stream.expect()).kind == "response_headers"
    assert recorder.first_chunks == []  # headers are not a token
    for part in (b"", b"data: one", b"data: two"):
        await stream.send(ec.response_body(part))
        assert (await stream.expect()).body == part
    ((request_id, elapsed),) = recorder.first_chunks
    assert request_id == "ok-1"
    assert elapsed >= 0.0
    await stream.send(ec.response_body(b"", end_of_stream=True))
    await stream.expect()
    assert await stream.ended() == grpc.StatusCode.OK
    assert len(recorder.first_chunks) == 1
    # An error's body is no first token.
    failed = epp.stream()
    await ec.route(failed, completion_body(prompt="x"), request_id="err-1")
    await ec.respond(failed, [b'{"error": "overloaded"}'], status=503)
    assert [r for r, _ in recorder.first_chunks] == ["ok-1"]


async def test_a_response_of_one_chunk_reports_its_first_chunk_before_its_end(
    start_epp: StartEpp,
) -> None:
    # The first-chunk hooks run after the chunk is handed back; a chunk that also
    # ends the response ends the request in the same message, and the hooks then
    # run at the end, first.
    epp = await start_epp(config_text=RECORDER_CONFIG)
    recorder = epp.plugin("recorder")
    stream = epp.stream()
    await ec.route(stream, completion_body(prompt="x"), request_id="one-1")
    await ec.respond(stream, [b'{"choices": [{"text": "ok"}]}'], status=200)
    assert await stream.ended() == grpc.StatusCode.OK
    assert recorder.events == [("first_chunk", "one-1"), ("post_response", "one-1")]


def sse_response(prompt_tokens: int, completion_tokens: int, cached: int) -> bytes:
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }
    events = [
        {"id": "c1", "choices": [{"text": "Hel"}], "usage": None},
        {"id": "c1", "choices": [{"text": "lo"}], "usage": None},
        {"id": "c1", "choices": [], "usage": usage},
    ]
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


@pytest.mark.parametrize("chunk_size", [1, 7, 50, 10_000])
async def test_sse_usage_is_read_across_chunks(start_epp: StartEpp, chunk_size: int) -> None:
    epp = await start_epp(config_text=RECORDER_CONFIG)
    body = sse_response(prompt_tokens=120, completion_tokens=3, cached=96)
    cached_before = await epp.metric("epp_cached_prompt_tokens_total")
    prompt_before = await epp.metric("epp_prompt_tokens_routed_total")

    stream = epp.stream()
    await ec.route(stream, completion_body(prompt="x", stream=True), request_id="sse-1")
    returned = await ec.respond(
        stream, ec.chunks(body, chunk_size), content_type="text/event-stream"
    )
    assert returned == body
    assert await stream.close() == grpc.StatusCode.OK

    (info,) = epp.plugin("recorder").for_request("sse-1")
    assert isinstance(info, ResponseInfo)
    assert info.completed is True
    assert info.status == 200
    assert info.usage == Usage(prompt_tokens=120, completion_tokens=3, cached_tokens=96)
    assert await epp.metric("epp_cached_prompt_tokens_total") == cached_before + 96
    assert await epp.metric("epp_prompt_tokens_routed_total") == prompt_before + 120


async def test_json_usage_is_read_across_chunks(start_epp: StartEpp) -> None:
    epp = await start_epp(config_text=RECORDER_CONFIG)
    body = json.dumps(
        {
            "id": "c2",
            "choices": [{"text": "x"}],
            "usage": {"prompt_tokens": 40, "completion_tokens": 1},
        }
    ).encode()
    stream = epp.stream()
    await ec.route(stream, completion_body(prompt="x"), request_id="json-1")
    await ec.respond(stream, ec.chunks(body, 9), status=201)
    assert await stream.close() == grpc.StatusCode.OK
    (info,) = epp.plugin("recorder").for_request("json-1")
    assert info.status == 201
    assert info.usage == Usage(prompt_tokens=40, completion_tokens=1)
    assert await epp.metric("epp_prompt_tokens_routed_total") == 40


# -- in-flight accounting -----------------------------------------------------------


async def test_in_flight_goes_up_at_pick_and_down_at_response_end(start_epp: StartEpp) -> None:
    epp = await start_epp(config_text=RECORDER_CONFIG)
    assert await epp.total_in_flight() == 0
    stream = epp.stream()
    routed = await ec.route(stream, completion_body(prompt="x"))
    in_flight = await epp.in_flight()
    assert in_flight == {a: int(a == routed.destination) for a in epp.addresses}

    await stream.send(ec.response_headers(200))
    await stream.expect()
    await stream.send(ec.response_body(b'{"a": '))
    await stream.expect()
    assert await epp.total_in_flight() == 1  # the response has not ended yet
    await stream.send(ec.response_body(b"1}", end_of_stream=True))
    await stream.expect()
    assert await epp.total_in_flight() == 0
    assert await stream.close() == grpc.StatusCode.OK
    assert await epp.metric("epp_responses_total", {"result": "completed"}) == 1


@pytest.mark.parametrize("where", ["after-decision", "during-response"])
async def test_in_flight_released_when_the_client_cancels(start_epp: StartEpp, where: str) -> None:
    epp = await start_epp(config_text=RECORDER_CONFIG)
    stream = epp.stream()
    routed = await ec.route(stream, completion_body(prompt="x"), request_id="gone")
    assert await epp.in_flight() == {a: int(a == routed.destination) for a in epp.addresses}
    if where == "during-response":
        await stream.send(ec.response_headers(200), ec.response_body(b"partial"))
        await stream.expect()
        await stream.expect()
    stream.cancel()

    assert await epp.wait_in_flight(0) == 0
    assert await epp.wait_metric("epp_responses_total", {"result": "aborted"}, 1) == 1
    (info,) = epp.plugin("recorder").for_request("gone")
    assert info.completed is False


# -- the subset hint ------------------------------------------------------------------


async def test_subset_hint_is_honoured(epp: Epp) -> None:
    for subset in (["10.0.0.2:8000"], ["10.0.0.1:8000", "10.0.0.3:8000"]):
        for _ in range(10):
            stream = epp.stream()
            routed = await ec.route(stream, completion_body(prompt="x"), subset=subset)
            assert routed.destination in subset
            assert routed.headers_reply.lb_destination == routed.destination
            await ec.respond(stream, [])
            assert await stream.close() == grpc.StatusCode.OK


@pytest.mark.parametrize(
    "subset", [pytest.param([], id="empty"), pytest.param(["10.9.9.9:8000"], id="disjoint")]
)
async def test_subset_hint_without_candidates_is_503(epp: Epp, subset: list[str]) -> None:
    stream = epp.stream()
    reply = await ec.send_request(stream, completion_body(prompt="x"), subset=subset)
    assert reply.kind == "immediate_response"
    assert reply.status == 503
    error = json.loads(reply.body)["error"]
    assert error["code"] == 503
    assert await stream.close() == grpc.StatusCode.OK
    assert await epp.total_in_flight() == 0


# -- concurrency -------------------------------------------------------------------------


@pytest.mark.timeout(60)
async def test_one_thousand_concurrent_streams(epp: Epp) -> None:
    addresses = sorted(ENDPOINTS.values())
    n = 1000
    all_routed = asyncio.Event()
    routed_count = 0
    in_flight_at_peak: dict[str, int] = {}

    async def one(i: int) -> None:
        nonlocal routed_count
        # Each stream is steered by its own subset hint and carries its own body, so
        # a reply delivered to the wrong stream is caught.
        target = addresses[i % len(addresses)]
        body = completion_body(prompt=f"request number {i}")
        stream = epp.stream()
        routed = await ec.route(stream, body, subset=[target], request_id=f"r-{i}")
        assert routed.destination == target
        assert routed.headers_reply.lb_destination == target
        assert routed.body == body
        routed_count += 1
        if routed_count == n:
            # The last one routed looks before any response is sent: all are in flight.
            in_flight_at_peak.update(await epp.in_flight())
            all_routed.set()
        await all_routed.wait()
        response = f'{{"id": "r-{i}"}}'.encode()
        assert await ec.respond(stream, [response]) == response
        assert await stream.close() == grpc.StatusCode.OK

    await asyncio.gather(*(one(i) for i in range(n)))
    assert in_flight_at_peak == {
        a: len(range(k, n, len(addresses))) for k, a in enumerate(addresses)
    }
    assert await epp.wait_in_flight(0) == 0
    assert await epp.metric("epp_requests_total", {"outcome": "routed"}) == n


async def test_the_score_header_shows_each_candidates_total(start_epp: StartEpp) -> None:
    plain = await start_epp()
    stream = plain.stream()
    await ec.route(stream, completion_body(prompt="x"))
    await stream.send(ec.response_headers(200))
    reply = await stream.expect()
    assert "x-epp-scores" not in reply.set_headers  # off by default

    epp = await start_epp(score_header=True)
    stream = epp.stream()
    routed = await ec.route(stream, completion_body(prompt="x"))
    picked = routed.headers_reply.destination
    await stream.send(ec.response_headers(200))
    reply = await stream.expect()
    entries = reply.set_headers["x-epp-scores"].split(",")
    assert len(entries) == len(epp.endpoints)
    scores = [float(e.split("=")[1]) for e in entries]
    assert scores == sorted(scores, reverse=True)
    (marked,) = [e.split("=")[0] for e in entries if "*=" in e]
    assert epp.endpoints[marked.rstrip("*")] == picked
