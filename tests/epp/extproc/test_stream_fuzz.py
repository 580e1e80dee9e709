"""Property-based tests of the ext_proc stream state machine: random message
orders, body chunkings, body modes, bodies and cancellations, against a real EPP
(`EppApp`: the real director, datastore, plugins and telemetry).

In-process, each message goes through `RequestStream.handle` exactly as the gRPC
servicer calls it; over real gRPC, the client cancels or half-closes at random
points. The invariants:

- `handle` never raises and never answers with an internal error (500): every
  input is either processed or refused with the documented status;
- every reply is a well-formed ProcessingResponse of the phase it answers, and
  nothing follows an ImmediateResponse;
- a well-formed request is routed to a pool endpoint (header and `envoy.lb`
  metadata agreeing) with its body handed back byte for byte, or refused with a
  400, 413, 429 or 503 carrying an OpenAI-shaped JSON error;
- whatever happened, once the stream is gone nothing is left: no in-flight count,
  no retained config, no open stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from epp._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from epp.app import EppApp
from epp.extproc.stream import RequestStream, StreamSettings
from tests.epp.conftest import app_on_runner, local_options, write_endpoints
from tests.epp.extproc import envoy_client as ec
from tests.fuzzing import examples

ENDPOINTS = {"pod-a": "10.0.0.1:8000", "pod-b": "10.0.0.2:8000", "pod-c": "10.0.0.3:8000"}
MAX_BODY = 2048
CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: header-based-testing-filter
- type: prefix-cache-scorer
  parameters: {autoTune: false, blockSizeTokens: 2}
- type: max-score-picker
inferenceObjectives:
- {name: batch, priority: -1}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: header-based-testing-filter
  - pluginRef: prefix-cache-scorer
  - pluginRef: max-score-picker
"""
REFUSALS = {400, 413, 429, 503}
# Which reply kinds may answer a message of each kind: its own, or (the body's end)
# the deferred request-headers decision; an ImmediateResponse may answer anything.
ALLOWED_REPLIES = {
    "request_headers": {"request_headers"},
    "request_body": {"request_headers", "request_body"},
    "request_trailers": {"request_headers", "request_body", "request_trailers"},
    "response_headers": {"response_headers"},
    "response_body": {"response_body"},
    "response_trailers": {"response_trailers"},
    None: {"request_headers"},  # a message with no phase set: a protocol error
}


@dataclass
class Running:
    runner: asyncio.Runner
    app: EppApp

    def leftovers(self) -> dict[str, Any]:
        """Everything a finished stream must have given back."""
        app = self.app
        return {
            "in_flight": {
                e.name: e.in_flight for e in app.datastore.all_endpoints() if e.in_flight
            },
            "config_users": app.director.users(app.director.config),
            "open_streams": app.processor.active,
        }

    def internal_errors(self) -> float:
        value = self.app.telemetry.registry.get_sample_value(
            "epp_extproc_stream_errors_total", {"reason": "internal"}
        )
        return value or 0.0


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    path: Path = tmp_path_factory.mktemp("stream-fuzz") / "endpoints.yaml"
    write_endpoints(path, ENDPOINTS)
    options = local_options(path, config_text=CONFIG, max_body_bytes=MAX_BODY, shutdown_grace_s=0.2)
    with app_on_runner(options) as (runner, app):
        # Refusals are logged at info and protocol violations at warning, by design.
        logging.disable(logging.WARNING)
        try:
            yield Running(runner, app)
        finally:
            logging.disable(logging.NOTSET)


# ---------------------------------------------------------------------------
# Strategies

API_PATHS = ["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings"]
texts = st.text(max_size=40)
json_scalars = st.none() | st.booleans() | st.integers(-5, 70000) | st.floats() | texts
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=15,
)
messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": texts}
    ),
    min_size=1,
    max_size=3,
)
salted = {"cache_salt": texts, "stream": st.booleans(), "max_tokens": st.integers(1, 9)}
# (path, body) pairs a model server would accept.
valid_requests = st.one_of(
    st.tuples(
        st.just("/v1/completions"),
        st.fixed_dictionaries(
            {
                "model": texts.filter(bool),
                "prompt": texts | st.lists(st.integers(0, 999), min_size=1),
            },
            optional=salted,
        ),
    ),
    st.tuples(
        st.just("/v1/chat/completions"),
        st.fixed_dictionaries({"model": texts.filter(bool), "messages": messages}, optional=salted),
    ),
    st.tuples(
        st.just("/v1/responses"),
        st.fixed_dictionaries({"model": texts.filter(bool), "input": texts | messages}),
    ),
    st.tuples(
        st.just("/v1/embeddings"),
        st.fixed_dictionaries({"model": texts.filter(bool), "input": texts}),
    ),
).map(lambda pair: (pair[0], json.dumps(pair[1]).encode()))
body_keys = st.sampled_from(
    ["model", "prompt", "messages", "input", "instructions", "cache_salt", "stream", "tools"]
)
bodies = st.one_of(
    st.dictionaries(body_keys, json_values, max_size=5).map(lambda b: json.dumps(b).encode()),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=300),
    st.just(b""),
    # Over the body limit.
    st.integers(MAX_BODY + 1, 3 * MAX_BODY).map(lambda n: b'{"model": "m", "prompt": "' + b"x" * n),
)
any_requests = st.tuples(
    st.sampled_from([*API_PATHS, "/v1/models", "/health?x=1", "/v1/completions/"]), bodies
)
body_modes = st.sampled_from(
    [ec.FULL_DUPLEX_STREAMED, ec.FULL_DUPLEX_STREAMED, ec.BUFFERED, ec.BUFFERED_PARTIAL,
     ec.mode.ProcessingMode.STREAMED, ec.NONE]
)  # fmt: skip
response_modes = st.sampled_from([ec.FULL_DUPLEX_STREAMED, ec.NONE, ec.BUFFERED])
control_headers = st.lists(
    st.sampled_from(
        [
            ("x-gateway-model-name-rewrite", "rewritten-model"),
            ("x-gateway-inference-objective", "batch"),
            ("x-gateway-inference-fairness-id", "tenant"),
            ("test-epp-endpoint-selection", ENDPOINTS["pod-b"]),
            ("test-epp-endpoint-selection", "192.0.2.1:1"),
            ("content-length", "12"),
        ]
    ),
    max_size=3,
    unique=True,
)


@dataclass
class Exchange:
    """One stream's messages, as Envoy would send them for one request."""

    messages: list[pb.ProcessingRequest]
    body: bytes
    request_mode: int
    well_formed: bool


@st.composite
def exchanges(draw: st.DrawFn, perturb: bool = True) -> Exchange:
    # Half valid requests, so that half the examples get as far as a pick.
    path, body = draw(st.one_of(valid_requests, any_requests))
    request_mode = draw(body_modes)
    header_only = draw(st.booleans()) if path in ("/v1/models", "/health?x=1") else False
    subset = draw(
        st.sampled_from([None, None, None, None, []])
        | st.lists(st.sampled_from([*ENDPOINTS.values(), "10.9.9.9:1"]), max_size=2)
    )
    first = ec.request_headers(
        path,
        method=draw(st.sampled_from(["POST", "POST", "GET"])),
        content_type=draw(st.sampled_from(["application/json"] * 4 + ["text/plain", None])),
        extra=draw(control_headers),
        request_id=draw(st.none() | st.just("")),
        end_of_stream=header_only,
        request_body_mode=request_mode,
        response_body_mode=draw(response_modes),
        subset=subset,
        protocol_config=draw(st.booleans()),
    )
    sequence = [first]
    if not header_only:
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=4)))
        parts = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
        ending = draw(st.sampled_from(["last", "empty", "trailers"]))
        for i, part in enumerate(parts):
            sequence.append(ec.request_body(part, ending == "last" and i == len(parts) - 1))
        if ending == "empty":
            sequence.append(ec.request_body(b"", end_of_stream=True))
        elif ending == "trailers":
            sequence.append(ec.request_trailers())
    response_end = draw(st.sampled_from(["body", "headers", "trailers", "none"]))
    if response_end != "none":
        sequence.append(
            ec.response_headers(
                draw(st.sampled_from([200, 500])),
                draw(st.sampled_from(["application/json", "text/event-stream"])),
                end_of_stream=response_end == "headers",
            )
        )
        if response_end in ("body", "trailers"):
            chunks = draw(st.lists(st.binary(max_size=40), min_size=1, max_size=3))
            for i, chunk in enumerate(chunks):
                last = response_end == "body" and i == len(chunks) - 1
                sequence.append(ec.response_body(chunk, end_of_stream=last))
            if response_end == "trailers":
                sequence.append(ec.response_trailers())
    well_formed = True
    if perturb and draw(st.booleans()):
        well_formed = False
        for _ in range(draw(st.integers(1, 3))):
            action = draw(st.sampled_from(["drop", "duplicate", "swap", "junk", "truncate"]))
            at = draw(st.integers(0, len(sequence) - 1))
            if action == "drop" and len(sequence) > 1:
                del sequence[at]
            elif action == "duplicate":
                sequence.insert(at, sequence[at])
            elif action == "swap":
                other = draw(st.integers(0, len(sequence) - 1))
                sequence[at], sequence[other] = sequence[other], sequence[at]
            elif action == "junk":
                sequence.insert(at, ec.empty_message())
            elif action == "truncate":  # the stream ends (Envoy cancels) mid-exchange
                del sequence[at + 1 :]
    return Exchange(sequence, body, request_mode, well_formed)


# ---------------------------------------------------------------------------
# Checks


def check_reply(message_kind: str | None, reply: pb.ProcessingResponse) -> ec.Reply:
    decoded = ec.Reply.of(reply)
    assert decoded.kind, f"a reply with no response set: {reply}"
    if decoded.kind == "immediate_response":
        assert decoded.status in REFUSALS, f"status {decoded.status}: {decoded.body!r}"
        error = json.loads(decoded.body)["error"]
        assert error["code"] == decoded.status
        assert error["message"]
        assert decoded.set_headers["content-type"] == "application/json"
        return decoded
    assert decoded.kind in ALLOWED_REPLIES[message_kind], (message_kind, decoded.kind)
    if decoded.destination is not None:
        assert decoded.destination in ENDPOINTS.values()
        assert decoded.lb_destination == decoded.destination
    if decoded.streamed:
        assert len(decoded.body) <= ec.MAX_CHUNK
    return decoded


async def play(running: Running, exchange: Exchange) -> list[tuple[str | None, ec.Reply]]:
    app = running.app
    stream = RequestStream(
        app.director,
        StreamSettings(max_body_bytes=MAX_BODY),
        app.telemetry,
        app.tracker,
    )
    replies: list[tuple[str | None, ec.Reply]] = []
    answered = False
    try:
        for message in exchange.messages:
            kind = message.WhichOneof("request")
            out = await stream.handle(message)
            assert not (answered and out), "a reply after an ImmediateResponse"
            for reply in out:
                decoded = check_reply(kind, reply)
                answered = answered or decoded.kind == "immediate_response"
                replies.append((kind, decoded))
    finally:
        stream.close()
    return replies


@settings(max_examples=examples(300))
@given(exchanges())
def test_any_message_sequence_is_handled_and_leaves_nothing_behind(
    running: Running, exchange: Exchange
) -> None:
    errors_before = running.internal_errors()
    replies = running.runner.run(play(running, exchange))
    # `pytest --hypothesis-show-statistics` shows how the examples ended.
    outcome = next(
        (f"refused {r.status}" for _, r in replies if r.kind == "immediate_response"),
        "routed" if any(r.destination for _, r in replies) else "not routed",
    )
    event(f"{'well-formed' if exchange.well_formed else 'perturbed'}: {outcome}")
    assert running.internal_errors() == errors_before
    assert running.leftovers() == {"in_flight": {}, "config_users": 0, "open_streams": 0}
    if not exchange.well_formed or exchange.request_mode != ec.FULL_DUPLEX_STREAMED:
        return
    # A well-formed GIE-mode request: routed with its body handed back intact, or
    # refused with a documented error.
    first = replies[0][1] if replies else None
    assert first is not None, "a complete request got no answer"
    if first.kind == "immediate_response":
        return
    assert first.kind == "request_headers"
    assert first.destination in ENDPOINTS.values()
    echoed = b"".join(r.body for kind, r in replies if r.kind == "request_body" and r.streamed)
    if exchange.messages[0].request_headers.end_of_stream:
        assert echoed == b""
    elif echoed != exchange.body:
        # Only a model rewrite changes the body, and then only its model.
        assert "x-gateway-model-name-rewrite" in first.remove_headers
        before, after = json.loads(exchange.body), json.loads(echoed)
        assert after.pop("model") == "rewritten-model"
        before.pop("model")
        assert after == before


# ---------------------------------------------------------------------------
# Over real gRPC: cancellations and early half-closes at random points


async def play_over_grpc(
    running: Running, exchange: Exchange, stop_after: int, how: str, pause: bool
) -> None:
    """Send the first `stop_after` messages, then cancel the call or half-close it
    (as Envoy does when the client goes away, or at the end of a request); replies
    are read all along, as Envoy reads them."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.app.ports['grpc']}") as channel:
        stream = ec.EnvoyStream(channel)
        call = stream.call

        async def read_all() -> None:
            # A cancelled call ends its reads with CancelledError (grpc's way of
            # saying so); that is the expected end here, not this task's.
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.CancelledError):
                while await call.read() is not grpc.aio.EOF:
                    pass

        reader = asyncio.create_task(read_all())
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            for message in exchange.messages[:stop_after]:
                await stream.send(message)
        if pause:
            await asyncio.sleep(0.01)  # let the EPP answer what it owes before the end
        if how == "cancel":
            stream.cancel()
        else:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                await call.done_writing()
        await asyncio.wait_for(reader, 10)


async def settled(running: Running, timeout_s: float = 5.0) -> dict[str, Any]:
    """The leftovers once the server has processed the end of the stream."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        left = running.leftovers()
        if left["open_streams"] == 0 or asyncio.get_running_loop().time() > deadline:
            return left
        await asyncio.sleep(0.005)


@settings(max_examples=examples(40))
@given(
    exchanges(perturb=False),
    st.integers(0, 12),
    st.sampled_from(["cancel", "half-close"]),
    st.booleans(),
)
def test_a_stream_cancelled_or_closed_at_any_point_leaves_nothing_behind(
    running: Running, exchange: Exchange, stop_after: int, how: str, pause: bool
) -> None:
    errors_before = running.internal_errors()

    async def scenario() -> dict[str, Any]:
        await play_over_grpc(running, exchange, stop_after, how, pause)
        return await settled(running)

    assert running.runner.run(scenario()) == {"in_flight": {}, "config_users": 0, "open_streams": 0}
    assert running.internal_errors() == errors_before
