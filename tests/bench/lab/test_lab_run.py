"""`python -m bench lab` end to end: determinism, the results file, bad input."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bench.__main__ import main
from bench.lab import summary
from bench.lab.cli import DELAY_FLAGS
from bench.lab.epp import Delays
from bench.lab.run import (
    PREDICTION_WARMUP,
    FleetSpec,
    LabOptions,
    prediction_error,
    prediction_error_by_tenth,
    restart_schedule,
    run_lab,
)
from bench.stats import percentile
from bench.workloads import Words, WorkloadSpec, default_tokenizer_dir

SMALL = {
    "groups": 4,
    "prompts_per_group": 8,
    "system_len": 256,
    "question_len": 32,
    "output_len": 16,
}
# What may differ between two runs of the same inputs: how long they took, when,
# and whether the checkout was edited meanwhile.
VOLATILE = {"wall_s", "wall_s_ci95", "wall_seconds", "created", "machine", "command", "dirty"}


def _stable(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _stable(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [_stable(v) for v in value]
    return value


def options(out: Path, policies: tuple[str, ...], seeds: tuple[int, ...] = (0, 1)) -> LabOptions:
    return LabOptions(
        workload=WorkloadSpec("shared-prefix", options=SMALL),
        policies=policies,
        fleet=FleetSpec(4),
        seeds=seeds,
        load=0.8,
        rate=None,
        tokenizer=default_tokenizer_dir(),
        out=out,
        command="test",
    )


def test_the_same_seeds_give_the_same_results_file(tmp_path: Path, qwen_words: Words) -> None:
    policies = ("round-robin", "default", "precise-prefix")
    first = run_lab(options(tmp_path / "a", policies))
    second = run_lab(options(tmp_path / "b", policies))
    a = json.loads((tmp_path / "a" / "results.json").read_text())
    b = json.loads((tmp_path / "b" / "results.json").read_text())
    assert _stable(a) == _stable(b)
    for name in policies:
        result = first["policies"][name]
        assert result["requests"] == 32
        assert result["errors"] == 0
        assert [run["seed"] for run in result["runs"]] == [0, 1]
        # Seeds differ (workload text, arrivals, tie-breaks): a CI is computed.
        assert result["ttft_p90_s_ci95"] is not None
    # The precise profile learnt from KV events: it found what the pods cached.
    assert (
        first["policies"]["precise-prefix"]["hit_rate"]
        > first["policies"]["round-robin"]["hit_rate"]
    )
    assert second["oracle"]["h_star"] > 0.5
    report = (tmp_path / "a" / "report.md").read_text()
    assert "| precise-prefix |" in report
    for plot in ("ttft_cdf.png", "hit_rate.png", "load_per_pod.png"):
        assert (tmp_path / "a" / plot).stat().st_size > 1000
    # Several runs' results in one table.
    rows = summary.table([tmp_path / "a", tmp_path / "b"]).splitlines()
    assert len(rows) == 2 + 2 * len(policies)
    assert rows[2].startswith("| shared-prefix | 4 | 0.80 | round-robin | ")


def test_the_command_line_runs_and_rejects_bad_input(
    tmp_path: Path, qwen_words: Words, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cli"
    argv = ["lab", "--pods", "2", "--seeds", "1", "--groups", "2", "--prompts-per-group", "4",
            "--system-len", "64", "--question-len", "16", "--output-len", "8",
            "--policy", "round-robin", "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    document = json.loads((out / "results.json").read_text())
    assert document["command"].startswith("python -m bench lab --pods 2")
    assert document["commit"]
    assert document["policies"]["round-robin"]["requests"] == 8
    assert "round-robin: hit rate" in capsys.readouterr().out

    for bad, message in [
        (["--load", "0"], "--load must be a finite number > 0"),
        (["--seeds", "0"], "--seeds must be at least 1"),
        (["--policy", "no-such-policy"], "unknown policy 'no-such-policy'"),
        (["--policy", "sglang-router"], "the real peer routers run in `python -m bench run`"),
        (["--turns", "3"], "--turns do(es) not apply to the shared-prefix workload"),
        (["--workload", "trace"], "the trace workload needs --trace FILE"),
        (["--route-delay", "-1"], "delay route_s must be a finite number >= 0"),
        (["--burst", "0"], "--burst must be at least 1"),
        (["--epp-replicas", "0"], "--epp-replicas must be at least 1"),
        (["--workload", "trace", "--trace", str(out), "--burst", "4"], "--burst shapes Poisson"),
        (["--restarts", "-1"], "--restarts must be at least 0"),
        (["--restarts", "2", "--prefill-pods", "1"], "--restarts are not modelled in a P/D"),
    ]:
        bad_out = tmp_path / "bad"
        code = main(["lab", "--pods", "2", "--seeds", "1", "--out", str(bad_out), *bad])
        assert code == 2, bad
        assert message in capsys.readouterr().err
        assert not (bad_out / "results.json").exists()


def test_a_config_outside_the_checkout_runs_and_is_recorded_by_its_name(
    tmp_path: Path, qwen_words: Words
) -> None:
    # Its path relative to the checkout does not exist: the results file names the
    # file alone (as it names no directory of the machine), and the run completes.
    shipped = Path(__file__).parents[3] / "manifests" / "config" / "round-robin.yaml"
    config = tmp_path / "mine.yaml"
    config.write_text(shipped.read_text())
    out = tmp_path / "outside"
    argv = ["lab", "--pods", "2", "--seeds", "1", "--groups", "2", "--prompts-per-group", "2",
            "--system-len", "32", "--question-len", "8", "--output-len", "4",
            "--policy", str(config), "--out", str(out), "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    runs = json.loads((out / "results.json").read_text())["policies"]["mine"]["runs"]
    assert [run["config"] for run in runs] == ["mine.yaml"]


def test_save_requests_writes_each_runs_requests_beside_its_results(
    tmp_path: Path, qwen_words: Words
) -> None:
    out = tmp_path / "requests"
    argv = ["lab", "--pods", "2", "--seeds", "2", "--groups", "2", "--prompts-per-group", "3",
            "--system-len", "32", "--question-len", "8", "--output-len", "4",
            "--policy", "round-robin", "--policy", "default", "--out", str(out),
            "--no-progress", "--save-requests"]  # fmt: skip
    assert main(argv) == 0
    document = json.loads((out / "results.json").read_text())
    files = sorted(p.name for p in (out / "requests").iterdir())
    assert files == [f"{policy}-seed{seed}.jsonl" for policy in ("default", "round-robin")
                     for seed in (0, 1)]  # fmt: skip
    for policy in ("default", "round-robin"):
        for run in document["policies"][policy]["runs"]:
            lines = (out / "requests" / f"{policy}-seed{run['seed']}.jsonl").read_text()
            requests = [json.loads(line) for line in lines.splitlines()]
            # Every request of the run, each as it was served: its TTFT is the run's.
            assert len(requests) == run["requests"] == 6
            assert all(r["ok"] and r["pod"] in ("pod-0", "pod-1") for r in requests)
            ttfts = sorted(r["ttft_s"] for r in requests)
            assert percentile(ttfts, 0.9) == pytest.approx(run["ttft_p90_s"])
            # ... and its TPOT: the run's median is the requests'.
            assert all(r["last_token_s"] >= r["ttft_s"] for r in requests)
            tpots = sorted(r["tpot_s"] for r in requests)
            assert percentile(tpots, 0.5) == pytest.approx(run["tpot_p50_s"])
            assert [r["scheduled_s"] for r in requests] == sorted(
                r["scheduled_s"] for r in requests
            )
            assert "records" not in run  # written out, not kept in results.json
    # Without the flag, no requests are written.
    plain = tmp_path / "plain"
    assert main([*argv[:-3], str(plain), "--no-progress"]) == 0
    assert not (plain / "requests").exists()


def test_every_delay_has_its_flag_and_the_flags_set_them(tmp_path: Path, qwen_words: Words) -> None:
    assert {field for _, field, _ in DELAY_FLAGS} == set(Delays.__dataclass_fields__)
    out = tmp_path / "delays"
    argv = ["lab", "--pods", "2", "--seeds", "1", "--groups", "2", "--prompts-per-group", "2",
            "--system-len", "32", "--question-len", "8", "--output-len", "4",
            "--policy", "round-robin", "--out", str(out), "--no-progress",
            "--route-delay", "0.25", "--metrics-interval", "0.1"]  # fmt: skip
    assert main(argv) == 0
    delays = json.loads((out / "results.json").read_text())["setup"]["delays"]
    assert delays["route_s"] == 0.25
    assert delays["metrics_interval_s"] == 0.1
    assert delays["kv_event_s"] == Delays().kv_event_s
    # A whole route delay of 0.25 s is in every request's TTFT.
    runs = json.loads((out / "results.json").read_text())["policies"]["round-robin"]
    assert runs["ttft_p50_s"] > 0.25


def test_bursts_of_arrivals_queue_requests_at_the_same_mean_rate(
    tmp_path: Path, qwen_words: Words
) -> None:
    plain = run_lab(options(tmp_path / "plain", ("round-robin",), seeds=(0,)))
    bursty = run_lab(replace(options(tmp_path / "bursty", ("round-robin",), seeds=(0,)), burst=8))
    assert bursty["setup"]["burst"] == 8
    assert "bursts of 8" in (tmp_path / "bursty" / "report.md").read_text()
    assert bursty["setup"]["rate_rps"] == plain["setup"]["rate_rps"]
    # Eight requests land on four pods at once: some wait behind another's prefill.
    assert (
        bursty["policies"]["round-robin"]["ttft_p90_s"]
        > plain["policies"]["round-robin"]["ttft_p90_s"]
    )


def test_epp_replicas_each_keep_their_own_state(tmp_path: Path, qwen_words: Words) -> None:
    one = run_lab(options(tmp_path / "one", ("default", "precise-prefix"), seeds=(0,)))
    spec = replace(options(tmp_path / "four", ("default", "precise-prefix"), seeds=(0,)))
    four = run_lab(replace(spec, fleet=FleetSpec(4, epp_replicas=4)))
    assert four["setup"]["epp_replicas"] == 4
    assert "EPP replicas behind Envoy: 4" in (tmp_path / "four" / "report.md").read_text()
    for name in ("default", "precise-prefix"):
        (run,) = four["policies"][name]["runs"]
        assert run["router"]["picks"] == 32  # every request picked once, by one replica
    # Four approximate indexes each learn a quarter of the picks: the default finds
    # less than one EPP does. The precise indexes all follow every pod's KV events.
    assert four["policies"]["default"]["hit_rate"] < one["policies"]["default"]["hit_rate"]
    assert four["policies"]["precise-prefix"]["hit_rate"] > four["policies"]["default"]["hit_rate"]


def test_restarts_are_spread_over_the_arrivals_and_the_pods() -> None:
    starts = [1.0 + 0.01 * i for i in range(1001)]  # arrivals from 1 s to 11 s
    schedule = restart_schedule(6, 4, starts, seed=3)
    assert [at for at, _ in schedule] == pytest.approx([1 + 10 * k / 7 for k in range(1, 7)])
    pods = [pod for _, pod in schedule]
    assert sorted(pods[:4]) == [0, 1, 2, 3]  # each pod once before any twice
    assert pods[4:] == pods[:2]
    assert restart_schedule(6, 4, starts, seed=3) == schedule  # the same for every policy
    assert restart_schedule(6, 4, starts, seed=4) != schedule
    assert restart_schedule(0, 4, starts, seed=3) == []


def test_a_restarted_pods_requests_are_sent_again_and_all_complete(
    tmp_path: Path, qwen_words: Words
) -> None:
    spec = options(tmp_path / "restarts", ("default", "precise-prefix"), seeds=(0,))
    document = run_lab(replace(spec, fleet=FleetSpec(4, restarts=2)))
    assert document["setup"]["restarts"] == 2
    report = (tmp_path / "restarts" / "report.md").read_text()
    assert "pod restarts: 2 per run" in report
    schedules = []
    for name in ("default", "precise-prefix"):
        (run,) = document["policies"][name]["runs"]
        schedules.append((run["restarts"]["at_s"], run["restarts"]["pods"]))
        # Every request a restart dropped is an error, sent again, and then served.
        assert run["errors"] == run["restarts"]["resent"]
        assert run["ok_requests"] == 32
        assert run["requests"] == 32 + run["errors"]
    assert schedules[0] == schedules[1]
    assert len(schedules[0][1]) == 2
    # At this load every pod has requests in flight most of the time.
    (run,) = document["policies"]["default"]["runs"]
    assert run["errors"] > 0


def test_predictions_are_set_beside_what_the_epp_then_observed(
    tmp_path: Path, qwen_words: Words
) -> None:
    document = run_lab(options(tmp_path / "p", ("predicted-ttft", "round-robin"), seeds=(0,)))
    predicted = document["policies"]["predicted-ttft"]
    (run,) = predicted["runs"]
    pairs = run["ttft_predictions"]
    assert len(pairs) == 32  # one per request, each with its first chunk
    assert all(p > 0 and o > 0 for p, o in pairs)
    errors = sorted(abs(p - o) / o for p, o in pairs)
    assert predicted["ttft_prediction_error_p50"] == pytest.approx((errors[15] + errors[16]) / 2)
    assert predicted["ttft_prediction_error_p90"] >= predicted["ttft_prediction_error_p50"]
    # 32 predictions: none after warm-up, but a median for each tenth of the run.
    assert predicted["ttft_prediction_error_p50_warm"] is None
    tenths = run["ttft_prediction_error_p50_by_tenth"]
    assert len(tenths) == 10
    assert min(tenths) <= predicted["ttft_prediction_error_p50"] <= max(tenths)
    # Round-robin predicts nothing: no figures, no plot panel.
    assert document["policies"]["round-robin"]["ttft_prediction_error_p50"] is None
    assert document["policies"]["round-robin"]["runs"][0]["ttft_predictions"] == []
    assert (tmp_path / "p" / "ttft_predicted_vs_observed.png").stat().st_size > 1000
    report = (tmp_path / "p" / "report.md").read_text()
    assert "- predicted-ttft: error p50 " in report
    assert "error p50 by tenth of the run: " in report
    assert "after each run's first" not in report  # too short a run to have one
    assert "round-robin: error" not in report
    # results.json keeps the figures, not the pairs.
    saved = json.loads((tmp_path / "p" / "results.json").read_text())
    assert "ttft_predictions" not in saved["policies"]["predicted-ttft"]["runs"][0]
    assert saved["policies"]["predicted-ttft"]["ttft_prediction_error_p50"] is not None


def test_the_error_after_warm_up_leaves_out_the_models_first_predictions() -> None:
    # The first predictions twice the observed TTFT (a prior far off), the rest 10%
    # above it, and the last tenth 50% below it (a queue the model missed).
    n = 2 * PREDICTION_WARMUP
    late = n - n // 10
    pairs = [(0.2 if i < PREDICTION_WARMUP else 0.11 if i < late else 0.05, 0.1) for i in range(n)]
    errors = prediction_error(pairs)
    assert errors["ttft_prediction_error_p50"] == pytest.approx(0.75)  # between 0.5 and 1.0
    assert errors["ttft_prediction_error_p50_warm"] == pytest.approx(0.1)
    assert errors["ttft_prediction_bias_p50"] == pytest.approx(0.55)
    tenths = prediction_error_by_tenth(pairs)
    assert tenths is not None
    assert tenths == pytest.approx([1.0] * 5 + [0.1] * 4 + [0.5])
    assert prediction_error_by_tenth(pairs[:9]) is None
    assert prediction_error_by_tenth([(0.1, 0.0)] * 20) is None  # nothing observed
    assert prediction_error(pairs[:PREDICTION_WARMUP])["ttft_prediction_error_p50_warm"] is None
    assert prediction_error([])["ttft_prediction_error_p50_warm"] is None


@pytest.mark.parametrize(
    ("workload", "shape"),
    [
        ("shared-prefix", ["--groups", "2", "--prompts-per-group", "3", "--system-len", "64"]),
        ("hot-prefix", ["--groups", "2", "--requests", "6", "--system-len", "64"]),
        ("multi-turn", ["--conversations", "2", "--turns", "3", "--system-len", "64"]),
        ("no-reuse", ["--requests", "6"]),
        ("rag", ["--documents", "2", "--requests", "6", "--document-len", "64"]),
        ("tenants", ["--requests", "20", "--system-len", "64"]),
        ("trace", ["--trace-limit", "6"]),
    ],
)
def test_every_workload_runs_on_the_simulators_own_tokenizer(
    tmp_path: Path, workload: str, shape: list[str]
) -> None:
    """No model files needed: the built-in tokenizer keeps a word one piece wherever
    it stands, as the lab's token ids assume (and check against it)."""
    if workload == "trace":
        trace = tmp_path / "trace.jsonl"
        records = [
            {"timestamp": 100 * i, "input_length": 900, "output_length": 8, "hash_ids": [0, i + 1]}
            for i in range(6)
        ]
        trace.write_text("".join(json.dumps(r) + "\n" for r in records))
        shape = [*shape, "--trace", str(trace)]
    else:
        shape = [*shape, "--output-len", "8"]
    out = tmp_path / "out"
    argv = ["lab", "--workload", workload, "--tokenizer", "builtin", "--pods", "2",
            "--seeds", "1", "--policy", "default", "--out", str(out), "--no-progress",
            *shape]  # fmt: skip
    assert main(argv) == 0
    document = json.loads((out / "results.json").read_text())
    assert document["setup"]["tokenizer"] == "builtin"
    result = document["policies"]["default"]
    assert result["requests"] >= 6
    assert result["errors"] == 0
