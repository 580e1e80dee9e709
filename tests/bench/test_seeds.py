"""`python -m bench.seeds`: several `bench run` directories of one experiment, one
table of means over the seeds; runs of different experiments are refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench import seeds


def _run(
    tmp_path: Path,
    seed: int,
    p90s: dict[str, float],
    *,
    groups: int = 32,
    pods: int = 8,
) -> Path:
    """A results.json shaped as `bench run` writes it, with these TTFT p90s."""
    policies = {
        name: {
            "ttft_p50_s": p90 / 2,
            "ttft_p90_s": p90,
            "ttft_p99_s": 2 * p90,
            "throughput_rps": 90.0 + seed,
            "hit_rate": 0.8,
            "errors": 0,
            "sim_lag_max_s": 0.0,
            "status": "ok",
        }
        for name, p90 in p90s.items()
    }
    document: dict[str, Any] = {
        "command": f"python -m bench run --seed {seed}",
        "workload": {"name": "shared-prefix", "params": {"groups": groups, "seed": seed}},
        "setup": {"pods": pods, "time_scale": 15.0},
        "ladder": [{"label": "rate 200/s", "policies": policies}],
        "policies": policies,
    }
    directory = tmp_path / f"run{len(list(tmp_path.iterdir()))}"
    directory.mkdir()
    (directory / "results.json").write_text(json.dumps(document), encoding="utf-8")
    return directory


def test_the_table_gives_each_policy_its_mean_and_interval_over_the_seeds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dirs = [
        _run(tmp_path, 0, {"ours": 0.050, "peer": 0.060}),
        _run(tmp_path, 1, {"ours": 0.054, "peer": 0.060}),
        _run(tmp_path, 2, {"ours": 0.058, "peer": 0.058}),
    ]
    assert seeds.main([*map(str, dirs), "--against", "peer"]) == 0
    out = capsys.readouterr().out
    assert "seeds 0, 1, 2 (mean ± 95% CI over 3 runs)" in out
    ours = next(line for line in out.splitlines() if line.startswith("| ours "))
    cells = [c.strip() for c in ours.split("|")]
    # p90: mean 54.0 ms, s = 4 ms, t(2) = 4.303: half-width 4.303 * 4 / sqrt(3) = 9.9
    assert cells[3] == "54.0 ± 9.9"
    assert cells[9] == "50.0, 54.0, 58.0"
    # Paired per seed: 50/60, 54/60, 58/58.
    assert cells[10] == "0.83, 0.90, 1.00"
    assert cells[11].startswith("0.91 ± ")
    peer = next(line for line in out.splitlines() if line.startswith("| peer "))
    assert peer.split("|")[10].strip() == "1.00, 1.00, 1.00"


def test_a_policy_missing_from_one_run_is_left_out(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dirs = [
        _run(tmp_path, 0, {"ours": 0.05, "peer": 0.06}),
        _run(tmp_path, 1, {"ours": 0.05}),
    ]
    assert seeds.main(list(map(str, dirs))) == 0
    out = capsys.readouterr().out
    assert "| ours " in out
    assert "| peer " not in out


@pytest.mark.parametrize(
    ("second", "message"),
    [
        ({"seed": 0}, "repeat a seed"),
        ({"seed": 1, "groups": 64}, "differs from"),
        ({"seed": 1, "pods": 16}, "pods"),
    ],
)
def test_runs_of_different_experiments_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], second: dict[str, int], message: str
) -> None:
    first = _run(tmp_path, 0, {"ours": 0.05})
    other = _run(tmp_path, p90s={"ours": 0.05}, **second)
    assert seeds.main([str(first), str(other)]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.startswith("error: ")


def test_a_directory_without_results_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    first = _run(tmp_path, 0, {"ours": 0.05})
    empty = tmp_path / "empty"
    empty.mkdir()
    assert seeds.main([str(first), str(empty)]) == 2
    assert f"no results.json in {empty}" in capsys.readouterr().err


def test_against_a_policy_no_run_has_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dirs = [_run(tmp_path, 0, {"ours": 0.05}), _run(tmp_path, 1, {"ours": 0.05})]
    assert seeds.main([*map(str, dirs), "--against", "sglang-router"]) == 2
    assert "--against 'sglang-router'" in capsys.readouterr().err
