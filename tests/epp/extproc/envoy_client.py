"""A grpc.aio client that plays Envoy's ext_proc filter against the EPP.

Messages are built the way Envoy 1.40 sends them (docs/architecture.md, "The
ext_proc protocol"): header values in `raw_value` (bytes), the pseudo-headers
`:method`, `:path`, `:authority`, `protocol_config` with the body modes on the first
message, bodies as `HttpBody` chunks whose last one has `end_of_stream` (possibly
empty), and an optional subset hint in `metadata_context`.

`EnvoyStream` wraps one `ExternalProcessor/Process` call; `Reply` decodes what the
EPP sends back into plain values the tests compare.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import json_format, struct_pb2

from epp._proto.envoy.config.core.v3 import base_pb2 as core
from epp._proto.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as mode
from epp._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from epp._proto.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

FULL_DUPLEX_STREAMED = mode.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED = mode.ProcessingMode.BUFFERED
BUFFERED_PARTIAL = mode.ProcessingMode.BUFFERED_PARTIAL
NONE = mode.ProcessingMode.NONE

DESTINATION = "x-gateway-destination-endpoint"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
MAX_CHUNK = 62_000

# How long a test waits for one reply before it fails (a hang is a failure, not a
# measurement: nothing asserts on how fast a reply comes).
REPLY_TIMEOUT_S = 10.0

Headers = Mapping[str, str] | Sequence[tuple[str, str]]


def header_map(headers: Headers) -> core.HeaderMap:
    items = headers.items() if isinstance(headers, Mapping) else headers
    return core.HeaderMap(headers=[core.HeaderValue(key=k, raw_value=v.encode()) for k, v in items])


def request_headers(
    path: str = "/v1/completions",
    *,
    method: str = "POST",
    content_type: str | None = "application/json",
    extra: Headers = (),
    request_id: str | None = None,
    end_of_stream: bool = False,
    request_body_mode: int = FULL_DUPLEX_STREAMED,
    response_body_mode: int = FULL_DUPLEX_STREAMED,
    subset: Sequence[str] | None = None,
    protocol_config: bool = True,
) -> pb.ProcessingRequest:
    """The first message of a stream, as Envoy 1.40 sends it."""
    headers: list[tuple[str, str]] = [
        (":authority", "gateway.example:8080"),
        (":path", path),
        (":method", method),
        (":scheme", "http"),
        ("user-agent", "envoy-client-test"),
        ("x-forwarded-proto", "http"),
        ("x-request-id", request_id if request_id is not None else str(uuid.uuid4())),
    ]
    if content_type is not None:
        headers.append(("content-type", content_type))
    items = extra.items() if isinstance(extra, Mapping) else extra
    headers.extend(items)
    message = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=header_map(headers), end_of_stream=end_of_stream)
    )
    if protocol_config:
        message.protocol_config.request_body_mode = request_body_mode  # type: ignore[assignment]
        message.protocol_config.response_body_mode = response_body_mode  # type: ignore[assignment]
    if subset is not None:
        hint = message.metadata_context.filter_metadata[SUBSET_NAMESPACE]
        hint.fields[SUBSET_KEY].list_value.values.extend(
            struct_pb2.Value(string_value=s) for s in subset
        )
    return message


def request_body(chunk: bytes, end_of_stream: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=chunk, end_of_stream=end_of_stream))


def request_trailers(trailers: Headers = (("x-trailer", "1"),)) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_trailers=pb.HttpTrailers(trailers=header_map(trailers)))


def response_headers(
    status: int = 200,
    content_type: str = "application/json",
    end_of_stream: bool = False,
) -> pb.ProcessingRequest:
    headers = [(":status", str(status)), ("content-type", content_type)]
    return pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(headers=header_map(headers), end_of_stream=end_of_stream)
    )


def response_body(chunk: bytes, end_of_stream: bool = False) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(response_body=pb.HttpBody(body=chunk, end_of_stream=end_of_stream))


def empty_message() -> pb.ProcessingRequest:
    """A message with none of the request fields set."""
    return pb.ProcessingRequest()


def response_trailers() -> pb.ProcessingRequest:
    return pb.ProcessingRequest(
        response_trailers=pb.HttpTrailers(trailers=header_map([("grpc-status", "0")]))
    )


def chunks(body: bytes, size: int) -> list[bytes]:
    return [body[i : i + size] for i in range(0, len(body), size)] or [b""]


def body_messages(
    body: bytes, chunk_size: int | None = None, empty_last: bool = False
) -> list[pb.ProcessingRequest]:
    """`body` as request-body messages: in chunks of `chunk_size` (one message when
    None), the last with end_of_stream, or followed by an empty end_of_stream chunk."""
    parts = [body] if chunk_size is None else chunks(body, chunk_size)
    if empty_last:
        return [*(request_body(p) for p in parts), request_body(b"", end_of_stream=True)]
    return [request_body(p, end_of_stream=i == len(parts) - 1) for i, p in enumerate(parts)]


# ---------------------------------------------------------------------------
# Decoding replies.


def _header_value(option: core.HeaderValueOption) -> str:
    header = option.header
    return header.raw_value.decode() if header.raw_value else header.value


@dataclass
class Reply:
    """One ProcessingResponse, decoded."""

    message: pb.ProcessingResponse
    kind: str = ""
    set_headers: dict[str, str] = field(default_factory=dict)
    remove_headers: list[str] = field(default_factory=list)
    clear_route_cache: bool = False
    metadata: dict[str, Any] = field(default_factory=dict)
    # body mutations
    streamed: bool = False
    body: bytes = b""
    end_of_stream: bool = False
    replaced_body: bytes | None = None  # BUFFERED: `body_mutation.body`
    # immediate response
    status: int | None = None
    error: dict[str, Any] | None = None

    @classmethod
    def of(cls, message: pb.ProcessingResponse) -> Reply:
        reply = cls(message=message, kind=message.WhichOneof("response") or "")
        if message.HasField("dynamic_metadata"):
            reply.metadata = json_format.MessageToDict(message.dynamic_metadata)
        if reply.kind == "immediate_response":
            immediate = message.immediate_response
            reply.status = int(immediate.status.code)
            reply.set_headers = {
                o.header.key: _header_value(o) for o in immediate.headers.set_headers
            }
            reply.body = immediate.body
            return reply
        if reply.kind in ("request_trailers", "response_trailers"):
            return reply
        common = getattr(message, reply.kind).response
        reply.set_headers = {
            o.header.key: _header_value(o) for o in common.header_mutation.set_headers
        }
        reply.remove_headers = list(common.header_mutation.remove_headers)
        reply.clear_route_cache = common.clear_route_cache
        mutation = common.body_mutation.WhichOneof("mutation")
        if mutation == "streamed_response":
            reply.streamed = True
            reply.body = common.body_mutation.streamed_response.body
            reply.end_of_stream = common.body_mutation.streamed_response.end_of_stream
        elif mutation == "body":
            reply.replaced_body = common.body_mutation.body
        return reply

    @property
    def destination(self) -> str | None:
        return self.set_headers.get(DESTINATION)

    @property
    def lb_destination(self) -> str | None:
        value = self.metadata.get("envoy.lb", {}).get(DESTINATION)
        return value if isinstance(value, str) else None

    @property
    def is_continue(self) -> bool:
        """A reply that changes nothing."""
        return (
            self.kind != "immediate_response"
            and not self.set_headers
            and not self.remove_headers
            and not self.streamed
            and self.replaced_body is None
            and not self.metadata
        )


# ---------------------------------------------------------------------------
# One stream.


class EnvoyStream:
    """One ExternalProcessor/Process call: write messages, read decoded replies."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        stub = pb_grpc.ExternalProcessorStub(channel)  # type: ignore[no-untyped-call]
        self.call = stub.Process()

    async def send(self, *messages: pb.ProcessingRequest) -> None:
        for message in messages:
            await self.call.write(message)

    async def recv(self) -> Reply | None:
        """The next reply, or None when the server ended the stream."""
        message = await asyncio.wait_for(self.call.read(), REPLY_TIMEOUT_S)
        if message is grpc.aio.EOF:
            return None
        return Reply.of(message)

    async def expect(self) -> Reply:
        reply = await self.recv()
        assert reply is not None, "the EPP ended the stream where a reply was due"
        return reply

    async def recv_body(self, kind: str) -> tuple[list[Reply], bytes]:
        """Streamed body replies of `kind` up to the one with end_of_stream."""
        replies: list[Reply] = []
        while True:
            reply = await self.expect()
            assert reply.kind == kind, f"expected a {kind} reply, got {reply.kind}"
            assert reply.streamed, f"a {kind} reply without a streamed_response"
            replies.append(reply)
            if reply.end_of_stream:
                return replies, b"".join(r.body for r in replies)

    async def close(self) -> grpc.StatusCode:
        """Half-close as Envoy does at the end of a request; the stream's status.
        (A no-op write side if the EPP has already ended the stream.)"""
        await self.call.done_writing()
        rest = await self.recv()
        assert rest is None, f"an unexpected {rest.kind} reply after the exchange"
        return await self.call.code()

    async def ended(self) -> grpc.StatusCode:
        """The status of a stream the EPP ended by itself, while this side still
        had it open (as Envoy does until its HTTP stream is over)."""
        rest = await self.recv()
        assert rest is None, f"an unexpected {rest.kind} reply after the exchange"
        return await self.call.code()

    def cancel(self) -> None:
        self.call.cancel()


@dataclass
class Routed:
    """What the request phase of one exchange produced."""

    headers_reply: Reply
    body_replies: list[Reply]
    body: bytes  # the request body as handed back to Envoy

    @property
    def destination(self) -> str:
        assert self.headers_reply.destination is not None
        return self.headers_reply.destination


async def send_request(
    stream: EnvoyStream,
    body: bytes,
    *,
    path: str = "/v1/completions",
    chunk_size: int | None = None,
    empty_last: bool = False,
    **header_args: Any,
) -> Reply:
    """Send a FULL_DUPLEX_STREAMED request; the first reply (the decision or an
    ImmediateResponse)."""
    await stream.send(request_headers(path, **header_args))
    await stream.send(*body_messages(body, chunk_size, empty_last))
    return await stream.expect()


async def route(
    stream: EnvoyStream,
    body: bytes,
    *,
    path: str = "/v1/completions",
    chunk_size: int | None = None,
    empty_last: bool = False,
    **header_args: Any,
) -> Routed:
    """Send a FULL_DUPLEX_STREAMED request and read the routed request phase:
    the request-headers decision, then the body handed back."""
    first = await send_request(
        stream, body, path=path, chunk_size=chunk_size, empty_last=empty_last, **header_args
    )
    assert first.kind == "request_headers", f"expected the decision, got {first.message}"
    replies, returned = await stream.recv_body("request_body")
    return Routed(first, replies, returned)


async def respond(
    stream: EnvoyStream,
    body_chunks: Iterable[bytes],
    *,
    status: int = 200,
    content_type: str = "application/json",
) -> bytes:
    """Play the upstream response through the stream (FULL_DUPLEX_STREAMED); the
    response body as the EPP handed it back."""
    await stream.send(response_headers(status, content_type))
    reply = await stream.expect()
    assert reply.kind == "response_headers"
    assert reply.is_continue
    parts = list(body_chunks) or [b""]
    returned = b""
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        await stream.send(response_body(part, end_of_stream=last))
        echo = await stream.expect()
        assert echo.kind == "response_body"
        assert echo.streamed
        assert echo.body == part
        assert echo.end_of_stream == last
        returned += echo.body
    return returned
