"""`python -m bench.idle_cpu`: the CPU a live EPP uses while nothing happens, with
flow control on and off, before a burst and after it has drained.

Flow control runs no timer while nothing waits (docs/flow-control.md, "Events, not
polling"); the lab checks it on virtual time (timer wake-ups with an empty queue).
This measures it on the real process. For each policy (default: `default`, flow
control off, and `flow-control`, the same profile with it on), on a fresh stack as
`bench run` starts it (bench/runner.py `data_path`: simulated pods, `epp serve`,
Envoy in front):

1. settle: the stack is left alone a few seconds (start-up work, first scrapes);
2. idle: the EPP process's CPU seconds (user + system, `/proc/<pid>/stat`, all its
   threads) are read, nothing is sent for `--idle` seconds, and read again: CPU %
   = CPU seconds / wall seconds x 100 (100% = one core). The EPP's own work while
   idle is its metrics scrapes of every pod (`--refresh-metrics-interval`),
   whatever the policy; flow control's share is the difference between the two
   policies. Flow control's dispatch-pass counter is read before and after the
   window (from /metrics, outside it): an idle controller runs none;
3. burst: a tenants workload (`--burst-requests` requests at `--burst-load` times
   the fleet's capacity, bench/workloads.py) through Envoy, so that requests queue
   in the EPP; every request must come back served, shed or failed, and the
   queue's peak is sampled;
4. drained: once every response has ended the queue must be empty; after the
   settle time again the same idle window is measured. CPU must be back at its
   idle level: a controller that kept a timer or a loop alive after the queue
   emptied would show here.

Writes idle_cpu.json and idle_cpu.md in `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.client import Arrivals, drive, is_shed
from bench.provenance import commit_label, produced_by, provenance
from bench.runner import (
    FC_PASSES,
    MODEL,
    Policy,
    QueueWatch,
    RunOptions,
    check_accounted,
    data_path,
    fleet_capacity_rps,
    http_get,
    queue_now,
    resolve_policy,
    series_sum,
    unique_names,
)
from bench.workloads import WorkloadSpec, load_words, tokenizer_from_arg

DEFAULT_POLICIES = ("default", "flow-control")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far, all its threads
    (/proc/<pid>/stat fields 14 and 15, in clock ticks)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = text[text.rindex(")") + 2 :].split()
    # fields[0] is field 3 (state): utime is field 14, stime field 15.
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


@dataclass(frozen=True)
class Window:
    """One idle window: the EPP's CPU over it, and flow control's activity."""

    wall_s: float
    cpu_s: float
    dispatch_passes: int | None  # during the window; None: flow control off
    queued_at_end: int | None

    @property
    def cpu_percent(self) -> float:
        return 100.0 * self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "wall_s": round(self.wall_s, 3),
            "cpu_s": round(self.cpu_s, 3),
            "cpu_percent": round(self.cpu_percent, 3),
            "dispatch_passes": self.dispatch_passes,
            "queued_at_end": self.queued_at_end,
        }


def _passes(metrics_url: str) -> tuple[int | None, int | None]:
    """Flow control's dispatch passes so far and the requests queued now (None, None
    when it is off)."""
    page = http_get(metrics_url)
    passes = series_sum(page, FC_PASSES)
    if passes is None:
        return None, None
    return int(passes), queue_now(page)[0]


def idle_window(pid: int, metrics_url: str, seconds: float) -> Window:
    """Nothing sent for `seconds`: the EPP's CPU over them. The metrics are read
    just outside the window, so their scrape is not counted."""
    passes_before, _ = _passes(metrics_url)
    cpu_before, wall_before = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    cpu_after, wall_after = cpu_seconds(pid), time.monotonic()
    passes_after, queued = _passes(metrics_url)
    during = (
        passes_after - passes_before
        if passes_before is not None and passes_after is not None
        else None
    )
    return Window(wall_after - wall_before, cpu_after - cpu_before, during, queued)


@dataclass(frozen=True)
class IdleOptions:
    out: Path
    policies: list[Policy]
    pods: int = 4
    idle_s: float = 30.0
    settle_s: float = 5.0
    burst_requests: int = 400
    burst_load: float = 3.0
    tokenizer: Path | None = None
    epp_args: tuple[str, ...] = ()
    seed: int = 0
    command: str = ""


def measure_policy(policy: Policy, options: IdleOptions, workdir: Path) -> dict[str, Any]:
    """One policy on a fresh stack: idle, burst, drained idle (module docstring)."""
    words = load_words(options.tokenizer)
    workload = WorkloadSpec(
        "tenants", seed=options.seed, options={"requests": options.burst_requests}
    ).build(words)
    capacity = fleet_capacity_rps(workload, words, options.pods)
    arrivals = Arrivals("trace", load=options.burst_load).with_capacity(capacity)
    run_options = RunOptions(
        out=workdir,
        workload=WorkloadSpec("tenants"),
        policies=[policy],
        ladder=[arrivals],
        pods=options.pods,
        tokenizer=options.tokenizer,
        epp_args=list(options.epp_args),
        seed=options.seed,
        progress=False,
    )
    workdir.mkdir(parents=True, exist_ok=True)
    with data_path(policy, run_options, workdir) as path:
        assert path.epp_pid is not None
        assert path.epp_metrics_url is not None
        time.sleep(options.settle_s)
        before = idle_window(path.epp_pid, path.epp_metrics_url, options.idle_s)
        burst_cpu = cpu_seconds(path.epp_pid)
        burst_started = time.monotonic()
        with QueueWatch(path.epp_metrics_url) as watch:
            records, _ = asyncio.run(
                drive(
                    workload,
                    path.url,
                    arrivals,
                    model=MODEL,
                    time_scale=1.0,
                    seed=options.seed,
                    request_timeout_s=600.0,
                )
            )
        burst_wall = time.monotonic() - burst_started
        burst_cpu = cpu_seconds(path.epp_pid) - burst_cpu
        check_accounted(records, workload.num_requests)
        _, queued_after_burst = _passes(path.epp_metrics_url)
        time.sleep(options.settle_s)
        after = idle_window(path.epp_pid, path.epp_metrics_url, options.idle_s)
    served = sum(1 for r in records if r.ok)
    shed = sum(1 for r in records if is_shed(r))
    return {
        **policy.describe(),
        "idle_before": before.to_json(),
        "burst": {
            "requests": workload.num_requests,
            "load": options.burst_load,
            "rate_rps": arrivals.rate,
            "served": served,
            "shed": shed,
            "failed": len(records) - served - shed,
            "queue_peak": watch.peak,
            "queued_when_drained": queued_after_burst,
            "wall_s": round(burst_wall, 3),
            "epp_cpu_s": round(burst_cpu, 3),
        },
        "idle_after": after.to_json(),
    }


def run(options: IdleOptions) -> dict[str, Any]:
    options.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for policy in options.policies:
        print(
            f"{policy.name}: settle {options.settle_s:g}s, idle {options.idle_s:g}s, burst,"
            f" idle {options.idle_s:g}s",
            flush=True,
        )
        results[policy.name] = measure_policy(policy, options, options.out / "runs" / policy.name)
        r = results[policy.name]
        print(
            f"  idle {r['idle_before']['cpu_percent']:.2f}% CPU, after the burst"
            f" {r['idle_after']['cpu_percent']:.2f}%; burst: {r['burst']['served']} served,"
            f" {r['burst']['shed']} shed, {r['burst']['failed']} failed, peak queue"
            f" {r['burst']['queue_peak']}",
            flush=True,
        )
    document = {
        "schema": 1,
        **provenance(options.command),
        "setup": {
            "pods": options.pods,
            "idle_s": options.idle_s,
            "settle_s": options.settle_s,
            "burst_requests": options.burst_requests,
            "burst_load": options.burst_load,
            "epp_args": list(options.epp_args),
            "clock_ticks_per_s": CLOCK_TICKS,
        },
        "policies": results,
    }
    (options.out / "idle_cpu.json").write_text(json.dumps(document, indent=2) + "\n")
    (options.out / "idle_cpu.md").write_text(markdown(document))
    return document


def _or_dash(value: Any) -> str:
    return "-" if value is None else str(value)


def _passes_text(window: dict[str, Any]) -> str:
    return _or_dash(window["dispatch_passes"])


def markdown(document: dict[str, Any]) -> str:
    setup = document["setup"]
    lines = [
        "# The EPP's CPU while idle: flow control off and on",
        "",
        *produced_by(document),
        f"{setup['pods']} simulated pods, `epp serve` and Envoy as `bench run` starts them;"
        f" {document['machine']['cpus']} CPUs; commit {commit_label(document)}. Each window:"
        f" nothing sent for {setup['idle_s']:g} s (after {setup['settle_s']:g} s of"
        " settling), the EPP process's CPU seconds (user + system, all threads, from"
        " /proc) over the window's wall seconds; 100% = one core. Its idle work is its"
        " metrics scrapes of the pods, whatever the policy. Between the windows, a burst"
        f" of {setup['burst_requests']} tenants requests at {setup['burst_load']:g} times"
        " the fleet's capacity, until every response ended.",
        "",
        "| policy | idle CPU % | dispatch passes while idle | burst: served / shed / failed"
        " | peak queue | queue when drained | idle CPU % after the burst"
        " | dispatch passes while idle after |",
        "|---|---:|---:|---|---:|---:|---:|---:|",
    ]
    for name, r in document["policies"].items():
        b = r["burst"]
        lines.append(
            f"| {name} | {r['idle_before']['cpu_percent']:.2f}"
            f" | {_passes_text(r['idle_before'])}"
            f" | {b['served']} / {b['shed']} / {b['failed']}"
            f" | {b['queue_peak']} | {_or_dash(b['queued_when_drained'])}"
            f" | {r['idle_after']['cpu_percent']:.2f} | {_passes_text(r['idle_after'])} |"
        )
    return "\n".join([*lines, ""])


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m bench.idle_cpu",
        description="The CPU a live EPP uses while idle, flow control off and on, before a"
        " burst and after it has drained (see the module docstring).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--policy",
        action="append",
        dest="policies",
        metavar="SPEC",
        help="a config file or a name in manifests/config/; repeat for several"
        f" (default: {', '.join(DEFAULT_POLICIES)})",
    )
    parser.add_argument("--pods", type=int, default=4, help="simulated pods")
    parser.add_argument("--idle", type=float, default=30.0, help="seconds of each idle window")
    parser.add_argument(
        "--settle",
        type=float,
        default=5.0,
        help="seconds left alone before each idle window (start-up, the burst's end)",
    )
    parser.add_argument(
        "--burst-requests", type=int, default=400, help="requests of the burst (tenants)"
    )
    parser.add_argument(
        "--burst-load",
        type=float,
        default=3.0,
        help="the burst's offered load, times the fleet's capacity (docs/lab.md#capacity)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer directory for pods and workload ('builtin': the simulator's own;"
        " default: the Qwen2.5 one of ../shared/testdata when present)",
    )
    parser.add_argument(
        "--epp-arg", action="append", default=[], metavar="ARG", help="extra `epp serve` option"
    )
    parser.add_argument("--seed", type=int, default=0, help="the burst's workload seed")
    parser.add_argument("--out", type=Path, default=Path("out/idle-cpu"), help="output directory")
    args = parser.parse_args(argv)
    problems = []
    if args.pods < 1:
        problems.append("--pods must be at least 1")
    if not args.idle > 0:
        problems.append("--idle must be > 0 seconds")
    if args.settle < 0:
        problems.append("--settle must be >= 0 seconds")
    if args.burst_requests < 2:
        problems.append("--burst-requests must be at least 2")
    if not args.burst_load > 0:
        problems.append("--burst-load must be > 0")
    try:
        policies = unique_names([resolve_policy(p) for p in args.policies or DEFAULT_POLICIES])
    except ValueError as exc:
        problems.append(str(exc))
        policies = []
    if any(p.kind != "epp" for p in policies):
        problems.append("idle CPU is measured for EPP policies (config files), not peer routers")
    if problems:
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    options = IdleOptions(
        out=args.out,
        policies=policies,
        pods=args.pods,
        idle_s=args.idle,
        settle_s=args.settle,
        burst_requests=args.burst_requests,
        burst_load=args.burst_load,
        tokenizer=tokenizer_from_arg(args.tokenizer),
        epp_args=tuple(args.epp_arg),
        seed=args.seed,
        command="python -m bench.idle_cpu " + shlex.join(argv),
    )
    try:
        run(options)
    except KeyboardInterrupt:
        print("\ninterrupted: everything started was stopped", file=sys.stderr)
        return 130
    print(f"results: {args.out / 'idle_cpu.json'}, {args.out / 'idle_cpu.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
