"""One ext_proc stream = one HTTP request through Envoy: an explicit state machine.

    REQUEST_HEADERS --headers--> REQUEST_BODY --body end--> RESPONSE_HEADERS
          |  (header-only request: routed at once)                |
          +-------------------------------------------------------+
    RESPONSE_HEADERS --headers--> RESPONSE_BODY --body end / trailers--> DONE
    RESPONSE_HEADERS | RESPONSE_BODY --stream ends--> DONE (aborted)
                                     --stream ends, lean mode--> HANDED_OFF
    any state --EPP answers the client itself (error)--> ANSWERED

With flow control on (docs/flow-control.md), routing may wait: the director
holds the request in its priority band until capacity frees, while the stream
stays in its request phase and Envoy waits for the reply (its ext_proc
`message_timeout` must cover the queue's TTL). The director calls the stream's
`on_wait` when the request is queued: the server then reads the stream while it
waits, so when the client goes away Envoy's half-close (or its reset) cancels the
waiting coroutine and the request leaves its queue at once (epp/extproc/server.py).
If flow control sheds it, the client gets an ImmediateResponse (429/503 with
Retry-After).

FULL_DUPLEX_STREAMED (GIE's mode): nothing is answered until the request body has
ended; then come the request-headers reply carrying the decision and the body,
handed back unchanged in chunks. BUFFERED bodies: the headers are answered at
once and the decision rides on the body reply. Response headers and body pass
through untouched while usage is read on the way.

Lean mode (manifests/envoy/envoy-lean.yaml): Envoy announces response_body_mode
NONE in the first message's protocol_config, and ends the stream as soon as the
request has been routed. The end of the stream is then not the end of the
request: the decision is given to the CompletionTracker when it is made, and
Envoy's access-log entry for the request ends it (epp/completion.py). Without a
protocol_config the stream is taken to be GIE's.

Envoy ends its side of the stream when it reads an ImmediateResponse, and
ignores whatever comes after it. The server ends the stream there too (below);
a message that still reaches `handle` in ANSWERED (the rest of a FULL_DUPLEX body
rejected with a 413, sent before Envoy read the 413) is dropped, unanswered.

Once a stream is `over` (the response has ended, or the EPP answered the client
itself), the server ends it with status OK at once; Envoy then stops sending for
this request. Envoy's own end of a stream it still holds is a half-close and a
reset, unless its `ext_proc_graceful_grpc_close` runtime flag is on (the shipped
Envoy configs set it, with the gRPC client cache setting without which the flag
crashes Envoy: docs/reliability.md, "Ending ext_proc streams").

`handle` never raises: an `EppError` becomes an ImmediateResponse with its status,
any other exception a 500 (and a log line with the traceback).
"""

from __future__ import annotations

import enum
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from epp._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from epp.completion import CompletionTracker
from epp.director import Decision, Director
from epp.errors import EppError, InternalError, PayloadTooLarge
from epp.extproc import messages as m
from epp.extproc.usage import UsageReader
from epp.logs import VERBOSE, request_id_var
from epp.requests import CONTROL_HEADERS, EPP_SET_HEADERS, InferenceRequest, parse_request
from epp.scheduling.types import ResponseInfo
from epp.telemetry import Telemetry

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


class Phase(enum.Enum):
    REQUEST_HEADERS = "request_headers"  # waiting for the request headers
    REQUEST_BODY = "request_body"  # buffering the request body
    RESPONSE_HEADERS = "response_headers"  # routed; waiting for the response
    RESPONSE_BODY = "response_body"  # passing the response body through
    DONE = "done"  # the response ended (or the stream did, aborting the request)
    ANSWERED = "answered"  # the EPP answered the client itself (ImmediateResponse)
    HANDED_OFF = "handed_off"  # lean: the stream ended first; the tracker ends the request


@dataclass(frozen=True, slots=True)
class StreamSettings:
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    log_prompts: bool = False
    # Debugging: add `x-epp-scores` to responses (each candidate's total in the
    # primary profile, best first); needs Envoy to send response headers (not lean).
    score_header: bool = False


SCORES_HEADER: Final = "x-epp-scores"
# At most this many candidates in the header (a fleet of hundreds would not fit).
SCORES_HEADER_MAX: Final = 16


Replies = list[pb.ProcessingResponse]
_NO_REPLY: Replies = []


class RequestStream:
    def __init__(
        self,
        director: Director,
        settings: StreamSettings,
        telemetry: Telemetry,
        tracker: CompletionTracker,
        on_wait: Callable[[], object] | None = None,
    ) -> None:
        """`on_wait`: called if the request is queued by flow control while it is
        routed (the server then watches the stream for the client leaving)."""
        self.director = director
        self.on_wait = on_wait
        self.settings = settings
        self.telemetry = telemetry
        self.tracker = tracker
        self.phase = Phase.REQUEST_HEADERS
        # Body modes: from the first message's protocol_config; GIE's mode otherwise.
        self.request_body_mode: int = m.FULL_DUPLEX_STREAMED
        self.response_body_mode: int = m.FULL_DUPLEX_STREAMED
        self.headers: dict[str, str] = {}
        self.request_id = ""
        self.generated_request_id = False
        self.subset: list[str] | None = None
        # Routed before the request ended (a STREAMED or NONE body mode, or a
        # BUFFERED body followed by trailers): the rest of the request, which the
        # decision did not wait for, passes through without being a violation.
        self.request_tail = False
        self.body = bytearray()
        self.decision: Decision | None = None
        self.usage: UsageReader | None = None
        self.status: int | None = None
        self.body_ended_at = 0.0

    # -- entry points --------------------------------------------------------

    async def handle(self, message: pb.ProcessingRequest) -> Replies:
        """The replies to one message from Envoy, in the order to send them."""
        kind = message.WhichOneof("request")
        if self.phase is Phase.ANSWERED:
            return _NO_REPLY
        try:
            if kind == "request_headers":
                return await self._request_headers(message)
            if kind == "request_body":
                return await self._request_body(message.request_body)
            if kind == "request_trailers":
                return await self._request_trailers()
            if kind == "response_headers":
                return self._response_headers(message.response_headers)
            if kind == "response_body":
                return self._response_body(message.response_body)
            if kind == "response_trailers":
                return self._response_trailers()
            self._protocol_error(f"message without a known phase ({kind})")
            return _NO_REPLY
        except EppError as error:
            return self._reject(error)
        except Exception:
            log.exception("internal error while handling %s", kind)
            self.telemetry.stream_errors.labels("internal").inc()
            if self.phase in (Phase.REQUEST_HEADERS, Phase.REQUEST_BODY):
                return self._reject(
                    InternalError(
                        f"internal error in the endpoint picker (request id {self.request_id})"
                    )
                )
            # The request already went upstream: let the response through untouched.
            return self._pass_through(message)

    @property
    def lean(self) -> bool:
        """Envoy will not show this EPP the response body: the response's end comes
        from the access log, not from this stream."""
        return self.response_body_mode == m.NONE

    @property
    def over(self) -> bool:
        """Nothing more is wanted from Envoy: the response has ended (and no part of
        the request is still to pass through), or the EPP answered the client
        itself. The server then ends the stream with status OK, which Envoy reads
        as "no more processing for this request"."""
        if self.phase is Phase.ANSWERED:
            return True
        return self.phase is Phase.DONE and not self.request_tail

    def close(self) -> None:
        """The stream ended, normally or not. A request still open is aborted,
        unless in lean mode, where its end is yet to come through the tracker."""
        if self.decision is not None and self.phase in (
            Phase.RESPONSE_HEADERS,
            Phase.RESPONSE_BODY,
        ):
            if self.lean:
                self.phase = Phase.HANDED_OFF
                self.tracker.stream_ended(self.request_id, self.decision, self.status)
                return
            self._finish(completed=False)
        elif self.phase in (Phase.REQUEST_HEADERS, Phase.REQUEST_BODY) and self.headers:
            self.telemetry.requests.labels("abandoned").inc()
        self.phase = Phase.DONE

    # -- request phase ---------------------------------------------------------

    async def _request_headers(self, message: pb.ProcessingRequest) -> Replies:
        if self.phase is not Phase.REQUEST_HEADERS:
            self._protocol_error("request headers twice")
            return [m.CONTINUE_REQUEST_HEADERS]
        if message.HasField("protocol_config"):
            config = message.protocol_config
            self.request_body_mode = config.request_body_mode
            self.response_body_mode = config.response_body_mode
        self.headers = m.header_dict(message.request_headers.headers)
        request_id = self.headers.get("x-request-id")
        if not request_id:
            request_id = uuid.uuid4().hex
            self.generated_request_id = True
        self.request_id = request_id
        request_id_var.set(request_id)
        self.subset = m.subset_hint(message)

        if message.request_headers.end_of_stream or self.request_body_mode in (m.NONE, m.STREAMED):
            # No body is coming to this EPP (a GET, or a body mode it cannot wait
            # for): route on the headers alone.
            if self.request_body_mode == m.STREAMED:
                log.debug("request body mode STREAMED: routing on headers only")
            self.body_ended_at = time.perf_counter()
            decision = await self._route(b"", body_seen=message.request_headers.end_of_stream)
            self.request_tail = not message.request_headers.end_of_stream
            return [self._headers_decision(decision)]
        self.phase = Phase.REQUEST_BODY
        if self.request_body_mode in (m.BUFFERED, m.BUFFERED_PARTIAL):
            # Envoy waits for this reply before it sends the buffered body.
            return [m.CONTINUE_REQUEST_HEADERS]
        return _NO_REPLY

    async def _request_body(self, body: pb.HttpBody) -> Replies:
        if self.phase is not Phase.REQUEST_BODY:
            if not self.request_tail:
                self._protocol_error(f"request body in phase {self.phase.value}")
            return self._echo("request_body", body.body, body.end_of_stream)
        self.body += body.body
        if len(self.body) > self.settings.max_body_bytes:
            raise PayloadTooLarge(
                f"the request body is over the endpoint picker's limit of"
                f" {self.settings.max_body_bytes} bytes"
            )
        if self.request_body_mode == m.BUFFERED_PARTIAL and not body.end_of_stream:
            # BUFFERED_PARTIAL sent only what fit in Envoy's buffer: the rest goes
            # upstream without passing here, so the body cannot be read whole.
            raise PayloadTooLarge("the request body is larger than the proxy's buffer limit")
        if self.request_body_mode == m.BUFFERED:
            # A BUFFERED body always comes whole, in one message (Envoy answers a
            # body over its buffer limit itself). Without end_of_stream it is
            # followed by the request trailers, and Envoy waits for this reply
            # before it sends them: route now.
            self.request_tail = not body.end_of_stream
            return await self._body_complete(trailers_follow=self.request_tail)
        if not body.end_of_stream:
            return _NO_REPLY
        return await self._body_complete(trailers_follow=False)

    async def _request_trailers(self) -> Replies:
        if self.phase is not Phase.REQUEST_BODY:
            if not self.request_tail:
                self._protocol_error(f"request trailers in phase {self.phase.value}")
            self.request_tail = False  # the trailers end the request
            return [m.CONTINUE_REQUEST_TRAILERS]
        # Trailers end the request: the body is complete.
        replies = await self._body_complete(trailers_follow=True)
        replies.append(m.CONTINUE_REQUEST_TRAILERS)
        return replies

    async def _body_complete(self, trailers_follow: bool) -> Replies:
        self.body_ended_at = time.perf_counter()
        body = bytes(self.body)
        self.body.clear()
        decision = await self._route(body)
        if self.request_body_mode in (m.BUFFERED, m.BUFFERED_PARTIAL):
            changed = decision.body_changed
            return [
                m.request_body_decision(
                    decision.destinations,
                    self._headers_to_remove(decision),
                    self._headers_to_set(decision, len(decision.body) if changed else None),
                    decision.body if changed else None,
                )
            ]
        return [
            self._headers_decision(decision),
            *m.streamed_body("request_body", decision.body, end_of_stream=not trailers_follow),
        ]

    async def _route(self, body: bytes, body_seen: bool = True) -> Decision:
        request = parse_request(
            request_id=self.request_id,
            method=self.headers.get(":method", ""),
            path=self.headers.get(":path", ""),
            headers=self.headers,
            body=body,
            body_seen=body_seen,
        )
        decision = await self.director.pick_endpoint(
            request, self.subset, on_wait=self.on_wait, reports_first_chunk=not self.lean
        )
        self.decision = decision
        self.phase = Phase.RESPONSE_HEADERS
        if self.lean:
            # From the pick, not from the end of this stream: Envoy's access-log entry
            # travels on another stream and may be read before this one's end.
            self.tracker.wait(self.request_id, decision)
        self.telemetry.routed.inc()
        self.telemetry.request_processing_duration.observe(time.perf_counter() - self.body_ended_at)
        self._log_decision(request, decision)
        return decision

    def _headers_decision(self, decision: Decision) -> pb.ProcessingResponse:
        return m.request_headers_decision(
            decision.destinations,
            self._headers_to_remove(decision, decision.body_changed),
            self._headers_to_set(decision, None),
        )

    def _headers_to_remove(self, decision: Decision, body_changed: bool = False) -> list[str]:
        remove: list[str] = [h for h in CONTROL_HEADERS if h in self.headers]
        # A client's copy of a header only the EPP sets; one the decision sets is
        # overwritten instead.
        remove += [
            h
            for h in EPP_SET_HEADERS
            if h in self.headers and h not in decision.result.request_headers
        ]
        if body_changed and "content-length" in self.headers:
            remove.append("content-length")
        return remove

    def _headers_to_set(
        self, decision: Decision, content_length: int | None
    ) -> list[tuple[str, str]]:
        out = []
        if self.generated_request_id:
            out.append(("x-request-id", self.request_id))
        if content_length is not None:
            out.append(("content-length", str(content_length)))
        # What the profile handler adds for the endpoint (a disaggregated pick's
        # prefill endpoint, for the decode pod's sidecar).
        out.extend(decision.result.request_headers.items())
        return out

    def _log_decision(self, request: InferenceRequest, decision: Decision) -> None:
        if not log.isEnabledFor(VERBOSE):
            return
        extra: dict[str, object] = {
            "path": request.path,
            "model": request.model,
            "endpoint": decision.endpoint.name,
            "destinations": decision.destinations,
        }
        if self.settings.log_prompts and request.prompt is not None:
            extra["prompt"] = repr(request.prompt)
        log.log(VERBOSE, "routed", extra=extra)

    def _reject(self, error: EppError) -> Replies:
        self.telemetry.requests.labels(error.outcome).inc()
        if self.decision is not None:
            self._finish(completed=False)
        self.phase = Phase.ANSWERED
        log.info("request rejected with %d: %s", error.status, error.message)
        return [m.immediate_response(error)]

    # -- response phase ----------------------------------------------------------

    def _response_headers(self, headers: pb.HttpHeaders) -> Replies:
        if self.phase is not Phase.RESPONSE_HEADERS:
            self._protocol_error(f"response headers in phase {self.phase.value}")
            return [m.CONTINUE_RESPONSE_HEADERS]
        values = m.header_dict(headers.headers)
        try:
            self.status = int(values.get(":status", ""))
        except ValueError:
            self.status = None
        content_type = values.get("content-type", "").lower()
        self.usage = UsageReader(event_stream="text/event-stream" in content_type)
        decision = self.decision
        if headers.end_of_stream:
            self._finish(completed=True)
        else:
            self.phase = Phase.RESPONSE_BODY
        if self.settings.score_header and decision is not None:
            return [m.response_headers_set([(SCORES_HEADER, _scores(decision))])]
        return [m.CONTINUE_RESPONSE_HEADERS]

    def _response_body(self, body: pb.HttpBody) -> Replies:
        if self.phase is not Phase.RESPONSE_BODY:
            self._protocol_error(f"response body in phase {self.phase.value}")
            return self._echo("response_body", body.body, body.end_of_stream)
        assert self.usage is not None
        self.usage.feed(body.body)
        if body.body and self.decision is not None and 200 <= (self.status or 0) < 300:
            # The hooks run once this chunk is on its way to the client.
            self.director.first_chunk(self.decision, defer=True)
        if body.end_of_stream:
            self._finish(completed=True)
        return self._echo("response_body", body.body, body.end_of_stream)

    def _response_trailers(self) -> Replies:
        if self.phase in (Phase.RESPONSE_HEADERS, Phase.RESPONSE_BODY):
            self._finish(completed=True)
        else:
            self._protocol_error(f"response trailers in phase {self.phase.value}")
        return [m.CONTINUE_RESPONSE_TRAILERS]

    def _finish(self, completed: bool) -> None:
        decision = self.decision
        self.phase = Phase.DONE
        if decision is None or decision.finished:
            return
        usage = self.usage.finish() if self.usage is not None else None
        self.director.finish(
            decision,
            ResponseInfo(
                completed=completed,
                status=self.status,
                usage=usage,
                duration_s=self.director.clock() - decision.picked_at,
            ),
        )

    # -- helpers -------------------------------------------------------------------

    def _echo(self, field: str, body: bytes, end_of_stream: bool) -> Replies:
        """Hand a body chunk back unchanged, as the body mode wants it."""
        mode = self.request_body_mode if field == "request_body" else self.response_body_mode
        if mode == m.FULL_DUPLEX_STREAMED:
            return m.streamed_body(field, body, end_of_stream)
        return [m.CONTINUE_REQUEST_BODY if field == "request_body" else m.CONTINUE_RESPONSE_BODY]

    def _pass_through(self, message: pb.ProcessingRequest) -> Replies:
        kind = message.WhichOneof("request")
        if kind == "response_headers":
            return [m.CONTINUE_RESPONSE_HEADERS]
        if kind in ("request_body", "response_body"):
            body = getattr(message, kind)
            return self._echo(kind, body.body, body.end_of_stream)
        if kind == "response_trailers":
            return [m.CONTINUE_RESPONSE_TRAILERS]
        if kind == "request_trailers":
            return [m.CONTINUE_REQUEST_TRAILERS]
        return [m.CONTINUE_REQUEST_HEADERS]

    def _protocol_error(self, what: str) -> None:
        self.telemetry.stream_errors.labels("protocol").inc()
        log.warning("ext_proc protocol violation by the proxy: %s", what)


def _scores(decision: Decision) -> str:
    """`name=total` of the primary profile's candidates, best first, the picked one
    marked with `*`: what `/debug/explain` would have said, for this request."""
    result = decision.result.profiles[decision.result.primary_profile]
    picked = decision.endpoint
    best = sorted(result.scored, key=lambda s: s.score, reverse=True)[:SCORES_HEADER_MAX]
    return ",".join(
        f"{s.endpoint.name}{'*' if s.endpoint is picked else ''}={s.score:.4f}" for s in best
    )
