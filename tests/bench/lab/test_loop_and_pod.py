"""The lab's event loop and its simulated pods in virtual time."""

from __future__ import annotations

import weakref
from pathlib import Path

import pytest

from bench.lab.epp import Delays, LabEpp
from bench.lab.loop import EventLoop
from bench.lab.pod import LabPod
from epp.clock import VirtualClock
from epp.scheduling.registry import PluginRegistry
from sim.engine import EngineConfig, TokenOutput
from sim.kv_events import AllBlocksCleared, BlockStored, KVEvent
from sim.latency import LatencyModel


def test_actions_run_in_time_order_and_ties_in_the_order_scheduled() -> None:
    loop = EventLoop(VirtualClock(0.0))
    seen: list[tuple[str, float]] = []
    loop.at(2.0, lambda: seen.append(("b", loop.now())))
    loop.at(1.0, lambda: seen.append(("a", loop.now())))
    loop.at(2.0, lambda: seen.append(("c", loop.now())))
    # An action may schedule more, also in the past (it then runs now).
    loop.at(1.5, lambda: loop.at(0.0, lambda: seen.append(("late", loop.now()))))
    loop.run()
    assert seen == [("a", 1.0), ("late", 1.5), ("b", 2.0), ("c", 2.0)]
    assert loop.now() == 2.0


class Collect:
    def __init__(self, loop: EventLoop) -> None:
        self.loop = loop
        self.times: list[float] = []
        self.outputs: list[TokenOutput] = []

    def put_nowait(self, output: TokenOutput) -> None:
        self.times.append(self.loop.now())
        self.outputs.append(output)


def pod_with(loop: EventLoop, events: list[tuple[float, list[KVEvent]]]) -> LabPod:
    return LabPod(
        0,
        EngineConfig(block_size=16, num_gpu_blocks=200),
        [7, 8, 9],
        loop,
        LatencyModel(),
        on_events=lambda pod, batch: events.append((loop.now(), list(batch))),
    )


def test_a_request_takes_the_latency_models_time_and_caches_its_blocks() -> None:
    latency = LatencyModel()
    loop = EventLoop(VirtualClock(10.0))
    events: list[tuple[float, list[KVEvent]]] = []
    pod = pod_with(loop, events)
    out = Collect(loop)
    prompt = list(range(100, 164))  # 4 blocks
    request = pod.submit(prompt, 3, out)
    loop.run()
    # First token after one prefill step, then two decode steps. The lab's client
    # only times the first token and the end, so those are all a pod puts.
    first = 10.0 + latency.prefill_time(64)
    assert out.times[0] == pytest.approx(first)
    assert [o.token_ids for o in out.outputs] == [(7,), (9,)]
    assert out.outputs[-1].finish_reason == "length"
    decode = latency.decode_step_time(1, 64) + latency.decode_step_time(1, 65)
    assert out.times[1] == pytest.approx(first + decode)
    assert request.output_token_ids == [7, 8, 9]
    assert request.first_token_time == pytest.approx(out.times[0])
    stored = [e for _, batch in events for e in batch if isinstance(e, BlockStored)]
    assert sum(len(e.block_hashes) for e in stored) == 4  # the prompt's 4 full blocks
    # The same prompt again hits 3 of them (the last token is always computed).
    again = pod.submit(prompt, 1, Collect(loop))
    loop.run()
    assert again.num_cached_tokens == 48


def test_state_at_reads_the_state_a_scrape_would_have_seen() -> None:
    loop = EventLoop(VirtualClock(0.0))
    pod = pod_with(loop, [])
    assert pod.state_at(0.0).waiting == 0
    loop.at(1.0, lambda: [pod.submit(list(range(i, i + 40)), 50, Collect(loop)) for i in (0, 500)])
    loop.run()
    assert pod.state_at(0.5).running == 0
    # The first request started a step at once; the second waits for the next one.
    assert pod.state_at(1.0).running == 1
    assert pod.state_at(1.0).waiting == 1
    assert pod.state_at(1.0).kv_usage > 0
    first_step = LatencyModel().prefill_time(40)
    assert pod.state_at(1.0 + first_step).running == 2
    assert pod.state_at(loop.now()).running == 0  # all done


def test_a_finished_request_lets_go_of_its_client() -> None:
    # The lab's client references its engine request back: the pod's engine drops
    # the client at the end, so both go without waiting for the garbage collector.
    loop = EventLoop(VirtualClock(0.0))
    pod = pod_with(loop, [])
    out = Collect(loop)
    client = weakref.ref(out)
    request = pod.submit(list(range(40)), 5, out)
    loop.run()
    assert [o.finish_reason for o in out.outputs] == [None, "length"]
    del out
    assert client() is None
    assert request.output_token_ids == [7, 8, 9, 7, 8]


def test_a_scrape_landing_late_has_seen_the_picks_before_it_was_taken() -> None:
    # The lab brings metrics up to date lazily, at the next pick: the scrape it then
    # lands was taken earlier, and has seen only the picks routed before that moment
    # (what `utilization-detector` adds the rest of to the scraped queue).
    config = Path(__file__).resolve().parents[3] / "manifests" / "config" / "round-robin.yaml"
    loop = EventLoop(VirtualClock(0.0))
    pod = LabPod(0, EngineConfig(block_size=16, num_gpu_blocks=200), [7, 8, 9], loop)
    epp = LabEpp(
        config.read_text(),
        str(config),
        [pod],
        loop,
        Delays(metrics_interval_s=0.05, metrics_latency_s=0.002),
        seed=0,
        registry=PluginRegistry.from_entry_points(),
    )
    body = b'{"model": "m", "prompt": "hello"}'
    try:
        (endpoint,) = epp.datastore.ready_endpoints()
        assert epp.pick("a", "/v1/completions", body) is not None
        loop.clock.set(1.0)
        assert epp.pick("b", "/v1/completions", body) is not None  # lands a scrape of ~0.95+
        assert (endpoint.routed, endpoint.metrics.routed_seen, endpoint.unseen_routed) == (2, 1, 1)
        loop.clock.set(1.0 + 0.001)
        assert epp.pick("c", "/v1/completions", body) is not None  # no newer scrape yet
        assert (endpoint.metrics.routed_seen, endpoint.unseen_routed) == (1, 2)
        loop.clock.set(1.2)
        epp.pick("d", "/v1/completions", body)  # lands one taken after "b" and "c"
        assert endpoint.metrics.routed_seen == 3
    finally:
        epp.close()


def test_a_restart_fails_the_requests_in_flight_and_empties_the_cache() -> None:
    loop = EventLoop(VirtualClock(0.0))
    events: list[tuple[float, list[KVEvent]]] = []
    pod = pod_with(loop, events)
    prompt = list(range(100, 164))  # 4 blocks
    pod.submit(prompt, 1, Collect(loop))
    loop.run()
    assert pod.core.stats.prefix_cache_queries == 64
    events.clear()
    # A request in its prefill step when the restart comes: the step's work is lost
    # with the process, at the end of that step; the request gets an error.
    victim = Collect(loop)
    sent = loop.now()
    pod.submit(list(range(500, 564)), 50, victim)
    step = LatencyModel().prefill_time(64)
    loop.at(sent + step / 2, pod.restart)
    loop.run()
    assert [o.error for o in victim.outputs] == ["engine restarted"]
    assert victim.times == [pytest.approx(sent + step)]
    assert pod.core.restarts == 1
    assert events == []  # the lost step stored nothing
    # The counters are the run's: they go on over the restart.
    assert pod.core.stats.prefix_cache_queries == 128
    # The cache is empty: the first prompt hits nothing now, and the new engine's
    # first KV-event batch clears what a subscriber held for the pod before storing.
    again = pod.submit(prompt, 1, Collect(loop))
    loop.run()
    assert again.num_cached_tokens == 0
    first_batch = events[0][1]
    assert isinstance(first_batch[0], AllBlocksCleared)
    assert isinstance(first_batch[1], BlockStored)
    assert not any(isinstance(e, AllBlocksCleared) for _, batch in events[1:] for e in batch)


def test_an_idle_pod_restarts_at_once() -> None:
    loop = EventLoop(VirtualClock(0.0))
    pod = pod_with(loop, [])
    pod.submit(list(range(64)), 1, Collect(loop))
    loop.run()
    pod.restart()
    assert pod.core.restarts == 1
    assert pod.prepare(list(range(64)))[1] == 64  # nothing of it cached any more
