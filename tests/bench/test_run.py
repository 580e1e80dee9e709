"""`python -m bench run` end to end: real simulated pods, real Envoy, the real EPP (and
the peer routers when their virtualenv is installed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.__main__ import main
from bench.client import Record, RunTiming
from bench.peers import PEER_VENV, peer_venv_ready
from bench.provenance import provenance
from bench.runner import PodCounters, parse_counters, summarize

RESULT_KEYS = {
    "hit_rate",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "throughput_rps",
    "output_tokens_per_s",
    "requests",
    "errors",
    "max_over_mean_load",
}
# 3 groups x 4 prompts: a dozen requests, one at a time so the measured hit rate of
# round-robin is exactly the one predicted for the arrival order.
SMALL = [
    "--pods", "2", "--groups", "3", "--prompts-per-group", "4", "--system-len", "256",
    "--question-len", "24", "--output-len", "8", "--concurrency", "1", "--no-progress",
]  # fmt: skip


def run(out: Path, *args: str) -> tuple[int, dict[str, Any]]:
    code = main(["run", *SMALL, "--out", str(out), *args])
    return code, json.loads((out / "results.json").read_text())


def test_round_robin_through_envoy_and_the_epp(tmp_path: Path) -> None:
    code, results = run(tmp_path, "--policy", "round-robin")
    assert code == 0
    result = results["policies"]["round-robin"]
    assert set(result) >= RESULT_KEYS
    assert set(results["oracle"]) >= {"h_star", "h_random"}
    # Where the result came from: the command, the commit, the machine.
    assert results["command"].startswith("python -m bench run ")
    assert len(results["commit"]) == 40
    assert results["machine"]["cpus"] >= 1
    assert (result["requests"], result["errors"], result["status"]) == (12, 0, "ok")
    assert result["load_per_pod"] == {"sim-0": 6, "sim-1": 6}
    assert result["max_over_mean_load"] == 1.0
    assert result["pods_in_headers"] == {"sim-0": 6, "sim-1": 6}
    # Measured from the pods' counters, and it is what the order predicts: one
    # request at a time, round-robin sends request i to pod i mod 2.
    assert result["hit_rate"] == result["prefix_cache_hits"] / result["prefix_cache_queries"]
    assert result["hit_rate"] == pytest.approx(results["oracle"]["h_round_robin"])
    assert result["hit_rate"] == pytest.approx(result["usage_hit_rate"])
    assert 0 < result["hit_rate"] < results["oracle"]["h_star"]
    assert 0 < result["ttft_p50_s"] <= result["ttft_p90_s"] <= result["ttft_p99_s"]
    assert result["throughput_rps"] > 0
    assert result["output_tokens"] == 12 * 8
    records = (tmp_path / result["records_file"]).read_text().splitlines()
    assert len(records) == 12
    report = (tmp_path / "report.md").read_text()
    assert "python -m bench run --pods 2" in report
    assert "| round-robin | " in report
    assert "h_random" in report
    for plot in ("ttft_cdf.png", "hit_rate.png", "load_per_pod.png"):
        assert (tmp_path / plot).read_bytes().startswith(b"\x89PNG")


def test_hit_rate_comes_from_the_counters_not_from_the_answers() -> None:
    ok = Record(0, 0, 0, 0.0, ok=True, ttft_s=0.1, e2e_s=0.5, prompt_tokens=100)
    ok.cached_tokens, ok.output_tokens = 90, 4
    failed = Record(1, 0, 0, 0.0, error="http 503: no endpoint")
    counters = {
        "sim-0": PodCounters(queries=300.0, hits=30.0, requests=3),
        "sim-1": PodCounters(queries=100.0, hits=10.0, requests=1),
    }
    timing = RunTiming(first_sent=10.0, last_done=12.0)
    result = summarize([ok, failed], timing, counters, time_scale=0.5, max_error_rate=0.05)
    assert result["hit_rate"] == pytest.approx(0.1)
    assert result["usage_hit_rate"] == pytest.approx(0.9)
    assert result["max_over_mean_load"] == pytest.approx(1.5)
    assert result["duration_s"] == pytest.approx(4.0)
    assert (result["errors"], result["error_kinds"]) == (1, {"http 503": 1})
    assert result["status"] == "failed", "half the requests failed"


def test_prometheus_counters_are_parsed() -> None:
    page = (
        b"# HELP vllm:prefix_cache_hits_total Prompt tokens found.\n"
        b"# TYPE vllm:prefix_cache_hits_total counter\n"
        b'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1234.0\n'
        # A second data-parallel engine: its count adds to the pod's.
        b'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 6.0\n'
        b'vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9\n'
        b"# TYPE vllm:prefix_cache_queries_total counter\n"
        b'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 2000.0\n'
        b'vllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
    )
    assert parse_counters(page) == {"hits": 1240.0, "queries": 2000.0}


def test_an_unreadable_counter_is_an_error_not_a_zero() -> None:
    page = b'vllm:prefix_cache_hits_total{engine="0"} many\n'
    with pytest.raises(ValueError, match="not a number"):
        parse_counters(page)


def test_an_unknown_policy_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", *SMALL, "--out", str(tmp_path), "--policy", "no-such-policy"]) == 2
    assert "unknown policy 'no-such-policy'" in capsys.readouterr().err


@pytest.mark.skipif(
    not peer_venv_ready(),
    reason=f"peer routers not installed in {PEER_VENV} (`make peers` or any"
    " `python -m bench run --policy sglang-router` installs them; needs PyPI)",
)
def test_peer_routers_on_the_same_fleet(tmp_path: Path) -> None:
    code, results = run(tmp_path, "--policy", "sglang-router", "--policy", "vllm-router")
    assert code == 0
    for name in ("sglang-router", "vllm-router"):
        result = results["policies"][name]
        assert (result["status"], result["errors"]) == ("ok", 0), result.get("failure")
        assert result["kind"] == "peer"
        assert sum(result["load_per_pod"].values()) == 12
        # One request at a time: a cache-aware router keeps each group on one pod.
        assert result["hit_rate"] == pytest.approx(results["oracle"]["h_star"])


def test_a_failed_policy_is_marked_failed_in_the_report(tmp_path: Path) -> None:
    from bench.report import write_outputs
    from bench.runner import failed_result

    ok = {
        **failed_result("", 3),
        "hit_rate": 0.5,
        "errors": 0,
        "status": "ok",
        "failure": None,
        "load_per_pod": {"sim-0": 2, "sim-1": 1},
    }
    document = {
        **provenance("python -m bench run ..."),
        "wall_seconds": 1.0,
        "setup": {
            "pods": 2,
            "time_scale": 1.0,
            "block_size": 16,
            "num_gpu_blocks": None,
            "tokenizer": "builtin",
            "max_error_rate": 0.05,
        },
        "workload": {"name": "shared-prefix", "params": {}, "requests": 3, "prompt_tokens": 30},
        "oracle": {
            "h_star": 0.6,
            "h_random": 0.4,
            "h_round_robin": 0.3,
            "pods": 2,
            "block_size": 16,
            "requests": 3,
        },
        "policies": {
            "good": ok,
            "broken": failed_result("ProcessFailed: epp exited with code 1", 3),
        },
    }
    document["ladder"] = [
        {
            "label": "concurrency 1",
            "arrivals": {"kind": "closed", "rate": None},
            "policies": document["policies"],
        }
    ]
    write_outputs(document, tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "| broken | - | - | - | - | - | - | 3 | 3 | - | **FAILED**: ProcessFailed" in report
    assert "| good | 0.500 |" in report
    assert json.loads((tmp_path / "results.json").read_text())["policies"]["broken"]["status"] == (
        "failed"
    )
