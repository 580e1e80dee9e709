"""The ext_proc gRPC service (grpc.aio): one coroutine per stream, one stream per
HTTP request."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from epp._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from epp._proto.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from epp.completion import CompletionTracker
from epp.director import Director
from epp.extproc.stream import RequestStream, StreamSettings
from epp.telemetry import Telemetry

log = logging.getLogger(__name__)

SERVICE_NAME = "envoy.service.ext_proc.v3.ExternalProcessor"


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(
        self,
        director: Director,
        settings: StreamSettings,
        telemetry: Telemetry,
        tracker: CompletionTracker,
    ) -> None:
        self.director = director
        self.settings = settings
        self.telemetry = telemetry
        self.tracker = tracker

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        stream = RequestStream(self.director, self.settings, self.telemetry, self.tracker)
        try:
            async for message in request_iterator:
                for reply in await stream.handle(message):
                    yield reply
        finally:
            # Runs on normal end, on cancellation by Envoy and on a broken stream:
            # a routed request that did not finish releases its in-flight slot (or,
            # in lean mode, leaves that to the access log).
            stream.close()


def add_to_server(server: grpc.aio.Server, processor: ExternalProcessor) -> None:
    pb_grpc.add_ExternalProcessorServicer_to_server(processor, server)  # type: ignore[no-untyped-call]
