"""`python -m bench run` end to end: real simulated pods, real Envoy, the real EPP (and
the peer routers when their virtualenv is installed); and its repeats: the policies'
order alternating, the means and their confidence intervals."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench import runner
from bench.__main__ import main
from bench.client import Arrivals, Record, RunTiming
from bench.peers import PEER_VENV, peer_venv_ready
from bench.provenance import provenance
from bench.runner import (
    PodCounters,
    Policy,
    RunOptions,
    combine_repeats,
    failed_result,
    parse_counters,
    policy_orders,
    resolve_policy,
    run_benchmark,
    summarize,
)
from bench.workloads import WorkloadSpec

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
    "client_lag_p50_s",
    "client_lag_p99_s",
    "client_lag_max_s",
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
    assert results["setup"]["repeats"] == 1
    assert results["ladder"][0]["policy_order"] == [["round-robin"]]
    # One run: no means, no intervals, no repeats.
    assert "repeats" not in result
    assert not [k for k in result if k.endswith("_ci95")]
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
    records = [
        json.loads(line) for line in (tmp_path / result["records_file"]).read_text().splitlines()
    ]
    assert len(records) == 12
    # Every request's scheduled and send times; TTFT counts from the schedule, so it
    # holds the client's lag.
    lags = sorted(r["sent_s"] - r["scheduled_s"] for r in records)
    assert all(lag >= 0 for lag in lags)
    assert result["client_lag_max_s"] == lags[-1]
    assert 0 <= result["client_lag_p50_s"] <= result["client_lag_p99_s"] <= lags[-1]
    assert all(r["ttft_s"] >= r["sent_s"] - r["scheduled_s"] for r in records)
    report = (tmp_path / "report.md").read_text()
    assert "python -m bench run --pods 2" in report
    assert "| round-robin | " in report
    assert "client lag p50 / p99 / max (s)" in report
    assert "from each request's scheduled time" in report
    assert "h_random" in report
    for plot in ("ttft_cdf.png", "hit_rate.png", "load_per_pod.png"):
        assert (tmp_path / plot).read_bytes().startswith(b"\x89PNG")


def test_hit_rate_comes_from_the_counters_not_from_the_answers() -> None:
    ok = Record(0, 0, 0, 0.0, 0.0, ok=True, ttft_s=0.1, e2e_s=0.5, prompt_tokens=100)
    ok.cached_tokens, ok.output_tokens = 90, 4
    failed = Record(1, 0, 0, 0.0, 0.0, error="http 503: no endpoint")
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


def test_client_lag_is_sent_minus_scheduled_over_the_requests_sent() -> None:
    records = [
        Record(0, 0, 0, scheduled_s=1.0, sent_s=1.0, ok=True, ttft_s=0.2),
        Record(1, 0, 1, scheduled_s=1.0, sent_s=1.25, ok=True, ttft_s=0.5),
        Record(2, 0, 2, scheduled_s=2.0, sent_s=2.5, ok=True, ttft_s=0.9),
        Record(3, 0, 3, scheduled_s=3.0, sent_s=3.125, error="http 503: busy"),
        # Never sent (its session's first turn failed): no lag.
        Record(3, 1, 3, scheduled_s=3.5, error="skipped: an earlier turn failed"),
    ]
    result = summarize(records, RunTiming(0.0, 4.0), {}, 1.0, max_error_rate=1.0)
    # Lags 0, 0.125, 0.25, 0.5 (the failed request was sent too: it counts).
    assert result["client_lag_p50_s"] == pytest.approx(0.1875)
    assert result["client_lag_p99_s"] == pytest.approx(0.25 + 0.97 * 0.25)
    assert result["client_lag_max_s"] == 0.5
    line = runner._one_line("p", Arrivals("poisson", rate=2.0), result)
    assert "client lag p50 0.188 s p99 0.492 s max 0.500 s" in line


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
    assert (
        "| broken | - | - | - | - | - | - | - | - | 3 | 3 | - | - | - | - / - / - |"
        " **FAILED**: ProcessFailed" in report
    )
    assert "| good | 0.500 |" in report
    assert json.loads((tmp_path / "results.json").read_text())["policies"]["broken"]["status"] == (
        "failed"
    )


# -- repeats -------------------------------------------------------------------------------


def test_policy_order_alternates_between_repeats() -> None:
    a, b, c = (resolve_policy(n) for n in ("round-robin", "random", "default"))
    orders = policy_orders([a, b, c], 4)
    assert [[p.name for p in order] for order in orders] == [
        ["round-robin", "random", "default"],
        ["default", "random", "round-robin"],
        ["round-robin", "random", "default"],
        ["default", "random", "round-robin"],
    ]
    assert policy_orders([a, b, c], 1) == [[a, b, c]]
    with pytest.raises(ValueError, match="repeats"):
        policy_orders([a], 0)


def _fake_result(hit_rate: float, ttft: float, lag: float) -> dict[str, Any]:
    return {
        **failed_result("", 4),
        "hit_rate": hit_rate,
        "ttft_p50_s": ttft,
        "ttft_p90_s": 2 * ttft,
        "ttft_p99_s": 3 * ttft,
        "throughput_rps": 10.0,
        "output_tokens_per_s": 100.0,
        "errors": 0,
        "max_over_mean_load": 1.0,
        "status": "ok",
        "failure": None,
        "ok_requests": 4,
        "error_kinds": {},
        "load_per_pod": {"sim-0": 2, "sim-1": 2},
        "client_lag_p50_s": lag,
        "client_lag_p99_s": 2 * lag,
        "client_lag_max_s": 3 * lag,
    }


def test_repeats_alternate_the_order_and_report_means_with_intervals(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, str]] = []
    base = {"round-robin": 0.3, "random": 0.4, "default": 0.8}

    def fake_run_policy(
        policy: Policy, arrivals: Arrivals, workload: Any, options: RunOptions, workdir: Path
    ) -> dict[str, Any]:
        runs = sum(1 for name, _ in calls if name == policy.name)
        calls.append((policy.name, str(workdir.relative_to(tmp_path))))
        workdir.mkdir(parents=True)
        record = Record(0, 0, 0, 0.0, 0.0, ok=True, ttft_s=0.1 + runs)
        (workdir / "requests.jsonl").write_text(json.dumps(record.to_json()) + "\n")
        # The k-th run of a policy: hit rate base + 0.1 k, TTFT p50 1 + k.
        result = _fake_result(base[policy.name] + 0.1 * runs, 1.0 + runs, 0.01 * (runs + 1))
        result["records_file"] = str((workdir / "requests.jsonl").relative_to(tmp_path))
        return result

    monkeypatch.setattr(runner, "run_policy", fake_run_policy)
    options = RunOptions(
        out=tmp_path,
        workload=WorkloadSpec(
            "shared-prefix",
            options={"groups": 2, "prompts_per_group": 2, "system_len": 16, "question_len": 4},
        ),
        policies=[resolve_policy(n) for n in ("round-robin", "random", "default")],
        ladder=[Arrivals("poisson", rate=2.0)],
        pods=2,
        progress=False,
        command="python -m bench run --repeats 3",
        repeats=3,
    )
    document = run_benchmark(options)

    # A B C, C B A, A B C, each run in a directory of its own.
    assert [name for name, _ in calls] == [
        "round-robin", "random", "default",
        "default", "random", "round-robin",
        "round-robin", "random", "default",
    ]  # fmt: skip
    assert len({workdir for _, workdir in calls}) == 9
    assert "runs/rate-2-s/random/repeat-2" in {workdir for _, workdir in calls}
    rung = document["ladder"][0]
    assert rung["policy_order"] == [
        ["round-robin", "random", "default"],
        ["default", "random", "round-robin"],
        ["round-robin", "random", "default"],
    ]
    # Provenance: the command, the commit, the machine; and the repeats.
    assert document["command"] == "python -m bench run --repeats 3"
    assert len(document["commit"]) == 40
    assert document["machine"]["cpus"] >= 1
    assert document["setup"]["repeats"] == 3

    result = document["policies"]["default"]
    assert document["policies"] is rung["policies"]
    # Means over the three repeats (0.8, 0.9, 1.0), the interval t(0.975, 2) s / sqrt 3.
    half = 4.3026527 * 0.1 / math.sqrt(3)
    assert result["hit_rate"] == pytest.approx(0.9)
    assert result["hit_rate_ci95"] == pytest.approx(half)
    assert result["ttft_p50_s"] == pytest.approx(2.0)
    assert result["ttft_p50_s_ci95"] == pytest.approx(10 * half)
    assert result["client_lag_max_s"] == pytest.approx(0.06)
    assert result["throughput_rps_ci95"] == 0.0
    assert result["max_over_mean_load"] == 1.0
    assert (result["requests"], result["errors"], result["status"]) == (4, 0, "ok")
    assert result["kind"] == "epp"
    assert [r["hit_rate"] for r in result["repeats"]] == pytest.approx([0.8, 0.9, 1.0])
    assert set(result) >= RESULT_KEYS | {f"{k}_ci95" for k in RESULT_KEYS}

    report = (tmp_path / "report.md").read_text()
    assert f"| default | 0.900 ± {half:.3f} | 2.000 ± {10 * half:.3f} |" in report
    assert "- rate 2/s: 1: round-robin, random, default; 2: default, random, round-robin;" in (
        report
    )
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["ladder"][0]["policy_order"] == rung["policy_order"]
    assert (tmp_path / "ttft_cdf.png").read_bytes().startswith(b"\x89PNG")


def test_combining_repeats_hides_no_failure() -> None:
    good = _fake_result(0.5, 1.0, 0.0)
    good["error_kinds"] = {"http 503": 1}
    good["errors"], good["status"] = 1, "errors"
    other = _fake_result(0.7, 2.0, 0.0)
    other["load_per_pod"] = {"sim-0": 3, "sim-1": 1}
    other["error_kinds"] = {"http 503": 2, "timeout after 9 wall seconds": 1}
    broken = failed_result("ProcessFailed: epp exited with code 1", 4)
    combined = combine_repeats([good, other, broken])
    assert combined["status"] == "failed"
    assert combined["failure"] == "repeat 3: ProcessFailed: epp exited with code 1"
    # The failed repeat has no hit rate: no mean of the other two.
    assert combined["hit_rate"] is None
    assert combined["hit_rate_ci95"] is None
    assert combined["requests"] == 4
    # Errors per repeat 1, 0 and 4 (a run that failed lost every request).
    assert combined["errors"] == pytest.approx(5 / 3)
    assert combined["error_kinds"] == {"http 503": 3, "timeout after 9 wall seconds": 1}
    assert combined["load_per_pod"] is None
    assert [r["status"] for r in combined["repeats"]] == ["errors", "ok", "failed"]

    two = combine_repeats([good, other])
    assert two["status"] == "errors"
    assert two["hit_rate"] == pytest.approx(0.6)
    assert two["hit_rate_ci95"] == pytest.approx(12.7062047 * math.sqrt(0.02) / math.sqrt(2))
    assert two["load_per_pod"] == {"sim-0": 2.5, "sim-1": 1.5}


def test_repeats_must_be_positive(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", *SMALL, "--out", str(tmp_path), "--repeats", "0"]) == 2
    assert "--repeats must be at least 1" in capsys.readouterr().err


def test_bursts_need_poisson_arrivals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", *SMALL, "--out", str(tmp_path), "--burst", "0"]) == 2
    assert "--burst must be at least 1" in capsys.readouterr().err
    # SMALL is closed loop (--concurrency): there is no arrival process to shape.
    assert main(["run", *SMALL, "--out", str(tmp_path), "--burst", "4"]) == 2
    assert "--burst shapes Poisson arrivals: give --rate" in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_repeats_through_envoy_and_the_epp(tmp_path: Path) -> None:
    code, results = run(tmp_path, "--policy", "round-robin", "--repeats", "2")
    assert code == 0
    result = results["policies"]["round-robin"]
    assert results["ladder"][0]["policy_order"] == [["round-robin"], ["round-robin"]]
    assert len(result["repeats"]) == 2
    # One request at a time: round-robin's hit rate is the same in both repeats.
    assert result["hit_rate"] == pytest.approx(results["oracle"]["h_round_robin"])
    assert result["hit_rate_ci95"] == pytest.approx(0.0, abs=1e-12)
    assert result["ttft_p50_s_ci95"] >= 0
    files = [r["records_file"] for r in result["repeats"]]
    assert files[0] != files[1]
    for name in files:
        assert len((tmp_path / name).read_text().splitlines()) == 12
    assert "±" in (tmp_path / "report.md").read_text()


def test_results_name_the_tokenizer_without_the_machines_directories() -> None:
    from bench.provenance import ROOT, portable_path

    assert portable_path(ROOT / "bench" / "traces") == "bench/traces"
    assert portable_path(ROOT / ".." / "shared" / "testdata" / "tokenizers" / "qwen2_5") == (
        "../shared/testdata/tokenizers/qwen2_5"
    )
    # Anywhere else, beside the checkout too: only the directory's name.
    assert portable_path(Path(ROOT.anchor) / "no-such-models-dir" / "qwen") == "qwen"
    assert portable_path(ROOT.parent / "some-models" / "qwen") == "qwen"
    assert portable_path(ROOT.parent / "shared-not" / "qwen") == "qwen"
