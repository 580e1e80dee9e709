"""`bench run --workload tenants`: its load as a multiple of the fleet's capacity (the
lab's), its tenant summary from the lab's one implementation (bench/lab/tenants.py),
flow control's figures from the EPP's metrics, and the checks that a queued request
may wait its TTL (Envoy's timeouts, the client's)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest
import yaml

from bench.__main__ import arrivals_from_args, main
from bench.client import Arrivals, Record, scaled_starts
from bench.lab import tenants as lab_tenants
from bench.lab.tenants import over_seeds_tenants, report_lines
from bench.runner import (
    Policy,
    RunOptions,
    check_waits,
    clock_scale,
    combine_repeats,
    fleet_capacity_rps,
    flow_control_figures,
    flow_control_ttl,
    resolve_policy,
    scaled_config,
    tenants_of_run,
    tenants_window,
    waited_by_objective,
)
from bench.stack import check_queue_wait, envoy_config, queue_wait_timeouts
from bench.workloads import (
    FAIRNESS_ID_HEADER,
    OBJECTIVE_HEADER,
    Words,
    Workload,
    WorkloadSpec,
    tenants,
)

ROOT = Path(__file__).resolve().parents[2]
FLOW_CONTROL = resolve_policy("flow-control")
DEFAULT = resolve_policy("default")
SMALL = {"requests": 60, "system_len": 8, "question_len": 32, "output_len": 10}


def _workload(words: Words) -> Workload:
    return tenants(words, **SMALL)


# -- load ----------------------------------------------------------------------------------


def test_capacity_is_the_labs_on_the_tenants_workload(builtin_words: Words) -> None:
    # docs/flow-control.md: the tenants workload (4,000 requests of 64 + 1,024 prompt
    # tokens, 64 output) has a capacity of 566 requests/s on 16 pods.
    workload = tenants(builtin_words)
    assert fleet_capacity_rps(workload, builtin_words, 16) == pytest.approx(566, abs=1)
    # Linear in the pods: the same engine model on each.
    assert fleet_capacity_rps(workload, builtin_words, 8) == pytest.approx(
        fleet_capacity_rps(workload, builtin_words, 16) / 2
    )


def test_a_load_scales_the_tenants_arrival_times_to_its_rate(builtin_words: Words) -> None:
    workload = _workload(builtin_words)
    arrivals = Arrivals("trace", load=1.5).with_capacity(100.0)
    assert arrivals.rate == 150.0
    assert arrivals.label() == "load 1.5, timestamps at 150/s"
    starts = scaled_starts(workload.sessions, arrivals.rate)
    # The mean rate over the span is the one asked for, the pattern (the burst) kept.
    assert (len(starts) / (max(starts) - min(starts))) == pytest.approx(150.0)
    speed = (workload.sessions[-1].arrival_s or 0.0) / starts[-1]
    start, end = workload.params["burst_window"]
    assert tenants_window(workload, arrivals) == pytest.approx((start / speed, end / speed))
    # Poisson arrivals of a workload of 2 requests a session start half as many.
    assert Arrivals("poisson", load=2.0).with_capacity(10.0, 0.5).rate == 10.0


def _args(**given: Any) -> argparse.Namespace:
    defaults = {"workload": "tenants", "burst": 1, "concurrency": None, "load": None}
    return argparse.Namespace(**{**defaults, "rate": None, "rates": None, **given})


def test_the_tenants_workload_keeps_its_arrival_times() -> None:
    assert arrivals_from_args(_args(load=1.5)) == [Arrivals("trace", load=1.5)]
    assert arrivals_from_args(_args(rate=20.0)) == [Arrivals("trace", rate=20.0)]
    with pytest.raises(ValueError, match="needs --load"):
        arrivals_from_args(_args())
    with pytest.raises(ValueError, match="not --concurrency"):
        arrivals_from_args(_args(concurrency=4))
    with pytest.raises(ValueError, match="--burst shapes Poisson"):
        arrivals_from_args(_args(load=1.0, burst=2))
    # Other workloads: a load is Poisson arrivals.
    assert arrivals_from_args(_args(workload="no-reuse", load=0.5)) == [
        Arrivals("poisson", load=0.5)
    ]


def test_the_command_line_refuses_a_tenants_run_without_a_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["run", "--workload", "tenants", "--out", str(tmp_path)]) == 2
    assert "the tenants workload needs --load" in capsys.readouterr().err


# -- Envoy's and the client's timeouts ------------------------------------------------------


def test_the_benchs_envoy_lets_a_request_wait_its_ttl() -> None:
    config = envoy_config(listen_port=1, epp_port=2, admin_port=3)
    found = dict(queue_wait_timeouts(config))
    assert found["inference: ext_proc message_timeout"] == 1000.0
    assert found["inference: stream_idle_timeout"] == 0.0  # none
    check_queue_wait(config, 30.0 + 30.0)
    # Envoy's defaults when a timeout is left out: 200 ms per message, 5 minutes idle.
    ext_proc = config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    hcm = ext_proc["typed_config"]
    del hcm["stream_idle_timeout"]
    next(f for f in hcm["http_filters"] if "ext_proc" in f["name"])["typed_config"].pop(
        "message_timeout"
    )
    with pytest.raises(ValueError, match=r"message_timeout 0\.2s") as refused:
        check_queue_wait(config, 60.0)
    assert "stream_idle_timeout" not in str(refused.value)  # 300 s: long enough
    with pytest.raises(ValueError, match=r"stream_idle_timeout 300s"):
        check_queue_wait(config, 600.0)


def test_a_run_whose_timeouts_would_cut_the_wait_is_refused(tmp_path: Path) -> None:
    options = RunOptions(
        out=tmp_path, workload=WorkloadSpec("tenants"), policies=[FLOW_CONTROL], ladder=[]
    )
    assert flow_control_ttl(ROOT / "manifests" / "config" / "flow-control.yaml") == 30.0
    assert flow_control_ttl(ROOT / "manifests" / "config" / "default.yaml") is None
    check_waits([FLOW_CONTROL, DEFAULT], options)
    options.request_timeout_s = 50.0  # simulated s: 30 s TTL + 30 s of headroom is more
    with pytest.raises(ValueError, match="raise --request-timeout"):
        check_waits([FLOW_CONTROL], options)
    # At time scale 40 the TTL is 1,200 wall seconds: above Envoy's 1000 s.
    options.request_timeout_s, options.time_scale = 600.0, 40.0
    with pytest.raises(ValueError, match="message_timeout 1000s"):
        check_waits([FLOW_CONTROL], options)
    options.scale_ttl = False
    check_waits([FLOW_CONTROL], options)


def test_the_ttl_is_scaled_to_simulated_seconds() -> None:
    text = (ROOT / "manifests" / "config" / "flow-control.yaml").read_text()
    scaled = yaml.safe_load(scaled_config(text, 10.0))
    assert scaled["flowControl"]["defaultRequestTTL"] == "300s"
    assert "noEndpointRequestTTL" not in scaled["flowControl"]
    # The rest is the config as it was.
    original = yaml.safe_load(text)
    original["flowControl"].pop("defaultRequestTTL")
    scaled["flowControl"].pop("defaultRequestTTL")
    assert scaled == original
    unset = yaml.safe_load(scaled_config("featureGates: [flowControl]\n", 2.0))
    assert unset["flowControl"]["defaultRequestTTL"] == "120s"  # llm-d's 60 s default


def test_the_busy_time_of_the_work_weight_is_scaled_as_a_ttl(tmp_path: Path) -> None:
    """The scorer's `workWeightBusyForS` is a duration on the EPP's clock: at time
    scale 15, 5 s of the pods' time is 75 wall seconds. A config with no flow control
    gets no flowControl section."""
    profile = ROOT / "bench" / "profiles" / "predicted-ttft-busy-time.yaml"
    text = profile.read_text()
    scaled = yaml.safe_load(scaled_config(text, 15.0))
    original = yaml.safe_load(text)

    def scorer(document: dict[str, Any]) -> dict[str, Any]:
        return next(p for p in document["plugins"] if p["type"] == "predicted-ttft-scorer")

    assert scorer(original)["parameters"]["workWeightBusyForS"] == 5
    assert scorer(scaled)["parameters"].pop("workWeightBusyForS") == 75.0
    scorer(original)["parameters"].pop("workWeightBusyForS")
    assert scaled == original  # the rest as it was, and no flowControl added
    policy = resolve_policy(str(profile))
    options = RunOptions(
        out=tmp_path, workload=WorkloadSpec("shared-prefix"), policies=[policy], ladder=[]
    )
    options.time_scale = 15.0
    assert clock_scale(profile, options) == 15.0
    # The default sets it too; a config with neither it nor flow control is as written.
    assert clock_scale(ROOT / "manifests" / "config" / "default.yaml", options) == 15.0
    assert clock_scale(ROOT / "manifests" / "config" / "weighted.yaml", options) == 1.0
    options.scale_ttl = False
    assert clock_scale(profile, options) == 1.0


# -- the EPP's metrics and the tenant summary ---------------------------------------------

WAIT = "epp_flow_control_request_queue_duration_seconds"
PAGE = f"""\
# TYPE epp_flow_control_queue_size gauge
epp_flow_control_queue_size{{fairness_id="steady",priority="0"}} 0.0
# TYPE epp_flow_control_dispatch_passes_total counter
epp_flow_control_dispatch_passes_total 42.0
# TYPE epp_flow_control_requests_total counter
epp_flow_control_requests_total{{fairness_id="steady",outcome="dispatched",priority="10"}} 3.0
epp_flow_control_requests_total{{fairness_id="bursty",outcome="dispatched",priority="0"}} 5.0
epp_flow_control_requests_total{{fairness_id="bursty",outcome="ttl_expired",priority="-1"}} 2.0
# TYPE {WAIT} histogram
{WAIT}_bucket{{le="0.001",outcome="dispatched",priority="10"}} 2.0
{WAIT}_bucket{{le="0.005",outcome="dispatched",priority="10"}} 3.0
{WAIT}_count{{outcome="dispatched",priority="10"}} 3.0
{WAIT}_bucket{{le="0.001",outcome="dispatched",priority="0"}} 1.0
{WAIT}_count{{outcome="dispatched",priority="0"}} 5.0
{WAIT}_count{{outcome="ttl_expired",priority="-1"}} 2.0
""".encode()


def test_flow_control_figures_come_from_the_epps_metrics() -> None:
    figures = flow_control_figures(PAGE, None)
    assert figures == {
        "queue_peak": 0,
        "queue_peak_bytes": 0,
        "queue_samples": 0,
        "queued_at_end": 0,
        "dispatch_passes": 42,
        "outcome_dispatched": 8,
        "outcome_ttl_expired": 2,
        "waited_priority_10": 1,
        "waited_priority_0": 4,
    }
    assert flow_control_figures(b"# nothing of flow control\n", None) is None
    # Per objective by the config's priorities (critical 10, standard 0, batch -1).
    assert waited_by_objective(FLOW_CONTROL, figures) == {
        "critical": 1,
        "standard": 4,
        "batch": 0,
    }
    # Without flow control nothing waits in the EPP; a peer router does not say.
    assert waited_by_objective(DEFAULT, None) == {"critical": 0, "standard": 0, "batch": 0}
    peer = Policy("sglang-router", "peer")
    assert waited_by_objective(peer, None) == dict.fromkeys(("critical", "standard", "batch"))


def _records(workload: Workload, served_after: float) -> list[Record]:
    """A record per request: served, each first token 0.1 s after its arrival and its
    10 tokens over the next 0.9 s, let go `served_after` s after arrival; the
    bursty tenant's batch requests shed."""
    out = []
    for s in workload.sessions:
        at = s.arrival_s or 0.0
        headers = dict(s.turns[0].headers)
        record = Record(s.id, 0, s.group, at, sent_s=at)
        if headers[FAIRNESS_ID_HEADER] == "bursty" and headers[OBJECTIVE_HEADER] == "batch":
            record.status, record.error = 429, "shed: 429 rejected-ttl-expired"
        else:
            record.ok, record.status = True, 200
            record.ttft_s, record.e2e_s, record.output_tokens = 0.1, 1.0, 10
            record.routed_s = at + served_after
        out.append(record)
    return out


def test_a_bench_run_feeds_the_labs_tenant_summary(builtin_words: Words) -> None:
    workload = _workload(builtin_words)
    records = _records(workload, served_after=0.05)
    arrivals = Arrivals("trace")  # the workload's own times: its window as it is
    figures = flow_control_figures(PAGE, None)
    summary = tenants_of_run(records, workload, arrivals, FLOW_CONTROL, figures)
    # The same figures the lab's function makes of the same requests, with the
    # headers each request was sent with and the EPP's counts of who waited.
    sent = [
        (r, s.turns[0].headers, r.routed_s) for r, s in zip(records, workload.sessions, strict=True)
    ]
    expected = lab_tenants.tenants_summary(
        sent,
        tuple(workload.params["burst_window"]),
        {"flow_control": figures},
        SMALL["output_len"],
        {"critical": 1, "standard": 4, "batch": 0},
    )
    assert summary == expected
    objectives = {
        o: sum(1 for s in workload.sessions if dict(s.turns[0].headers)[OBJECTIVE_HEADER] == o)
        for o in ("critical", "standard", "batch")
    }
    assert {o: v["sent"] for o, v in summary["by_objective"].items()} == objectives
    bursty_batch = sum(
        1
        for s in workload.sessions
        if dict(s.turns[0].headers) == {FAIRNESS_ID_HEADER: "bursty", OBJECTIVE_HEADER: "batch"}
    )
    assert summary["shed"] == bursty_batch > 0
    assert summary["served"] + summary["shed"] + summary["failed"] == summary["sent"] == 60
    assert summary["by_objective"]["critical"]["queue_wait_p90_s"] == pytest.approx(0.05)
    assert summary["by_objective"]["critical"]["waited"] == 1
    assert summary["waited"] == 5
    assert 0 < summary["jain_burst"] <= 1.0
    steady = summary["by_tenant"]["steady"]
    assert steady["of_fair_share"] == pytest.approx(
        steady["served_tokens_per_s_burst"] / steady["fair_share_tokens_per_s_burst"]
    )


def test_a_request_left_in_the_queue_fails_the_summary(builtin_words: Words) -> None:
    workload = _workload(builtin_words)
    stuck = {**(flow_control_figures(PAGE, None) or {}), "queued_at_end": 1}
    with pytest.raises(RuntimeError, match="left in flow control"):
        tenants_of_run(_records(workload, 0.0), workload, Arrivals("trace"), FLOW_CONTROL, stuck)


def test_repeats_and_the_report_take_the_labs_over_seeds(builtin_words: Words) -> None:
    workload = _workload(builtin_words)
    figures = flow_control_figures(PAGE, None)
    runs = [
        tenants_of_run(_records(workload, wait), workload, Arrivals("trace"), FLOW_CONTROL, figures)
        for wait in (0.05, 0.15)
    ]
    results = [{"tenants_run": run, "tenants": over_seeds_tenants([run])} for run in runs]
    combined = combine_repeats(results)
    assert combined["tenants"] == over_seeds_tenants(runs)
    critical = combined["tenants"]["by_objective"]["critical"]
    assert critical["queue_wait_p90_s"] == pytest.approx(0.10)
    assert critical["queue_wait_p90_s_ci95"] > 0
    # Through Envoy there are no timer counts: unknown, shown as "-".
    fc = combined["tenants"]["flow_control"]
    assert fc["timer_wakeups"] is None
    assert fc["dispatch_passes"] == 84
    lines = report_lines({"flow-control": combined})
    row = next(line for line in lines if line.startswith("| flow-control | 60"))
    assert row.endswith("| 0 | 0 | 84 | - | - |")
