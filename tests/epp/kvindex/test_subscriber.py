"""The KV-event subscriber over real ZMQ sockets: against simulated vLLM pods
(publishing byte-compatible events with replay), and against a hand-driven
publisher where exact control of the frames is needed."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import zmq

from bench.stack import free_ports
from epp.clock import Clock, VirtualClock
from epp.datastore import EndpointSpec
from epp.kvindex.blockkeys import BlockKeys
from epp.kvindex.events import decode_batch
from epp.kvindex.subscriber import StreamState, SubscriberSettings, offset_address
from sim.hashing import to_event_hash
from sim.server import SimPod
from tests.epp.kvindex.kv_support import (
    FAST,
    Harness,
    RawPublisher,
    batch,
    engine_hash,
    make_harness,
    removed,
    stored,
    wait_for,
)
from tests.sim.conftest import pod_config

StartPod = Callable[..., Awaitable[SimPod]]


@pytest.fixture
async def pods() -> AsyncIterator[StartPod]:
    started: list[SimPod] = []

    async def start(**overrides: Any) -> SimPod:
        pod = SimPod(pod_config(**overrides))
        started.append(pod)  # stopped at teardown even if it fails to start
        await pod.start("127.0.0.1", 0)
        return pod

    yield start
    for pod in started:
        await pod.stop()


@pytest.fixture
async def harnesses() -> AsyncIterator[list[Harness]]:
    running: list[Harness] = []
    yield running
    for harness in running:
        await harness.stop()


def spec(name: str, pod: SimPod) -> EndpointSpec:
    return EndpointSpec(
        name,
        f"127.0.0.1:{pod.port}",
        kv_events=pod.kv_events_endpoint,
        kv_events_replay=pod.replay_endpoint,
    )


def truth(pod: SimPod) -> set[int]:
    """The blocks the simulated engine really caches, as event keys (as the
    index's engine-hash map keeps them)."""
    return {engine_hash(to_event_hash(h)) for h in pod.engine.kv.pool.cached_hashes()}


# Our own keys, as a lookup computes them for a prompt: no hash settings.
OWN = BlockKeys(16)


async def complete(pod: SimPod, prompt: list[int]) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"http://127.0.0.1:{pod.port}/v1/completions",
            json={"prompt": prompt, "max_tokens": 2},
        ) as response,
    ):
        assert response.status == 200, await response.text()


async def start_harness(
    harnesses: list[Harness],
    specs: list[EndpointSpec],
    settings: SubscriberSettings = FAST,
    wall_clock: Clock = time.time,
) -> Harness:
    harness = make_harness(specs, settings, wall_clock=wall_clock)
    harnesses.append(harness)
    await harness.start()
    return harness


async def connected(harness: Harness, name: str, rank: int = 0) -> None:
    await wait_for(lambda: harness.stream(name, rank).status.connects >= 1, what="a connection")
    await asyncio.sleep(0.1)  # the subscription travels to the PUB socket


def prompt(seed: int, blocks: int = 6) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * 16 + 3)]


# --- against the simulator ------------------------------------------------------------


async def test_blocks_appear_after_a_request(pods: StartPod, harnesses: list[Harness]) -> None:
    pod = await pods()
    harness = await start_harness(harnesses, [spec("a", pod)])
    await connected(harness, "a")
    await complete(pod, prompt(1))
    await wait_for(lambda: harness.keys("a") == truth(pod) != set(), what="the blocks")
    assert OWN.keys(prompt(1))[0] in harness.own_keys("a")
    status = harness.stream("a").status
    assert status.state is StreamState.LIVE
    assert status.gaps == 0
    assert status.last_seq == 0
    info = harness.precise.describe(harness.endpoint("a"))
    assert info["blocks"] == len(truth(pod))
    assert info["aligned"] is True


async def test_a_gap_is_replayed(pods: StartPod, harnesses: list[Harness]) -> None:
    pod = await pods()
    harness = await start_harness(harnesses, [spec("a", pod)])
    await connected(harness, "a")
    await complete(pod, prompt(1))
    await wait_for(lambda: harness.keys("a") == truth(pod), what="the first blocks")
    assert pod.publisher is not None
    pod.publisher.drop_next(2)  # lost on the PUB socket, still in the replay buffer
    for seed in (2, 3, 4):
        await complete(pod, prompt(seed))
    await wait_for(lambda: harness.keys("a") == truth(pod), what="the replayed blocks")
    status = harness.stream("a").status
    assert status.gaps == 1
    assert status.replays >= 1
    assert status.replay_failures == 0
    assert not harness.precise.streams(harness.endpoint("a"))[0].counters.clears


QUIET = dataclasses.replace(FAST, tail_check_s=0.2)
# `drop_next` drops batches even while the subscriber reads everything, which a
# real PUB socket never does (it drops only what waits unread at its high-water
# mark): a check that came before the second prompt's batches were published
# would find nothing, and nothing later would ask again. The quiet spell is
# therefore longer than that prompt takes on a loaded host (0.2 s was not, once).
LOST_TAIL_QUIET = dataclasses.replace(FAST, tail_check_s=1.0)


async def lose_the_tail(
    pods: StartPod, harnesses: list[Harness], settings: SubscriberSettings
) -> tuple[SimPod, Harness]:
    """A pod whose last batches are lost on the PUB socket (as at its high-water
    mark) after some that arrived, with nothing published after them: no later
    batch will show a gap."""
    pod = await pods()
    harness = await start_harness(harnesses, [spec("a", pod)], settings)
    await connected(harness, "a")
    await complete(pod, prompt(1))
    await wait_for(lambda: harness.keys("a") == truth(pod), what="the first blocks")
    assert pod.publisher is not None
    pod.publisher.drop_next(100)
    await complete(pod, prompt(2))
    return pod, harness


async def test_a_lost_tail_is_found_once_the_stream_goes_quiet(
    pods: StartPod, harnesses: list[Harness]
) -> None:
    pod, harness = await lose_the_tail(pods, harnesses, LOST_TAIL_QUIET)
    await wait_for(lambda: harness.keys("a") == truth(pod), what="the lost tail")
    status = harness.stream("a").status
    assert status.tail_losses == 1
    assert status.gaps == 1
    assert pod.publisher is not None
    assert status.last_seq == pod.publisher.last_seq
    assert not harness.precise.streams(harness.endpoint("a"))[0].counters.clears


async def test_without_tail_checks_a_lost_tail_stays_lost(
    pods: StartPod, harnesses: list[Harness]
) -> None:
    settings = dataclasses.replace(FAST, tail_check_s=0.0)
    pod, harness = await lose_the_tail(pods, harnesses, settings)
    await asyncio.sleep(1.0)
    assert harness.keys("a") < truth(pod)
    assert harness.stream("a").status.tail_checks == 0


async def test_a_quiet_stream_is_checked_once_per_quiet_spell(
    pods: StartPod, harnesses: list[Harness]
) -> None:
    pod = await pods()
    harness = await start_harness(harnesses, [spec("a", pod)], QUIET)
    await connected(harness, "a")
    status = harness.stream("a").status
    for n in (1, 2):
        await complete(pod, prompt(n))
        await wait_for(functools.partial(lambda k: status.tail_checks == k, n), what="a check")
        # Idle: no more checks (nor replays) until batches come again.
        replays = status.replays
        await asyncio.sleep(1.0)
        assert status.tail_checks == n
        assert status.replays == replays
    assert harness.keys("a") == truth(pod)
    assert status.tail_losses == 0
    assert status.gaps == 0


async def test_a_gap_the_buffer_cannot_fill_clears_and_rebuilds(
    pods: StartPod, harnesses: list[Harness]
) -> None:
    pod = await pods()
    harness = await start_harness(harnesses, [spec("a", pod)])
    await connected(harness, "a")
    await complete(pod, prompt(1))
    await wait_for(lambda: harness.keys("a") == truth(pod), what="the first blocks")
    assert pod.publisher is not None
    pod.publisher.drop_next(1, from_replay=True)  # gone for good
    await complete(pod, prompt(2))
    await complete(pod, prompt(3))
    sink = harness.precise.streams(harness.endpoint("a"))[0]
    await wait_for(lambda: sink.counters.clears["gap"] >= 1, what="a clear")
    # What is indexed now is true (a subset: blocks stored before the hole are lost).
    await wait_for(lambda: harness.keys("a") and harness.keys("a") <= truth(pod))
    assert OWN.keys(prompt(3))[0] in harness.own_keys("a")


async def test_an_engine_restart_clears_its_entries(
    pods: StartPod, harnesses: list[Harness]
) -> None:
    pod = await pods()
    harness = await start_harness(harnesses, [spec("a", pod)])
    await connected(harness, "a")
    await complete(pod, prompt(1))
    await complete(pod, prompt(2))
    await wait_for(lambda: harness.keys("a") == truth(pod), what="the first blocks")
    old = harness.keys("a")
    async with aiohttp.ClientSession() as session:
        await session.post(f"http://127.0.0.1:{pod.port}/sim/restart")
    await complete(pod, prompt(3))
    await wait_for(lambda: harness.keys("a") == truth(pod), what="the new engine's blocks")
    assert not (old & harness.keys("a"))
    assert harness.stream("a").status.restarts == 1
    sink = harness.precise.streams(harness.endpoint("a"))[0]
    assert sink.counters.clears["restart"] == 1


async def test_a_late_subscriber_learns_the_state_from_replay(
    pods: StartPod, harnesses: list[Harness]
) -> None:
    pod = await pods()
    for seed in (1, 2, 3):
        await complete(pod, prompt(seed))
    await wait_for(lambda: bool(truth(pod)))
    # The engine is idle: it publishes nothing more, and the subscriber still learns
    # everything it caches.
    harness = await start_harness(harnesses, [spec("a", pod)])
    await wait_for(lambda: harness.keys("a") == truth(pod), what="the replayed state")
    status = harness.stream("a").status
    assert status.replays == 1
    assert status.last_seq is not None
    assert status.last_seq >= 2
    # Then the stream goes on live.
    await complete(pod, prompt(4))
    await wait_for(lambda: harness.keys("a") == truth(pod), what="live blocks")
    assert status.gaps == 0


async def test_legacy_replay_layout(pods: StartPod, harnesses: list[Harness]) -> None:
    pod = await pods(replay_layout="legacy", kv_events_format="array")
    await complete(pod, prompt(1))
    harness = await start_harness(harnesses, [spec("a", pod)])
    await wait_for(lambda: harness.keys("a") == truth(pod) != set(), what="the replayed state")
    assert pod.publisher is not None
    pod.publisher.drop_next(1)
    await complete(pod, prompt(2))
    await complete(pod, prompt(3))
    await wait_for(lambda: harness.keys("a") == truth(pod), what="the gap replayed")
    assert harness.stream("a").status.gaps == 1


async def test_an_endpoint_leaving_the_pool_is_purged(
    pods: StartPod, harnesses: list[Harness]
) -> None:
    a, b = await pods(name="a"), await pods(name="b")
    harness = await start_harness(harnesses, [spec("a", a), spec("b", b)])
    await connected(harness, "a")
    await connected(harness, "b")
    await complete(a, prompt(1))
    await complete(b, prompt(1))
    await wait_for(lambda: harness.keys("a") == truth(a) and harness.keys("b") == truth(b))
    gone = harness.endpoint("a")
    harness.set_endpoints([spec("b", b)])
    assert gone not in harness.subscriber.streams
    assert not harness.precise.streams(gone)
    await complete(a, prompt(2))  # events after the removal must not come back
    await wait_for(lambda: not harness.precise.index.pending_sweep, what="the sweep")
    b_mask = sum(1 << s.slot for s in harness.precise.streams(harness.endpoint("b")))
    assert all(
        mask & ~b_mask == 0 for tier in harness.precise.index.tiers for mask in tier.blocks.values()
    )
    assert harness.keys("b") == truth(b)
    assert harness.precise.index.stats.entries == len(truth(b))


async def test_a_pod_replaced_on_the_same_ports_is_followed_afresh(
    pods: StartPod, harnesses: list[Harness]
) -> None:
    kv_port, replay_port = free_ports(2)
    pod = await pods(kv_events_port=kv_port, replay_port=replay_port)
    harness = await start_harness(harnesses, [spec("a", pod)])
    await connected(harness, "a")
    await complete(pod, prompt(1))
    await wait_for(lambda: harness.keys("a") == truth(pod) != set())
    before = harness.keys("a")
    await pod.stop()  # the publisher vanishes
    stream = harness.stream("a")
    await wait_for(lambda: stream.status.state is StreamState.CONNECTING, what="the disconnect")
    assert stream.status.disconnects == 1
    assert harness.keys("a") == before  # kept while away
    fresh = await pods(kv_events_port=kv_port, replay_port=replay_port)
    await wait_for(lambda: stream.status.connects >= 2, what="the reconnection")
    # A new engine: nothing it caches is known from before, and the old entries go.
    await wait_for(lambda: harness.keys("a") == set(), what="the old entries cleared")
    await asyncio.sleep(0.1)
    await complete(fresh, prompt(2))
    await wait_for(lambda: harness.keys("a") == truth(fresh) != set(), what="new blocks")
    assert stream.status.restarts == 1


# --- against a hand-driven publisher -------------------------------------------------------


async def raw_harness(
    harnesses: list[Harness],
    publisher: RawPublisher,
    replay: bool = True,
    wall_clock: Clock = time.time,
) -> Harness:
    harness = await start_harness(
        harnesses,
        [
            EndpointSpec(
                "raw",
                "127.0.0.1:1",
                kv_events=publisher.address,
                kv_events_replay=publisher.replay_address if replay else None,
            )
        ],
        wall_clock=wall_clock,
    )
    await publisher.wait_subscribed()
    return harness


@pytest.fixture
async def publishers() -> AsyncIterator[list[RawPublisher]]:
    made: list[RawPublisher] = []
    yield made
    for publisher in made:
        await publisher.close()


async def test_stores_removals_and_clears_in_order(
    publishers: list[RawPublisher], harnesses: list[Harness]
) -> None:
    publisher = RawPublisher()
    publishers.append(publisher)
    harness = await raw_harness(harnesses, publisher)
    await publisher.send(0, batch(stored([1, 2, 3]), stored([4], parent=3, medium="CPU")))
    await publisher.send(1, batch(removed([2]), stored([1])))  # stored again: idempotent
    await wait_for(lambda: harness.stream("raw").status.last_seq == 1)
    assert harness.keys("raw") == {1, 3, 4}
    info = harness.precise.describe(harness.endpoint("raw"))
    assert info["blocksByMedium"] == {"gpu": 2, "cpu": 1}
    assert info["eventsApplied"] == 4
    await publisher.send(2, batch({"type": "AllBlocksCleared"}))
    await wait_for(lambda: harness.keys("raw") == set())


async def test_bad_input_is_counted_logged_once_and_never_fatal(
    publishers: list[RawPublisher], harnesses: list[Harness], caplog: pytest.LogCaptureFixture
) -> None:
    publisher = RawPublisher()
    publishers.append(publisher)
    harness = await raw_harness(harnesses, publisher, replay=False)
    caplog.set_level(logging.WARNING)
    seq = 0
    for _ in range(2):  # every cause twice: logged once, counted twice
        await publisher.send_frames([b"", seq.to_bytes(8, "big")])  # 2 frames
        await publisher.send_frames([b"", seq.to_bytes(8, "big"), b"x", b"y"])  # 4 frames
        await publisher.send_frames([b"", b"\x00\x01", batch()])  # a 2-byte seq
        await publisher.send_frames([b"", b"\xff" * 8, b""])  # the end marker, live
        await publisher.send(seq, b"\x93\xcb\x41")  # truncated msgpack: its seq is used up
        await publisher.send(seq + 1, b"garbage, not msgpack")
        await publisher.send(
            seq + 2,
            batch(
                {"type": "Teleported", "block_hashes": [5]},  # an unknown event type
                {"type": "BlockRemoved", "block_hashes": [b"\x01\x02\x03"]},  # a 3-byte hash
                stored([100 + seq]),
            ),
        )
        seq += 3
    sink = harness.precise.streams(harness.endpoint("raw"))[0]
    await wait_for(lambda: harness.stream("raw").status.last_seq == seq - 1)
    assert dict(sink.counters.rejected) == {
        "frame_count": 4,
        "bad_seq": 4,
        "bad_payload": 4,
        "unknown_event_type": 2,
        "bad_hash": 2,
    }
    assert harness.keys("raw") == {100, 103}  # only the good events, nothing else
    status = harness.stream("raw").status
    assert status.gaps == 0
    assert status.state is StreamState.LIVE
    logged = [r for r in caplog.records if "KV events from raw" in r.getMessage()]
    assert len(logged) == len({(r.getMessage().split(" (")[0]) for r in logged}) == 5


async def test_a_publisher_vanishing_mid_stream(
    publishers: list[RawPublisher], harnesses: list[Harness]
) -> None:
    publisher = RawPublisher()
    harness = await raw_harness(harnesses, publisher)
    await publisher.send(0, batch(stored([1, 2])))
    await publisher.send(1, batch(stored([3])))
    await wait_for(lambda: harness.keys("raw") == {1, 2, 3})
    port = publisher.port
    await publisher.close()
    stream = harness.stream("raw")
    await wait_for(lambda: stream.status.state is StreamState.CONNECTING, what="the disconnect")
    assert harness.keys("raw") == {1, 2, 3}  # kept: it may come back unchanged
    # It comes back on the same port, a new engine whose seq starts again.
    again = RawPublisher(port=port)
    publishers.append(again)
    await again.wait_subscribed()
    await again.send(0, batch(stored([9])))
    await wait_for(lambda: harness.keys("raw") == {9}, what="the new engine's blocks only")
    assert stream.status.restarts == 1


async def test_a_gap_without_replay_clears(
    publishers: list[RawPublisher], harnesses: list[Harness]
) -> None:
    publisher = RawPublisher()
    publishers.append(publisher)
    harness = await raw_harness(harnesses, publisher, replay=False)
    await publisher.send(0, batch(stored([1])))
    await publisher.send(3, batch(stored([2])))  # 1 and 2 lost, and no replay socket
    await wait_for(lambda: harness.stream("raw").status.last_seq == 3)
    assert harness.keys("raw") == {2}
    assert harness.stream("raw").status.gaps == 1


async def test_a_replayed_batch_that_differs_means_a_new_engine(
    publishers: list[RawPublisher], harnesses: list[Harness]
) -> None:
    publisher = RawPublisher()
    publishers.append(publisher)
    harness = await raw_harness(harnesses, publisher)
    await publisher.send(0, batch(stored([1])))
    await publisher.send(1, batch(stored([2])))
    await wait_for(lambda: harness.keys("raw") == {1, 2})
    # The engine restarted unseen and got past seq 1 again: same numbers, other batches.
    publisher.sent = {0: batch(stored([7])), 1: batch(stored([8])), 2: batch(stored([9]))}
    await publisher.send(3, batch(stored([10])))
    await wait_for(lambda: harness.keys("raw") == {7, 8, 9, 10}, what="the new engine's state")
    assert harness.stream("raw").status.restarts == 1


async def test_data_parallel_ranks_publish_on_consecutive_ports(
    publishers: list[RawPublisher], harnesses: list[Harness]
) -> None:
    for _ in range(20):
        rank0 = RawPublisher()
        publishers.append(rank0)  # closed at teardown whatever happens
        assert rank0.port is not None
        try:
            rank1 = RawPublisher(port=rank0.port + 1)
        except zmq.ZMQError:  # the next port is taken: try another pair
            continue
        publishers.append(rank1)
        break
    else:
        pytest.fail("no two consecutive free ports")
    settings = SubscriberSettings(**{**FAST.__dict__, "dp_size": 2, "replay": False})
    harness = await start_harness(
        harnesses, [EndpointSpec("dp", "127.0.0.1:1", kv_events=rank0.address)], settings
    )
    await rank0.wait_subscribed()
    await rank1.wait_subscribed()
    await rank0.send(0, batch(stored([1, 2]), rank=0))
    await rank1.send(0, batch(stored([2, 3]), rank=1))  # its own seq space
    await rank1.send(1, batch(removed([2]), rank=1))  # rank 0 still holds 2
    await wait_for(lambda: harness.stream("dp", 1).status.last_seq == 1)
    assert harness.keys("dp") == {1, 2, 3}
    info = harness.subscriber.describe(harness.endpoint("dp"))
    assert info is not None
    assert [r["lastSeq"] for r in info["ranks"]] == [0, 1]


# --- the lag of live batches -------------------------------------------------------------


# Without a replay socket where a batch must arrive live: with one, the resync at the
# connection may fetch it from the replay buffer first.


def lag_buckets(harness: Harness, name: str = "raw") -> dict[float, int]:
    """The stream's lag histogram as {upper bound: observations <= it}."""
    return {float(le): int(count) for le, count in harness.stream(name).status.lag.cumulative()}


async def test_a_live_batch_lag_is_read_on_the_injected_wall_clock(
    publishers: list[RawPublisher], harnesses: list[Harness]
) -> None:
    wall = VirtualClock(1_700_000_000.0)
    publisher = RawPublisher()
    publishers.append(publisher)
    harness = await raw_harness(harnesses, publisher, replay=False, wall_clock=wall)
    await publisher.send(0, batch(stored([1]), ts=wall() - 0.25))
    await wait_for(lambda: harness.stream("raw").status.last_seq == 0)
    lag = harness.stream("raw").status.lag
    assert (lag.count, lag.sum) == (1, 0.25)
    buckets = lag_buckets(harness)
    assert buckets[0.1] == 0
    assert buckets[0.25] == buckets[math.inf] == 1  # le is "less than or equal"
    assert harness.stream("raw").status.lag_negative == 0


async def test_batches_without_a_usable_ts_are_not_observed(
    publishers: list[RawPublisher], harnesses: list[Harness]
) -> None:
    wall = VirtualClock(1_700_000_000.0)
    publisher = RawPublisher()
    publishers.append(publisher)
    harness = await raw_harness(harnesses, publisher, replay=False, wall_clock=wall)
    await publisher.send(0, batch(stored([1]), ts=0.0))  # a producer that stamps nothing
    await publisher.send(1, batch(stored([2]), ts=math.nan))
    await publisher.send(2, batch(stored([3]), ts=wall() - 0.002))
    await wait_for(lambda: harness.stream("raw").status.last_seq == 2)
    assert harness.keys("raw") == {1, 2, 3}  # applied all the same
    status = harness.stream("raw").status
    assert status.lag.count == 1
    assert status.lag.sum == pytest.approx(0.002, abs=1e-6)  # floats near 1.7e9
    assert status.lag_negative == 0


async def test_a_batch_stamped_ahead_of_our_clock_is_observed_as_zero_and_counted(
    publishers: list[RawPublisher], harnesses: list[Harness]
) -> None:
    """Clock skew: the engine's host is 0.5 s ahead. Nothing is dropped: the batch is
    in the histogram (at 0) and the skew in the negative counters."""
    wall = VirtualClock(1_700_000_000.0)
    publisher = RawPublisher()
    publishers.append(publisher)
    harness = await raw_harness(harnesses, publisher, replay=False, wall_clock=wall)
    await publisher.send(0, batch(stored([1]), ts=wall() + 0.5))
    await wait_for(lambda: harness.stream("raw").status.last_seq == 0)
    status = harness.stream("raw").status
    assert (status.lag.count, status.lag.sum) == (1, 0.0)
    assert lag_buckets(harness)[0.0001] == 1
    assert (status.lag_negative, status.lag_negative_s) == (1, 0.5)


async def test_replayed_batches_are_history_not_lag(
    publishers: list[RawPublisher], harnesses: list[Harness]
) -> None:
    """A late subscriber replays what the engine did before it came: those batches
    are an hour old, which is no lag of the index; only the live one counts."""
    wall = VirtualClock(1_700_000_000.0)
    publisher = RawPublisher()
    publishers.append(publisher)
    publisher.sent = {
        0: batch(stored([1]), ts=wall() - 3600.0),
        1: batch(stored([2]), ts=wall() - 3599.0),
    }
    harness = await raw_harness(harnesses, publisher, wall_clock=wall)
    # The resync at the connection learns batches 0 and 1 from the replay socket.
    await wait_for(lambda: harness.keys("raw") == {1, 2}, what="the replayed batches")
    await publisher.send(2, batch(stored([3]), ts=wall() - 0.01))
    await wait_for(lambda: harness.stream("raw").status.last_seq == 2)
    assert harness.keys("raw") == {1, 2, 3}
    assert harness.stream("raw").status.replays >= 1
    lag = harness.stream("raw").status.lag
    assert lag.count == 1
    assert lag.sum == pytest.approx(0.01, abs=1e-6)


async def test_the_lag_of_a_simulated_pod_on_the_wall_clock(
    pods: StartPod, harnesses: list[Harness]
) -> None:
    """The simulator stamps time.time() as it publishes, as vLLM does: on one host
    the lag is positive and small, one observation per batch applied live."""
    pod = await pods()
    harness = await start_harness(harnesses, [spec("a", pod)])
    await connected(harness, "a")
    for seed in (1, 2, 3):
        await complete(pod, prompt(seed))
    await wait_for(lambda: harness.keys("a") == truth(pod) != set(), what="the blocks")
    status = harness.stream("a").status
    assert status.last_seq is not None
    assert status.lag.count == status.last_seq + 1  # every batch, all of them live
    assert status.lag_negative == 0  # one host, one clock
    assert 0.0 < status.lag.sum / status.lag.count < 1.0


def test_offset_addresses() -> None:
    assert offset_address("tcp://10.0.0.1:5557", 0) == "tcp://10.0.0.1:5557"
    assert offset_address("tcp://10.0.0.1:5557", 2) == "tcp://10.0.0.1:5559"
    assert offset_address("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert offset_address("inproc://kv", 1) == "inproc://kv_dp1"
    with pytest.raises(ValueError, match="data-parallel"):
        offset_address("ipc:///tmp/kv", 1)


def test_a_batch_for_an_endpoint_already_removed_changes_nothing() -> None:
    harness = make_harness([EndpointSpec("gone", "127.0.0.1:1")])
    sink = harness.precise.add_stream(harness.endpoint("gone"), 0)
    harness.precise.remove_endpoint(harness.endpoint("gone"))
    sink.apply(decode_batch(batch(stored([1, 2, 3]))))
    assert harness.precise.index.stats.entries == 0
    assert harness.precise.late_batches == 1


async def test_a_payload_with_invalid_utf8_or_a_junk_extra_key_never_restarts_the_stream(
    publishers: list[RawPublisher], harnesses: list[Harness], caplog: pytest.LogCaptureFixture
) -> None:
    """Regressions found by fuzzing (tests/epp/kvindex/test_events_fuzz.py): a msgpack
    string that is not UTF-8 escaped the decoder as a UnicodeDecodeError, and an
    extra key that is not a list (after block 0) made the alignment check raise. Either
    broke the stream mid-batch; it restarted, replayed the same bytes and broke again."""
    publisher = RawPublisher()
    publishers.append(publisher)
    harness = await raw_harness(harnesses, publisher)
    caplog.set_level(logging.WARNING)
    not_utf8 = (
        b"\x93\xcb\x3f\xf0\x00\x00\x00\x00\x00\x00\x91\xa2\xff\xfe\x00"  # [1.0, ["\xff\xfe"], 0]
    )
    junk_extra_key = {
        **stored([7, 8]),
        "token_ids": list(range(32)),  # two whole blocks: the alignment check runs
        "extra_keys": [None, 5],
    }
    await publisher.send(0, not_utf8)
    await publisher.send(1, batch(junk_extra_key, stored([9], parent=8)))
    await wait_for(lambda: harness.stream("raw").status.last_seq == 1)
    assert harness.keys("raw") == {7, 8, 9}
    sink = harness.precise.streams(harness.endpoint("raw"))[0]
    assert dict(sink.counters.rejected) == {"bad_payload": 1}
    assert sink.alignment.aligned is not False  # unverifiable, not a mismatch
    assert harness.stream("raw").status.state is StreamState.LIVE
    assert not [r for r in caplog.records if "the stream failed" in r.getMessage()]
