"""Reading and writing Envoy ext_proc messages (the protocol: docs/architecture.md,
"The ext_proc protocol")."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

from google.protobuf import struct_pb2

from epp._proto.envoy.config.core.v3 import base_pb2 as core
from epp._proto.envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as mode
from epp._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from epp._proto.envoy.type.v3 import http_status_pb2 as http_status
from epp.errors import EppError

DESTINATION_HEADER: Final = "x-gateway-destination-endpoint"
LB_METADATA_NAMESPACE: Final = "envoy.lb"
SUBSET_HINT_NAMESPACE: Final = "envoy.lb.subset_hint"
SUBSET_HINT_KEY: Final = "x-gateway-destination-endpoint-subset"
# Envoy's ext_proc takes body mutations of at most this many bytes per message
# (the limit GIE's EPP uses; Envoy rejects larger streamed chunks).
BODY_CHUNK_BYTES: Final = 62_000

BodyMode = mode.ProcessingMode.BodySendMode
FULL_DUPLEX_STREAMED: Final = mode.ProcessingMode.FULL_DUPLEX_STREAMED
BUFFERED: Final = mode.ProcessingMode.BUFFERED
BUFFERED_PARTIAL: Final = mode.ProcessingMode.BUFFERED_PARTIAL
STREAMED: Final = mode.ProcessingMode.STREAMED
NONE: Final = mode.ProcessingMode.NONE

_OVERWRITE: Final = core.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD


def header_dict(header_map: core.HeaderMap) -> dict[str, str]:
    """Headers as a dict with lower-case names. Envoy 1.40 sends values in
    `raw_value` (bytes); older versions in `value`. Repeated names are joined
    with ", " as HTTP allows."""
    out: dict[str, str] = {}
    for header in header_map.headers:
        raw = header.raw_value
        value = raw.decode("utf-8", "replace") if raw else header.value
        key = header.key.lower()
        out[key] = f"{out[key]}, {value}" if key in out else value
    return out


def subset_hint(request: pb.ProcessingRequest) -> list[str] | None:
    """Envoy's candidate subset (`envoy.lb.subset_hint` metadata), if it sent one."""
    if not request.HasField("metadata_context"):
        return None
    namespace = request.metadata_context.filter_metadata.get(SUBSET_HINT_NAMESPACE)
    if namespace is None or SUBSET_HINT_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_HINT_KEY]
    if value.HasField("list_value"):
        return [v.string_value for v in value.list_value.values if v.string_value]
    if value.HasField("string_value"):  # tolerate a comma-separated string
        return [part.strip() for part in value.string_value.split(",") if part.strip()]
    return []


def _set(key: str, value: str) -> core.HeaderValueOption:
    return core.HeaderValueOption(
        header=core.HeaderValue(key=key, raw_value=value.encode()), append_action=_OVERWRITE
    )


def _lb_metadata(destinations: str) -> struct_pb2.Struct:
    metadata = struct_pb2.Struct()
    metadata.get_or_create_struct(LB_METADATA_NAMESPACE)[DESTINATION_HEADER] = destinations
    return metadata


def routing_mutation(
    destinations: str, remove: Iterable[str], set_headers: Sequence[tuple[str, str]] = ()
) -> pb.CommonResponse:
    """The decision as a header: `x-gateway-destination-endpoint`, with the route
    cache cleared so Envoy routes on it."""
    return pb.CommonResponse(
        header_mutation=pb.HeaderMutation(
            set_headers=[
                _set(DESTINATION_HEADER, destinations),
                *(_set(k, v) for k, v in set_headers),
            ],
            remove_headers=list(remove),
        ),
        clear_route_cache=True,
    )


def request_headers_decision(
    destinations: str, remove: Iterable[str], set_headers: Sequence[tuple[str, str]] = ()
) -> pb.ProcessingResponse:
    """The request-headers reply carrying the decision (header and `envoy.lb`
    dynamic metadata, which must agree)."""
    return pb.ProcessingResponse(
        request_headers=pb.HeadersResponse(
            response=routing_mutation(destinations, remove, set_headers)
        ),
        dynamic_metadata=_lb_metadata(destinations),
    )


def request_body_decision(
    destinations: str,
    remove: Iterable[str],
    set_headers: Sequence[tuple[str, str]] = (),
    new_body: bytes | None = None,
) -> pb.ProcessingResponse:
    """BUFFERED mode: the decision rides on the request-body reply."""
    common = routing_mutation(destinations, remove, set_headers)
    if new_body is not None:
        common.body_mutation.body = new_body
    return pb.ProcessingResponse(
        request_body=pb.BodyResponse(response=common), dynamic_metadata=_lb_metadata(destinations)
    )


def _streamed(field: str, body: bytes, end_of_stream: bool) -> pb.ProcessingResponse:
    common = pb.CommonResponse(
        body_mutation=pb.BodyMutation(
            streamed_response=pb.StreamedBodyResponse(body=body, end_of_stream=end_of_stream)
        )
    )
    if field == "request_body":
        return pb.ProcessingResponse(request_body=pb.BodyResponse(response=common))
    return pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))


def streamed_body(field: str, body: bytes, end_of_stream: bool) -> list[pb.ProcessingResponse]:
    """FULL_DUPLEX_STREAMED: a body handed back to Envoy unchanged, in chunks of at
    most BODY_CHUNK_BYTES (an empty body is one empty chunk). `field` is
    "request_body" or "response_body"."""
    if len(body) <= BODY_CHUNK_BYTES:
        return [_streamed(field, body, end_of_stream)]
    last = (len(body) - 1) // BODY_CHUNK_BYTES * BODY_CHUNK_BYTES
    return [
        _streamed(field, body[i : i + BODY_CHUNK_BYTES], end_of_stream and i == last)
        for i in range(0, len(body), BODY_CHUNK_BYTES)
    ]


def immediate_response(error: EppError) -> pb.ProcessingResponse:
    """Answer the client directly with `error`'s status and OpenAI-shaped body, and
    the headers the error carries, if any (`response_headers`: flow control's
    Retry-After and dropped reason)."""
    extra: tuple[tuple[str, str], ...] = getattr(error, "response_headers", ())
    return pb.ProcessingResponse(
        immediate_response=pb.ImmediateResponse(
            status=http_status.HttpStatus(code=error.status),  # type: ignore[arg-type]
            headers=pb.HeaderMutation(
                set_headers=[
                    _set("content-type", "application/json"),
                    *(_set(k, v) for k, v in extra),
                ]
            ),
            body=error.body(),
            details=f"epp_{error.outcome}",
        )
    )


# Replies that carry nothing: immutable once built, so shared by every stream.
CONTINUE_REQUEST_HEADERS: Final = pb.ProcessingResponse(request_headers=pb.HeadersResponse())
CONTINUE_REQUEST_BODY: Final = pb.ProcessingResponse(request_body=pb.BodyResponse())
CONTINUE_RESPONSE_HEADERS: Final = pb.ProcessingResponse(response_headers=pb.HeadersResponse())


def response_headers_set(set_headers: Sequence[tuple[str, str]]) -> pb.ProcessingResponse:
    """The response-headers reply adding headers to what the client gets."""
    return pb.ProcessingResponse(
        response_headers=pb.HeadersResponse(
            response=pb.CommonResponse(
                header_mutation=pb.HeaderMutation(set_headers=[_set(k, v) for k, v in set_headers])
            )
        )
    )


CONTINUE_RESPONSE_BODY: Final = pb.ProcessingResponse(response_body=pb.BodyResponse())
CONTINUE_REQUEST_TRAILERS: Final = pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
CONTINUE_RESPONSE_TRAILERS: Final = pb.ProcessingResponse(response_trailers=pb.TrailersResponse())
