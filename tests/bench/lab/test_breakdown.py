"""Where the TTFT went (bench/lab/breakdown.py): the parts add up to each request's
TTFT, each part grows with what it names, and a run's report shows them."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.lab.breakdown import PART_KEYS, PARTS, ServedWhole, summarize_parts, ttft_parts
from bench.lab.epp import Delays
from bench.lab.floor import prefill_alone_s, request_floor_s
from bench.workloads import Words
from sim.engine import EngineConfig
from sim.latency import LatencyModel
from tests.bench.lab.test_floor import lab

ENGINE = EngineConfig()
LATENCY = LatencyModel()
DELAYS = Delays()


def _served(ttft_s: float, cached: int, queue_s: float, batch_s: float) -> ServedWhole:
    """A 4,096-token prompt whose prefill took its time alone plus `batch_s`."""
    prefill = prefill_alone_s(4096, cached, ENGINE, LATENCY) + batch_s
    return ServedWhole((0, 0), ttft_s, 4096, cached, queue_s, prefill)


def test_a_request_served_as_its_floor_has_nothing_but_its_floor_and_router_path() -> None:
    floor = request_floor_s(4096, 2048, ENGINE, LATENCY, DELAYS)
    parts = ttft_parts(_served(floor, 2048, 0.0, 0.0), 2048, ENGINE, LATENCY, DELAYS)
    assert parts["floor"] == pytest.approx(floor)
    for part in ("miss", "queue", "batch", "other"):
        assert parts[part] == pytest.approx(0.0, abs=1e-12)


def test_the_parts_add_up_and_each_takes_its_own_cause() -> None:
    floor = request_floor_s(4096, 2048, ENGINE, LATENCY, DELAYS)
    cold = request_floor_s(4096, 0, ENGINE, LATENCY, DELAYS)
    # Its pod held nothing of the 2,048 tokens some pod held, it waited 30 ms in the
    # queue, its steps carried 5 ms of batch-mates, and the router took 2 ms more.
    ttft = cold + 0.030 + 0.005 + 0.002
    parts = ttft_parts(_served(ttft, 0, 0.030, 0.005), 2048, ENGINE, LATENCY, DELAYS)
    assert sum(parts.values()) == pytest.approx(ttft)
    assert parts["floor"] == pytest.approx(floor)
    assert parts["miss"] == pytest.approx(cold - floor)
    assert parts["miss"] > 0
    assert parts["queue"] == pytest.approx(0.030)
    assert parts["batch"] == pytest.approx(0.005)
    assert parts["other"] == pytest.approx(0.002)


def test_the_tail_is_the_requests_at_or_above_the_p90() -> None:
    floor = request_floor_s(4096, 0, ENGINE, LATENCY, DELAYS)
    # Nine requests at their floor, one that queued a second.
    requests = [
        ServedWhole((i, 0), floor, 4096, 0, 0.0, prefill_alone_s(4096, 0, ENGINE, LATENCY))
        for i in range(9)
    ]
    slow = _served(floor + 1.0, 0, 1.0, 0.0)
    requests.append(ServedWhole((9, 0), slow.ttft_s, 4096, 0, 1.0, slow.prefill_s))
    out = summarize_parts(requests, {(i, 0): 0 for i in range(10)}, ENGINE, LATENCY, DELAYS)
    assert out["ttft_all_queue_s"] == pytest.approx(0.1)
    assert out["ttft_tail_queue_s"] == pytest.approx(1.0)
    assert out["ttft_tail_floor_s"] == pytest.approx(floor)
    assert summarize_parts([], {}, ENGINE, LATENCY, DELAYS) == dict.fromkeys(PART_KEYS)


def test_a_request_without_its_h_star_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"no h\*.*session 0, turn 0"):
        summarize_parts([_served(0.1, 0, 0.0, 0.0)], {(1, 0): 0}, ENGINE, LATENCY, DELAYS)


SHAPE = {
    "groups": 4,
    "prompts_per_group": 8,
    "system_len": 1024,
    "question_len": 32,
    "output_len": 16,
}
POLICIES = ("round-robin", "precise-prefix")


def test_a_lab_run_cuts_its_requests_ttft_and_reports_it(tmp_path: Path, qwen_words: Words) -> None:
    light = lab("shared-prefix", SHAPE, None, 0.3, tmp_path / "light", POLICIES, (0, 1))
    heavy = lab("shared-prefix", SHAPE, None, 3.0, tmp_path / "heavy", POLICIES, (0, 1))
    for document in (light, heavy):
        for result in document["policies"].values():
            for run in result["runs"]:
                # Every request is served whole: the parts' means add up to the mean TTFT.
                total = sum(run[f"ttft_all_{part}_s"] for part in PARTS)
                assert total == pytest.approx(run["ttft_mean_s"])
                assert run["ttft_all_queue_s"] >= 0
                assert run["ttft_all_batch_s"] >= -1e-9
                tail = sum(run[f"ttft_tail_{part}_s"] for part in PARTS)
                assert tail >= total
    # Round-robin sends each group's prompt to every pod: it misses what the precise
    # index finds.
    for document in (light, heavy):
        policies = document["policies"]
        assert (
            policies["round-robin"]["ttft_all_miss_s"]
            > policies["precise-prefix"]["ttft_all_miss_s"]
        )
    # Ten times the load: requests wait for each other.
    for name in ("round-robin", "precise-prefix"):
        assert (
            heavy["policies"][name]["ttft_all_queue_s"]
            > light["policies"][name]["ttft_all_queue_s"]
        )
    report = (tmp_path / "heavy" / "report.md").read_text()
    assert "Where the TTFT went" in report
    assert "| round-robin | tail (≥ p90) |" in report
