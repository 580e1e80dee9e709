"""`python -m bench.seeds DIR...`: `bench run` over several seeds, in one table.

Each DIR is a `python -m bench run` output directory of the same workload, fleet and
policies run with a different `--seed` (a different sample of the workload and its
arrivals). The table has a row per policy: each figure the mean over the seeds ±
the half-width of its 95% confidence interval (Student's t, as `--repeats` gives
within one run: bench/runner.py `combine_repeats`), each seed's TTFT p90, and with
`--against POLICY` each seed's TTFT p90 over that policy's in the same run (paired:
the policies of one seed ran on the same requests, minutes apart).

A directory whose workload shape, fleet or arrivals differ from the first's in
anything but the seed is refused: the mean would mix different experiments.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from bench.runner import combine_repeats
from bench.stats import pm

# What may differ between the runs being combined: the seed, and where they went.
_SEED_ONLY = ("seed",)


def _comparable(document: dict[str, Any]) -> dict[str, Any]:
    """What must be equal for two runs to be seeds of one experiment."""
    workload = document["workload"]
    params = {k: v for k, v in workload.get("params", {}).items() if k not in _SEED_ONLY}
    setup = document["setup"]
    ladder = document["ladder"]
    return {
        "workload": workload["name"],
        "params": params,
        "pods": setup.get("pods"),
        "time_scale": setup.get("time_scale"),
        "prefill_pods": setup.get("prefill_pods"),
        "arrivals": [rung.get("label") for rung in ladder],
    }


def load_runs(directories: list[Path]) -> list[dict[str, Any]]:
    """Each directory's results.json; ValueError naming what is missing or differs."""
    documents = []
    for directory in directories:
        path = directory / "results.json"
        if not path.is_file():
            raise ValueError(f"no results.json in {directory} (a `bench run --out` directory?)")
        document = json.loads(path.read_text(encoding="utf-8"))
        if "ladder" not in document:
            raise ValueError(f"{path} is not a `bench run` result (no ladder)")
        documents.append(document)
    first = _comparable(documents[0])
    for directory, document in zip(directories[1:], documents[1:], strict=True):
        other = _comparable(document)
        differ = [k for k in first if first[k] != other[k]]
        if differ:
            raise ValueError(
                f"{directory} differs from {directories[0]} in {', '.join(differ)}:"
                " combine only runs that differ in --seed"
            )
    seeds = [d["workload"].get("params", {}).get("seed") for d in documents]
    if len(set(seeds)) < len(seeds):
        raise ValueError(f"the runs repeat a seed ({seeds}): give each its own --seed")
    return documents


def _last_rung(document: dict[str, Any]) -> dict[str, Any]:
    policies: dict[str, Any] = document["ladder"][-1]["policies"]
    return policies


def table(documents: list[dict[str, Any]], against: str | None = None) -> str:
    """The markdown table of the policies every run has, in the first run's order."""
    rungs = [_last_rung(d) for d in documents]
    names = [n for n in rungs[0] if all(n in r for r in rungs[1:])]
    if against is not None and against not in names:
        raise ValueError(f"--against {against!r}: not a policy of every run ({', '.join(names)})")
    seeds = [d["workload"].get("params", {}).get("seed") for d in documents]
    header = (
        "| policy | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms | throughput req/s | hit rate"
        " | errors | sim lag max ms | p90 per seed (ms) |"
    )
    rule = "|---|---:|---:|---:|---:|---:|---:|---:|---|"
    if against is not None:
        header += f" p90 / {against}'s, per seed | mean |"
        rule += "---|---:|"
    lines = [header, rule]
    for name in names:
        runs = [r[name] for r in rungs]
        combined = combine_repeats(runs)
        p90s = [r.get("ttft_p90_s") for r in runs]
        per_seed = ", ".join("-" if v is None else f"{v * 1e3:.1f}" for v in p90s)
        line = (
            f"| {name} | {pm(combined, 'ttft_p50_s', '.1f', 1e3)}"
            f" | {pm(combined, 'ttft_p90_s', '.1f', 1e3)}"
            f" | {pm(combined, 'ttft_p99_s', '.1f', 1e3)}"
            f" | {pm(combined, 'throughput_rps', '.1f')} | {pm(combined, 'hit_rate', '.3f')}"
            f" | {pm(combined, 'errors', 'g')} | {pm(combined, 'sim_lag_max_s', '.1f', 1e3)}"
            f" | {per_seed} |"
        )
        if against is not None:
            ratios = [
                None if a is None or b is None or b <= 0 else a / b
                for a, b in zip(p90s, (r[against].get("ttft_p90_s") for r in rungs), strict=True)
            ]
            known = [x for x in ratios if x is not None]
            text = ", ".join("-" if x is None else f"{x:.2f}" for x in ratios)
            # A mean over the seeds only when every seed has its ratio.
            summary = combine_repeats([{"ratio": x} for x in ratios]) if known == ratios else {}
            line += f" {text} | {pm(summary, 'ratio', '.2f')} |"
        lines.append(line)
    seed_text = ", ".join(str(s) for s in seeds)
    return (
        f"{documents[0]['workload']['name']}, {documents[0]['setup'].get('pods')} pods,"
        f" {documents[0]['ladder'][-1].get('label')}, seeds {seed_text}"
        f" (mean ± 95% CI over {len(documents)} runs):\n\n" + "\n".join(lines) + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.seeds",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("directories", nargs="+", type=Path, metavar="DIR")
    parser.add_argument(
        "--against",
        metavar="POLICY",
        help="also give each policy's TTFT p90 over this policy's, seed by seed",
    )
    args = parser.parse_args(argv)
    try:
        documents = load_runs(args.directories)
        text = table(documents, args.against)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
