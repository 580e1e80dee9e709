"""`python -m bench.lab.goals`: a policy's lab results against the goals, per cell."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

import pytest

from bench.lab.goals import compare, main


def result(
    p90_ms: float,
    p50_ms: float,
    rps: float,
    ci: float = 0.0,
    seeds: int = 5,
    error: float | None = None,
) -> dict[str, Any]:
    """A policy's figures as `python -m bench lab` writes them (seconds, req/s), each
    with the same 95% half-width in its own unit (ms for times)."""
    out: dict[str, Any] = {
        "seeds": seeds,
        "ttft_p90_s": p90_ms / 1e3,
        "ttft_p90_s_ci95": ci / 1e3,
        "ttft_p50_s": p50_ms / 1e3,
        "ttft_p50_s_ci95": ci / 1e3,
        "throughput_rps": rps,
        "throughput_rps_ci95": ci,
    }
    if error is not None:
        out["ttft_prediction_error_p50_warm"] = error
    return out


def write(directory: Path, policies: dict[str, dict[str, Any]]) -> Path:
    directory.mkdir(parents=True)
    (directory / "results.json").write_text(json.dumps({"policies": policies}))
    return directory


def peers(p90_ms: float = 30.0, ci: float = 0.0) -> dict[str, dict[str, Any]]:
    return {
        "round-robin": result(90.0, 25.0, 95.0),
        "sglang-cache-aware": result(p90_ms + 5, 22.0, 100.0, ci),
        "dynamo-kv": result(p90_ms, 21.0, 101.0, ci),
        "llm-d-optimized-baseline": result(p90_ms + 1, 20.0, 104.0, ci),
    }


def test_each_goal_is_held_against_the_best_peer_for_that_figure(tmp_path: Path) -> None:
    ours = write(tmp_path / "ours", {"mine": result(27.0, 20.5, 99.0, ci=0.2, error=0.11)})
    theirs = write(tmp_path / "peers", peers(ci=0.2))
    cell = compare("c", ours, theirs)
    # p90: Dynamo's 30 is the best peer's; 27 meets it.
    assert (cell.p90.peer, cell.p90.met) == ("Dynamo", True)
    # p50: llm-d's 20.0 is the best; 20.5 misses it by more than the two intervals.
    assert (cell.p50.peer, cell.p50.met, cell.p50.close) == ("llm-d", False, False)
    # Throughput: llm-d's 104 is the best (the highest); 99 misses it.
    assert (cell.throughput.peer, cell.throughput.met) == ("llm-d", False)
    assert cell.round_robin_ratio == pytest.approx(27.0 / 90.0)
    assert cell.error == 0.11
    # Round-robin is not a peer: its p50 of 25 ms is not what ours is held to, nor is
    # its throughput.


def test_a_miss_inside_both_intervals_is_told_apart(tmp_path: Path) -> None:
    ours = write(tmp_path / "ours", {"mine": result(31.0, 20.0, 104.0, ci=0.6)})
    theirs = write(tmp_path / "peers", peers(p90_ms=30.0, ci=0.5))
    cell = compare("c", ours, theirs)
    # 31.0 ± 0.6 against 30.0 ± 0.5: missed, inside both intervals.
    assert not cell.p90.met
    assert cell.p90.close
    # Equal to the best counts as met.
    assert cell.p50.met
    assert cell.throughput.met


def test_the_p90_factor_tightens_the_p90_goal_only(tmp_path: Path) -> None:
    theirs = write(tmp_path / "peers", peers(p90_ms=1000.0))
    under = write(tmp_path / "under", {"mine": result(790.0, 19.0, 110.0)})
    over = write(tmp_path / "over", {"mine": result(810.0, 19.0, 110.0)})
    assert compare("c", under, theirs, p90_factor=0.8).p90.met
    assert not compare("c", over, theirs, p90_factor=0.8).p90.met
    assert compare("c", over, theirs).p90.met


def test_the_cells_with_both_results_are_compared_and_counted(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(tmp_path / "ours" / "a-x", {"mine": result(27.0, 19.0, 110.0, error=0.25)})
    write(tmp_path / "ours" / "b-x", {"mine": result(40.0, 19.0, 110.0, error=0.05)})
    write(tmp_path / "ours" / "c-x", {"mine": result(27.0, 19.0, 110.0)})  # no peers' run
    write(tmp_path / "peers" / "a", peers())
    write(tmp_path / "peers" / "b", peers())
    code = main(["--ours", f"{tmp_path}/ours/{{cell}}-x", "--peers", f"{tmp_path}/peers/{{cell}}"])
    out = capsys.readouterr().out
    assert code == 0
    rows = [line for line in out.splitlines() if line.startswith(("| a ", "| b "))]
    assert len(rows) == 2
    assert "| c " not in out
    assert "TTFT p90 at most the best peer's: 1 of 2" in out
    assert "TTFT p50 at most the best peer's: 2 of 2" in out
    assert "median prediction error after warm-up at most 20%: 1 of 2 (the largest 25.0%)" in out


def test_out_writes_the_table_with_its_command(tmp_path: Path) -> None:
    write(tmp_path / "ours" / "a", {"mine": result(27.0, 19.0, 110.0)})
    write(tmp_path / "peers" / "a", peers())
    out = tmp_path / "goals" / "cells.md"
    args = ["--ours", f"{tmp_path}/ours/{{cell}}", "--peers", f"{tmp_path}/peers/{{cell}}"]
    assert main([*args, "--cell", "a", "--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("Produced by:")
    assert "python -m bench.lab.goals --ours" in text
    assert "--cell a" in text
    assert "| a | 5 / 5 | 27.0 ± 0.0 | 30.0 ± 0.0 (Dynamo) | yes |" in text


def test_a_single_seed_figure_is_shown_without_an_interval(tmp_path: Path) -> None:
    one_seed = result(27.0, 19.0, 110.0, seeds=1)
    one_seed.update(ttft_p90_s_ci95=None, ttft_p50_s_ci95=None, throughput_rps_ci95=None)
    write(tmp_path / "ours" / "a", {"mine": one_seed})
    write(tmp_path / "peers" / "a", peers())
    out = tmp_path / "goals.md"
    args = ["--ours", f"{tmp_path}/ours/{{cell}}", "--peers", f"{tmp_path}/peers/{{cell}}"]
    assert main([*args, "--out", str(out)]) == 0
    assert "| a | 1 / 5 | 27.0 | 30.0 ± 0.0 (Dynamo) | yes | 19.0 |" in out.read_text()


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("no-placeholder", "a template needs {cell} once"),
        ("two-policies", "holds 2 policies (a, b): name ours with --policy"),
        ("unknown-policy", "has no policy 'zz'; it has: mine"),
        ("no-peers", "has none of the peers' models"),
        ("no-cells", "no cell has results under both"),
        ("not-a-result", "has no 'policies'"),
        ("bad-factor", "--p90-factor must be in (0, 10]"),
    ],
)
def test_bad_input_gets_a_clear_error_and_writes_nothing(
    case: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ours, theirs = f"{tmp_path}/ours/{{cell}}", f"{tmp_path}/peers/{{cell}}"
    extra: list[str] = []
    policies: dict[str, dict[str, Any]] = {"mine": result(27.0, 19.0, 110.0)}
    peer_policies = peers()
    if case == "no-placeholder":
        ours = f"{tmp_path}/ours/a"
    elif case == "two-policies":
        policies = {"a": result(27.0, 19.0, 110.0), "b": result(28.0, 19.0, 110.0)}
    elif case == "unknown-policy":
        extra = ["--policy", "zz"]
    elif case == "no-peers":
        peer_policies = {"round-robin": result(90.0, 25.0, 95.0)}
    elif case == "bad-factor":
        extra = ["--p90-factor", "0"]
    if case != "no-cells":
        write(tmp_path / "ours" / "a", policies)
    if case == "not-a-result":
        (tmp_path / "peers" / "a").mkdir(parents=True)
        (tmp_path / "peers" / "a" / "results.json").write_text("[1, 2]")
    else:
        write(tmp_path / "peers" / "a", peer_policies)
    out = tmp_path / "goals.md"
    assert main(["--ours", ours, "--peers", theirs, *extra, "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


ROOT = Path(__file__).resolve().parents[3]
GOALS_FILES = sorted((ROOT / "docs" / "results").glob("**/goals/*.md"))


def test_the_committed_goals_files_are_found() -> None:
    # docs/routing.md, Against the goals, cites these four; an empty glob would
    # leave the check below with nothing to check.
    names = {p.name for p in GOALS_FILES}
    assert {"cells.md", "trace-0.8.md", "trace-0.95.md", "no-busy-time-cells.md"} <= names


@pytest.mark.parametrize("path", GOALS_FILES, ids=lambda p: p.name)
def test_each_committed_goals_file_is_what_its_command_gives_now(
    path: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A goals file is made from committed results: results measured again without
    the file made again would leave docs quoting stale verdicts."""
    text = path.read_text(encoding="utf-8")
    command = shlex.split(text.split("```sh\n", 1)[1].split("\n```", 1)[0])
    assert command[:3] == ["python", "-m", "bench.lab.goals"]
    args = command[3:]
    out = args.index("--out")
    again = tmp_path / "again.md"
    args[out + 1] = str(again)
    monkeypatch.chdir(ROOT)  # the templates are relative to the repository
    assert main(args) == 0
    made = again.read_text(encoding="utf-8")
    # The same table; only the --out path in the recorded command differs.
    assert made.split("```\n", 1)[1] == text.split("```\n", 1)[1]
