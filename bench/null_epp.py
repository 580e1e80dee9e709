"""A null endpoint picker: the protocol floor for the overhead benchmark.

It speaks the same ext_proc protocol as the EPP (the same message helpers, the
same grpc.aio server) but decides nothing: no parsing, no datastore, no plugins;
every request goes to the first upstream. Measured beside the real EPP, it splits
the EPP's cost into what the gRPC protocol costs in Python and what the EPP's own
work adds.

    python -m bench.null_epp --port P --destination IP:PORT --ready-port Q
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import AsyncIterator

import grpc
from aiohttp import web

from epp._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from epp._proto.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from epp.extproc import messages as m


class NullProcessor(pb_grpc.ExternalProcessorServicer):
    def __init__(self, destination: str) -> None:
        self.destination = destination

    async def Process(
        self,
        request_iterator: AsyncIterator[pb.ProcessingRequest],
        context: grpc.aio.ServicerContext[pb.ProcessingRequest, pb.ProcessingResponse],
    ) -> AsyncIterator[pb.ProcessingResponse]:
        body = bytearray()
        async for message in request_iterator:
            kind = message.WhichOneof("request")
            if kind == "request_body":
                body += message.request_body.body
                if message.request_body.end_of_stream:
                    yield m.request_headers_decision(self.destination, [])
                    for reply in m.streamed_body("request_body", bytes(body), True):
                        yield reply
            elif kind == "request_headers" and message.request_headers.end_of_stream:
                yield m.request_headers_decision(self.destination, [])
            elif kind == "response_headers":
                yield m.CONTINUE_RESPONSE_HEADERS
            elif kind == "response_body":
                chunk = message.response_body
                for reply in m.streamed_body("response_body", chunk.body, chunk.end_of_stream):
                    yield reply
            elif kind == "response_trailers":
                yield m.CONTINUE_RESPONSE_TRAILERS
            elif kind == "request_trailers":
                yield m.CONTINUE_REQUEST_TRAILERS


async def serve(port: int, destination: str, ready_port: int) -> None:
    server = grpc.aio.server()
    pb_grpc.add_ExternalProcessorServicer_to_server(NullProcessor(destination), server)  # type: ignore[no-untyped-call]
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    app = web.Application()

    async def ready(request: web.Request) -> web.Response:
        return web.Response(text="ready\n")

    app.router.add_get("/readyz", ready)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", ready_port).start()
    await server.wait_for_termination()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--destination", required=True)
    parser.add_argument("--ready-port", type=int, required=True)
    args = parser.parse_args()
    asyncio.run(serve(args.port, args.destination, args.ready_port))


if __name__ == "__main__":
    main()
