"""`python -m bench churn`: a small churn against a real `epp serve --pool-name`,
timed by real picks; and its summary arithmetic."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.__main__ import main
from bench.churn import Change, ChurnOptions, run_churn, summarize


def test_a_small_churn_is_measured_and_ends_consistent(tmp_path: Path) -> None:
    document = run_churn(
        ChurnOptions(out_dir=tmp_path, pods=10, rate=10.0, duration_s=1.5, seed=3, timeout_s=5.0)
    )
    summary = document["summary"]
    assert sum(summary[k]["changes"] for k in ("ready", "unready", "deleted")) == 15
    assert all(summary[k]["missed"] == 0 for k in summary)
    # Every change was seen by a real pick, after it was made.
    for change in document["changes"]:
        assert change["latency_ms"] is not None
        assert 0 < change["latency_ms"] < 5000
        assert change["probes"] >= 1
    assert document["consistent"]
    # The EPP followed by watching (one list per resource, no relist).
    metrics = document["epp_metrics"]
    assert metrics["epp_kubernetes_lists_total{reason=initial,resource=pods}"] == 1
    assert not [k for k in metrics if "reason=expired" in k]
    assert json.loads((tmp_path / "churn.json").read_text())["consistent"]
    assert "| deleted | deleted in the API → not routed to |" in (tmp_path / "churn.md").read_text()


def test_summary_bounds() -> None:
    made = 10.0
    changes = [
        # Seen by the first pick: the floor is 0.
        Change("ready", "a", "10.0.0.1:8000", made, seen=made + 0.004, probe_sent=made + 0.001),
        # Seen by the third pick; the second, sent at +6 ms, still saw the old routing.
        Change(
            "ready",
            "b",
            "10.0.0.2:8000",
            made,
            seen=made + 0.010,
            probe_sent=made + 0.008,
            last_miss_sent=made + 0.006,
        ),
        Change("deleted", "c", "10.0.0.3:8000", made),  # never seen
    ]
    summary = summarize(changes)
    assert summary["ready"]["changes"] == 2
    # Percentiles interpolate between the two changes (bench.stats): latencies 4
    # and 10 ms, floors 0 and 6 ms.
    assert summary["ready"]["p99_ms"] == pytest.approx(4.0 + 6.0 * 0.99)
    assert summary["ready"]["max_ms"] == pytest.approx(10.0)
    assert summary["ready"]["floor_p99_ms"] == pytest.approx(6.0 * 0.99)
    assert summary["ready"]["floor_p50_ms"] == pytest.approx(3.0)
    assert summary["deleted"]["missed"] == 1
    # Nothing seen: no percentile, NaN in churn.json.
    assert math.isnan(summary["deleted"]["p50_ms"])
    assert math.isnan(summary["unready"]["max_ms"])


def test_bad_options_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["churn", "--pods", "0"]) == 2
    assert "must be positive" in capsys.readouterr().err
    assert main(["churn", "--delete-share", "2"]) == 2
