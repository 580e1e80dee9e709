"""The TTFT floor (bench/lab/floor.py): what it charges one request, and that the
lab's policies are bounded by it and reach it when nothing queues."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bench.lab.epp import Delays
from bench.lab.floor import request_floor_s, ttft_floor
from bench.lab.run import FleetSpec, LabOptions, run_lab
from bench.workloads import Words, WorkloadSpec, default_tokenizer_dir
from sim.engine import EngineConfig
from sim.latency import LatencyModel, StepChunk

ENGINE = EngineConfig(max_num_batched_tokens=8192)
LATENCY = LatencyModel()
DELAYS = Delays()
# Outside the engine: the cheapest router's transport, the pod's overhead, the way back.
OUTSIDE = DELAYS.peer_route_s + DELAYS.pod_overhead_s + DELAYS.response_s


def test_a_new_prompt_is_one_prefill_step_plus_the_path_around_it() -> None:
    seconds = request_floor_s(2000, 0, ENGINE, LATENCY, DELAYS)
    expected = OUTSIDE + DELAYS.pod_overhead_per_token_s * 2000 + LATENCY.prefill_time(2000)
    assert seconds == pytest.approx(expected)


def test_a_long_prompt_is_prefilled_in_chunks_of_the_step_budget() -> None:
    seconds = request_floor_s(10_000, 0, ENGINE, LATENCY, DELAYS)
    steps = LATENCY.step_time([StepChunk(8192, 0)]) + LATENCY.step_time(
        [StepChunk(10_000 - 8192, 8192)]
    )
    assert seconds == pytest.approx(OUTSIDE + DELAYS.pod_overhead_per_token_s * 10_000 + steps)
    # One step of everything would be cheaper (one overhead, one weight read).
    assert seconds > OUTSIDE + DELAYS.pod_overhead_per_token_s * 10_000 + (
        LATENCY.prefill_time(10_000)
    )


def test_a_cached_prefix_lowers_the_floor_and_at_least_one_token_is_computed() -> None:
    cold = request_floor_s(4096, 0, ENGINE, LATENCY, DELAYS)
    warm = request_floor_s(4096, 4080, ENGINE, LATENCY, DELAYS)
    assert warm < cold / 4
    for hit in (4096, 5000, -16):
        with pytest.raises(ValueError, match="at least one prompt token"):
            request_floor_s(4096, hit, ENGINE, LATENCY, DELAYS)


def test_percentiles_over_requests() -> None:
    requests = [(1000, 0)] * 9 + [(20_000, 0)]
    floor = ttft_floor(requests, ENGINE, LATENCY, DELAYS)
    assert floor is not None
    short = request_floor_s(1000, 0, ENGINE, LATENCY, DELAYS)
    long = request_floor_s(20_000, 0, ENGINE, LATENCY, DELAYS)
    assert floor.p50_s == pytest.approx(short)
    assert short < floor.p99_s < long
    assert floor.mean_s == pytest.approx((9 * short + long) / 10)
    assert ttft_floor([], ENGINE, LATENCY, DELAYS) is None


def lab(
    workload: str,
    options: dict[str, int],
    rate: float | None,
    load: float | None,
    out: Path,
    policies: tuple[str, ...] = ("round-robin", "predicted-ttft"),
    seeds: tuple[int, ...] = (0,),
) -> dict[str, Any]:
    """A lab run of `policies` on 4 pods."""
    return run_lab(
        LabOptions(
            workload=WorkloadSpec(workload, options=options),
            policies=policies,
            fleet=FleetSpec(4),
            seeds=seeds,
            load=load,
            rate=rate,
            tokenizer=default_tokenizer_dir(),
            out=out,
            command="test",
        )
    )


def test_no_policy_is_below_the_floor_under_load(tmp_path: Path, qwen_words: Words) -> None:
    shape = {
        "groups": 4,
        "prompts_per_group": 16,
        "system_len": 1024,
        "question_len": 64,
        "output_len": 32,
    }
    document = lab("shared-prefix", shape, None, 1.5, tmp_path)
    oracle = document["oracle"]
    for name, result in document["policies"].items():
        for q in ("p50", "p90", "p99"):
            assert result[f"ttft_{q}_s"] >= oracle[f"ttft_floor_{q}_s"], (name, q)
    assert "TTFT floor" in (tmp_path / "report.md").read_text()


def test_with_nothing_queued_a_request_gets_its_floor(tmp_path: Path, qwen_words: Words) -> None:
    # One request at a time, nothing shared: each runs alone on an idle pod. The lab
    # charges this EPP's route (3.8 ms) where the floor takes the cheapest (3.6).
    options = {"requests": 24, "question_len": 3000, "output_len": 4}
    document = lab("no-reuse", options, 0.5, None, tmp_path)
    floor = document["oracle"]["ttft_floor_p50_s"]
    extra = DELAYS.route_s - DELAYS.peer_route_s
    for result in document["policies"].values():
        assert result["ttft_p50_s"] == pytest.approx(floor + extra, abs=2e-4)
