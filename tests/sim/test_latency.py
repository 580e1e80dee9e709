"""The step-time model lands on its calibration targets and has the right shape."""

from __future__ import annotations

import pytest

from sim.latency import LatencyModel, StepChunk

MODEL = LatencyModel()


def test_prefill_of_2000_tokens_is_45_to_50_ms() -> None:
    assert 0.045 <= MODEL.prefill_time(2000) <= 0.050


def test_prefill_has_a_quadratic_attention_term() -> None:
    # Compute-bound prefill grows faster than linearly with the prompt.
    assert MODEL.prefill_time(8000) > 4 * MODEL.prefill_time(2000) - 3 * MODEL.step_overhead_s
    # A cached prefix still costs attention for the new tokens.
    assert MODEL.prefill_time(1000, cached_tokens=7000) > MODEL.prefill_time(1000)


def test_a_prefix_hit_cuts_ttft() -> None:
    assert MODEL.prefill_time(200, cached_tokens=1800) < MODEL.prefill_time(2000) / 4


def test_decode_step_grows_with_batch_and_context() -> None:
    one = MODEL.decode_step_time(1, 1000)
    assert 0.005 <= one <= 0.009  # ~140 tokens/s for a single stream
    assert MODEL.decode_step_time(64, 1000) > one
    assert MODEL.decode_step_time(256, 1000) > MODEL.decode_step_time(64, 1000)
    assert MODEL.decode_step_time(64, 4000) > MODEL.decode_step_time(64, 1000)
    # But batching pays: per-token time falls with the batch.
    assert MODEL.decode_step_time(64, 1000) / 64 < one / 10


def test_mixed_step_and_empty_step() -> None:
    assert MODEL.step_time([]) == 0.0
    mixed = MODEL.step_time([StepChunk(500, 0), *[StepChunk(1, 500)] * 8])
    assert mixed >= MODEL.prefill_time(500)
    assert mixed == pytest.approx(MODEL.prefill_time(500), rel=0.2)
