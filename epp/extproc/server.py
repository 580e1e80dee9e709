"""The ext_proc gRPC service (grpc.aio): one coroutine per stream, one stream per
HTTP request.

Reading Envoy's messages. The stream's coroutine reads one message, hands it to
its `RequestStream`, sends the replies, and only then reads the next: while a
message is handled nothing reads the stream. One exception, while a request waits
in flow control's queue (the controller's `admit` says when, through `on_wait`):
then one read runs ahead, in a task of its own, so that the EPP sees Envoy end the
stream while the request waits. Envoy's graceful close (the runtime flag
`ext_proc_graceful_grpc_close`, on in the shipped configs) first half-closes the
stream when the client hangs up, and resets it only after its remote close
timeout (1 s); a half-close is only seen by a read. So:

- the read ahead ends with the end of the stream while the request still waits:
  the client is gone. The waiting coroutine is cancelled (the request leaves its
  queue at once, counted `cancelled`), nothing is answered, and the RPC ends with
  status OK, which is what Envoy's graceful close waits for;
- it brings a message instead: the message is kept, and handed to the stream
  after the current one, in order. No other read starts before then (Envoy is
  held back by gRPC's flow control as before; a client leaving after that is
  seen at Envoy's reset);
- the wait ends first (the request is dispatched and routed): the read ahead is
  simply the next read, as it would have been;
- the stream is over once the request leaves the queue (shed at its TTL, or its
  pick failed): the EPP waits for that read to end (Envoy half-closes once it has
  the ImmediateResponse) before it ends the RPC, so no read is pending when the
  status goes (below), for at most `_READ_AHEAD_END_WAIT_S`.

Requests that do not wait (flow control off, or dispatched at once) read exactly
as before: one read at a time, from the stream's own coroutine, never while a
message is handled. That matters for memory: a reset that meets a pending read
makes grpc.aio (up to 1.85 at least) leak the read's operation array
(docs/reliability.md, "Ending ext_proc streams").
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from typing import Final

import grpc

from epp import defaults
from epp._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from epp._proto.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from epp.completion import CompletionTracker
from epp.director import Director
from epp.errors import Overloaded
from epp.extproc import messages as m
from epp.extproc.stream import RequestStream, StreamSettings
from epp.telemetry import Telemetry

log = logging.getLogger(__name__)

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"


# At most one warning per this many seconds about refused streams: under overload
# a line per request would add to the load.
_OVERLOAD_WARNING_INTERVAL_S = 10.0


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(
        self,
        director: Director,
        settings: StreamSettings,
        telemetry: Telemetry,
        tracker: CompletionTracker,
        max_streams: int = defaults.MAX_CONCURRENT_STREAMS,
    ) -> None:
        """`max_streams`: streams served at once (0: no limit); see `Process`."""
        self.director = director
        self.settings = settings
        self.telemetry = telemetry
        self.tracker = tracker
        # Reads running ahead (see the module docstring), kept alive until they end:
        # asyncio holds tasks weakly, and such a read may outlive its stream's
        # coroutine.
        self.reads_ahead: set[asyncio.Task[pb.ProcessingRequest | None]] = set()
        self.max_streams = max_streams
        self.active = 0
        self.refused = 0
        self._refused_logged = 0
        self._warned_at: float | None = None
        telemetry.extproc_streams.set_function(lambda: self.active)

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        if self.max_streams and self.active >= self.max_streams:
            # Over the limit: the request is answered 503 with an ImmediateResponse to
            # its first message, rather than the stream refused with a gRPC status.
            # Envoy acts on an ImmediateResponse the same way whatever its
            # failure_mode_allow, so the client always gets a clear 503 with a JSON
            # body. A gRPC error would leave it to Envoy: a bare 500 under FailClose
            # (and under FailOpen with FULL_DUPLEX_STREAMED bodies, where Envoy does
            # not fail open), or, where it fails open, the request passed on without
            # a destination, which the standalone Envoy's ORIGINAL_DST route cannot
            # send anywhere useful.
            async for _first in request_iterator:
                yield self._refuse()
                break
            return
        self.active += 1
        messages = _Messages(request_iterator, self.reads_ahead)
        stream = RequestStream(
            self.director, self.settings, self.telemetry, self.tracker, on_wait=messages.read_ahead
        )
        try:
            while (message := await messages.next()) is not None:
                messages.handling = True
                try:
                    replies = await stream.handle(message)
                except asyncio.CancelledError:
                    if messages.client_gone():
                        # Envoy half-closed the stream while the request waited
                        # in flow control: the client hung up. The wait was
                        # cancelled (the request left its queue); end the RPC.
                        return
                    raise
                finally:
                    messages.handling = False
                for reply in replies:
                    yield reply
                if stream.over:
                    # End the RPC here rather than wait for Envoy to: Envoy ends a
                    # stream it still holds open with a half-close and a reset,
                    # and a reset that meets a pending read makes grpc.aio (up to
                    # 1.85 at least) leak the read's operation array, and then the
                    # status it sends on the cancelled call: about 110 bytes a
                    # request of native memory that is never freed. (Only a read
                    # started while the request waited can be pending here: let
                    # it end first, see the module's docstring.)
                    await messages.settle()
                    return
        finally:
            self.active -= 1
            # Runs on normal end, on cancellation by Envoy and on a broken stream:
            # a routed request that did not finish releases its in-flight slot (or,
            # in lean mode, leaves that to the access log).
            stream.close()

    def _refuse(self) -> pb.ProcessingResponse:
        error = Overloaded(
            f"the endpoint picker is at its limit of {self.max_streams} concurrent requests"
            " (--max-concurrent-streams); retry later"
        )
        self.telemetry.requests.labels(error.outcome).inc()
        self.refused += 1
        now = time.monotonic()
        if self._warned_at is None or now - self._warned_at >= _OVERLOAD_WARNING_INTERVAL_S:
            log.warning(
                "%d requests refused with 503: %d ext_proc streams open, the limit of"
                " --max-concurrent-streams",
                self.refused - self._refused_logged,
                self.active,
            )
            self._warned_at = now
            self._refused_logged = self.refused
        return m.immediate_response(error)


# How long a stream that is over waits for a read started while its request was
# queued to end before the RPC ends anyway: above Envoy's remote close timeout
# (1 s), though Envoy half-closes within milliseconds of the EPP's answer.
_READ_AHEAD_END_WAIT_S: Final = 2.0


class _Messages:
    """Envoy's messages on one stream, in order; None at the stream's end.

    `next` reads as `async for` would, from the stream's own coroutine. While the
    request waits in flow control, `read_ahead` starts one read in a task of its
    own; `next` returns its result first. See the module's docstring."""

    __slots__ = ("_ahead", "_gone", "_iterator", "_reads_ahead", "_task", "handling")

    def __init__(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        reads_ahead: set[asyncio.Task[pb.ProcessingRequest | None]],
    ) -> None:
        self._iterator = aiter(request_iterator)
        self._reads_ahead = reads_ahead  # the server's: keeps a read alive until it ends
        self._ahead: asyncio.Task[pb.ProcessingRequest | None] | None = None
        self._task: asyncio.Task[object] | None = None  # the stream's coroutine's task
        self.handling = False  # a message is being handled: the server sets it
        self._gone = False  # the stream ended while the request waited: its task cancelled

    async def next(self) -> pb.ProcessingRequest | None:
        ahead = self._ahead
        if ahead is not None:
            self._ahead = None
            return await ahead
        try:
            return await anext(self._iterator)
        except StopAsyncIteration:
            return None

    async def _read(self) -> pb.ProcessingRequest | None:
        try:
            return await anext(self._iterator)
        except StopAsyncIteration:
            return None

    def read_ahead(self) -> None:
        """The request is about to wait in flow control (called from the stream's
        task, inside `handle`): read the stream meanwhile."""
        if self._ahead is not None or not self.handling:
            return
        self._task = asyncio.current_task()
        ahead = self._ahead = asyncio.get_running_loop().create_task(self._read())
        self._reads_ahead.add(ahead)
        ahead.add_done_callback(self._ahead_done)

    def _ahead_done(self, ahead: asyncio.Task[pb.ProcessingRequest | None]) -> None:
        self._reads_ahead.discard(ahead)
        # A message waits for `next`, and so does an error (`exception()` marks it
        # retrieved, so nothing is logged if the stream ends before `next`).
        if ahead.cancelled() or ahead.exception() is not None or ahead.result() is not None:
            return
        # The end of the stream. While the message is still being handled (the
        # request waits, or is being picked) the stream's task is suspended inside
        # `handle`, so the cancellation lands there; once `handle` has returned,
        # `next` returns the end as any read would.
        if self.handling and self._task is not None and not self._task.done():
            self._gone = True
            self._task.cancel()

    def client_gone(self) -> bool:
        """Whether a cancellation of the stream's task is this class's own (the
        stream ended while the request waited), and nothing else cancelled it
        too; consumes the cancellation."""
        if not self._gone or self._task is None:
            return False
        self._gone = False
        return self._task.uncancel() == 0

    async def settle(self) -> None:
        """Let a read still running ahead end (Envoy half-closes a stream it no
        longer wants), for at most `_READ_AHEAD_END_WAIT_S`."""
        ahead = self._ahead
        if ahead is not None and not ahead.done():
            await asyncio.wait((ahead,), timeout=_READ_AHEAD_END_WAIT_S)


def add_to_server(server: grpc.aio.Server, processor: ExternalProcessor) -> None:
    pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)  # type: ignore[no-untyped-call]
