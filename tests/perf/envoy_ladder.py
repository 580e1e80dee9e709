"""A load ladder through real Envoy with the shipped config: does anything crash,
and does every request end as it should, from a trickle to past the point where
the machine's cores are saturated?

    .venv/bin/python -m tests.perf.envoy_ladder --out docs/results/envoy-ladder

How: three upstreams (tests/integration/upstream.py) in this process, `epp serve`
with the default profile and Envoy with manifests/envoy/envoy.yaml (ports
changed) as child processes, and the load in a spawned child: the mix of
tests/integration/load_mix.py (short, long and 100 kB streams, plain answers,
header-only GETs, client hang-ups, 400s and 413s from the EPP, 500s and dropped
connections from the upstream) at open-loop Poisson rates, one rung after another
on the same Envoy and EPP. Each rung counts every request's outcome against what
its kind must end with, the CPU that Envoy and the EPP used (from /proc), the
host's busy share, the EPP's RSS, and whether Envoy and the EPP are still
running. The default rates go from a trickle to twice what two cores can serve
(they saturate near 100 a second with this mix); the ladder stops early only if
a process died.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import re
import shlex
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from tqdm import tqdm

from bench.provenance import provenance
from bench.stack import (
    ENVOY_YAML,
    EppPorts,
    ManagedProcess,
    envoy_config,
    envoy_version,
    free_ports,
    start_envoy,
    start_epp,
    write_endpoints_file,
)
from bench.stats import percentile
from tests.integration.load_mix import EXPECTED, MAX_BODY_BYTES, open_loop
from tests.integration.upstream import Upstreams

DEFAULT_RATES = (25, 50, 100, 200, 400)
DEFAULT_PROFILE = ENVOY_YAML.parent.parent / "config" / "default.yaml"
_TICKS = os.sysconf("SC_CLK_TCK")


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICKS


def _host_busy() -> tuple[float, float]:
    """(busy, total) CPU seconds of the host so far."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = values[3] + values[4]
    total = sum(values[:8])
    return (total - idle) / _TICKS, total / _TICKS


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


# Envoy's own counts of what went wrong on the ext_proc side: streams that failed,
# and resets on the connection to the EPP.
_ENVOY_COUNTERS = re.compile(
    r"^(http\.inference\.ext_proc\.(streams_failed|failure_mode_allowed|message_timeouts)"
    r"|cluster\.epp\.(upstream_rq_rx_reset|upstream_rq_tx_reset|upstream_cx_destroy_remote"
    r"|upstream_rq_pending_overflow))$"
)


def _envoy_counters(admin_url: str) -> dict[str, int]:
    with urllib.request.urlopen(admin_url + "/stats?usedonly", timeout=10) as answer:
        text = answer.read().decode()
    counters = {}
    for line in text.splitlines():
        name, _, value = line.partition(": ")
        if _ENVOY_COUNTERS.match(name):
            counters[name] = int(value)
    return counters


def _send(url: str, requests: int, rate: float, seed: int, out: Any) -> None:
    """The load, in a spawned child so that it does not share this process's GIL
    with the upstreams."""
    started = time.perf_counter()
    tally = asyncio.run(open_loop(url, requests, rate, seed))
    out.put(
        {
            "seconds": time.perf_counter() - started,
            "sent_seconds": tally.sent_s,
            "outcomes": [[k, o, n] for (k, o), n in tally.outcomes.items()],
            "latencies_s": {k: sorted(v) for k, v in tally.latencies_s.items()},
        }
    )


def _rung(url: str, requests: int, rate: float, seed: int) -> dict[str, Any]:
    spawn = multiprocessing.get_context("spawn")
    out = spawn.Queue()
    child = spawn.Process(target=_send, args=(url, requests, rate, seed, out))
    child.start()
    result: dict[str, Any] = out.get()
    child.join()
    return result


def _measure_rung(
    envoy: ManagedProcess,
    epp: ManagedProcess,
    url: str,
    admin_url: str,
    requests: int,
    rate: float,
    seed: int,
) -> dict[str, Any]:
    assert envoy.process is not None
    assert epp.process is not None
    envoy_pid, epp_pid = envoy.process.pid, epp.process.pid
    envoy_cpu, epp_cpu = _cpu_seconds(envoy_pid), _cpu_seconds(epp_pid)
    busy, total = _host_busy()
    rss_before = _rss_mib(epp_pid)
    counters = _envoy_counters(admin_url)
    measured = _rung(url, requests, rate, seed)
    busy_after, total_after = _host_busy()
    envoy_alive = envoy.process.poll() is None
    epp_alive = epp.process.poll() is None
    seconds = measured["seconds"]
    outcomes: dict[str, dict[str, int]] = {}
    unexpected = 0
    for kind, outcome, n in measured["outcomes"]:
        outcomes.setdefault(kind, {})[outcome] = n
        unexpected += 0 if outcome in EXPECTED[kind] else n
    plain = measured["latencies_s"].get("json", [])
    return {
        "offered_rate": rate,
        "requests": sum(sum(o.values()) for o in outcomes.values()),
        "seconds": round(seconds, 2),
        # The rate the load generator managed to send at.
        "sent_rate": round(requests / measured["sent_seconds"], 1),
        "unexpected": unexpected,
        "outcomes": outcomes,
        "json_latency_p50_s": percentile(plain, 0.5),
        "json_latency_p99_s": percentile(plain, 0.99),
        "envoy_cpu_share": (
            round((_cpu_seconds(envoy_pid) - envoy_cpu) / seconds, 3) if envoy_alive else None
        ),
        "epp_cpu_share": (
            round((_cpu_seconds(epp_pid) - epp_cpu) / seconds, 3) if epp_alive else None
        ),
        "host_busy_share": round((busy_after - busy) / (total_after - total), 3),
        "epp_rss_mib": [round(rss_before, 1), round(_rss_mib(epp_pid), 1) if epp_alive else None],
        "envoy_alive": envoy_alive,
        "epp_alive": epp_alive,
        "envoy_counters": (
            {
                name: value - counters.get(name, 0)
                for name, value in _envoy_counters(admin_url).items()
                if value != counters.get(name, 0)
            }
            if envoy_alive
            else None
        ),
    }


def run(
    rates: list[float],
    requests: int,
    seed: int,
    progress: bool = True,
    workdir: Path | None = None,
) -> dict[str, Any]:
    """The ladder; the processes' logs go to `workdir` (kept) or a temporary one."""
    rungs: list[dict[str, Any]] = []
    with contextlib.ExitStack() as stop:
        if workdir is None:
            workdir = Path(stop.enter_context(tempfile.TemporaryDirectory(prefix="envoy-ladder-")))
        work = workdir
        upstreams = Upstreams(3).start()
        stop.callback(upstreams.stop)
        endpoints = write_endpoints_file(
            work / "endpoints.yaml", [(u.name, u.address) for u in upstreams]
        )
        ports = EppPorts.free()
        epp = start_epp(
            endpoints,
            work,
            ports,
            config_file=DEFAULT_PROFILE,
            extra_args=["--max-body-bytes", str(MAX_BODY_BYTES)],
        )
        stop.callback(epp.stop)
        listen, admin = free_ports(2)
        envoy = start_envoy(
            envoy_config(listen_port=listen, epp_port=ports.grpc, admin_port=admin), work
        )
        stop.callback(envoy.stop)
        url = f"http://127.0.0.1:{listen}"
        with tqdm(total=len(rates), desc="ladder", unit="rung", disable=not progress) as bar:
            for i, rate in enumerate(rates):
                rung = _measure_rung(
                    envoy, epp, url, f"http://127.0.0.1:{admin}", requests, rate, seed + i
                )
                rungs.append(rung)
                bar.update()
                bar.write(
                    f"rate {rate:g}/s: {rung['sent_rate']}/s sent, {rung['unexpected']}"
                    f" unexpected, host busy {rung['host_busy_share']:.0%},"
                    f" Envoy {'up' if rung['envoy_alive'] else 'DOWN'},"
                    f" EPP {'up' if rung['epp_alive'] else 'DOWN'}"
                )
                if not (rung["envoy_alive"] and rung["epp_alive"]):
                    break
    return {
        **provenance("python -m tests.perf.envoy_ladder " + shlex.join(sys.argv[1:])),
        "envoy": envoy_version(),
        "requests_per_rung": requests,
        "seed": seed,
        "total_requests": sum(r["requests"] for r in rungs),
        "total_unexpected": sum(r["unexpected"] for r in rungs),
        "crashed": not all(r["envoy_alive"] and r["epp_alive"] for r in rungs),
        "rungs": rungs,
    }


def report(result: dict[str, Any]) -> str:
    lines = [
        "# Load ladder through real Envoy (shipped config)",
        "",
        "Produced by:",
        "",
        "```sh",
        result["command"],
        "```",
        "",
        f"Envoy {result['envoy']}; {result['machine']['cpus']} CPUs; {result['requests_per_rung']}"
        f" requests a rung (the mix of tests/integration/load_mix.py), open-loop Poisson"
        f" arrivals, seed {result['seed']}; {result['total_requests']} requests in all,"
        f" {result['total_unexpected']} with an unexpected outcome;"
        f" {'a process DIED' if result['crashed'] else 'Envoy and the EPP up throughout'}.",
        "Sent/s is the rate the load generator managed (below the offered rate once the"
        " host is saturated). Latency is that of the plain (non-streamed) completions as"
        " the client saw them: it shows queueing, not the EPP's overhead. CPU shares are"
        " of one core; host busy is of all cores (the upstreams and the load generator"
        " run on the same host).",
        "",
        "| offered/s | sent/s | requests | unexpected | plain p50 (s) | plain p99 (s)"
        " | Envoy CPU | EPP CPU | host busy | EPP RSS (MiB) | Envoy | EPP |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|",
    ]
    for r in result["rungs"]:
        rss = r["epp_rss_mib"]
        lines.append(
            f"| {r['offered_rate']:g} | {r['sent_rate']} | {r['requests']}"
            f" | {r['unexpected']} | {r['json_latency_p50_s']:.3f}"
            f" | {r['json_latency_p99_s']:.3f}"
            f" | {r['envoy_cpu_share']} | {r['epp_cpu_share']} | {r['host_busy_share']:.0%}"
            f" | {rss[0]} → {rss[1]} | {'up' if r['envoy_alive'] else 'DIED'}"
            f" | {'up' if r['epp_alive'] else 'DIED'} |"
        )
    lines += ["", "Outcomes by kind (all rungs):", ""]
    totals: dict[str, dict[str, int]] = {}
    for r in result["rungs"]:
        for kind, seen in r["outcomes"].items():
            for outcome, n in seen.items():
                totals.setdefault(kind, {})[outcome] = totals.get(kind, {}).get(outcome, 0) + n
    lines += ["| kind | must end with | seen |", "|---|---|---|"]
    for kind in sorted(totals):
        seen = ", ".join(f"{o}: {n}" for o, n in sorted(totals[kind].items()))
        lines.append(f"| {kind} | {' or '.join(sorted(EXPECTED[kind]))} | {seen} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rates",
        default=",".join(f"{r:g}" for r in DEFAULT_RATES),
        help="offered rates in requests/s, lowest first (default: %(default)s)",
    )
    parser.add_argument("--requests", type=int, default=2000, help="per rung (default: 2000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write results.json and report.md here")
    parser.add_argument(
        "--workdir", type=Path, help="keep Envoy's and the EPP's logs here (default: deleted)"
    )
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args()
    rates = [float(r) for r in args.rates.split(",")]
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    result = run(rates, args.requests, args.seed, not args.no_progress, args.workdir)
    text = report(result)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "report.md").write_text(text)
    print(text)
    if result["crashed"] or result["total_unexpected"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
