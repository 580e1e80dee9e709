"""The ext_proc gRPC service (grpc.aio): one coroutine per stream, one stream per
HTTP request."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

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
        stream = RequestStream(self.director, self.settings, self.telemetry, self.tracker)
        try:
            async for message in request_iterator:
                for reply in await stream.handle(message):
                    yield reply
                if stream.over:
                    # End the RPC here rather than wait for Envoy to: Envoy ends a
                    # stream it still holds open with a half-close and a reset,
                    # and a reset that meets a pending read makes grpc.aio (up to
                    # 1.85 at least) leak the read's operation array, and then the
                    # status it sends on the cancelled call: about 110 bytes a
                    # request of native memory that is never freed.
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


def add_to_server(server: grpc.aio.Server, processor: ExternalProcessor) -> None:
    pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)  # type: ignore[no-untyped-call]
