"""Prefill/decode disaggregation in the engine core: the prefill leg's blocks, the
decode leg's wait for its KV transfer (WAITING_FOR_REMOTE_KVS) and what it then
computes, on a virtual clock (exact times) and on the asyncio engine."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest

from sim.engine import (
    Engine,
    EngineConfig,
    EngineCore,
    EngineRequest,
    RemotePrefill,
    RequestState,
    TokenOutput,
)
from sim.latency import LatencyModel, StepChunk
from sim.metrics import EngineStats

ANSWER = [5, 6, 7]
B = 16
MODEL = LatencyModel()
KV_BYTES = MODEL.model.kv_bytes_per_token  # 128 KiB


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class Sink:
    def __init__(self) -> None:
        self.items: list[TokenOutput] = []

    def put_nowait(self, item: TokenOutput, /) -> None:
        self.items.append(item)


def core(**config: Any) -> tuple[EngineCore, Clock]:
    clock = Clock()
    config.setdefault("block_size", B)
    config.setdefault("hash_seed", "0")
    return EngineCore(EngineConfig(**config), ANSWER, MODEL, clock=clock), clock


def run(engine: EngineCore, clock: Clock) -> list[float]:
    """Step the core until it has nothing left, as the lab's pod does: steps back to
    back, and with only transfers pending, the clock moved to the first one's end.
    Returns the durations of the steps run."""
    durations = []
    while engine.has_work or engine.receiving:
        step = engine.begin_step()
        if step.empty:
            ready = engine.next_ready_at()
            assert ready is not None, "no step and no transfer: stuck"
            assert ready > clock.t
            clock.t = ready
            continue
        durations.append(step.duration)
        clock.t += step.duration
        engine.finish_step(step)
    return durations


def add(
    engine: EngineCore, prompt: list[int], max_tokens: int = 2, **legs: Any
) -> tuple[EngineRequest, Sink]:
    sink = Sink()
    request = engine.add_request(prompt, max_tokens, "length", sink, **legs)
    return request, sink


PROMPT = list(range(1000, 1100))  # 100 tokens: 6 full blocks and 4 tokens


def test_a_prefill_leg_records_the_blocks_of_its_prompts_full_blocks() -> None:
    engine, clock = core()
    leg, sink = add(engine, PROMPT, 1, remote_decode=True)
    run(engine, clock)
    assert sink.items[-1].finish_reason == "length"
    assert leg.kv_block_ids is not None
    assert len(leg.kv_block_ids) == 100 // B
    # They are the blocks the prompt's full blocks are cached in.
    pool = engine.kv.pool
    for block, block_hash in zip(leg.kv_block_ids, leg.seq.block_hashes, strict=False):
        assert pool.block_hash(block) == block_hash
    assert engine.stats.prefill_legs == 1
    assert engine.stats.decode_legs == 0


def test_a_prefill_leg_that_does_not_end_on_its_length_has_no_blocks_to_give() -> None:
    engine, clock = core()
    sink = Sink()
    leg = engine.add_request(PROMPT, 1, "stop", sink, remote_decode=True)
    run(engine, clock)
    assert leg.kv_block_ids is None


def test_a_decode_leg_waits_for_the_transfer_then_computes_only_the_last_partial_block() -> None:
    engine, clock = core()
    remote = RemotePrefill("prefill-engine", tuple(range(1, 7)))  # 6 blocks: 96 tokens
    leg, sink = add(engine, PROMPT, 3, remote=remote)
    first = engine.begin_step()
    # Allocated, not scheduled: nothing runs while the KV cache comes.
    assert first.empty
    assert leg.state is RequestState.WAITING_FOR_REMOTE_KVS
    assert engine.num_waiting == 1
    assert not engine.waiting
    assert engine.kv.pool.num_used_blocks == 6
    transfer = MODEL.kv_transfer_latency_s + 96 * KV_BYTES / MODEL.kv_transfer_bandwidth
    assert leg.kv_ready_at == transfer
    assert engine.next_ready_at() == transfer
    durations = run(engine, clock)
    # The first step after the transfer computes the 4 tokens the prefill pod did not
    # send, after the 96 it did.
    prefill_step = MODEL.step_time([StepChunk(4, 96)])
    assert durations[0] == prefill_step
    assert leg.first_token_time == transfer + prefill_step
    assert [o.token_ids for o in sink.items] == [(5,), (6,), (7,)]
    assert leg.num_cached_tokens == 0
    stats = engine.stats
    assert stats.decode_legs == 1
    assert stats.prefix_cache_queries == 100
    assert stats.prefix_cache_hits == 0
    assert stats.external_prefix_cache_queries == 100
    assert stats.external_prefix_cache_hits == 96
    assert stats.nixl_xfer_time.count == 1
    assert stats.nixl_xfer_time.total == transfer
    assert stats.nixl_bytes_transferred.total == 96 * KV_BYTES
    # The loaded blocks are cached like computed ones.
    assert engine.kv.pool.num_cached_blocks >= 6


def test_a_decode_leg_pulls_only_the_blocks_it_does_not_cache() -> None:
    engine, clock = core()
    add(engine, PROMPT[:80], 1)  # caches the first 5 blocks
    run(engine, clock)
    start = clock.t
    leg, _ = add(engine, PROMPT, 1, remote=RemotePrefill(None, tuple(range(1, 7))))
    run(engine, clock)
    transfer = MODEL.kv_transfer_time(16)
    assert transfer == MODEL.kv_transfer_latency_s + 16 * KV_BYTES / MODEL.kv_transfer_bandwidth
    assert leg.first_token_time == start + transfer + MODEL.step_time([StepChunk(4, 96)])
    assert leg.num_cached_tokens == 80
    assert engine.stats.external_prefix_cache_hits == 16
    assert engine.stats.nixl_bytes_transferred.total == 16 * KV_BYTES


def test_a_block_aligned_prompt_computes_its_last_token_for_the_logits() -> None:
    engine, clock = core()
    prompt = PROMPT[:96]  # 6 full blocks, all sent
    leg, _ = add(engine, prompt, 1, remote=RemotePrefill(None, tuple(range(1, 7))))
    durations = run(engine, clock)
    transfer = MODEL.kv_transfer_time(96)
    assert durations == [MODEL.step_time([StepChunk(1, 95)])]
    assert leg.first_token_time == transfer + durations[0]
    assert engine.stats.external_prefix_cache_hits == 95


def test_a_decode_leg_with_everything_cached_or_nothing_sent_prefills_here() -> None:
    engine, clock = core()
    add(engine, PROMPT, 1)
    run(engine, clock)
    start = clock.t
    cached, _ = add(engine, PROMPT, 1, remote=RemotePrefill(None, tuple(range(1, 7))))
    durations = run(engine, clock)
    assert cached.kv_transfer_tokens == 0
    assert cached.first_token_time == start + durations[0]
    assert durations[0] == MODEL.step_time([StepChunk(4, 96)])
    # A prompt shorter than a block: the prefill pod sends no block.
    engine, clock = core()
    add(engine, PROMPT[:10], 1, remote=RemotePrefill(None, ()))
    durations = run(engine, clock)
    assert durations == [MODEL.step_time([StepChunk(10, 0)])]
    assert engine.stats.nixl_xfer_time.count == 0


def test_remote_block_ids_beyond_the_prompt_are_not_pulled() -> None:
    engine, clock = core()
    leg, _ = add(engine, PROMPT, 1, remote=RemotePrefill(None, tuple(range(1, 50))))
    run(engine, clock)
    assert leg.kv_transfer_tokens == 96


def test_a_waiting_decode_leg_does_not_hold_up_the_queue() -> None:
    engine, clock = core()
    leg, _ = add(engine, PROMPT, 1, remote=RemotePrefill(None, tuple(range(1, 7))))
    other, _ = add(engine, list(range(5000, 5020)), 1)
    step = engine.begin_step()
    assert [s.request for s in step.scheduled] == [other]
    assert leg.state is RequestState.WAITING_FOR_REMOTE_KVS
    assert engine.num_waiting == 1
    clock.t += step.duration
    engine.finish_step(step)
    run(engine, clock)
    assert other.first_token_time is not None
    assert leg.first_token_time is not None
    assert other.first_token_time < leg.first_token_time


def test_a_decode_leg_waits_at_the_head_for_blocks_to_load_into() -> None:
    # 7 usable blocks: the running request holds 2 of them, the leg needs 6.
    engine, clock = core(num_gpu_blocks=8)
    running, _ = add(engine, list(range(5000, 5020)), 20)
    step = engine.begin_step()
    clock.t += step.duration
    engine.finish_step(step)
    leg, _ = add(engine, PROMPT, 1, remote=RemotePrefill(None, tuple(range(1, 7))))
    step = engine.begin_step()
    assert leg.state is RequestState.WAITING  # no blocks for it yet
    assert leg.kv_ready_at is None
    clock.t += step.duration
    engine.finish_step(step)
    run(engine, clock)
    assert running.first_token_time is not None
    assert leg.first_token_time is not None
    assert leg.kv_transfer_tokens == 96


def test_aborting_a_receiving_decode_leg_frees_its_blocks() -> None:
    engine, _ = core()
    leg, _ = add(engine, PROMPT, 1, remote=RemotePrefill(None, tuple(range(1, 7))))
    engine.begin_step()
    assert engine.kv.pool.num_used_blocks == 6
    engine.abort(leg)
    assert leg.state is RequestState.ABORTED
    assert engine.kv.pool.num_used_blocks == 0
    assert not engine.receiving
    assert engine.next_ready_at() is None


def test_a_restart_fails_receiving_decode_legs() -> None:
    engine, _ = core()
    leg, sink = add(engine, PROMPT, 1, remote=RemotePrefill(None, tuple(range(1, 7))))
    engine.begin_step()
    engine.restart()
    assert sink.items[-1].error == "engine restarted"
    assert leg.state is RequestState.ABORTED
    assert not engine.receiving


def test_a_decode_leg_pulls_its_kv_cache_once_then_decodes_normally() -> None:
    engine, clock = core()
    leg, sink = add(engine, PROMPT, 40, remote=RemotePrefill(None, tuple(range(1, 7))))
    durations = run(engine, clock)
    assert sink.items[-1].finish_reason == "length"
    assert len(leg.output_token_ids) == 40
    assert leg.loaded is False
    assert engine.stats.nixl_xfer_time.count == 1
    # One step computing the rest of the prompt, then one decode step per token.
    assert len(durations) == 40
    assert durations[1] == MODEL.step_time([StepChunk(1, 100)])


def test_a_request_cannot_be_both_legs() -> None:
    engine, _ = core()
    with pytest.raises(ValueError, match="not both"):
        add(engine, PROMPT, 1, remote_decode=True, remote=RemotePrefill(None, (1,)))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("kv_transfer_bandwidth", 0.0),
        ("kv_transfer_bandwidth", math.nan),
        ("kv_transfer_latency_s", -1.0),
    ],
)
def test_bad_transfer_settings_are_refused(field: str, value: float) -> None:
    settings: dict[str, Any] = {field: value}
    with pytest.raises(ValueError, match=field):
        LatencyModel(**settings)


def test_transfer_time_defaults() -> None:
    assert MODEL.kv_transfer_time(0) == 0.0
    # 2,000 tokens of Llama-3.1-8B's KV (262 MB) at 25 GB/s, plus 2 ms.
    assert MODEL.kv_transfer_time(2000) == pytest.approx(0.002 + 2000 * 131072 / 25e9)
    assert EngineStats().nixl_xfer_time.count == 0


async def test_the_asyncio_engine_wakes_up_when_a_transfer_ends() -> None:
    engine = Engine(EngineConfig(block_size=B, hash_seed="0", time_scale=0.02), ANSWER)
    engine.start()
    try:
        outputs: asyncio.Queue[TokenOutput] = asyncio.Queue()
        leg = engine.add_request(
            PROMPT, 2, "length", outputs, remote=RemotePrefill(None, tuple(range(1, 7)))
        )
        while True:
            out = await asyncio.wait_for(outputs.get(), 10)
            if out.finish_reason is not None:
                break
        assert leg.first_token_time is not None
        # Simulated seconds: at least the transfer and the step after it.
        waited = leg.first_token_time - leg.arrival_time
        assert waited >= MODEL.kv_transfer_time(96) + MODEL.step_time([StepChunk(4, 96)])
        assert engine.stats.nixl_xfer_time.count == 1
    finally:
        await engine.stop()
