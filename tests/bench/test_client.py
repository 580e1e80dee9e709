"""bench.client times every request from its scheduled time, not from its send: a
client that falls behind its schedule shows it in TTFT and in its lag, whatever the
arrivals (open loop, the turns of a session, closed loop). Against a small streaming
server in the test's own event loop; the client is made slow by a request body that
blocks the loop while it is built, as a busy client would."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import pytest
from aiohttp import web

from bench.client import Arrivals, Record, RunTiming, drive
from bench.runner import summarize
from bench.workloads import Session, Turn, Workload

# Wall seconds the server waits before the answer's first text chunk.
ANSWER_DELAY = 0.02
MESSAGES = (("user", "hello"),)


@dataclass(frozen=True)
class SlowTurn(Turn):
    """A turn whose request body takes `block_s` wall seconds to build, blocking the
    event loop: the client cannot send anything meanwhile."""

    block_s: float = 0.05

    def body(self, model: str) -> dict[str, Any]:
        time.sleep(self.block_s)
        return super().body(model)


async def _answer(request: web.Request) -> web.StreamResponse:
    await request.read()
    response = web.StreamResponse(
        headers={"content-type": "text/event-stream", "x-sim-pod": "fake-0"}
    )
    await response.prepare(request)
    await response.write(b'data: {"choices":[{"delta":{"role":"assistant"}}]}\n\n')
    await asyncio.sleep(ANSWER_DELAY)
    await response.write(b'data: {"choices":[{"delta":{"content":"hi"}}]}\n\n')
    usage = b'{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1}}'
    await response.write(b"data: " + usage + b"\n\ndata: [DONE]\n\n")
    await response.write_eof()
    return response


@asynccontextmanager
async def server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _answer)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


def workload(sessions: Sequence[Session]) -> Workload:
    return Workload("test", {}, tuple(sessions))


async def run(
    sessions: Sequence[Session], arrivals: Arrivals, time_scale: float = 1.0
) -> tuple[list[Record], RunTiming]:
    async with server() as url:
        return await drive(
            workload(sessions),
            url,
            arrivals,
            model="m",
            time_scale=time_scale,
            seed=0,
            request_timeout_s=30.0,
        )


def lag(record: Record) -> float:
    assert record.sent_s is not None
    return record.sent_s - record.scheduled_s


async def test_open_loop_ttft_counts_from_the_schedule_when_the_client_falls_behind() -> None:
    # Four sessions due at once; building each body blocks the client 50 ms, so the
    # k-th request goes out about 50 ms x k after it was due.
    block = 0.05
    sessions = [Session(i, i, (SlowTurn(MESSAGES, 1, block_s=block),)) for i in range(4)]
    records, _ = await run(sessions, Arrivals("poisson", rate=float("inf")))
    assert [r.session for r in records] == [0, 1, 2, 3]
    assert all(r.ok for r in records), [r.error for r in records]
    for k, record in enumerate(records):
        assert record.scheduled_s == 0.0
        assert lag(record) >= block * (k + 1) - 0.005
        # TTFT from the schedule holds the lag and the answer's own wait.
        assert record.ttft_s is not None
        assert record.e2e_s is not None
        assert record.ttft_s >= lag(record) + ANSWER_DELAY - 0.005
        assert record.e2e_s >= record.ttft_s
    last = records[-1]
    assert last.ttft_s is not None
    # Timed from its send, the last request looked fast: nothing blocked the client
    # any more. Timed from its schedule, it waited the four bodies' 0.2 s as well.
    from_send = last.ttft_s - lag(last)
    assert from_send < 0.1
    assert last.ttft_s >= 4 * block
    assert last.ttft_s > from_send + 0.15


async def test_the_lag_is_reported_in_the_summary() -> None:
    sessions = [Session(i, i, (SlowTurn(MESSAGES, 1, block_s=0.03),)) for i in range(3)]
    records, timing = await run(sessions, Arrivals("poisson", rate=float("inf")))
    result = summarize(records, timing, {}, time_scale=1.0, max_error_rate=0.05)
    lags = sorted(lag(r) for r in records)
    assert result["client_lag_max_s"] == lags[-1] >= 0.085
    assert result["client_lag_p50_s"] == lags[1] >= 0.055
    assert lags[1] <= result["client_lag_p99_s"] <= lags[-1]
    assert result["ttft_p50_s"] >= result["client_lag_p50_s"]


async def test_a_later_turn_is_due_when_the_previous_answer_ended_plus_think_time() -> None:
    # Time scale 0.5: think time 0.1 simulated seconds is 0.05 of wall time, and a
    # 30 ms body is 0.06 simulated seconds of lag.
    scale, think, block = 0.5, 0.1, 0.03
    turns = (
        Turn(MESSAGES, 1),
        SlowTurn(MESSAGES, 1, block_s=block),
        SlowTurn(MESSAGES, 1, block_s=block),
    )
    records, _ = await run([Session(0, 0, turns, think_s=think)], Arrivals("trace"), scale)
    assert [r.turn for r in records] == [0, 1, 2]
    assert all(r.ok for r in records), [r.error for r in records]
    assert records[0].scheduled_s == 0.0
    for previous, record in itertools.pairwise(records):
        assert previous.e2e_s is not None
        answered = previous.scheduled_s + previous.e2e_s
        assert record.scheduled_s == pytest.approx(answered + think, abs=1e-9)
        # The slow body is the client's lag, and it is in the TTFT.
        assert lag(record) >= block / scale - 0.01
        assert record.ttft_s is not None
        assert record.ttft_s >= lag(record) + ANSWER_DELAY / scale - 0.01


async def test_closed_loop_a_session_is_due_when_its_slot_became_free() -> None:
    block = 0.03
    sessions = [Session(i, i, (SlowTurn(MESSAGES, 1, block_s=block),)) for i in range(3)]
    records, _ = await run(sessions, Arrivals("closed", concurrency=1))
    assert [r.session for r in records] == [0, 1, 2]
    assert records[0].scheduled_s == 0.0
    for previous, record in itertools.pairwise(records):
        assert previous.e2e_s is not None
        freed = previous.scheduled_s + previous.e2e_s
        assert record.scheduled_s == pytest.approx(freed, abs=1e-9)
    for record in records:
        assert lag(record) >= block - 0.005
        assert record.ttft_s is not None
        assert record.ttft_s >= lag(record) + ANSWER_DELAY - 0.005


async def test_skipped_turns_are_never_sent() -> None:
    # Nothing listens on this port: the first turn fails, the second is skipped.
    sessions = [Session(0, 0, (Turn(MESSAGES, 1), Turn(MESSAGES, 1)))]
    records, timing = await drive(
        workload(sessions),
        "http://127.0.0.1:9",
        Arrivals("closed", concurrency=1),
        model="m",
        time_scale=1.0,
        seed=0,
        request_timeout_s=5.0,
    )
    failed, skipped = records
    assert not failed.ok
    assert failed.sent_s is not None
    assert skipped.error is not None
    assert skipped.error.startswith("skipped")
    assert skipped.sent_s is None
    assert skipped.scheduled_s >= failed.scheduled_s
    result = summarize(records, timing, {}, time_scale=1.0, max_error_rate=0.05)
    # Only the request that went out has a lag.
    assert result["client_lag_max_s"] == lag(failed)
