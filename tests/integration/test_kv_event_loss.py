"""KV events lost on the way from a simulated pod to a real `epp serve` (real ZMQ):
a dropped range of batches, and a slow subscriber at the PUB high-water mark. The
EPP must see the seq gap, replay the lost batches from the pod's replay socket, and
end with an index that holds exactly the blocks the engine caches (its
`/sim/state`, compared by count and by the XOR digest of the block hashes)."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from tests.integration.faults import (
    Pod,
    Stack,
    debug_endpoints,
    eventually,
    index_in_step,
    precise_config,
    running,
    send,
    sim_pods,
    sim_state,
)

# A PUB socket that queues at most 10 messages for a subscriber that does not read
# (vLLM's knob; its default is 100,000), and a pool small enough to evict.
POD_ARGS = ["--kv-events-hwm", "10", "--num-gpu-blocks", "4000"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("kv-loss")
    pods = sim_pods(workdir, 1, POD_ARGS)
    config = precise_config(filters=())
    with running(workdir, pods, config=config, envoy=False) as started:
        yield started


def _tokens(request: int, length: int) -> list[int]:
    return [(request * 100_003 + i) % 150_000 + 1 for i in range(length)]


async def _index(session: aiohttp.ClientSession, stack: Stack) -> dict[str, Any]:
    index: dict[str, Any] = (await debug_endpoints(session, stack))["sim-0"]["index"]
    return index


async def _live(session: aiohttp.ClientSession, stack: Stack) -> dict[str, Any]:
    async def live() -> dict[str, Any] | None:
        index = await _index(session, stack)
        return index if index["state"] == "live" else None

    found: dict[str, Any] = await eventually(live, "the KV-event stream live")
    return found


async def _followed(session: aiohttp.ClientSession, stack: Stack, pod: Pod) -> dict[str, Any]:
    """The index once the stream is followed from a known batch on (an engine's
    first batches are learnt by a replay anyway, as a late join, not a gap)."""
    await _live(session, stack)
    assert (await send(session, f"http://{pod.address}", _tokens(100, 64)))[0] == 200
    await _converged(session, stack, pod)
    index = await _index(session, stack)
    assert index["lastSeq"] is not None
    return index


async def _converged(session: aiohttp.ClientSession, stack: Stack, pod: Pod) -> None:
    try:
        await eventually(
            lambda: index_in_step(session, stack, pod), "the index in step with the engine"
        )
    except AssertionError as failed:
        # What each side holds and has sent, and what the EPP logged, to tell a
        # lost batch from a wrong one.
        index = await _index(session, stack)
        engine = await sim_state(session, pod)
        raise AssertionError(
            f"{failed}\nindex: {index}\nengine: {engine['kvEvents']}, cached"
            f" {len(engine['cachedBlockHashes'])}\nEPP log:\n{stack.epps[0].log_tail(15)}"
        ) from None


async def test_a_dropped_range_is_replayed(stack: Stack) -> None:
    pod = stack.pods["sim-0"]
    url = f"http://{pod.address}"
    async with aiohttp.ClientSession() as session:
        before = await _followed(session, stack, pod)
        async with session.post(url + "/sim/drop-events", json={"count": 3}) as response:
            assert response.status == 200
        # Each request stores new blocks: a batch each, the first three never sent.
        for n in range(6):
            assert (await send(session, url, _tokens(n, 200)))[0] == 200
        await _converged(session, stack, pod)
        after = await _index(session, stack)
    assert after["gaps"] > before["gaps"]
    assert after["replays"] > before["replays"]
    # Recovered, not rebuilt: nothing was cleared or given up.
    assert after["partialReplays"] == before["partialReplays"]
    assert after["replayFailures"] == before["replayFailures"]
    assert after["restarts"] == before["restarts"]


async def test_a_slow_subscriber_at_the_high_water_mark_catches_up(stack: Stack) -> None:
    pod = stack.pods["sim-0"]
    url = f"http://{pod.address}"
    async with aiohttp.ClientSession() as session:
        before = await _followed(session, stack, pod)
        # The EPP stops reading (frozen, as a process starved of CPU for seconds
        # would be) while the engine publishes far more than the socket buffers and
        # the 10-message queue hold: the PUB socket drops what does not fit.
        os.kill(stack.epp_pid(), signal.SIGSTOP)
        try:
            semaphore = asyncio.Semaphore(8)

            async def one(n: int) -> int:
                async with semaphore:
                    return (await send(session, url, _tokens(1000 + n, 4000)))[0]

            statuses = await asyncio.gather(*(one(n) for n in range(300)))
        finally:
            os.kill(stack.epp_pid(), signal.SIGCONT)
        assert set(statuses) == {200}
        # The next batch after the lost ones shows the gap.
        assert (await send(session, url, _tokens(5000, 64)))[0] == 200
        await _converged(session, stack, pod)
        after = await _index(session, stack)
    assert after["gaps"] > before["gaps"]
    assert after["replays"] > before["replays"]
    assert after["partialReplays"] == before["partialReplays"]
    assert after["restarts"] == before["restarts"]
    assert after["blocks"] > 1000  # a full pool's worth, after evictions
