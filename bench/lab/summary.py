"""`python -m bench.lab.summary DIR...`: one markdown table of several lab runs.

Each DIR is a `python -m bench lab` output directory; the table has a row per
(run, policy): hit rate, TTFT p50, p90 and p99, max/mean load, each mean ± 95% CI
over the run's seeds, with the run's workload, pods and load.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.stats import pm


def table(directories: list[Path]) -> str:
    lines = [
        "| workload | pods | load | policy | hit rate | TTFT p50 ms | TTFT p90 ms | TTFT p99 ms"
        " | max/mean load |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for directory in directories:
        document = json.loads((directory / "results.json").read_text(encoding="utf-8"))
        setup = document["setup"]
        for name, r in document["policies"].items():
            lines.append(
                f"| {document['workload']['name']} | {setup['pods']} | {setup['load']:.2f}"
                f" | {name} | {pm(r, 'hit_rate', '.3f')}"
                f" | {pm(r, 'ttft_p50_s', '.1f', 1000)} | {pm(r, 'ttft_p90_s', '.1f', 1000)}"
                f" | {pm(r, 'ttft_p99_s', '.1f', 1000)} | {pm(r, 'max_over_mean_load', '.2f')} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.lab.summary", description=__doc__)
    parser.add_argument("directories", nargs="+", type=Path, metavar="DIR")
    args = parser.parse_args(argv)
    missing = [str(d) for d in args.directories if not (d / "results.json").is_file()]
    if missing:
        print(f"error: no results.json in {', '.join(missing)}", file=sys.stderr)
        return 2
    print(table(args.directories), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
