"""The lab's models of peer routers decide as their published algorithms say."""

from __future__ import annotations

import json

from bench.lab.loop import EventLoop
from bench.lab.peers import CHAR_STEP, DynamoKv, SglangCacheAware, routing_text
from bench.lab.pod import LabPod
from epp.clock import VirtualClock
from sim.engine import EngineConfig
from sim.hashing import BlockHasher
from sim.kv_events import BlockRemoved, BlockStored


def fleet(n: int) -> tuple[EventLoop, list[LabPod]]:
    loop = EventLoop(VirtualClock(0.0))
    config = EngineConfig(block_size=4, num_gpu_blocks=100)
    return loop, [LabPod(i, config, [1], loop) for i in range(n)]


def chat(system: str, user: str) -> bytes:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return json.dumps({"model": "m", "messages": messages}).encode()


def test_routing_text_is_the_messages_contents() -> None:
    assert routing_text(chat("be brief", "hello")) == "be brief hello"


def test_sglang_sticks_to_the_deepest_match_unless_loads_are_imbalanced() -> None:
    _, pods = fleet(3)
    router = SglangCacheAware(pods, seed=0)
    system = "x" * (CHAR_STEP * 20)
    # Nothing matched yet: the least loaded, lowest index first.
    first, h1 = router.route("1", chat(system, "a"), [])
    assert first.index == 0
    # The same system prompt matches well over 30%: the same pod, though busier.
    again, h2 = router.route("2", chat(system, "b"), [])
    assert again.index == 0
    # A new text goes to the least loaded pod.
    other, h3 = router.route("3", chat("y" * 400, "c"), [])
    assert other.index == 1
    assert router.decisions == {"imbalanced": 0, "cache": 1, "min_load": 2}
    for handle in (h1, h2, h3):
        router.end(handle, None, completed=True)
    assert router.load == [0, 0, 0]
    # Imbalanced (max - min > 64 and max > 1.5 x min): the least loaded, match or not.
    router.load = [70, 5, 6]
    chosen, _ = router.route("4", chat(system, "d"), [])
    assert chosen.index == 1
    assert router.decisions["imbalanced"] == 1


def test_dynamo_weighs_cached_blocks_against_blocks_in_flight() -> None:
    loop, pods = fleet(2)
    router = DynamoKv(pods, loop, kv_event_s=0.001, seed=0)
    hasher = BlockHasher(block_size=4)
    prompt = list(range(40))  # 10 blocks
    hashes = hasher.block_hashes(prompt)
    # Pod 1 reports the prompt's first 8 blocks cached; applied after the event delay.
    stored = BlockStored(tuple(hashes[:8]), None, tuple(prompt[:32]), 4, (None,) * 8)
    router.on_events(pods[1], [stored])
    loop.run()
    chosen, flight = router.route("1", b"{}", prompt)
    assert chosen.index == 1
    # Its prefill (8 tokens) and its 10 blocks are now in flight on pod 1; the same
    # prompt again shares them all (distinct blocks are counted once), so pod 1 still
    # costs less than pod 0: (8 + 8) / 4 + 10 + 0 = 14 < 40 / 4 + 0 + 10 = 20.
    again, second = router.route("2", b"{}", prompt)
    assert again.index == 1
    assert len(router.active[1]) == 10
    assert router.prefill_tokens == [0, 16]
    router.first_token(flight)
    router.end(flight, None, completed=True)
    router.end(second, None, completed=True)
    assert router.prefill_tokens == [0, 0]
    assert router.active == [{}, {}]
    # Evicted blocks no longer count: pod 1 lost its first block, so it holds no
    # prefix at all, and both pods cost the same (ties at random).
    router.on_events(pods[1], [BlockRemoved((hashes[0],))])
    loop.run()
    chosen, _ = router.route("3", b"{}", prompt)
    assert router.prefill_tokens[chosen.index] == 40
