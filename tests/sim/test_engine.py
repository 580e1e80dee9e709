"""The engine's scheduling: prefix hits, queueing, chunked prefill, preemption, restart."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from sim.engine import Engine, EngineConfig, EngineRequest, TokenOutput
from sim.kv_events import KVEvent
from sim.latency import LatencyModel

ANSWER = [5, 6, 7]


class Collect:
    def __init__(self) -> None:
        self.batches: list[list[KVEvent]] = []

    async def publish(self, events: Sequence[KVEvent]) -> int:
        self.batches.append(list(events))
        return len(self.batches) - 1


@pytest.fixture
async def make_engine() -> AsyncIterator[Any]:
    engines: list[Engine] = []

    def make(**config: Any) -> Engine:
        config.setdefault("time_scale", 0.02)
        config.setdefault("hash_seed", "0")
        engine = Engine(EngineConfig(**config), ANSWER, sink=Collect())
        engine.start()
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        await engine.stop()


def submit(engine: Engine, prompt: list[int], max_tokens: int = 2) -> EngineRequest:
    queue: asyncio.Queue[TokenOutput] = asyncio.Queue()
    return engine.add_request(prompt, max_tokens, "length", queue)


async def finish(request: EngineRequest) -> list[TokenOutput]:
    outputs = []
    while True:
        out = await asyncio.wait_for(request.outputs.get(), 10)
        outputs.append(out)
        if out.finish_reason is not None or out.error is not None:
            return outputs


async def test_generates_and_counts_prefix_hits(make_engine: Any) -> None:
    engine = make_engine(block_size=16)
    prompt = list(range(1000, 1100))  # 100 tokens: 6 full blocks
    first = submit(engine, prompt, 4)
    outs = await finish(first)
    assert [o.token_ids for o in outs] == [(5,), (6,), (7,), (5,)]
    assert outs[-1].finish_reason == "length"
    assert first.num_cached_tokens == 0
    second = submit(engine, [*prompt, 1, 2, 3])
    await finish(second)
    assert second.num_cached_tokens == 96
    stats = engine.stats
    assert stats.prefix_cache_queries == 100 + 103
    assert stats.prefix_cache_hits == 96
    assert stats.ttft.count == 2
    assert engine.kv.pool.num_used_blocks == 0  # all freed, still cached
    assert engine.kv.pool.num_cached_blocks >= 6


async def test_ttft_is_prefill_of_the_uncached_tokens(make_engine: Any) -> None:
    engine = make_engine(block_size=16, time_scale=0.1)
    prompt = list(range(2000))
    cold = submit(engine, prompt, 1)
    await finish(cold)
    warm = submit(engine, [*prompt[:1984], *range(5000, 5016)], 1)
    await finish(warm)
    model = LatencyModel()
    assert cold.first_token_time is not None
    assert warm.first_token_time is not None
    cold_ttft = cold.first_token_time - cold.arrival_time
    warm_ttft = warm.first_token_time - warm.arrival_time
    # Simulated seconds; generous upper bounds for a loaded test machine.
    assert model.prefill_time(2000) * 0.9 <= cold_ttft < model.prefill_time(2000) + 0.15
    assert warm_ttft < cold_ttft
    assert warm.num_cached_tokens == 1984


async def test_requests_wait_when_the_pool_is_full(make_engine: Any) -> None:
    # 8 usable blocks of 4 tokens; each request needs 6 blocks over its life.
    engine = make_engine(block_size=4, num_gpu_blocks=9)
    a = submit(engine, list(range(100, 120)), 4)
    b = submit(engine, list(range(200, 220)), 4)
    await asyncio.sleep(0)
    outs_a = await finish(a)
    assert len(outs_a) == 4
    outs_b = await finish(b)
    assert len(outs_b) == 4
    assert a.first_token_time is not None
    assert b.first_token_time is not None
    # b could not start before a finished and freed its blocks.
    assert b.first_token_time > a.first_token_time
    assert engine.stats.preemptions == 0


async def test_max_num_seqs_queues(make_engine: Any) -> None:
    engine = make_engine(max_num_seqs=1)
    a = submit(engine, list(range(10)), 3)
    b = submit(engine, list(range(20, 30)), 3)
    await asyncio.sleep(0.001)
    assert len(engine.running) <= 1
    await finish(a)
    await finish(b)
    assert b.first_token_time is not None
    assert a.first_token_time is not None
    assert b.first_token_time > a.first_token_time


async def test_chunked_prefill(make_engine: Any) -> None:
    engine = make_engine(block_size=16, max_num_batched_tokens=64)
    request = submit(engine, list(range(200)), 1)
    await finish(request)
    # 200 tokens in chunks of 64: 4 steps before the first token.
    assert engine.stats.steps == 4
    stored = [e for batch in engine.sink.batches for e in batch]
    assert sum(len(e.block_hashes) for e in stored) == 12  # 192 tokens in full blocks


async def test_preemption_when_decode_runs_out_of_blocks(make_engine: Any) -> None:
    # 6 usable blocks of 4 tokens. Both prompts fit at once (2 blocks each), but
    # growing by 8 tokens each needs 8 blocks: the later one is preempted, then
    # resumes from its own cached blocks.
    engine = make_engine(block_size=4, num_gpu_blocks=7)
    a = submit(engine, list(range(100, 107)), 8)
    b = submit(engine, list(range(200, 207)), 8)
    outs_a, outs_b = await asyncio.gather(finish(a), finish(b))
    assert len(outs_a) == len(outs_b) == 8
    assert engine.stats.preemptions >= 1
    assert b.num_preemptions >= 1
    assert b.num_cached_tokens == 0  # cached_tokens is the first admission's
    assert engine.kv.pool.num_used_blocks == 0


async def test_abort_frees_blocks(make_engine: Any) -> None:
    engine = make_engine(block_size=4)
    request = submit(engine, list(range(40)), 50)
    await asyncio.wait_for(request.outputs.get(), 5)
    assert engine.kv.pool.num_used_blocks > 0
    engine.abort(request)
    assert engine.kv.pool.num_used_blocks == 0
    assert engine.running == []


async def test_restart_fails_requests_and_empties_the_cache(make_engine: Any) -> None:
    engine = make_engine(block_size=4)
    done = submit(engine, list(range(40)), 1)
    await finish(done)
    assert engine.kv.pool.cached_hashes()
    busy = submit(engine, list(range(100, 140)), 1000)
    engine.restart()
    outs = await finish(busy)
    assert outs[-1].error == "engine restarted"
    assert engine.kv.pool.cached_hashes() == set()
    assert engine.stats.requests_received == 0
    again = submit(engine, list(range(40)), 1)
    await finish(again)
    assert again.num_cached_tokens == 0


def test_requests_longer_than_the_pool_are_refused() -> None:
    engine = Engine(EngineConfig(block_size=4, num_gpu_blocks=5), ANSWER)
    assert engine.max_model_len == 16
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(list(range(10)), 8, "length", asyncio.Queue())


async def test_non_streaming_requests_get_one_output(make_engine: Any) -> None:
    engine = make_engine()
    queue: asyncio.Queue[TokenOutput] = asyncio.Queue()
    request = engine.add_request(list(range(30)), 5, "stop", queue, stream=False)
    (out,) = await finish(request)
    assert out.token_ids == (5, 6, 7, 5, 6)
    assert out.finish_reason == "stop"
    assert request.first_token_time is not None  # TTFT is still measured
