"""A grpc.aio client that plays Envoy's gRPC access logger against the EPP.

Messages are built the way Envoy 1.40 sends them (seen with the real Envoy and
manifests/envoy/envoy-lean.yaml): one stream per worker, opened at the first flush;
the first message carries the identifier (node, log name) and the first batch;
every entry has `access_log_type: DownstreamEnd`, the request's x-request-id, the
response code when a response was sent, and timing offsets, the last byte to the
client only when the whole response went out.
"""

from __future__ import annotations

import grpc
from google.protobuf import duration_pb2, wrappers_pb2

from epp._proto.envoy.config.core.v3 import base_pb2 as core
from epp._proto.envoy.data.accesslog.v3 import accesslog_pb2 as data
from epp._proto.envoy.service.accesslog.v3 import als_pb2 as als
from epp._proto.envoy.service.accesslog.v3 import als_pb2_grpc as als_grpc

LOG_NAME = "epp-lean"


def _seconds(value: float) -> duration_pb2.Duration:
    duration = duration_pb2.Duration()
    duration.FromNanoseconds(round(value * 1e9))
    return duration


def entry(
    request_id: str,
    status: int | None = 200,
    *,
    whole: bool = True,
    log_type: int = data.AccessLogType.DownstreamEnd,
    rx_s: float = 0.001,
    duration_s: float = 0.5,
) -> data.HTTPAccessLogEntry:
    """One HTTP entry: `whole` = the response went out to its last byte."""
    common = data.AccessLogCommon(
        time_to_last_rx_byte=_seconds(rx_s),
        duration=_seconds(duration_s),
        access_log_type=log_type,  # type: ignore[arg-type]
    )
    if whole:
        common.time_to_last_downstream_tx_byte.CopyFrom(_seconds(duration_s))
    log_entry = data.HTTPAccessLogEntry(
        common_properties=common, request=data.HTTPRequestProperties(request_id=request_id)
    )
    if status is not None:
        log_entry.response.response_code.CopyFrom(wrappers_pb2.UInt32Value(value=status))
    return log_entry


class AccessLogStream:
    """One AccessLogService/StreamAccessLogs call."""

    def __init__(self, channel: grpc.aio.Channel, node_id: str = "envoy-test") -> None:
        stub = als_grpc.AccessLogServiceStub(channel)  # type: ignore[no-untyped-call]
        self.call = stub.StreamAccessLogs()
        self.node_id = node_id
        self.identified = False

    async def send(self, *entries: data.HTTPAccessLogEntry) -> None:
        """One batch; the identifier rides on the first message, as Envoy does it."""
        message = als.StreamAccessLogsMessage()
        if not self.identified:
            message.identifier.CopyFrom(
                als.StreamAccessLogsMessage.Identifier(
                    node=core.Node(id=self.node_id, cluster="test"), log_name=LOG_NAME
                )
            )
            self.identified = True
        message.http_logs.log_entry.extend(entries)
        await self.call.write(message)

    async def close(self) -> als.StreamAccessLogsResponse:
        """Half-close; the server's reply."""
        await self.call.done_writing()
        response: als.StreamAccessLogsResponse = await self.call
        return response

    def cancel(self) -> None:
        self.call.cancel()
