"""Quiet decoding (sim/engine.py): an engine whose requests only want their first
token and their end runs every step exactly as one that touches each request every
step: same durations, KV events, preemptions, blocks, tokens and counters."""

from __future__ import annotations

import random
from dataclasses import asdict

import pytest

from sim.engine import EngineConfig, EngineCore, EngineRequest, RequestState, TokenOutput

ANSWER = [5, 6, 7, 8, 9]


class Outputs:
    def __init__(self, clock: list[float]) -> None:
        self.clock = clock
        self.got: list[tuple[float, TokenOutput]] = []

    def put_nowait(self, item: TokenOutput, /) -> None:
        self.got.append((self.clock[0], item))


class Twin:
    """One engine: the same calls as its twin, its own clock and outputs."""

    def __init__(self, config: EngineConfig, quiet: bool) -> None:
        self.clock = [0.0]
        self.quiet = quiet
        self.core = EngineCore(config, ANSWER, clock=lambda: self.clock[0])
        self.requests: list[EngineRequest] = []
        self.outputs: list[Outputs] = []

    def add(self, prompt: list[int], max_tokens: int, stream: bool, quiet: bool = True) -> None:
        outputs = Outputs(self.clock)
        request = self.core.add_request(
            prompt, max_tokens, "length", outputs, stream=stream, quiet=self.quiet and quiet
        )
        self.requests.append(request)
        self.outputs.append(outputs)

    def state(self, full: bool = True) -> tuple[object, ...]:
        core = self.core
        pool = core.kv.pool
        state = (
            [r.request_id for r in core.waiting],
            [r.request_id for r in core.running],
            pool.num_free_blocks,
            core.stats.generation_tokens,
            core.stats.preemptions,
        )
        if not full:
            return state
        return (
            *state,
            pool.free_queue_ids(),
            sorted(pool.cached_hashes()),
            pool.num_cached_blocks,
            asdict(core.stats),
        )


def scenario(seed: int) -> None:
    rng = random.Random(seed)
    config = EngineConfig(
        block_size=rng.choice([2, 4, 16]),
        num_gpu_blocks=rng.choice([12, 30, 80, 400]),
        max_num_seqs=rng.choice([2, 5, 64]),
        # Small budgets: not every running request gets a token every step.
        max_num_batched_tokens=rng.choice([4, 8, 24, 64, 8192]),
        hash_seed="0",
    )
    capacity = (config.num_gpu_blocks - 1) * config.block_size
    loud, quiet = Twin(config, False), Twin(config, True)
    twins = (loud, quiet)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(1, 40))] for _ in range(3)]
    steps = 0
    while steps < 250:
        for _ in range(rng.choice([0, 0, 0, 0, 1, 2, 12])):
            prompt = rng.choice(prefixes)[: rng.randrange(1, 40)]
            prompt += [rng.randrange(1000) for _ in range(rng.randrange(0, 30))]
            max_tokens = rng.choice([1, 2, 3, 17, 40, 90])
            if len(prompt) + max_tokens > min(capacity, config.max_model_len):
                continue
            stream = rng.random() < 0.8
            for twin in twins:
                twin.add(prompt, max_tokens, stream)
        if rng.random() < 0.03 and loud.requests:
            index = rng.randrange(len(loud.requests))  # between steps
            for twin in twins:
                twin.core.abort(twin.requests[index])
        a, b = (twin.core.begin_step() for twin in twins)
        assert (a.duration, a.preempted, a.empty) == (b.duration, b.preempted, b.empty)
        if rng.random() < 0.03 and loud.requests:
            index = rng.randrange(len(loud.requests))  # during the step
            for twin in twins:
                twin.core.abort(twin.requests[index])
        if not a.empty:
            for twin, step in zip(twins, (a, b), strict=True):
                twin.clock[0] += step.duration
                twin.core.finish_step(step)
        assert loud.core.take_events() == quiet.core.take_events()
        assert loud.state(steps % 16 == 0) == quiet.state(steps % 16 == 0)
        steps += 1
        if not loud.core.has_work and rng.random() < 0.2:
            break
    # Run everything to its end, then compare every request.
    while loud.core.has_work:
        a, b = (twin.core.begin_step() for twin in twins)
        assert (a.duration, a.preempted, a.empty) == (b.duration, b.preempted, b.empty)
        for twin, step in zip(twins, (a, b), strict=True):
            if not step.empty:
                twin.clock[0] += step.duration
                twin.core.finish_step(step)
        assert loud.core.take_events() == quiet.core.take_events()
        assert loud.state(full=False) == quiet.state(full=False)
    assert loud.state() == quiet.state()
    assert not quiet.core.has_work
    for x, y, out_x, out_y in zip(
        loud.requests, quiet.requests, loud.outputs, quiet.outputs, strict=True
    ):
        assert x.state == y.state
        assert x.seq.token_ids == y.seq.token_ids
        assert x.seq.block_hashes == y.seq.block_hashes
        assert x.output_token_ids == y.output_token_ids
        assert (x.num_computed_tokens, x.num_cached_tokens, x.num_preemptions) == (
            y.num_computed_tokens,
            y.num_cached_tokens,
            y.num_preemptions,
        )
        assert x.first_token_time == y.first_token_time
        if x.state is RequestState.FINISHED:
            # Quiet: the first token and the end (the same outputs at the same times).
            expected = out_x.got if not x.stream else [out_x.got[0], out_x.got[-1]]
            if len(out_x.got) == 1:
                expected = out_x.got
            assert out_y.got == expected


@pytest.mark.parametrize("seed", range(40))
def test_quiet_requests_step_exactly_as_loud_ones(seed: int) -> None:
    scenario(seed)


def test_a_quiet_request_is_skipped_between_its_blocks() -> None:
    # One request decoding alone: it is scheduled one by one only where it caches a
    # block, takes a block or ends; the other steps are priced from running totals.
    core = EngineCore(EngineConfig(block_size=16, num_gpu_blocks=100), ANSWER, clock=lambda: 0.0)
    outputs = Outputs([0.0])
    request = core.add_request(list(range(100, 120)), 40, "length", outputs, quiet=True)
    loud_steps = quiet_steps = 0
    while core.has_work:
        step = core.begin_step()
        loud_steps += bool(step.scheduled)
        quiet_steps += step.quiet
        core.finish_step(step)
    assert loud_steps + quiet_steps == 40
    assert quiet_steps > 25
    assert request.output_token_ids == [ANSWER[i % len(ANSWER)] for i in range(40)]
    assert [o.token_ids for _, o in outputs.got] == [(5,), (9,)]
    assert core.stats.generation_tokens == 40


def test_quiet_requests_a_step_cannot_all_serve_are_scheduled_one_by_one() -> None:
    # The scheduler never gets there by itself (only its last running request can be
    # short of budget), so a loud request at the head of the queue is made to
    # recompute its last tokens: the budget of 8 then covers it and one of the three
    # quiet requests behind it, as it does without quiet decoding.
    config = EngineConfig(block_size=4, num_gpu_blocks=60, max_num_batched_tokens=8)
    loud, quiet = Twin(config, False), Twin(config, True)
    for twin in (loud, quiet):
        twin.add(list(range(10, 17)), 60, stream=True, quiet=False)
        for first in (20, 30, 40):
            twin.add(list(range(first, first + 5)), 60, stream=True)
    for _ in range(8):
        a, b = loud.core.begin_step(), quiet.core.begin_step()
        assert a.duration == b.duration
        loud.core.finish_step(a)
        quiet.core.finish_step(b)
    assert len(quiet.core._quiet) == 3
    for twin in (loud, quiet):
        twin.requests[0].num_computed_tokens -= 6
    a, b = loud.core.begin_step(), quiet.core.begin_step()
    assert [(s.request.request_id, s.new_tokens) for s in a.scheduled] == [
        ("req-1", 7),
        ("req-2", 1),
    ]
    assert (a.duration, len(b.scheduled), b.quiet) == (b.duration, 2, 0)
    for twin, step in ((loud, a), (quiet, b)):
        twin.core.finish_step(step)
    while loud.core.has_work:
        a, b = loud.core.begin_step(), quiet.core.begin_step()
        assert a.duration == b.duration
        loud.core.finish_step(a)
        quiet.core.finish_step(b)
        assert loud.state() == quiet.state()
    for x, y in zip(loud.requests, quiet.requests, strict=True):
        assert x.output_token_ids == y.output_token_ids
