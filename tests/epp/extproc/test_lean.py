"""Lean mode over real gRPC: Envoy announces response_body_mode NONE and ends the
ext_proc stream once the request is routed; the request stays in flight until its
access-log entry arrives on the AccessLogService of the same server."""

from __future__ import annotations

import json

import grpc

from epp._proto.envoy.data.accesslog.v3 import accesslog_pb2 as data
from tests.epp.conftest import Epp, StartEpp
from tests.epp.extproc import envoy_client as ec
from tests.epp.extproc.als_client import AccessLogStream, entry
from tests.epp.extproc.sample_plugins import MODULE, config

BODY = json.dumps({"model": "m", "prompt": "hello", "stream": True}).encode()
RECORDER_CONFIG = config(("recorder", f"{MODULE}:Recorder"))


async def lean_request(epp: Epp, request_id: str) -> ec.Routed:
    """One lean request through its whole ext_proc stream, as Envoy runs it with
    envoy-lean.yaml: routed, the body handed back, then the stream half-closed."""
    stream = epp.stream()
    routed = await ec.route(stream, BODY, request_id=request_id, response_body_mode=ec.NONE)
    assert routed.destination in epp.addresses
    assert routed.body == BODY
    assert await stream.close() == grpc.StatusCode.OK
    return routed


async def connect_access_log(epp: Epp) -> AccessLogStream:
    """An access-log stream the EPP has seen open (Envoy's first batch)."""
    before = await epp.metric("epp_access_log_streams_total")
    log = epp.access_log()
    await log.send()
    assert await epp.wait_metric("epp_access_log_streams_total", None, before + 1) == before + 1
    return log


async def entries_seen(epp: Epp, result: str, expected: float) -> float:
    return await epp.wait_metric("epp_access_log_entries_total", {"result": result}, expected)


async def lean_ends(epp: Epp, how: str) -> float:
    return await epp.metric("epp_lean_request_ends_total", {"how": how})


async def test_a_lean_request_is_in_flight_until_its_access_log_entry(
    start_epp: StartEpp,
) -> None:
    epp = await start_epp(config_text=RECORDER_CONFIG)
    log = await connect_access_log(epp)
    await lean_request(epp, "lean-1")
    # The stream has ended, the response has not: still in flight.
    assert await epp.total_in_flight() == 1
    assert epp.plugin("recorder").for_request("lean-1") == []
    assert await epp.metric("epp_lean_waiting_requests") == 1

    await log.send(entry("lean-1", 200, duration_s=2.0, rx_s=0.5))
    assert await epp.wait_in_flight(0) == 0
    (info,) = epp.plugin("recorder").for_request("lean-1")
    assert info.completed
    assert info.status == 200
    assert info.usage is None
    assert info.duration_s == 1.5
    assert await lean_ends(epp, "access_log") == 1
    assert await epp.metric("epp_responses_total", {"result": "completed"}) == 1
    assert await epp.metric("epp_lean_waiting_requests") == 0
    await log.close()


async def test_unknown_ids_and_entries_that_are_not_the_end_are_ignored(epp: Epp) -> None:
    log = await connect_access_log(epp)
    await lean_request(epp, "mine")
    await log.send(
        entry("not-routed-here", 200),
        entry("mine", 200, log_type=data.AccessLogType.DownstreamPeriodic),
        entry("", 400),
    )
    assert await entries_seen(epp, "unknown", 2) == 2
    assert await entries_seen(epp, "not_final", 1) == 1
    assert await epp.total_in_flight() == 1
    await log.send(entry("mine", 200))
    assert await epp.wait_in_flight(0) == 0
    assert await entries_seen(epp, "ended", 1) == 1
    await log.close()


async def test_an_entry_for_a_response_cut_short_ends_the_request_as_aborted(
    start_epp: StartEpp,
) -> None:
    epp = await start_epp(config_text=RECORDER_CONFIG)
    log = await connect_access_log(epp)
    await lean_request(epp, "cut")
    await log.send(entry("cut", 200, whole=False))
    assert await epp.wait_in_flight(0) == 0
    (info,) = epp.plugin("recorder").for_request("cut")
    assert not info.completed
    assert info.status == 200
    await log.close()


async def test_an_entry_read_before_the_stream_end_still_ends_the_request_once(
    start_epp: StartEpp,
) -> None:
    # The entry travels on another stream: nothing orders it after this one's end.
    epp = await start_epp(config_text=RECORDER_CONFIG)
    log = await connect_access_log(epp)
    stream = epp.stream()
    await ec.route(stream, BODY, request_id="early", response_body_mode=ec.NONE)
    await log.send(entry("early", 200))
    assert await epp.wait_in_flight(0) == 0
    assert await stream.close() == grpc.StatusCode.OK
    assert await epp.total_in_flight() == 0
    assert len(epp.plugin("recorder").for_request("early")) == 1
    await log.close()


async def test_a_lean_header_only_request_cancelled_by_envoy_waits_for_its_entry(
    epp: Epp,
) -> None:
    # Envoy cancels (rather than half-closes) the stream of a header-only request.
    log = await connect_access_log(epp)
    stream = epp.stream()
    await stream.send(
        ec.request_headers(
            "/v1/models",
            method="GET",
            content_type=None,
            end_of_stream=True,
            request_id="get-1",
            response_body_mode=ec.NONE,
        )
    )
    reply = await stream.expect()
    assert reply.destination in epp.addresses
    stream.cancel()
    await log.send(entry("someone-else", 200))
    assert await entries_seen(epp, "unknown", 1) == 1
    assert await epp.total_in_flight() == 1
    await log.send(entry("get-1", 200))
    assert await epp.wait_in_flight(0) == 0
    await log.close()


async def test_response_headers_without_the_body_also_wait_for_the_entry(epp: Epp) -> None:
    # A lean variant that still shows the response headers: the body never comes.
    log = await connect_access_log(epp)
    stream = epp.stream()
    await ec.route(stream, BODY, request_id="headers-only", response_body_mode=ec.NONE)
    await stream.send(ec.response_headers(200, "text/event-stream"))
    assert (await stream.expect()).is_continue
    assert await stream.close() == grpc.StatusCode.OK
    assert await epp.total_in_flight() == 1
    await log.send(entry("headers-only", 200))
    assert await epp.wait_in_flight(0) == 0
    await log.close()


async def test_a_request_whose_entry_never_comes_is_ended_as_aborted_after_the_timeout(
    start_epp: StartEpp,
) -> None:
    epp = await start_epp(config_text=RECORDER_CONFIG, lean_completion_timeout_s=0.2)
    log = await connect_access_log(epp)
    await lean_request(epp, "lost")
    assert await epp.wait_in_flight(0) == 0
    (info,) = epp.plugin("recorder").for_request("lost")
    assert not info.completed
    assert await lean_ends(epp, "timeout") == 1
    # The entry, late, changes nothing.
    await log.send(entry("lost", 200))
    assert await entries_seen(epp, "unknown", 1) == 1
    assert len(epp.plugin("recorder").for_request("lost")) == 1
    await log.close()


async def test_without_any_access_log_the_stream_end_ends_a_lean_request(
    start_epp: StartEpp,
) -> None:
    epp = await start_epp(config_text=RECORDER_CONFIG)
    await lean_request(epp, "no-log")
    assert await epp.wait_in_flight(0) == 0
    (info,) = epp.plugin("recorder").for_request("no-log")
    assert info.completed
    assert await lean_ends(epp, "stream_end") == 1


async def test_gie_streams_ending_early_still_abort_with_an_access_log_connected(
    start_epp: StartEpp,
) -> None:
    # The full-duplex protocol is unchanged: a routed request whose stream ends
    # before the response did was aborted, whatever the access log says later.
    epp = await start_epp(config_text=RECORDER_CONFIG)
    log = await connect_access_log(epp)
    stream = epp.stream()
    await ec.route(stream, BODY, request_id="gie")
    assert await epp.total_in_flight() == 1
    stream.cancel()
    assert await epp.wait_in_flight(0) == 0
    (info,) = epp.plugin("recorder").for_request("gie")
    assert not info.completed
    await log.send(entry("gie", 200))
    assert await entries_seen(epp, "unknown", 1) == 1
    assert len(epp.plugin("recorder").for_request("gie")) == 1
    await log.close()


async def test_gie_and_lean_streams_share_one_epp(epp: Epp) -> None:
    log = await connect_access_log(epp)
    await lean_request(epp, "lean")
    stream = epp.stream()
    await ec.route(stream, BODY, request_id="gie")
    assert await epp.total_in_flight() == 2
    await ec.respond(stream, [b"data: [DONE]\n\n"], content_type="text/event-stream")
    assert await stream.close() == grpc.StatusCode.OK
    assert await epp.wait_in_flight(1) == 1
    await log.send(entry("lean", 200))
    assert await epp.wait_in_flight(0) == 0
    await log.close()


async def test_stopping_the_service_ends_open_access_log_streams(epp: Epp) -> None:
    log = await connect_access_log(epp)
    epp.app.access_log.stop()
    # The server answers without Envoy closing its side.
    response = await log.call
    assert response.ByteSize() == 0
    assert await log.call.code() == grpc.StatusCode.OK
