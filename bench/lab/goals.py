"""`python -m bench.lab.goals`: one policy's lab results held against the routing
goals (docs/routing.md, Against the goals), cell by cell, beside the peers'
models measured in the same cells.

A cell is a workload, a fleet and a load (`shared-prefix-16pods-load1.6`). Its
results are two `python -m bench lab` output directories, found by two templates
with `{cell}` in them: the policy's own (`--ours`) and the one holding the peers'
models and round-robin (`--peers`); every cell with both is compared, or those
named with `--cell`. The goals, on each cell's means over its seeds:

- TTFT p90 at most `--p90-factor` (1 unless set) times the best peer's, and p50
  at most the best peer's; throughput at least the best peer's. The peers are
  the models of SGLang's cache-aware router, Dynamo's KV router, llm-d's
  optimized baseline and GIE's default (`PEERS`), those of them the cell has.
  A goal missed where the two 95% intervals overlap is marked so: the seeds do
  not tell the two apart there;
- the median prediction error after warm-up at most 20% (`ERROR_GOAL`), where
  the policy predicts;
- beside round-robin, where the cell has it: the p90's ratio to round-robin's
  (the goals ask for at most 1/5 where round-robin queues, and at most 1.05 on
  prompts that share nothing: which cells those are is the reader's call, so
  the ratio is given and no verdict).

It writes a markdown table and the count of cells meeting each goal, to stdout
or `--out`. It reads the results files only: nothing is run.

    python -m bench.lab.goals --ours 'docs/results/predicted-ttft/lab/{cell}-crowd-demand' \\
        --peers 'docs/results/lab/{cell}'
"""

from __future__ import annotations

import argparse
import glob
import json
import re
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from bench.stats import pm

PEERS: Final = ("sglang-cache-aware", "dynamo-kv", "llm-d-optimized-baseline", "gie-default")
PEER_LABELS: Final = {
    "sglang-cache-aware": "SGLang",
    "dynamo-kv": "Dynamo",
    "llm-d-optimized-baseline": "llm-d",
    "gie-default": "GIE",
}
ROUND_ROBIN: Final = "round-robin"
THROUGHPUT: Final = "throughput_rps"
ERROR_GOAL: Final = 0.20
CELL: Final = "{cell}"


class GoalsError(Exception):
    """Input the comparison cannot use; the message says what to change."""


@dataclass(frozen=True)
class Figure:
    """One figure of a policy's results: its mean over seeds and its 95% interval's
    half-width (0 for one seed), with the result it came from, for `pm`."""

    result: Mapping[str, Any]
    key: str
    mean: float
    ci: float

    @classmethod
    def of(cls, result: Mapping[str, Any], key: str) -> Figure:
        value = result.get(key)
        if not isinstance(value, int | float):
            raise GoalsError(f"no {key!r} in a policy's results")
        ci = result.get(f"{key}_ci95")
        return cls(result, key, float(value), float(ci) if isinstance(ci, int | float) else 0.0)

    def overlaps(self, other: Figure) -> bool:
        return abs(self.mean - other.mean) <= self.ci + other.ci

    def text(self) -> str:
        """Times in ms, throughput in req/s, ± the interval where there is one."""
        return pm(self.result, self.key, ".1f", 1.0 if self.key == THROUGHPUT else 1e3)


@dataclass(frozen=True)
class Goal:
    """One figure of one cell: ours, the best peer's, and whether the goal holds."""

    ours: Figure
    best: Figure
    peer: str
    met: bool

    @property
    def close(self) -> bool:
        """Missed, but inside both intervals."""
        return not self.met and self.ours.overlaps(self.best)


@dataclass(frozen=True)
class Cell:
    name: str
    seeds: int
    peer_seeds: int
    p90: Goal
    p50: Goal
    throughput: Goal
    error: float | None  # the median prediction error after warm-up, where predicted
    round_robin_ratio: float | None  # our p90 over round-robin's


def _load(directory: Path) -> dict[str, Any]:
    path = directory / "results.json"
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise GoalsError(f"no results.json in {directory}") from None
    except json.JSONDecodeError as e:
        raise GoalsError(f"{path} is not JSON: {e}") from None
    if not isinstance(document, dict) or not isinstance(document.get("policies"), dict):
        raise GoalsError(f"{path} has no 'policies': not a `python -m bench lab` result")
    return document


def _ours(document: Mapping[str, Any], directory: Path, policy: str | None) -> dict[str, Any]:
    policies: dict[str, Any] = document["policies"]
    if policy is not None:
        if policy not in policies:
            raise GoalsError(
                f"{directory} has no policy {policy!r}; it has: {', '.join(sorted(policies))}"
            )
        return dict(policies[policy])
    if len(policies) != 1:
        raise GoalsError(
            f"{directory} holds {len(policies)} policies ({', '.join(sorted(policies))}):"
            " name ours with --policy"
        )
    return dict(next(iter(policies.values())))


def _best(
    ours: Mapping[str, Any], peers: Mapping[str, Mapping[str, Any]], key: str, factor: float
) -> Goal:
    """The best peer's figure (lowest; highest for throughput) and whether ours meets
    it (at most `factor` times it; at least it for throughput)."""
    higher = key == THROUGHPUT
    figures = {name: Figure.of(result, key) for name, result in peers.items()}
    name = (max if higher else min)(figures, key=lambda n: figures[n].mean)
    mine, best = Figure.of(ours, key), figures[name]
    met = mine.mean >= best.mean if higher else mine.mean <= factor * best.mean
    return Goal(mine, best, PEER_LABELS[name], met)


def compare(
    name: str,
    ours_dir: Path,
    peers_dir: Path,
    policy: str | None = None,
    p90_factor: float = 1.0,
) -> Cell:
    """One cell's goals."""
    mine = _ours(_load(ours_dir), ours_dir, policy)
    document = _load(peers_dir)
    policies: dict[str, Any] = document["policies"]
    peers: dict[str, Any] = {p: policies[p] for p in PEERS if p in policies}
    if not peers:
        raise GoalsError(f"{peers_dir} has none of the peers' models ({', '.join(PEERS)})")
    error = mine.get("ttft_prediction_error_p50_warm")
    ratio = None
    if ROUND_ROBIN in policies:
        ratio = (
            Figure.of(mine, "ttft_p90_s").mean / Figure.of(policies[ROUND_ROBIN], "ttft_p90_s").mean
        )
    return Cell(
        name=name,
        seeds=int(mine.get("seeds", 0)),
        peer_seeds=min(int(r.get("seeds", 0)) for r in peers.values()),
        p90=_best(mine, peers, "ttft_p90_s", p90_factor),
        p50=_best(mine, peers, "ttft_p50_s", 1.0),
        throughput=_best(mine, peers, THROUGHPUT, 1.0),
        error=float(error) if isinstance(error, int | float) else None,
        round_robin_ratio=ratio,
    )


def _pattern(template: str) -> re.Pattern[str]:
    before, _, after = template.partition(CELL)
    return re.compile(re.escape(before) + r"(?P<cell>[^/]+)" + re.escape(after) + r"\Z")


def _check_template(template: str) -> None:
    if template.count(CELL) != 1:
        raise GoalsError(f"a template needs {CELL} once, got {template!r}")


def cells_of(ours: str, peers: str) -> list[str]:
    """The cells with results under both templates (each with `{cell}` once:
    `_check_template`), in name order."""
    pattern = _pattern(ours.rstrip("/"))
    found = []
    for path in glob.glob(glob.escape(ours.rstrip("/")).replace(glob.escape(CELL), "*")):
        match = pattern.match(path)
        if match is None:
            continue
        name = match["cell"]
        if (Path(path) / "results.json").is_file() and (
            Path(peers.replace(CELL, name)) / "results.json"
        ).is_file():
            found.append(name)
    return sorted(found)


def _verdict(goal: Goal) -> str:
    return "yes" if goal.met else ("no (inside the intervals)" if goal.close else "**no**")


def table(cells: Sequence[Cell], p90_factor: float = 1.0) -> str:
    p90_head = "p90" if p90_factor == 1.0 else f"p90 at most {p90_factor:g} times the peer's"
    lines = [
        f"| cell | seeds | TTFT p90 ms | best peer p90 | {p90_head} | TTFT p50 ms"
        " | best peer p50 | p50 | req/s | best peer req/s | req/s | error after warm-up"
        " | p90 / round-robin's |",
        "|---|---:|---:|---:|---|---:|---:|---|---:|---:|---|---:|---:|",
    ]
    for c in cells:
        error = "" if c.error is None else f"{c.error * 100:.1f}%"
        ratio = "" if c.round_robin_ratio is None else f"{c.round_robin_ratio:.3f}"
        lines.append(
            f"| {c.name} | {c.seeds} / {c.peer_seeds} | {c.p90.ours.text()}"
            f" | {c.p90.best.text()} ({c.p90.peer}) | {_verdict(c.p90)}"
            f" | {c.p50.ours.text()} | {c.p50.best.text()} ({c.p50.peer}) | {_verdict(c.p50)}"
            f" | {c.throughput.ours.text()} | {c.throughput.best.text()} ({c.throughput.peer})"
            f" | {_verdict(c.throughput)} | {error} | {ratio} |"
        )
    n = len(cells)

    def count(goals: Sequence[Goal]) -> str:
        close = sum(g.close for g in goals)
        return f"{sum(g.met for g in goals)} of {n}" + (
            f" ({close} more missed inside the intervals)" if close else ""
        )

    errors = [c.error for c in cells if c.error is not None]
    bound = "the best peer's" if p90_factor == 1.0 else f"{p90_factor:g} times the best peer's"
    lines += [
        "",
        f"- TTFT p90 at most {bound}: {count([c.p90 for c in cells])}",
        f"- TTFT p50 at most the best peer's: {count([c.p50 for c in cells])}",
        f"- throughput at least the best peer's: {count([c.throughput for c in cells])}",
    ]
    if errors:
        met = sum(e <= ERROR_GOAL for e in errors)
        lines.append(
            f"- median prediction error after warm-up at most {ERROR_GOAL:.0%}:"
            f" {met} of {len(errors)} (the largest {max(errors) * 100:.1f}%)"
        )
    lines.append(
        "- seeds: ours / the fewest of the peers'; means over them, ± the 95% interval's half-width"
    )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.lab.goals",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--ours", required=True, help="our results' directory, {cell} for the cell's name"
    )
    parser.add_argument(
        "--peers",
        required=True,
        help="the directory with the peers' models and round-robin, {cell} for the cell's name",
    )
    parser.add_argument(
        "--cell",
        action="append",
        default=[],
        metavar="NAME",
        help="compare this cell (repeat); default: every cell with both results",
    )
    parser.add_argument(
        "--policy", help="our policy's name in its results (needed where there are several)"
    )
    parser.add_argument(
        "--p90-factor",
        type=float,
        default=1.0,
        help="the p90 goal: at most this times the best peer's (0.8 for the trace at 0.8)",
    )
    parser.add_argument("--out", type=Path, help="write the table here instead of stdout")
    raw = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    try:
        if not 0.0 < args.p90_factor <= 10.0:
            raise GoalsError(f"--p90-factor must be in (0, 10], got {args.p90_factor}")
        _check_template(args.ours)
        _check_template(args.peers)
        names = args.cell or cells_of(args.ours, args.peers)
        if not names:
            raise GoalsError(
                f"no cell has results under both {args.ours!r} and {args.peers!r}"
                " (each directory needs a results.json)"
            )
        cells = [
            compare(
                name,
                Path(args.ours.replace(CELL, name)),
                Path(args.peers.replace(CELL, name)),
                args.policy,
                args.p90_factor,
            )
            for name in names
        ]
    except GoalsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = table(cells, args.p90_factor)
    if args.out is not None:
        command = " ".join(shlex.quote(a) for a in ["python", "-m", "bench.lab.goals", *raw])
        text = f"Produced by:\n\n```sh\n{command}\n```\n\n{text}"
    if args.out is None:
        print(text, end="")
    else:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text, encoding="utf-8")
        print(f"{len(cells)} cells: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
