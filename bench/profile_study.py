"""Score candidate default profiles from `python -m bench run` results.

    python -m bench.profile_study out/study/shared-prefix out/study/hot-prefix ...

Each rung of each run's load ladder is one cell. In a cell, the candidates (the
policies whose name starts with `--candidate-prefix`, default `approx-`: the
default profile must work without KV events) are ranked by TTFT p90 among those
whose hit rate and throughput are at least `--floor` (0.9) of the best
candidate's in that cell (piling a hot prefix onto one pod can keep TTFT low for
a while, but it halves throughput: that must not win); the lowest wins the cell.
A run where the simulator fell behind by more than `--max-sim-lag` of its
duration is shown but does not compete (the machine, not the policy, decided its
figures); a cell with fewer than two competing candidates is not counted.

A candidate also gets, per counted cell, its TTFT p90 over the cell's best (1.0 =
the best); their geometric mean says how far it is from the best where it does
not win. Candidates are ranked by cells won; on a tie, one that kept the per-pod
load of every hot-prefix run within 1.3 times the mean goes first. Other
policies (round-robin, precise, peers) are shown for reference.
docs/default-profile.md has the method and the figures.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Cell:
    workload: str
    rung: str
    h_star: float
    results: dict[str, dict[str, Any]]


@dataclass
class Standing:
    wins: int = 0
    ratios: list[float] = field(default_factory=list)
    # The worst per-pod load imbalance in any of its completed hot-prefix runs:
    # the tie-break (the issue asks for max/mean <= 1.3 there).
    hot_max_over_mean: float = 0.0

    def geomean(self) -> float:
        if not self.ratios:
            return math.nan
        return math.exp(sum(math.log(r) for r in self.ratios) / len(self.ratios))


def load_cells(run_dirs: Sequence[Path]) -> list[Cell]:
    cells: list[Cell] = []
    for run_dir in run_dirs:
        path = run_dir / "results.json" if run_dir.is_dir() else run_dir
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise SystemExit(f"{path}: cannot read benchmark results ({exc})") from None
        workload = str(doc["workload"]["name"])
        h_star = float(doc["oracle"]["h_star"])
        for rung in doc["ladder"]:
            cells.append(Cell(workload, str(rung["label"]), h_star, dict(rung["policies"])))
    return cells


def ok(result: dict[str, Any]) -> bool:
    return result.get("status") == "ok" and result.get("ttft_p90_s") is not None


def lagged(result: dict[str, Any], max_sim_lag: float) -> bool:
    return float(result.get("sim_lag_fraction") or 0.0) > max_sim_lag


def score(
    cells: Sequence[Cell], candidate_prefix: str, floor: float, max_sim_lag: float
) -> tuple[dict[str, Standing], list[tuple[Cell, str | None]]]:
    standings: dict[str, Standing] = {}
    winners: list[tuple[Cell, str | None]] = []
    for cell in cells:
        candidates = {
            name: r for name, r in cell.results.items() if name.startswith(candidate_prefix)
        }
        for name, r in candidates.items():
            standing = standings.setdefault(name, Standing())
            if cell.workload == "hot-prefix" and ok(r):
                load = float(r["max_over_mean_load"])
                standing.hot_max_over_mean = max(standing.hot_max_over_mean, load)
        usable = {name: r for name, r in candidates.items() if ok(r) and not lagged(r, max_sim_lag)}
        if len(usable) < 2:
            winners.append((cell, None))
            continue
        best_hit = max(float(r["hit_rate"]) for r in usable.values())
        best_rps = max(float(r["throughput_rps"]) for r in usable.values())
        eligible = {
            name: r
            for name, r in usable.items()
            if float(r["hit_rate"]) >= floor * best_hit
            and float(r["throughput_rps"]) >= floor * best_rps
        }
        best_p90 = min(float(r["ttft_p90_s"]) for r in eligible.values())
        winner = min(eligible, key=lambda n: float(eligible[n]["ttft_p90_s"]))
        standings[winner].wins += 1
        winners.append((cell, winner))
        for name, r in usable.items():
            standings[name].ratios.append(float(r["ttft_p90_s"]) / best_p90)
    return standings, winners


def render(
    cells: Sequence[Cell],
    standings: dict[str, Standing],
    winners: list[tuple[Cell, str | None]],
    max_sim_lag: float,
) -> str:
    policies: list[str] = []
    for cell in cells:
        policies.extend(p for p in cell.results if p not in policies)
    lines = [
        "| workload | load | h* | "
        + " | ".join(f"{p} hit / p90 s / max:mean" for p in policies)
        + " | winner |",
        "|---|---|---:|" + "---|" * len(policies) + "---|",
    ]
    for cell, winner in winners:
        row = []
        for p in policies:
            r = cell.results.get(p)
            if r is None:
                row.append("")
            elif not ok(r):
                row.append("FAILED")
            elif lagged(r, max_sim_lag):
                row.append("lagged")
            else:
                row.append(
                    f"{r['hit_rate']:.3f} / {r['ttft_p90_s']:.3f} / {r['max_over_mean_load']:.2f}"
                )
        lines.append(
            f"| {cell.workload} | {cell.rung} | {cell.h_star:.3f} | "
            + " | ".join(row)
            + f" | {winner or 'not counted'} |"
        )
    counted = sum(1 for _, winner in winners if winner is not None)
    lines += [
        "",
        "| candidate | cells won | TTFT p90 / cell best (geometric mean)"
        " | worst hot-prefix max/mean load |",
        "|---|---:|---:|---:|",
    ]
    ranked = sorted(standings.items(), key=lambda kv: (-kv[1].wins, kv[1].hot_max_over_mean > 1.3))
    for name, s in ranked:
        lines.append(
            f"| {name} | {s.wins} of {counted} | {s.geomean():.2f} | {s.hot_max_over_mean:.2f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.profile_study",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "runs", nargs="+", type=Path, help="`bench run` output directories (or results.json)"
    )
    parser.add_argument(
        "--candidate-prefix", default="approx-", help="policies whose name starts with this compete"
    )
    parser.add_argument(
        "--floor",
        type=float,
        default=0.9,
        help="a candidate competes in a cell if its hit rate and throughput are at least this"
        " share of the best candidate's",
    )
    parser.add_argument(
        "--max-sim-lag",
        type=float,
        default=0.05,
        help="runs where a simulator fell behind by more than this share of the run do not compete",
    )
    args = parser.parse_args(argv)
    cells = load_cells(args.runs)
    standings, winners = score(cells, args.candidate_prefix, args.floor, args.max_sim_lag)
    if not standings:
        print(f"no policy starts with {args.candidate_prefix!r}", file=sys.stderr)
        return 1
    print(render(cells, standings, winners, args.max_sim_lag))
    return 0


if __name__ == "__main__":
    sys.exit(main())
