"""Flow control in the routing lab: requests wait in virtual time and are dispatched
by lab events; every request is served or answered; the tenants workload's shape."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.client import Record
from bench.lab.run import FleetSpec, LabOptions, LabPolicy, build_workload, run_lab, run_once
from bench.lab.tenants import Sent, fair_shares, jain, tenants_summary
from bench.workloads import (
    BURST_FACTOR,
    BURST_WINDOW,
    FAIRNESS_ID_HEADER,
    OBJECTIVE_HEADER,
    Words,
    WorkloadSpec,
    answer_ids,
    default_tokenizer_dir,
    tenants,
)
from epp.scheduling.registry import PluginRegistry
from tests.bench.lab.test_lab_run import _stable

ROOT = Path(__file__).resolve().parents[3]
FLOW_CONTROL = ROOT / "manifests" / "config" / "flow-control.yaml"
SMALL = {"requests": 300, "system_len": 16, "question_len": 256, "output_len": 16}


def _run(words: Words, config: Path, load_speed: float, seed: int = 0) -> dict[str, Any]:
    """The small tenants workload on 2 pods, its arrivals `load_speed` times as fast
    as its own units (one steady request per unit)."""
    from bench.lab.run import _scaled

    workload = _scaled(
        build_workload(WorkloadSpec("tenants", options=SMALL), words, seed), load_speed
    )
    factory = LabPolicy(config.stem, config).router_factory(
        PluginRegistry.from_entry_points(), default_tokenizer_dir()
    )
    return run_once(factory, workload, FleetSpec(2), answer_ids(words.tokenizer, 4096), None, seed)


def test_queued_requests_wait_in_virtual_time_and_are_all_served(qwen_words: Words) -> None:
    result = _run(qwen_words, FLOW_CONTROL, load_speed=150.0)
    t = result["tenants"]
    # Requests waited in the EPP's queue, and were dispatched later by lab events.
    assert t["waited"] > 0
    waits = [o["queue_wait_max_s"] for o in t["by_objective"].values()]
    assert max(w for w in waits if w is not None) > 0.0
    fc = t["flow_control"]
    assert fc["queue_peak"] > 0
    assert fc["queue_peak_bytes"] > 0
    assert fc["queued_at_end"] == 0
    assert fc["picks_waiting_at_end"] == 0
    assert fc["timer_wakeups_with_empty_queue"] == 0
    # Every request served or answered with a status.
    assert t["served"] + t["shed"] + t["failed"] == t["sent"] == result["requests"]
    assert t["failed"] == 0
    assert result["errors"] == 0
    # Strict priority: critical requests wait less than batch ones.
    by = t["by_objective"]
    assert by["critical"]["queue_wait_p90_s"] < by["batch"]["queue_wait_p90_s"]


def test_shed_requests_are_answered_with_their_status_not_errors(
    qwen_words: Words, tmp_path: Path
) -> None:
    # A tiny queue and a short TTL: requests are shed, each with its 429.
    text = FLOW_CONTROL.read_text(encoding="utf-8")
    text = text.replace("defaultRequestTTL: 30s", "defaultRequestTTL: 200ms")
    text = text.replace("maxRequests: 6000", "maxRequests: 40")
    config = tmp_path / "tight.yaml"
    config.write_text(text, encoding="utf-8")
    result = _run(qwen_words, config, load_speed=150.0)
    t = result["tenants"]
    assert t["shed"] > 0
    assert result["shed"] == t["shed"]
    assert all(kind.startswith("429 ") for kind in result["shed_kinds"])
    assert any("rejected-ttl-expired" in kind for kind in result["shed_kinds"])
    assert any("rejected-saturated" in kind for kind in result["shed_kinds"])
    assert result["errors"] == 0
    assert result["status"] == "ok"
    assert t["served"] + t["shed"] + t["failed"] == t["sent"]
    assert t["flow_control"]["queue_peak"] <= 40


def test_flow_control_runs_are_deterministic(qwen_words: Words, tmp_path: Path) -> None:
    def options(out: Path) -> LabOptions:
        return LabOptions(
            workload=WorkloadSpec("tenants", options=SMALL),
            policies=("default", "flow-control"),
            fleet=FleetSpec(2),
            seeds=(1,),
            load=1.5,
            rate=None,
            tokenizer=default_tokenizer_dir(),
            out=out,
            command="test",
        )

    run_lab(options(tmp_path / "a"))
    run_lab(options(tmp_path / "b"))
    a = json.loads((tmp_path / "a" / "results.json").read_text())
    b = json.loads((tmp_path / "b" / "results.json").read_text())
    assert _stable(a) == _stable(b)
    fc = a["policies"]["flow-control"]
    assert fc["tenants"]["waited"] > 0
    assert "burst_window_s" in a["setup"]
    report = (tmp_path / "a" / "report.md").read_text()
    assert "## Flow control" in report
    assert (tmp_path / "a" / "flow_control.png").is_file()


def test_the_tenants_workload_has_the_shape_it_says(qwen_words: Words) -> None:
    workload = tenants(qwen_words, requests=6000, system_len=8, question_len=8, seed=3)
    assert workload.num_requests == 6000
    span = workload.params["span"]
    start, end = workload.params["burst_window"]
    assert (start, end) == pytest.approx((BURST_WINDOW[0] * span, BURST_WINDOW[1] * span))
    counts = {(t, inside): 0 for t in ("steady", "bursty") for inside in (False, True)}
    objectives = {"critical": 0, "standard": 0, "batch": 0}
    for session in workload.sessions:
        (turn,) = session.turns
        headers = dict(turn.headers)
        assert session.arrival_s is not None
        assert 0 <= session.arrival_s <= span
        inside = start <= session.arrival_s < end
        counts[headers[FAIRNESS_ID_HEADER], inside] += 1
        objectives[headers[OBJECTIVE_HEADER]] += 1
    width, rest = end - start, span - (end - start)
    # Steady: the same rate throughout (1 per unit); bursty: the same outside the
    # window, BURST_FACTOR times it inside.
    assert counts["steady", True] / width == pytest.approx(1.0, rel=0.15)
    assert counts["steady", False] / rest == pytest.approx(1.0, rel=0.1)
    assert counts["bursty", False] / rest == pytest.approx(1.0, rel=0.1)
    assert counts["bursty", True] / width == pytest.approx(BURST_FACTOR, rel=0.1)
    assert objectives["critical"] / 6000 == pytest.approx(0.1, abs=0.02)
    assert objectives["standard"] / 6000 == pytest.approx(0.6, abs=0.03)
    assert objectives["batch"] / 6000 == pytest.approx(0.3, abs=0.03)
    # Each tenant has its own system prompt; arrivals are in time order.
    systems = {
        dict(s.turns[0].headers)[FAIRNESS_ID_HEADER]: s.turns[0].messages[0]
        for s in workload.sessions
    }
    assert systems["steady"] != systems["bursty"]
    times = [s.arrival_s or 0.0 for s in workload.sessions]
    assert times == sorted(times)


def test_fair_shares_and_jain() -> None:
    # The steady tenant asks for less than half: it gets what it asks, the rest goes
    # to the other.
    assert fair_shares({"steady": 30.0, "bursty": 500.0}, 100.0) == {
        "steady": 30.0,
        "bursty": 70.0,
    }
    assert fair_shares({"a": 80.0, "b": 90.0}, 100.0) == {"a": 50.0, "b": 50.0}
    assert jain([1.0, 1.0]) == 1.0
    assert jain([1.0, 0.0]) == 0.5


def test_the_per_band_fair_share_is_what_strict_priority_promises() -> None:
    # During a 10 s window the bursty tenant sends 4 critical requests, the steady
    # one 1 critical and 2 batch; the critical band is served in full, the batch band
    # not at all (the bursty tenant's critical requests took the capacity).
    def request(n: int, tenant: str, objective: str, served: bool) -> Sent:
        record = Record(session=n, turn=0, group=0, scheduled_s=1.0 + n / 10)
        if served:
            record.ok, record.ttft_s, record.e2e_s, record.output_tokens = True, 0.1, 1.1, 10
        headers = ((FAIRNESS_ID_HEADER, tenant), (OBJECTIVE_HEADER, objective))
        return record, headers, None

    sent = [
        *(request(n, "bursty", "critical", True) for n in range(4)),
        request(4, "steady", "critical", True),
        request(5, "steady", "batch", False),
        request(6, "steady", "batch", False),
    ]
    summary = tenants_summary(sent, (0.0, 10.0), {}, output_len=10)
    steady = summary["by_tenant"]["steady"]
    bursty = summary["by_tenant"]["bursty"]
    # Across tenants: 50 tokens served, steady offered 30 of them, so its max-min
    # share is 25 (half): it got 10.
    assert steady["fair_share_tokens_per_s_burst"] == pytest.approx(2.5)
    assert steady["of_fair_share"] == pytest.approx(0.4)
    # Per band: the critical band's 50 tokens split by the offers there (10 and 40)
    # give steady its 10; the batch band served nothing, so nothing is owed there.
    assert steady["band_fair_share_tokens_per_s_burst"] == pytest.approx(1.0)
    assert steady["of_band_fair_share"] == pytest.approx(1.0)
    assert bursty["of_band_fair_share"] == pytest.approx(1.0)
    assert summary["jain_band_burst"] == pytest.approx(1.0)
    assert summary["jain_burst"] < 1.0
