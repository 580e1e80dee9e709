"""bench.client sends each request's own headers (the tenants workload's objective and
fairness id), records a 429/503 the router answered itself as shed (never retried,
not a failure), reads when Envoy let a request go, and the runner checks that served
+ shed + failed add up to the requests sent. Against a real aiohttp server in the
test's own event loop that answers as the EPP and Envoy would."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from bench.client import (
    DROPPED_REASON_HEADER,
    ROUTED_HEADER,
    Arrivals,
    Record,
    RunTiming,
    drive,
    is_shed,
    shed_reason,
)
from bench.runner import check_accounted, summarize
from bench.workloads import FAIRNESS_ID_HEADER, OBJECTIVE_HEADER, Session, Turn, Workload

MESSAGES = (("user", "hello"),)
# What the test server does with a request, by its `x-test-answer` header.
ANSWER = "x-test-answer"
# The headers of every request the server received.
SEEN = web.AppKey("seen", list[dict[str, str]])


async def _answer(request: web.Request) -> web.StreamResponse:
    """Answers as flow control (429 with its dropped reason), as the EPP's other
    refusals (503, JSON), as Envoy's own local reply (503, plain text), or serves."""
    request.app[SEEN].append({k.lower(): v for k, v in request.headers.items()})
    await request.read()
    kind = request.headers.get(ANSWER, "serve")
    if kind == "ttl":
        body = {"error": {"message": "waited 30s", "type": "rate_limit_error", "code": 429}}
        return web.json_response(
            body,
            status=429,
            headers={"retry-after": "1", DROPPED_REASON_HEADER: "rejected-ttl-expired"},
        )
    if kind == "no-endpoint":
        body = {"error": {"message": "no endpoint", "type": "service_unavailable", "code": 503}}
        return web.json_response(body, status=503)
    if kind == "envoy":
        return web.Response(status=503, text="no healthy upstream", content_type="text/plain")
    response = web.StreamResponse(
        headers={"content-type": "text/event-stream", ROUTED_HEADER: "250000"}
    )
    await response.prepare(request)
    await response.write(b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n')
    usage = b'{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}'
    await response.write(b"data: " + usage + b"\n\ndata: [DONE]\n\n")
    await response.write_eof()
    return response


@asynccontextmanager
async def server() -> AsyncIterator[tuple[str, list[dict[str, str]]]]:
    app = web.Application()
    app[SEEN] = []
    app.router.add_post("/v1/chat/completions", _answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", app[SEEN]
    finally:
        await runner.cleanup()


def _session(i: int, *headers: tuple[str, str]) -> Session:
    return Session(i, 0, (Turn(MESSAGES, 1, tuple(headers)),), arrival_s=0.01 * i)


async def _drive(
    sessions: list[Session], scale: float = 1.0
) -> tuple[list[Record], list[dict[str, str]]]:
    async with server() as (url, seen):
        records, _ = await drive(
            Workload("test", {}, tuple(sessions)),
            url,
            Arrivals("trace"),
            model="m",
            time_scale=scale,
            seed=0,
            request_timeout_s=30.0,
        )
        return records, seen


async def test_each_request_carries_its_own_headers() -> None:
    sessions = [
        _session(0, (FAIRNESS_ID_HEADER, "steady"), (OBJECTIVE_HEADER, "critical")),
        _session(1, (FAIRNESS_ID_HEADER, "bursty"), (OBJECTIVE_HEADER, "batch")),
        _session(2),
    ]
    records, seen = await _drive(sessions)
    assert all(r.ok for r in records), [r.error for r in records]
    assert len(seen) == 3
    by_tenant = {h.get(FAIRNESS_ID_HEADER): h for h in seen}
    assert by_tenant["steady"][OBJECTIVE_HEADER] == "critical"
    assert by_tenant["bursty"][OBJECTIVE_HEADER] == "batch"
    # A turn without headers sends none of them; the body is still JSON.
    assert OBJECTIVE_HEADER not in by_tenant[None]
    assert all(h["content-type"] == "application/json" for h in seen)


async def test_the_routers_429_and_503_are_shed_once_envoys_503_is_a_failure() -> None:
    sessions = [
        _session(0, (ANSWER, "ttl")),
        _session(1, (ANSWER, "no-endpoint")),
        _session(2, (ANSWER, "envoy")),
        _session(3),
    ]
    records, seen = await _drive(sessions)
    # Each request went out once: nothing is retried.
    assert len(seen) == 4
    ttl, no_endpoint, envoy, served = records
    assert ttl.error == "shed: 429 rejected-ttl-expired"
    assert ttl.status == 429
    assert no_endpoint.error == "shed: 503 service_unavailable"
    assert [is_shed(r) for r in records] == [True, True, False, False]
    assert envoy.error is not None
    assert envoy.error.startswith("http 503: no healthy upstream")
    assert served.ok
    result = summarize(records, _timing(records), {}, time_scale=1.0, max_error_rate=0.5)
    assert (result["ok_requests"], result["shed"], result["errors"]) == (1, 2, 1)
    assert result["shed_kinds"] == {"429 rejected-ttl-expired": 1, "503 service_unavailable": 1}
    assert result["error_kinds"] == {"http 503": 1}
    # One failure in four: "errors"; the shed ones do not count against the run.
    assert result["status"] == "errors"
    check_accounted(records, 4)


async def test_only_shed_requests_leave_the_run_ok() -> None:
    records, _ = await _drive([_session(0, (ANSWER, "ttl")), _session(1)])
    result = summarize(records, _timing(records), {}, time_scale=1.0, max_error_rate=0.05)
    assert (result["errors"], result["shed"], result["status"]) == (0, 1, "ok")


async def test_when_envoy_let_the_request_go_is_read_from_its_header() -> None:
    # The server says 250,000 us: a quarter of a wall second, half a simulated
    # second at time scale 0.5.
    records, _ = await _drive([_session(0)], scale=0.5)
    (record,) = records
    assert record.sent_s is not None
    assert record.routed_s == pytest.approx(record.sent_s + 0.5)


def test_the_accounting_check_finds_a_request_left_hanging() -> None:
    served = Record(0, 0, 0, 0.0, ok=True)
    shed = Record(1, 0, 0, 0.0, error="shed: 429 rejected-saturated")
    check_accounted([served, shed], 2)
    hanging = Record(2, 0, 0, 0.0)  # neither served nor answered
    with pytest.raises(RuntimeError, match=re.escape("1 served + 1 shed + 0 failed")):
        check_accounted([served, shed, hanging], 3)
    with pytest.raises(RuntimeError, match="3 requests sent, 2 records"):
        check_accounted([served, shed], 3)


def test_which_answers_are_the_routers() -> None:
    json_headers = {"content-type": "application/json"}
    body = json.dumps({"error": {"type": "rate_limit_error"}}).encode()
    assert shed_reason(429, {DROPPED_REASON_HEADER: "rejected-saturated"}, b"") == (
        "429 rejected-saturated"
    )
    assert shed_reason(429, json_headers, body) == "429 rate_limit_error"
    assert shed_reason(503, {"content-type": "text/plain"}, b"upstream connect error") is None
    assert shed_reason(500, json_headers, body) is None
    assert shed_reason(503, json_headers, b"not json") is None


def _timing(records: list[Record]) -> RunTiming:
    """A one-second run (the figures tested here do not depend on it)."""
    return RunTiming(0.0, 1.0)
