"""Model servers that hang, behind real Envoy and `epp serve` with the
stale-metrics filter: a /metrics page that never comes, and a pod that accepts
connections and never answers anything (a frozen process: the kernel still
completes the handshakes). The EPP must never hang with them: it keeps routing
other requests, marks the pod stale with the reason in /debug/endpoints, sends it
nothing more, and releases what it counted in flight there once the clients give
up. Both recover when the pod answers again. The frozen pod again under the
built-in default config, which has no filter: the director leaves it out."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from epp.config.defaults import DEFAULT_CONFIG
from tests.integration.faults import (
    MODEL,
    Load,
    Stack,
    debug_endpoints,
    eventually,
    precise_config,
    prompt,
    running,
    send,
    sim_pods,
)

# Tighter than the defaults (1 s scrape timeout, 2 s staleness), so the test is short.
EPP_ARGS = ["--metrics-scrape-timeout", "300ms", "--metrics-staleness-threshold", "1s"]
CLIENT_TIMEOUT_S = 3.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("hanging")
    config = precise_config(filters=("header-based-testing-filter", "stale-metrics-filter"))
    with running(workdir, sim_pods(workdir, 3), config=config, epp_args=EPP_ARGS) as started:
        yield started


async def _entries(session: aiohttp.ClientSession, stack: Stack) -> dict[str, dict[str, Any]]:
    return await debug_endpoints(session, stack)


async def _fresh(session: aiohttp.ClientSession, stack: Stack) -> bool:
    return all(not e["metrics"]["stale"] for e in (await _entries(session, stack)).values())


async def _stale(session: aiohttp.ClientSession, stack: Stack, name: str) -> dict[str, Any] | None:
    entry = (await _entries(session, stack))[name]
    return entry if entry["metrics"]["stale"] else None


async def test_a_metrics_page_that_never_comes(stack: Stack) -> None:
    pod = stack.pods["sim-2"]
    async with aiohttp.ClientSession() as session:
        await eventually(lambda: _fresh(session, stack), "every pod scraped")
        async with session.post(
            f"http://{pod.address}/sim/metrics-delay", json={"seconds": 30}
        ) as response:
            assert response.status == 200
        try:
            entry = await eventually(lambda: _stale(session, stack, "sim-2"), "sim-2 stale")
            reason = str(entry["metrics"]["reason"])
            assert reason.startswith("stale: last good scrape"), reason
            assert "no answer within 0.3s" in reason
            # The other pods stay fresh, and the requests go to them only.
            others = await _entries(session, stack)
            assert not others["sim-0"]["metrics"]["stale"]
            assert not others["sim-1"]["metrics"]["stale"]
            for n in range(12):
                status, served = await send(session, stack.url, prompt(n, n))
                assert status == 200
                assert served != "sim-2"
        finally:
            async with session.post(
                f"http://{pod.address}/sim/metrics-delay", json={"seconds": 0}
            ) as response:
                assert response.status == 200
        await eventually(lambda: _fresh(session, stack), "sim-2 fresh again")


async def test_a_pod_that_accepts_connections_and_never_answers(stack: Stack) -> None:
    frozen = stack.pods["sim-1"]
    async with aiohttp.ClientSession() as session:
        await eventually(lambda: _fresh(session, stack), "every pod scraped")
        load = Load(stack.url, timeout_s=CLIENT_TIMEOUT_S).start()
        await asyncio.sleep(1.0)
        frozen_at = time.monotonic()
        stack.pods.freeze("sim-1")
        try:
            entry = await eventually(lambda: _stale(session, stack, "sim-1"), "sim-1 stale")
            detected = time.monotonic()
            reason = str(entry["metrics"]["reason"])
            assert "no answer within 0.3s" in reason, reason
            # A request that can only go there (the testing header names it) is
            # refused at once once the pod is down, saying why, rather than hang.
            await eventually(lambda: _down(session, stack, "sim-1"), "sim-1 taken as down")
            async with session.post(
                stack.url + "/v1/completions",
                json={"model": MODEL, "prompt": prompt(50, 0), "max_tokens": 4},
                headers={"test-epp-endpoint-selection": frozen.address},
                timeout=aiohttp.ClientTimeout(total=CLIENT_TIMEOUT_S),
            ) as response:
                assert response.status == 429  # no capacity for it, as GIE answers
                message = (await response.json())["error"]["message"]
            assert "down by their metrics scrapes: sim-1" in message, message
            await asyncio.sleep(1.5)
            outcomes = await load.stop()
            # Every request the clients gave up on is no longer counted in flight.
            await eventually(
                lambda: _in_flight(session, stack, 0), "no request left in flight", 15.0
            )
        finally:
            stack.pods.thaw("sim-1")
        await eventually(lambda: _fresh(session, stack), "sim-1 fresh again")
        only_sim1 = {"test-epp-endpoint-selection": frozen.address}
        assert await send(session, stack.url, prompt(51, 0), only_sim1) == (200, "sim-1")

    # Only requests routed there before the EPP knew hang (and time out); every
    # later one succeeds elsewhere.
    hung = [o for o in outcomes if not o.ok]
    assert all(o.started < detected and o.ended > frozen_at for o in hung), hung
    later = [o for o in outcomes if o.started >= detected]
    assert later
    assert all(o.ok and o.pod != "sim-1" for o in later), later


async def _down(session: aiohttp.ClientSession, stack: Stack, name: str) -> bool:
    return bool((await _entries(session, stack))[name]["metrics"]["down"])


async def _in_flight(session: aiohttp.ClientSession, stack: Stack, expected: int) -> bool:
    return sum(e["inFlight"] for e in (await _entries(session, stack)).values()) == expected


async def test_no_config_sends_requests_to_a_hung_pod(tmp_path: Path) -> None:
    # The built-in default has no stale-metrics filter, and a pod holding a prompt
    # group is where that group's requests go: before the director left hung
    # servers out, the frozen pod kept a third of the load, 75 requests hanging
    # there after 6 s, while the model read its queue as drained.
    pods = sim_pods(tmp_path, 3)
    with running(tmp_path, pods, config=DEFAULT_CONFIG, epp_args=EPP_ARGS) as stack:
        async with aiohttp.ClientSession() as session:
            await eventually(lambda: _fresh(session, stack), "every pod scraped")
            load = Load(stack.url, timeout_s=CLIENT_TIMEOUT_S).start()
            await asyncio.sleep(1.0)
            frozen_at = time.monotonic()
            pods.freeze("sim-1")
            try:
                await eventually(lambda: _down(session, stack, "sim-1"), "sim-1 taken as down")
                detected = time.monotonic()
                await asyncio.sleep(2.0)
                outcomes = await load.stop()
            finally:
                pods.thaw("sim-1")
            await eventually(lambda: _fresh(session, stack), "sim-1 fresh again")
            assert (await _entries(session, stack))["sim-1"]["metrics"]["down"] is False

    hung = [o for o in outcomes if not o.ok]
    assert all(o.started < detected and o.ended > frozen_at for o in hung), hung
    later = [o for o in outcomes if o.started >= detected]
    assert len(later) > 30
    assert all(o.ok and o.pod != "sim-1" for o in later), later


async def test_an_engine_that_stalls_behind_a_server_that_answers(tmp_path: Path) -> None:
    # The engine stops stepping; /metrics keeps answering, so no scrape sees it. The
    # EPP does: requests wait there for their first token and nothing progresses
    # (--stall-threshold, 1 s here), so the pod is no candidate until it moves.
    pods = sim_pods(tmp_path, 3)
    args = ["--stall-threshold", "1s"]
    with running(tmp_path, pods, config=DEFAULT_CONFIG, epp_args=args) as stack:
        async with aiohttp.ClientSession() as session:
            await eventually(lambda: _fresh(session, stack), "every pod scraped")
            sim1 = f"http://{pods['sim-1'].address}"
            load = Load(stack.url, timeout_s=10.0).start()
            await asyncio.sleep(1.0)
            async with session.post(sim1 + "/sim/stall", json={"stalled": True}) as response:
                assert response.status == 200
            stalled_at = time.monotonic()

            async def sim1_stalled() -> bool:
                entry = (await _entries(session, stack))["sim-1"]
                return bool(entry["progress"]["stalled"]) and not entry["metrics"]["stale"]

            await eventually(sim1_stalled, "sim-1 stalled, its scrapes fine")
            detected = time.monotonic()
            assert detected - stalled_at < 5.0
            await asyncio.sleep(2.0)
            resumed = time.monotonic()
            async with session.post(sim1 + "/sim/stall", json={"stalled": False}) as response:
                assert response.status == 200

            async def sim1_serves_again() -> bool:
                return any(o.pod == "sim-1" and o.started > resumed for o in load.outcomes)

            await eventually(sim1_serves_again, "a request sent to sim-1 after it moved again")
            outcomes = await load.stop()
            entry = (await _entries(session, stack))["sim-1"]
            assert entry["progress"]["stalled"] is False
            assert entry["progress"]["stallsInARow"] == 0
            async with session.get(stack.admin_url() + "/metrics") as response:
                text = await response.text()
            # One stall or more: with requests still waiting there, each exclusion
            # (1 s, 2 s, ...) ends in the next.
            (line,) = [x for x in text.splitlines() if x.startswith("epp_endpoint_stalls_total")]
            assert float(line.split()[1]) >= 1

    # Nothing failed: the requests that waited on the stalled engine were answered
    # once it moved; none sent after the stall was seen went there.
    assert all(o.ok for o in outcomes), [o for o in outcomes if not o.ok]
    held = [o for o in outcomes if o.pod == "sim-1" and o.started < detected < o.ended]
    assert held
    assert all(o.started > stalled_at - 1.0 for o in held)
    # Requests wait there until it moves, so it stays out until then.
    during = [o for o in outcomes if detected <= o.started < resumed]
    assert len(during) > 30
    assert all(o.pod != "sim-1" for o in during), during
