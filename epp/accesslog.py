"""Envoy's gRPC access-log service (`envoy.service.accesslog.v3.AccessLogService`):
how the EPP learns in lean mode that a request it routed has ended.

Envoy opens one stream per worker thread and log configuration, the first time it
flushes entries; the first message carries an identifier (node and log name), every
message a batch of HTTP entries, one per finished request. Envoy expects no reply
while the stream lasts.

The stream is served on the ext_proc port (the same grpc.aio server), so Envoy's
`epp` cluster serves both. It never ends by itself: at shutdown `stop` ends it, so
the server's grace period is spent on ext_proc streams, not on this one.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Final

import grpc

from epp._proto.envoy.data.accesslog.v3 import accesslog_pb2 as data
from epp._proto.envoy.service.accesslog.v3 import als_pb2 as als
from epp._proto.envoy.service.accesslog.v3 import als_pb2_grpc as als_grpc
from epp.completion import CompletionTracker
from epp.telemetry import Telemetry

log = logging.getLogger(__name__)

# The end of a downstream request; NotSet is what Envoys before the type existed send.
_FINAL_TYPES: Final = frozenset({data.AccessLogType.DownstreamEnd, data.AccessLogType.NotSet})


class AccessLogService(als_grpc.AccessLogServiceServicer):
    def __init__(self, tracker: CompletionTracker, telemetry: Telemetry) -> None:
        self.tracker = tracker
        self._ended = telemetry.access_log_entries.labels("ended")
        self._unknown = telemetry.access_log_entries.labels("unknown")
        self._not_final = telemetry.access_log_entries.labels("not_final")
        self._streams = telemetry.access_log_streams
        self._stopping = asyncio.Event()

    async def StreamAccessLogs(
        self,
        request_iterator: AsyncIterator[als.StreamAccessLogsMessage],
        context: grpc.aio.ServicerContext[
            als.StreamAccessLogsMessage, als.StreamAccessLogsResponse
        ],
    ) -> als.StreamAccessLogsResponse:
        self.tracker.connected()
        self._streams.inc()
        peer = context.peer()
        stopping = asyncio.ensure_future(self._stopping.wait())
        try:
            while True:
                # Read through the context (not the iterator) so that `stop` can end
                # a stream that is waiting for Envoy's next batch.
                read = asyncio.ensure_future(context.read())
                await asyncio.wait((read, stopping), return_when=asyncio.FIRST_COMPLETED)
                if not read.done():
                    read.cancel()
                    break
                message = read.result()
                if message is grpc.aio.EOF:
                    break
                if message.HasField("identifier"):
                    identifier = message.identifier
                    log.info(
                        "access log stream from %s: node %r, cluster %r, log %r",
                        peer,
                        identifier.node.id,
                        identifier.node.cluster,
                        identifier.log_name,
                    )
                for entry in message.http_logs.log_entry:
                    self._entry(entry)
        finally:
            stopping.cancel()
        log.debug("access log stream from %s ended", peer)
        return als.StreamAccessLogsResponse()

    def _entry(self, entry: data.HTTPAccessLogEntry) -> None:
        common = entry.common_properties
        if common.access_log_type not in _FINAL_TYPES:
            self._not_final.inc()
            return
        response = entry.response
        status = response.response_code.value if response.HasField("response_code") else None
        duration_s = None
        if common.HasField("duration"):
            # From the end of the request (about when the pick was made) to the end
            # of the stream.
            end, start = common.duration, common.time_to_last_rx_byte
            duration_s = max(0.0, end.seconds - start.seconds + (end.nanos - start.nanos) / 1e9)
        ended = self.tracker.complete(
            entry.request.request_id,
            status=status,
            # Envoy notes the last byte sent to the client only when the whole
            # response went out (a client gone mid-response leaves it unset).
            completed=common.HasField("time_to_last_downstream_tx_byte"),
            duration_s=duration_s,
        )
        (self._ended if ended else self._unknown).inc()

    def stop(self) -> None:
        """End every open stream (at shutdown)."""
        self._stopping.set()


def add_to_server(server: grpc.aio.Server, service: AccessLogService) -> None:
    als_grpc.add_AccessLogServiceServicer_to_server(service, server)  # type: ignore[no-untyped-call]
