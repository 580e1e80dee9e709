"""`python -m bench.lab.fidelity`: the lab against the real benchmark, side by side.

For each workload, the same requests (workload seed), the same Poisson arrivals
(arrival seed and rate) and the same fleet (pods, engine) go once through
`python -m bench run` (client -> real Envoy -> `epp serve` -> simulated pods in
real time; the real sglang-router for SGLang) and once through the lab (the same
EPP code in virtual time; the lab's model of SGLang's router). The table compares
hit rate (target: within 0.03) and TTFT p50 and p90 (target: within 25%), with the
real run's simulator lag beside them: the real run on this machine can fall
behind its own clock, which the lab never does.

    python -m bench.lab.fidelity --out docs/results/lab-fidelity
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.client import Arrivals
from bench.lab.run import FleetSpec, LabOptions, run_lab
from bench.provenance import provenance
from bench.runner import RunOptions, resolve_policy, run_benchmark
from bench.workloads import WorkloadSpec, default_tokenizer_dir

SHAPE = {"system_len": 1024, "question_len": 128, "output_len": 64}


@dataclass(frozen=True)
class Case:
    workload: str
    options: dict[str, Any]
    rate: float


CASES = (
    Case("shared-prefix", {"groups": 8, "prompts_per_group": 16, **SHAPE}, 10.0),
    Case("hot-prefix", {"groups": 8, "requests": 128, "hot_share": 0.5, **SHAPE}, 10.0),
    Case(
        "multi-turn",
        {
            "conversations": 16,
            "turns": 4,
            "system_len": 1024,
            "question_len": 128,
            "output_len": 64,
        },
        2.0,
    ),
)
# (name in the table, `bench run` policy, lab policy)
POLICIES = (
    ("round-robin", "round-robin", "round-robin"),
    ("default", "default", "default"),
    ("precise-prefix", "precise-prefix", "precise-prefix"),
    ("sglang cache_aware", "sglang-router", "sglang-cache-aware"),
)
HIT_TOLERANCE = 0.03
TTFT_TOLERANCE = 0.25
PEER_HIT_TOLERANCE = 0.05


def run(out: Path, pods: int, command: str) -> dict[str, Any]:
    tokenizer = default_tokenizer_dir()
    rows = []
    for case in CASES:
        spec = WorkloadSpec(case.workload, seed=0, options=case.options)
        real = run_benchmark(
            RunOptions(
                out=out / case.workload / "bench-run",
                workload=spec,
                policies=[resolve_policy(p[1]) for p in POLICIES],
                ladder=[Arrivals("poisson", rate=case.rate)],
                pods=pods,
                tokenizer=tokenizer,
                seed=0,
                progress=False,
                command=command,
            )
        )
        lab = run_lab(
            LabOptions(
                workload=spec,
                policies=tuple(p[2] for p in POLICIES),
                fleet=FleetSpec(pods),
                seeds=(0,),
                load=None,
                rate=case.rate,
                tokenizer=tokenizer,
                out=out / case.workload / "lab",
                command=command,
            )
        )
        for name, real_name, lab_name in POLICIES:
            r = real["policies"][real_name]
            m = lab["policies"][lab_name]
            rows.append(compare(case, name, r, m, peer=real_name == "sglang-router"))
    document = {**provenance(command), "pods": pods, "rows": rows}
    (out / "fidelity.json").write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    (out / "fidelity.md").write_text(markdown(document), encoding="utf-8")
    return document


def _ratio(lab: float | None, real: float | None) -> float | None:
    if lab is None or real is None or real <= 0:
        return None
    return lab / real


def compare(
    case: Case, name: str, real: dict[str, Any], lab: dict[str, Any], peer: bool
) -> dict[str, Any]:
    hit_real, hit_lab = real.get("hit_rate"), lab.get("hit_rate")
    hit_diff = None if hit_real is None or hit_lab is None else hit_lab - hit_real
    row: dict[str, Any] = {
        "workload": case.workload,
        "rate": case.rate,
        "policy": name,
        "hit_rate_real": hit_real,
        "hit_rate_lab": hit_lab,
        "hit_rate_diff": hit_diff,
        "hit_rate_ok": hit_diff is not None
        and abs(hit_diff) <= (PEER_HIT_TOLERANCE if peer else HIT_TOLERANCE),
        "real_status": real.get("status"),
        "real_sim_lag_max_s": real.get("sim_lag_max_s"),
        "real_client_lag_p99_s": real.get("client_lag_p99_s"),
    }
    ok = True
    for key in ("ttft_p50_s", "ttft_p90_s"):
        ratio = _ratio(lab.get(key), real.get(key))
        row[f"{key}_real"], row[f"{key}_lab"], row[f"{key}_ratio"] = (
            real.get(key),
            lab.get(key),
            ratio,
        )
        ok = ok and ratio is not None and abs(ratio - 1.0) <= TTFT_TOLERANCE
    row["ttft_ok"] = ok
    return row


def _f(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "-" if value is None else format(value * scale, spec)


def markdown(document: dict[str, Any]) -> str:
    lines = [
        f"# The lab against `bench run` ({document['pods']} pods, one seed)",
        "",
        "```sh",
        document["command"],
        "```",
        "",
        f"commit {document['commit'][:12]}{' (dirty)' if document['dirty'] else ''},"
        f" {document['machine']['cpus']} CPUs. Targets: hit rate within {HIT_TOLERANCE}"
        f" ({PEER_HIT_TOLERANCE} for the peer's model), TTFT p50 and p90 within"
        f" {TTFT_TOLERANCE:.0%}. TTFT in ms.",
        "",
        "| workload | policy | hit real | hit lab | diff | ok | p50 real | p50 lab | ratio"
        " | p90 real | p90 lab | ratio | ok | real sim lag s |",
        "|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in document["rows"]:
        lines.append(
            f"| {r['workload']} (rate {r['rate']:g}/s) | {r['policy']}"
            f" | {_f(r['hit_rate_real'], '.3f')} | {_f(r['hit_rate_lab'], '.3f')}"
            f" | {_f(r['hit_rate_diff'], '+.3f')} | {'yes' if r['hit_rate_ok'] else 'NO'}"
            f" | {_f(r['ttft_p50_s_real'], '.1f', 1000)} | {_f(r['ttft_p50_s_lab'], '.1f', 1000)}"
            f" | {_f(r['ttft_p50_s_ratio'], '.2f')}"
            f" | {_f(r['ttft_p90_s_real'], '.1f', 1000)} | {_f(r['ttft_p90_s_lab'], '.1f', 1000)}"
            f" | {_f(r['ttft_p90_s_ratio'], '.2f')} | {'yes' if r['ttft_ok'] else 'NO'}"
            f" | {_f(r['real_sim_lag_max_s'], '.2f')} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m bench.lab.fidelity",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("out/lab-fidelity"))
    parser.add_argument("--pods", type=int, default=4)
    args = parser.parse_args(argv)
    document = run(args.out, args.pods, "python -m bench.lab.fidelity " + shlex.join(argv))
    print(markdown(document))
    return 0


if __name__ == "__main__":
    sys.exit(main())
