"""`make demo` / `python -m bench demo`: the routing benchmark, small and quick,
then the routing lab at fleet scale.

1. Real: for each policy of DEMO_POLICIES, 4 fresh simulated vLLM pods, `epp serve`
   with the policy's config and a real Envoy in front; a short shared-prefix
   workload streamed through Envoy; the pods' prefix-cache counters read before and
   after. Then a table (hit rate, TTFT, throughput, and the workload's analytic
   bounds). Four pods on two cores are too few for routing to change TTFT much.
2. Lab (`python -m bench lab`, docs/lab.md): LAB_POLICIES, peers' models included,
   on LAB_PODS pods in virtual time at LAB_LOAD times the fleet's no-hit capacity,
   where the routing decides whether the fleet keeps up: TTFT per policy, and a TTFT
   CDF plot.

Everything it starts is stopped on exit, on Ctrl-C and on SIGTERM too.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from pathlib import Path

from bench.client import Arrivals
from bench.runner import (
    RunOptions,
    data_path,
    resolve_policy,
    run_benchmark,
    stop_on_sigterm,
    unique_names,
)
from bench.workloads import WorkloadSpec, default_tokenizer_dir

# The policies the demo compares, by config name (manifests/config/NAME.yaml) or
# path; the baseline first. Add a prefix-aware profile here when it exists.
DEMO_POLICIES = ("round-robin", "random", "default")

DEMO_PODS = 4
# 16 system prompts of 1,024 tokens, 8 questions each: 128 requests, at a rate that
# keeps 4 pods busy (simulated seconds, run in real time).
DEMO_WORKLOAD = {
    "groups": 16,
    "prompts_per_group": 8,
    "system_len": 1024,
    "question_len": 64,
    "output_len": 64,
}
DEMO_RATE = 24.0
DEMO_TIME_SCALE = 1.0

# The lab part: a fleet of 32 pods, 768 shared-prefix requests (24 system prompts
# of 2,048 tokens, 32 questions each), at 1.6 times the capacity with no cache
# hits, one seed per policy.
LAB_POLICIES = ("round-robin", "sglang-cache-aware", "dynamo-kv", "gie-default", "default")
LAB_PODS = 32
LAB_WORKLOAD = {
    "groups": 24,
    "prompts_per_group": 32,
    "system_len": 2048,
    "question_len": 128,
    "output_len": 128,
}
LAB_LOAD = 1.6


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def run_demo(out: Path, policies: Sequence[str] | None = None, keep_running: bool = False) -> int:
    # SIGTERM stops the demo as cleanly as Ctrl-C does.
    stop_on_sigterm()
    names = list(policies or DEMO_POLICIES)
    command = "python -m bench demo" + "".join(f" --policy {p}" for p in policies or ())
    try:
        options = RunOptions(
            out=out,
            workload=WorkloadSpec("shared-prefix", options=DEMO_WORKLOAD),
            policies=unique_names([resolve_policy(p) for p in names]),
            ladder=[Arrivals("poisson", rate=DEMO_RATE)],
            pods=DEMO_PODS,
            time_scale=DEMO_TIME_SCALE,
            tokenizer=default_tokenizer_dir(),
            progress=sys.stderr.isatty(),
            command=command,
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(
        f"{len(names)} policies ({', '.join(names)}), each on {DEMO_PODS} fresh simulated pods"
        f" behind Envoy + the EPP; {DEMO_WORKLOAD['groups'] * DEMO_WORKLOAD['prompts_per_group']}"
        f" shared-prefix requests at {DEMO_RATE:g}/s (logs in {out}/runs/)"
    )
    try:
        document = run_benchmark(options)
        oracle = document["oracle"]
        head = f"{'policy':<16} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p90':>9} {'req/s':>7}"
        print(f"\n{head}  errors")
        for name, r in document["policies"].items():
            flag = "  FAILED: " + str(r["failure"]) if r["status"] == "failed" else ""
            print(
                f"{name:<16} {_cell(r['hit_rate'], '8.3f')} {_cell(r['ttft_p50_s'], '8.3f')}s"
                f" {_cell(r['ttft_p90_s'], '8.3f')}s {_cell(r['throughput_rps'], '7.2f')}"
                f"  {r['errors']}{flag}"
            )
        print(f"{'bound h*':<16} {oracle['h_star']:8.3f}   (one copy of every prefix)")
        print(f"{'h_random':<16} {oracle['h_random']:8.3f}   (uniform random, {DEMO_PODS} pods)")
        print(f"\nreport: {out / 'report.md'}; plots: {out}/*.png; data: {out / 'results.json'}")
        if not keep_running:
            run_lab_part(out / "lab")
        if keep_running:
            policy = options.policies[0]
            with data_path(policy, options, out / "live") as path:
                url = path.url
                print(f"\n{policy.name} stack up: curl -s {url}/v1/chat/completions \\")
                print(
                    '  -H \'content-type: application/json\' -d \'{"model": "sim-model",'
                    ' "messages": [{"role": "user", "content": "Hello"}]}\''
                )
                print("Running until Ctrl-C.")
                while True:
                    time.sleep(3600)
    except KeyboardInterrupt:
        print("\nstopped: every process the demo started is stopped")
        return 130
    return 0


def run_lab_part(out: Path) -> None:
    from bench.lab.run import FleetSpec, LabOptions, run_lab

    requests = LAB_WORKLOAD["groups"] * LAB_WORKLOAD["prompts_per_group"]
    print(
        f"\nThe routing lab (virtual time, the EPP's real scheduling code, peers' models):"
        f" {LAB_PODS} pods, {requests} shared-prefix requests at {LAB_LOAD:g} x the fleet's"
        " capacity with no cache hits"
    )
    started = time.monotonic()
    document = run_lab(
        LabOptions(
            workload=WorkloadSpec("shared-prefix", options=LAB_WORKLOAD),
            policies=LAB_POLICIES,
            fleet=FleetSpec(LAB_PODS),
            seeds=(0,),
            load=LAB_LOAD,
            rate=None,
            tokenizer=default_tokenizer_dir(),
            out=out,
            command="python -m bench demo (lab part)",
            progress=sys.stderr.isatty(),
        )
    )
    head = f"{'policy':<20} {'hit rate':>8} {'TTFT p50':>9} {'TTFT p90':>9} {'TTFT p99':>9}"
    print(f"\n{head}")
    for name, r in document["policies"].items():
        print(
            f"{name:<20} {_cell(r['hit_rate'], '8.3f')} {_cell(r['ttft_p50_s'], '8.3f')}s"
            f" {_cell(r['ttft_p90_s'], '8.3f')}s {_cell(r['ttft_p99_s'], '8.3f')}s"
        )
    print(f"{'bound h*':<20} {document['oracle']['h_star']:8.3f}")
    print(
        f"\nlab: {time.monotonic() - started:.0f} s; TTFT CDF: {out / 'ttft_cdf.png'};"
        f" report: {out / 'report.md'}"
    )
