"""The default-profile study's scoring rules (bench/profile_study.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import profile_study


def result(hit: float, p90: float, rps: float, lag: float = 0.0) -> dict[str, Any]:
    return {
        "status": "ok",
        "hit_rate": hit,
        "ttft_p90_s": p90,
        "throughput_rps": rps,
        "max_over_mean_load": 1.0,
        "sim_lag_fraction": lag,
    }


def write_run(path: Path, workload: str, rungs: dict[str, dict[str, dict[str, Any]]]) -> Path:
    path.mkdir()
    doc = {
        "workload": {"name": workload},
        "oracle": {"h_star": 0.9},
        "ladder": [{"label": label, "policies": policies} for label, policies in rungs.items()],
    }
    (path / "results.json").write_text(json.dumps(doc))
    return path


def test_a_pile_up_with_low_ttft_but_half_the_throughput_does_not_win(tmp_path: Path) -> None:
    run = write_run(
        tmp_path / "hot",
        "hot-prefix",
        {
            "rate 150/s": {
                "round-robin": result(0.7, 0.010, 90.0),  # not a candidate
                "approx-pile": result(0.90, 0.05, 45.0),
                "approx-spread": result(0.89, 0.06, 88.0),
                "approx-no-hits": result(0.50, 0.04, 90.0),  # below the hit floor
            }
        },
    )
    standings, winners = profile_study.score(profile_study.load_cells([run]), "approx-", 0.9, 0.05)
    assert [w for _, w in winners] == ["approx-spread"]
    assert standings["approx-spread"].wins == 1
    assert standings["approx-pile"].wins == 0
    assert "round-robin" not in standings
    assert standings["approx-pile"].geomean() == pytest.approx(0.05 / 0.06)


def test_a_run_where_the_simulator_lagged_does_not_compete(tmp_path: Path) -> None:
    lag = 0.2  # above the 0.05 allowed below
    run = write_run(
        tmp_path / "shared",
        "shared-prefix",
        {
            "rate 150/s": {
                "approx-a": result(0.9, 0.03, 80.0, lag=lag),  # fastest, but lagged
                "approx-b": result(0.9, 0.04, 80.0),
                "approx-c": result(0.9, 0.05, 80.0),
            },
            "rate 200/s": {  # one candidate left: nothing to compare
                "approx-a": result(0.9, 0.03, 80.0, lag=lag),
                "approx-b": result(0.9, 0.04, 80.0, lag=lag),
                "approx-c": result(0.9, 0.05, 80.0),
            },
            "rate 250/s": {
                "approx-a": result(0.9, 0.05, 80.0),
                "approx-b": result(0.9, 0.07, 80.0),
                "approx-c": result(0.9, 0.10, 80.0),
            },
        },
    )
    cells = profile_study.load_cells([run])
    standings, winners = profile_study.score(cells, "approx-", 0.9, 0.05)
    assert [w for _, w in winners] == ["approx-b", None, "approx-a"]
    assert [standings[n].wins for n in ("approx-a", "approx-b", "approx-c")] == [1, 1, 0]
    table = profile_study.render(cells, standings, winners, 0.05)
    assert "| shared-prefix | rate 200/s |" in table
    assert "lagged" in table
    assert "not counted" in table
    assert "| approx-a | 1 of 2 |" in table


def test_unreadable_results_say_which_file(tmp_path: Path) -> None:
    bad = tmp_path / "results.json"
    bad.write_text("{not json")
    with pytest.raises(SystemExit, match=r"results\.json: cannot read benchmark results"):
        profile_study.load_cells([bad])
