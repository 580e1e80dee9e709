"""`burst-prefix-cache-producer`: requests wait for their window (on the context's
sleep and clock), then prompt-sharing ones are placed together and get a full
match on their endpoint."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence
from typing import Any

import msgspec
import pytest
from epp.plugins.burst_prefix_cache_producer import BatchFull, BurstPrefixCacheProducer
from prometheus_client import CollectorRegistry

from epp.clock import VirtualClock
from epp.config import InvalidConfig
from epp.config.build import BuildResources, build
from epp.config.defaults import complete
from epp.config.parse import read_yaml, validate
from epp.datastore import Datastore, Endpoint, EndpointMetrics
from epp.scheduling import (
    EXPLAIN_NOTES,
    CycleState,
    PluginContext,
    ServerSettings,
    prefix_match_key,
)
from epp.scheduling.registry import PluginRegistry
from tests.plugins.helpers import make_endpoints
from tests.plugins.llmd_helpers import load, one_plugin_config, request

NAME = "burst-prefix-cache-producer"
BLOCK = "x" * 16  # one block: blockSizeTokens 4 x 4 characters per token


class ManualSleep:
    """A simulation's sleep: it ends when the test moves the virtual clock on."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.asked: list[float] = []
        self._pending: list[tuple[float, asyncio.Future[None]]] = []

    async def __call__(self, seconds: float) -> None:
        self.asked.append(seconds)
        future = asyncio.get_running_loop().create_future()
        self._pending.append((self.clock() + seconds, future))
        await future

    def elapse(self, seconds: float) -> None:
        self.clock.advance(seconds)
        for deadline, future in list(self._pending):
            if deadline <= self.clock():
                self._pending.remove((deadline, future))
                future.set_result(None)


def producer(sleep: ManualSleep, **params: object) -> BurstPrefixCacheProducer:
    params.setdefault("blockSizeTokens", 4)
    return BurstPrefixCacheProducer(
        msgspec.convert(params, BurstPrefixCacheProducer.Parameters),
        PluginContext(
            NAME, NAME, Datastore(), CollectorRegistry(), {}, clock=sleep.clock, sleep=sleep
        ),
    )


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def burst(
    plugin: BurstPrefixCacheProducer,
    sleep: ManualSleep,
    prompts: Sequence[str],
    endpoints: Sequence[Endpoint],
) -> list[CycleState]:
    """Send `prompts` in one window; check none is answered before it closes."""
    cycles = [CycleState() for _ in prompts]
    tasks = [
        asyncio.create_task(plugin.prepare(request(p), cycle, endpoints))
        for p, cycle in zip(prompts, cycles, strict=True)
    ]
    await settle()
    assert not any(t.done() for t in tasks)
    sleep.elapse(plugin.window_s)
    await asyncio.gather(*tasks)
    return cycles


def assigned(cycle: CycleState) -> Endpoint | None:
    info = cycle.get(prefix_match_key(NAME))
    assert info is not None
    full = [e for e, m in info.matched.items() if m == info.total_blocks]
    assert len(full) == len(info.matched) <= 1  # a full match on one endpoint, none elsewhere
    return full[0] if full else None


@pytest.fixture
def sleep() -> ManualSleep:
    return ManualSleep(VirtualClock(100.0))


async def test_identical_prompts_in_one_window_share_an_endpoint(sleep: ManualSleep) -> None:
    plugin = producer(sleep)
    endpoints = make_endpoints(3)
    cycles = await burst(plugin, sleep, [BLOCK * 3] * 5, endpoints)
    targets = {assigned(c) for c in cycles}
    assert len(targets) == 1
    assert None not in targets
    info = cycles[0].get(prefix_match_key(NAME))
    assert info is not None
    assert info.total_blocks == 3
    assert info.block_size_tokens == 4
    # It waited its window (100 ms by default) on the context's sleep and clock.
    assert sleep.asked == [0.1]
    notes = cycles[0].get(EXPLAIN_NOTES)
    assert notes is not None
    assert notes[NAME]["waitedMs"] == pytest.approx(100.0)
    assert notes[NAME]["batchSize"] == 5


async def test_groups_are_spread_over_the_endpoints(sleep: ManualSleep) -> None:
    plugin = producer(sleep)
    a, b = make_endpoints(2)
    prompts = [BLOCK + "group one"] * 3 + [BLOCK + "group two"] * 3
    cycles = await burst(plugin, sleep, prompts, [a, b])
    assert [assigned(c) for c in cycles] == [a, a, a, b, b, b]


async def test_a_prompt_nobody_shares_gets_no_affinity(sleep: ManualSleep) -> None:
    plugin = producer(sleep)
    endpoints = make_endpoints(2)
    cycles = await burst(plugin, sleep, [BLOCK + "one", BLOCK + "two"], endpoints)
    assert [assigned(c) for c in cycles] == [None, None]
    info = cycles[0].get(prefix_match_key(NAME))
    assert info is not None
    assert info.total_blocks == 2


async def test_max_per_replica_splits_a_group(sleep: ManualSleep) -> None:
    plugin = producer(sleep, maxPerReplica=2)
    endpoints = make_endpoints(3)
    cycles = await burst(plugin, sleep, [BLOCK] * 5, endpoints)
    assert sorted(Counter(assigned(c) for c in cycles).values()) == [1, 2, 2]


async def test_prefix_sharing_requests_colocate_with_min_colocate_blocks(
    sleep: ManualSleep,
) -> None:
    a, b, c = make_endpoints(3)
    group = ["other prompt " * 8] * 4  # to a
    sharing = [BLOCK * 2 + "x" * 40, BLOCK * 2 + "y" * 20]  # 2 shared leading blocks
    with_prefix = producer(sleep, minColocateBlocks=2)
    cycles = await burst(with_prefix, sleep, group + sharing, [a, b, c])
    # The longer one goes to the least loaded (b); the shorter follows it there, not
    # to the emptier c, as b is under its fair share (6 requests / 3 = 2).
    assert [assigned(x) for x in cycles] == [a, a, a, a, b, b]
    without = producer(sleep)  # minColocateBlocks 0: lone requests are left alone
    cycles = await burst(without, sleep, group + sharing, [a, b, c])
    assert [assigned(x) for x in cycles] == [a, a, a, a, None, None]


async def test_a_shared_prefix_does_not_pile_past_the_fair_share(sleep: ManualSleep) -> None:
    a, b = make_endpoints(2)
    # Two lone requests sharing their first 2 blocks: fair share 1 request each.
    sharing = [BLOCK * 2 + "x" * 40, BLOCK * 2 + "y" * 20]
    cycles = await burst(producer(sleep, minColocateBlocks=2), sleep, sharing, [a, b])
    assert [assigned(c) for c in cycles] == [a, b]


async def test_balance_by_tokens_weighs_long_prompts(sleep: ManualSleep) -> None:
    a, b = make_endpoints(2)
    prompts = [BLOCK * 10] * 2 + ["s1"] * 2 + ["s2"] * 2
    by_requests = await burst(producer(sleep), sleep, prompts, [a, b])
    # Loads in requests: long -> a (2), s1 -> b (2), s2 -> the tie goes to the name.
    assert [assigned(c) for c in by_requests] == [a, a, b, b, a, a]
    by_tokens = await burst(producer(sleep, balanceBy="tokens"), sleep, prompts, [a, b])
    # Loads in blocks: long -> a (10), s1 -> b (1), s2 -> b (1 < 10).
    assert [assigned(c) for c in by_tokens] == [a, a, b, b, b, b]


async def test_ties_go_to_fewer_running_requests(sleep: ManualSleep) -> None:
    a, b = make_endpoints(2)
    a.metrics = EndpointMetrics(running_requests=5, updated_at=sleep.clock())
    b.metrics = EndpointMetrics(running_requests=1, updated_at=sleep.clock())
    cycles = await burst(producer(sleep), sleep, [BLOCK] * 2, [a, b])
    assert [assigned(c) for c in cycles] == [b, b]


async def test_a_full_window_refuses_more(sleep: ManualSleep) -> None:
    plugin = producer(sleep, maxBatchSize=2)
    endpoints = make_endpoints(2)
    waiting = [
        asyncio.create_task(plugin.prepare(request(BLOCK), CycleState(), endpoints))
        for _ in range(2)
    ]
    await settle()
    with pytest.raises(BatchFull, match="maxBatchSize=2"):
        await plugin.prepare(request(BLOCK), CycleState(), endpoints)
    sleep.elapse(0.1)
    await asyncio.gather(*waiting)


async def test_each_window_is_placed_on_its_own(sleep: ManualSleep) -> None:
    plugin = producer(sleep, windowDurationMs=250)
    endpoints = make_endpoints(2)
    first = await burst(plugin, sleep, [BLOCK], endpoints)
    second = await burst(plugin, sleep, [BLOCK], endpoints)
    # Alone in its window, each request is a lone prompt: no affinity.
    assert [assigned(first[0]), assigned(second[0])] == [None, None]
    assert sleep.asked == [0.25, 0.25]


async def test_a_request_without_a_prompt_does_not_wait(sleep: ManualSleep) -> None:
    plugin = producer(sleep)
    cycle = CycleState()
    await plugin.prepare(request(""), cycle, make_endpoints(2))
    info = cycle.get(prefix_match_key(NAME))
    assert info is not None
    assert info.total_blocks == 0
    assert sleep.asked == []


async def test_a_cancelled_request_leaves_the_window_working(sleep: ManualSleep) -> None:
    plugin = producer(sleep)
    endpoints = make_endpoints(2)
    gone = asyncio.create_task(plugin.prepare(request(BLOCK), CycleState(), endpoints))
    stays = CycleState()
    task = asyncio.create_task(plugin.prepare(request(BLOCK), stays, endpoints))
    await settle()
    gone.cancel()
    await settle()
    sleep.elapse(0.1)
    await task
    assert assigned(stays) is not None


def test_the_builder_hands_plugins_the_sleep_it_is_given() -> None:
    text = one_plugin_config(NAME, {})
    registry = PluginRegistry.from_entry_points()

    async def virtual(seconds: float) -> None:
        return None

    def built(**resources: Any) -> BurstPrefixCacheProducer:
        completed = complete(validate(read_yaml(text, "t").data, registry), registry)
        config = build(
            completed,
            BuildResources(
                datastore=Datastore(),
                metrics=CollectorRegistry(),
                observe=lambda *_: lambda _: None,
                settings=ServerSettings(),
                **resources,
            ),
        )
        plugin = config.plugins[NAME]
        assert isinstance(plugin, BurstPrefixCacheProducer)
        return plugin

    assert built(sleep=virtual).sleep is virtual
    # By default: asyncio.sleep itself, through load_config too.
    assert built().sleep is asyncio.sleep
    plugin = load(text).plugins[NAME]
    assert isinstance(plugin, BurstPrefixCacheProducer)
    assert plugin.sleep is asyncio.sleep


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"windowDurationMs": 0}, "windowDurationMs must be in 1..10000"),
        ({"windowDurationMs": 10001}, "windowDurationMs must be in 1..10000"),
        ({"maxPerReplica": 0}, "maxPerReplica must be -1"),
        ({"maxPerReplica": -2}, "maxPerReplica must be -1"),
        ({"blockSizeTokens": 0}, "blockSizeTokens must be > 0"),
        ({"maxPrefixTokensToMatch": -1}, "maxPrefixTokensToMatch must be >= 0"),
        ({"maxPrefixTokensToMatch": 10}, "at least blockSizeTokens"),
        ({"minColocateBlocks": -1}, "minColocateBlocks must be >= 0"),
        ({"maxBatchSize": 0}, "maxBatchSize must be -1"),
        ({"balanceBy": "bytes"}, "balanceBy"),
        ({"windowDuration": "100ms"}, "windowDuration"),
    ],
)
def test_bad_parameters_are_config_errors(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        load(one_plugin_config(NAME, parameters))


def test_llm_d_parameters_load() -> None:
    parameters = {
        "windowDurationMs": 100,
        "maxPerReplica": -1,
        "blockSizeTokens": 64,
        "maxPrefixTokensToMatch": 0,
        "minColocateBlocks": 0,
        "maxBatchSize": 1000,
        "balanceBy": "tokens",
    }
    assert NAME in load(one_plugin_config(NAME, parameters)).plugins
    assert NAME in load(one_plugin_config(NAME, {"balanceBy": ""})).plugins
