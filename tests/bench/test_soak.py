"""`python -m bench soak`: a short run of the real thing (pods killed and restarted
under load, through Envoy and the EPP), and the arithmetic of its summary."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.__main__ import main
from bench.longrun import PrefixSpace, histogram, quantile, total
from bench.soak import SoakOptions, growing_sites, report, run_soak
from epp.memory import malloc_in_use


def test_a_short_soak_with_churn(tmp_path: Path) -> None:
    document = run_soak(
        SoakOptions(
            out_dir=tmp_path,
            minutes=0.2,
            pods=2,
            rate=8.0,
            groups=200,
            churn_interval_s=4.0,
            sample_interval_s=2.0,
            max_index_entries=300,  # far below what the pods cache: the bound must act
            trace_memory_frames=1,
        )
    )
    summary = document["summary"]
    assert summary["kills"] >= 1
    assert summary["requests"] > 40
    # Failures only around a kill (in flight to the pod, or routed before the EPP
    # saw it go); none otherwise.
    assert summary["errors_other"] == 0, summary
    assert summary["ok"] > 0.8 * summary["requests"]
    assert document["epp_alive_at_end"]
    assert summary["in_flight_at_end"] == 0
    # The index stayed within its bound, which had to evict.
    assert summary["index_bound"] == 300
    assert summary["index_within_bound"]
    assert summary["index_evicted_entries"] > 0
    assert summary["kv_engine_restarts_seen"] >= 1
    samples = document["samples"]
    assert len(samples) >= 5
    assert all(s["rss_bytes"] and s["rss_bytes"] > 10 * 2**20 for s in samples)
    assert any(s["pick_p99_s"] is not None for s in samples)
    # What the memory is made of, from the EPP's /debug/memory, traced.
    assert all(s["python_blocks"] > 10_000 for s in samples)
    assert all(0 < s["traced_bytes"] < s["rss_bytes"] for s in samples)
    if malloc_in_use() is not None:  # glibc: the EPP reads its allocator too
        assert all(0 < s["malloc_in_use_bytes"] < s["rss_bytes"] for s in samples)
    readings = document["site_readings"]
    # Every eighth of the run, and its end; on a busy host a reading that comes due
    # while a slow one runs is that one.
    assert 4 <= len(readings) <= 8
    assert readings[-1]["t_s"] >= 0.2 * 60
    assert [r["t_s"] for r in readings] == sorted(r["t_s"] for r in readings)
    assert all(r["sites"] and r["sites"][0]["bytes"] > 0 for r in readings)
    # The EPP's own code holds memory: its index, at least, is among the lines.
    assert any(site["site"].startswith("epp/") for site in readings[-1]["sites"])
    assert summary["traced_end_mb"] > 0
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["summary"] == summary
    report = (tmp_path / "report.md").read_text()
    assert "| EPP RSS |" in report
    assert "| Python allocations (traced) |" in report
    assert "![soak.png](soak.png)" in report
    assert (tmp_path / "soak.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _sites(**kib: int) -> list[dict[str, int | str]]:
    return [{"site": k, "bytes": v * 1024, "blocks": v} for k, v in kib.items()]


def test_growing_sites_over_the_second_half() -> None:
    readings = [
        {"t_s": 10.0, "sites": _sites(a=500, b=10)},  # before half the run: not compared
        {"t_s": 45.0, "sites": _sites(a=100, b=50, c=40)},  # the first at half the run
        {"t_s": 80.0, "sites": _sites(a=400, b=50, c=30, d=60)},
    ]
    grown = growing_sites(readings)
    # a grew 300 KiB; d was not among the lines at 45 s (counted from nothing); b
    # stayed, c shrank: neither is listed.
    assert [(g["site"], g["growth_bytes"] // 1024) for g in grown] == [("a", 300), ("d", 60)]
    assert grown[0]["bytes_first"] == 100 * 1024
    assert grown[1]["bytes_first"] is None
    assert grown[0]["t_first_s"] == 45.0
    assert grown[0]["t_last_s"] == 80.0
    # Two readings: the earlier is the start, wherever it falls (a shrank from it).
    two = growing_sites(readings[::2])
    assert [(g["site"], g["growth_bytes"] // 1024) for g in two] == [
        ("d", 60),
        ("b", 40),
        ("c", 30),
    ]
    assert growing_sites(readings[:1]) == []


def test_histogram_quantile_between_two_readings() -> None:
    before = {0.001: 10.0, 0.01: 10.0, 0.1: 10.0, math.inf: 10.0}
    # 100 more observations: 90 under 1 ms, 9 more under 10 ms, 1 more under 100 ms.
    now = {0.001: 100.0, 0.01: 109.0, 0.1: 110.0, math.inf: 110.0}
    assert quantile(0.5, now, before) == pytest.approx(0.001 * 50 / 90)
    assert quantile(0.99, now, before) == pytest.approx(0.001 + 0.009 * 9 / 9)
    assert quantile(0.999, now, before) == pytest.approx(0.01 + 0.09 * 0.9)
    assert quantile(0.5, before, before) is None  # nothing observed in between
    # Beyond the last finite bound: that bound.
    assert quantile(1.0, {0.1: 0.0, math.inf: 5.0}) == 0.1


def test_metrics_readers_sum_series_and_histograms() -> None:
    page = (
        b"# HELP x_total a counter\n"
        b"# TYPE x_total counter\n"
        b'x_total{endpoint="a",result="requested"} 3.0\n'
        b'x_total{endpoint="b",result="failed"} 1.0\n'
        b'x_created{endpoint="a",result="requested"} 1.7e9\n'
        b"# TYPE y gauge\n"
        b"y 2.5e-3\n"
        b"# TYPE h histogram\n"
        b'h_bucket{le="0.01",profile="a"} 1.0\n'
        b'h_bucket{le="+Inf",profile="a"} 2.0\n'
        b'h_count{profile="a"} 2.0\n'
        b'h_bucket{le="0.01",profile="b"} 3.0\n'
        b'h_bucket{le="+Inf",profile="b"} 5.0\n'
    )
    assert total(page, "x_total") == 4.0
    assert total(page, "x_total", result="failed") == 1.0
    assert total(page, "x_total", result="other") == 0.0
    assert total(page, "y") == 0.0025
    assert total(page, "absent_total") == 0.0
    # Buckets summed over the other labels, in bound order.
    assert histogram(page, "h") == {0.01: 4.0, math.inf: 7.0}
    with pytest.raises(ValueError, match="not a number"):
        total(b"z NaNa\n", "z")


def test_the_prefix_space_is_skewed_and_reproducible() -> None:
    import random

    space = PrefixSpace(groups=1000, system_len=32, question_len=4, skew=1.0, seed=3)
    rng = random.Random(0)
    draws = [space.draw(rng) for _ in range(5000)]
    assert min(draws) >= 0
    assert max(draws) < 1000
    assert draws.count(0) > draws.count(500) * 20  # rank 1 against rank 501
    assert space.prompt(7, 1)[:32] == space.prompt(7, 2)[:32] == space.system(7)
    assert space.prompt(7, 1) != space.prompt(7, 2)
    assert PrefixSpace(groups=1000, system_len=32, seed=3).system(7) == space.system(7)


def test_bad_options_are_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["soak", "--minutes", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err
    for fault in ("freeze", "stall"):
        for seconds in ("0", "60"):
            assert main(["soak", "--fault", fault, f"--{fault}-seconds", seconds]) == 2
            assert f"--{fault}-seconds must be positive" in capsys.readouterr().err
    assert main(["soak", "--trace-memory", "101"]) == 2
    assert "--trace-memory must be from 0 (off) to 100" in capsys.readouterr().err
    out = tmp_path / "out"
    assert main(["soak", "--config", str(tmp_path / "none.yaml"), "--out", str(out)]) == 2
    assert "none.yaml: no such file" in capsys.readouterr().err
    assert not out.exists()  # nothing was started or written


def test_a_soak_of_the_default_config(tmp_path: Path) -> None:
    """`--config`: the EPP runs the file given (here what `epp serve` runs without
    one: predicted TTFT on the approximate index, no precise index to bound)."""
    default = Path(__file__).parents[2] / "manifests" / "config" / "default.yaml"
    document = run_soak(
        SoakOptions(
            out_dir=tmp_path / "out",
            minutes=0.1,
            pods=2,
            rate=8.0,
            groups=50,
            churn_interval_s=0,
            sample_interval_s=2.0,
            config=default,
        )
    )
    assert (tmp_path / "out" / "config.yaml").read_text() == default.read_text()
    summary = document["summary"]
    assert summary["requests"] > 20
    assert summary["errors"] == 0
    assert summary["index_within_bound"] is None  # no precise index in this config
    assert "| precise index | | | none in this config |" in report(document)


# (--fault, its duration option, `epp serve` arguments that let the EPP act
# within the fault, the count in the summary, the report's words)
FAULT_CASES = {
    # A pod frozen (SIGSTOP) for a while in every churn interval, then thawed; a
    # short staleness threshold, so the director takes it as down within the freeze.
    "freeze": (
        {"freeze_s": 3.0},
        ("--metrics-staleness-threshold", "500ms", "--metrics-scrape-timeout", "200ms"),
        "freezes",
        "a pod frozen for 3 s every 6 s",
        "held over 1 s by a frozen pod",
    ),
    # A pod's engine stopped while its server answers everything; the stall watch,
    # at 1 s, leaves it out until it moves.
    "stall": (
        {"stall_s": 3.0},
        ("--stall-threshold", "1s"),
        "stalls",
        "a pod's engine stalled for 3 s every 6 s",
        "held over 1 s by a stalled pod",
    ),
}


@pytest.mark.parametrize("fault", sorted(FAULT_CASES))
def test_a_soak_with_pods_that_hang_and_come_back(tmp_path: Path, fault: str) -> None:
    """`--fault freeze|stall`, and `--epp-arg` reaching `epp serve`."""
    lasting, epp_args, counted, churn, held = FAULT_CASES[fault]
    default = Path(__file__).parents[2] / "manifests" / "config" / "default.yaml"
    document = run_soak(
        SoakOptions(
            out_dir=tmp_path,
            minutes=0.25,
            pods=2,
            rate=8.0,
            groups=50,
            churn_interval_s=6.0,
            fault=fault,
            sample_interval_s=2.0,
            config=default,
            epp_args=epp_args,
            **lasting,  # type: ignore[arg-type]
        )
    )
    summary = document["summary"]
    assert summary[counted] >= 2
    assert summary["kills"] == 0
    assert document["epp_alive_at_end"]
    assert summary["in_flight_at_end"] == 0
    # Requests the pod held (in flight when it hung, or routed in the moment before
    # the EPP left it out) were answered once it moved again, none lost.
    assert summary["errors"] == 0, summary
    assert summary["held_by_freezes"] >= 1
    assert len(document[f"{counted}_s"]) == summary[counted]
    text = report(document)
    assert f"{churn} ({summary[counted]} {counted})" in text
    assert held in text
    assert f"`epp serve {epp_args[0]} {epp_args[1]}" in text
