"""`python -m bench run`: a workload through each routing policy to a simulated fleet.

For every rung of the load ladder and every policy, from cold:

1. a fresh `python -m sim fleet` of N pods (new processes: empty KV caches, counters
   at zero, cold tokenizer caches; every policy starts from the same state);
2. the data path: for an EPP policy (an EndpointPickerConfig file) `epp serve` with
   that config and the fleet's endpoints file, and a real Envoy with
   manifests/envoy/envoy.yaml in front (client -> Envoy -> ext_proc EPP -> pod); for
   a peer (`sglang-router`, `vllm-router`) the peer router in front of the same pods
   (client -> router -> pod);
3. the pods' counters are read (`/metrics`: `vllm:prefix_cache_hits_total`,
   `vllm:prefix_cache_queries_total`, ...; `/sim/state`: requests, lag), the workload
   is sent (bench/client.py), and the counters are read again. The hit rate is the
   sum over pods of the hits' increase over the sum of the queries' increase: what the
   engines actually found in their caches, never a prediction. Load per pod is the
   increase of each pod's request counter (so it is known for peers too);
4. everything is stopped.

With `repeats` N > 1 each rung runs every policy N times, each from cold, the order
of the policies reversed every other repeat (A B C, C B A, A B C, ...) so that a
drift of the shared machine over the rung falls on every policy alike; a policy's
result is then the mean over its repeats with a 95% confidence half-width beside
each number (`combine_repeats`), and each repeat's own result under `repeats`. The
order used is recorded per rung (`policy_order`).

Times are simulated seconds (wall time divided by the fleet's time scale). TTFT and
end-to-end times count from each request's scheduled time (bench/client.py); the
client's lag behind its schedule is reported beside them (`client_lag_*_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, Literal, TypeGuard

import yaml
from tqdm import tqdm

from bench.bounds import Bounds, compute_bounds
from bench.client import Arrivals, Record, RunTiming, drive
from bench.peers import PeerKind, ensure_peer_venv, parse_peer, start_peer
from bench.provenance import portable_path, provenance
from bench.stack import (
    ROOT,
    EppPorts,
    ManagedProcess,
    ProcessFailed,
    envoy_config,
    free_port,
    start_envoy,
    start_epp,
    start_sim_fleet,
)
from bench.stats import ci95, percentile
from bench.workloads import Workload, WorkloadSpec, load_words, token_sequences
from epp.sources.metrics import read_series

CONFIG_DIR = ROOT / "manifests" / "config"
MODEL = "sim-model"


# -- policies ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Policy:
    name: str
    kind: Literal["epp", "peer"]
    config: Path | None = None
    peer: PeerKind | None = None
    peer_policy: str | None = None

    def describe(self) -> dict[str, Any]:
        if self.kind == "epp":
            assert self.config is not None
            return {"kind": "epp", "config": _relative(self.config)}
        assert self.peer is not None
        return {"kind": "peer", "router": self.peer.name, "policy": self.peer_policy}


def _relative(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


def resolve_policy(spec: str) -> Policy:
    """An EndpointPickerConfig file (a path, or a name in manifests/config/), or a
    peer router: `sglang-router`, `vllm-router` (optionally `:policy`)."""
    peer = parse_peer(spec)
    if peer is not None:
        kind, policy = peer
        name = kind.name if policy == kind.default_policy else f"{kind.name}:{policy}"
        return Policy(name, "peer", peer=kind, peer_policy=policy)
    path = Path(spec)
    if not path.is_file():
        named = CONFIG_DIR / f"{spec}.yaml"
        if not named.is_file():
            known = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))
            raise ValueError(
                f"unknown policy {spec!r}: not a file, not one of manifests/config/"
                f" ({', '.join(known)}), not sglang-router or vllm-router"
            )
        path = named
    return Policy(path.stem, "epp", config=path.resolve())


def unique_names(policies: Sequence[Policy]) -> list[Policy]:
    seen: dict[str, int] = {}
    out = []
    for policy in policies:
        count = seen.get(policy.name, 0)
        seen[policy.name] = count + 1
        if count:
            policy = Policy(
                f"{policy.name}#{count + 1}",
                policy.kind,
                policy.config,
                policy.peer,
                policy.peer_policy,
            )
        out.append(policy)
    return out


# -- options -------------------------------------------------------------------------------


@dataclass
class RunOptions:
    out: Path
    workload: WorkloadSpec
    policies: list[Policy]
    ladder: list[Arrivals]
    pods: int = 8
    time_scale: float = 1.0
    tokenizer: Path | None = None
    block_size: int = 16
    num_gpu_blocks: int | None = None
    sim_args: list[str] = field(default_factory=list)
    epp_args: list[str] = field(default_factory=list)
    seed: int = 0
    request_timeout_s: float = 600.0
    max_error_rate: float = 0.05
    progress: bool = True
    command: str = ""
    # Runs of every policy per rung, each from cold, the order alternating.
    repeats: int = 1

    def epp_flags(self) -> list[str]:
        """`epp serve`'s flags: the simulator's model gets the pods' own tokenizer
        (the shipped profiles fetch each model's from the Hugging Face Hub, and
        `sim-model` is none), then the user's flags."""
        local = ["--tokenizer-dir", f"{MODEL}={self.tokenizer}"] if self.tokenizer else []
        return local + list(self.epp_args)

    def fleet_args(self) -> list[str]:
        args = ["--time-scale", repr(self.time_scale), "--block-size", str(self.block_size)]
        if self.tokenizer is not None:
            args += ["--tokenizer", str(self.tokenizer)]
        if self.num_gpu_blocks is not None:
            args += ["--num-gpu-blocks", str(self.num_gpu_blocks)]
        return args + list(self.sim_args)


# -- the pods' counters --------------------------------------------------------------------------


@dataclass(frozen=True)
class PodCounters:
    queries: float = 0.0
    hits: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    preemptions: float = 0.0
    requests: int = 0
    lag_s: float = 0.0
    busy_s: float = 0.0

    def minus(self, before: PodCounters) -> PodCounters:
        return PodCounters(
            self.queries - before.queries,
            self.hits - before.hits,
            self.prompt_tokens - before.prompt_tokens,
            self.generation_tokens - before.generation_tokens,
            self.preemptions - before.preemptions,
            self.requests - before.requests,
            self.lag_s - before.lag_s,
            self.busy_s - before.busy_s,
        )


METRICS = {
    "vllm:prefix_cache_queries_total": "queries",
    "vllm:prefix_cache_hits_total": "hits",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:generation_tokens_total": "generation_tokens",
    "vllm:num_preemptions_total": "preemptions",
}


def parse_counters(page: bytes) -> dict[str, float]:
    """The counters of METRICS on a Prometheus text page, each summed over its label
    sets (a vLLM pod with data-parallel engines reports one per engine), read by the
    EPP's own reader; a counter not on the page is left out (PodCounters' 0). A line
    of one that cannot be read raises ValueError rather than count as 0."""
    values: dict[str, float] = {}
    for name, key in METRICS.items():
        read = read_series(page, name)
        if read.problems:
            raise ValueError("; ".join(read.problems))
        if read.samples:
            values[key] = sum(sample.value for sample in read.samples)
    return values


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10.0) as response:
        body: bytes = response.read()
        return body


def read_counters(address: str) -> PodCounters:
    values = parse_counters(_get(f"http://{address}/metrics"))
    state = json.loads(_get(f"http://{address}/sim/state"))["counters"]
    return PodCounters(
        requests=int(state["requests"]),
        lag_s=float(state["lagSeconds"]),
        busy_s=float(state["busySeconds"]),
        **values,
    )


def read_fleet(pods: Sequence[tuple[str, str]]) -> dict[str, PodCounters]:
    return {name: read_counters(address) for name, address in pods}


def summarize(
    records: Sequence[Record],
    timing: RunTiming,
    counters: dict[str, PodCounters],
    time_scale: float,
    max_error_rate: float,
) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    errors = [r for r in records if not r.ok]
    ttft = sorted(r.ttft_s for r in ok if r.ttft_s is not None)
    e2e = sorted(r.e2e_s for r in ok if r.e2e_s is not None)
    duration = timing.duration_s(time_scale)
    hits = sum(c.hits for c in counters.values())
    queries = sum(c.queries for c in counters.values())
    load = {name: c.requests for name, c in counters.items()}
    mean_load = sum(load.values()) / len(load) if load else 0.0
    output_tokens = sum(r.output_tokens or 0 for r in ok)
    usage_prompt = sum(r.prompt_tokens or 0 for r in ok)
    usage_cached = sum(r.cached_tokens or 0 for r in ok)
    error_kinds: dict[str, int] = {}
    for r in errors:
        kind = (r.error or "error").split(":", 1)[0]
        error_kinds[kind] = error_kinds.get(kind, 0) + 1
    pods_in_headers: dict[str, int] = {}
    for r in ok:
        if r.pod is not None:
            pods_in_headers[r.pod] = pods_in_headers.get(r.pod, 0) + 1
    lag = max((c.lag_s for c in counters.values()), default=0.0)
    # How late the client sent each request it sent, after its scheduled time.
    client_lag = sorted(r.sent_s - r.scheduled_s for r in records if r.sent_s is not None)
    status = "ok"
    failure = None
    if not ok:
        status, failure = "failed", "no request succeeded"
    elif records and len(errors) / len(records) > max_error_rate:
        status = "failed"
        failure = f"{len(errors)} of {len(records)} requests failed (> {max_error_rate:.0%})"
    elif errors:
        status = "errors"
    return {
        # docs/architecture.md, "The benchmark's result file"'s keys.
        "hit_rate": hits / queries if queries else None,
        "ttft_p50_s": percentile(ttft, 0.50),
        "ttft_p90_s": percentile(ttft, 0.90),
        "ttft_p99_s": percentile(ttft, 0.99),
        "throughput_rps": len(ok) / duration if duration > 0 else None,
        "output_tokens_per_s": output_tokens / duration if duration > 0 else None,
        "requests": len(records),
        "errors": len(errors),
        "max_over_mean_load": max(load.values()) / mean_load if mean_load > 0 else None,
        # More.
        "status": status,
        "failure": failure,
        "ok_requests": len(ok),
        "error_kinds": error_kinds,
        "ttft_mean_s": sum(ttft) / len(ttft) if ttft else None,
        "e2e_p50_s": percentile(e2e, 0.50),
        "e2e_p90_s": percentile(e2e, 0.90),
        "e2e_p99_s": percentile(e2e, 0.99),
        "duration_s": duration,
        "prefix_cache_hits": hits,
        "prefix_cache_queries": queries,
        "usage_hit_rate": usage_cached / usage_prompt if usage_prompt else None,
        "output_tokens": output_tokens,
        "load_per_pod": load,
        "prompt_tokens_per_pod": {n: c.prompt_tokens for n, c in counters.items()},
        "preemptions": sum(c.preemptions for c in counters.values()),
        "pods_in_headers": pods_in_headers,
        "sim_lag_max_s": lag,
        "sim_lag_per_pod_s": {n: round(c.lag_s, 4) for n, c in counters.items()},
        "sim_lag_fraction": lag / duration if duration > 0 else None,
        "client_lag_p50_s": percentile(client_lag, 0.50),
        "client_lag_p99_s": percentile(client_lag, 0.99),
        "client_lag_max_s": client_lag[-1] if client_lag else None,
    }


def failed_result(reason: str, requests: int) -> dict[str, Any]:
    keys = ("hit_rate", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "throughput_rps")
    return {
        **dict.fromkeys(keys),
        "output_tokens_per_s": None,
        "requests": requests,
        "errors": requests,
        "max_over_mean_load": None,
        "status": "failed",
        "failure": reason,
        "client_lag_p50_s": None,
        "client_lag_p99_s": None,
        "client_lag_max_s": None,
    }


# -- repeats -------------------------------------------------------------------------------


def policy_orders(policies: Sequence[Policy], repeats: int) -> list[list[Policy]]:
    """The order of the policies in each repeat: as given, then reversed, then as
    given, ... (A B C, C B A, A B C): every policy runs early and late alike."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, not {repeats!r}")
    return [list(policies) if i % 2 == 0 else list(reversed(policies)) for i in range(repeats)]


def _is_number(value: Any) -> TypeGuard[float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _mean(values: Sequence[float]) -> float:
    mean = math.fsum(values) / len(values)
    if all(isinstance(v, int) for v in values) and mean.is_integer():
        return int(mean)
    return mean


def _worst_status(results: Sequence[dict[str, Any]]) -> str:
    statuses = {r.get("status") for r in results}
    for status in ("failed", "errors"):
        if status in statuses:
            return status
    return "ok"


def combine_repeats(results: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One policy's result over N repeats (each a `summarize` or `failed_result`):

    - a number: the mean over the repeats, with `<key>_ci95` beside it, the half-width
      of its 95% confidence interval (bench/stats.py `ci95`: Student's t with N - 1
      degrees of freedom); None for both when a repeat has no value for it (a failed
      run), since a mean over the others would hide the failure;
    - a mapping of numbers per pod (`load_per_pod`, ...): the mean per pod (a missing
      pod counts 0), None when a repeat has none; `error_kinds`: the counts over all
      repeats (a failed run's lost requests are in `errors`, not here);
    - `status`: the worst (failed, errors, ok); `failure`: each failed repeat's;
    - `repeats`: every repeat's own result (its `records_file` among them).
    """
    if not results:
        raise ValueError("no repeats to combine")
    keys: list[str] = []
    for result in results:
        keys += [k for k in result if k not in keys]
    combined: dict[str, Any] = {}
    for key in keys:
        values = [r.get(key) for r in results]
        if key == "status":
            combined[key] = _worst_status(results)
        elif key == "failure":
            failures = [f"repeat {i}: {v}" for i, v in enumerate(values, 1) if v]
            combined[key] = "; ".join(failures) if failures else None
        elif key == "records_file":
            continue
        elif any(_is_number(v) for v in values):
            known = [v for v in values if _is_number(v)]
            if len(known) == len(values):
                combined[key] = _mean(known)
                combined[f"{key}_ci95"] = ci95(known)
            else:
                combined[key] = None
                combined[f"{key}_ci95"] = None
        elif (maps := [v for v in values if isinstance(v, dict)]) and all(
            v is None or isinstance(v, dict) for v in values
        ):
            names = [n for v in maps for n in v]
            per_pod = {n: [v.get(n, 0) for v in maps] for n in dict.fromkeys(names)}
            if key == "error_kinds":
                combined[key] = {n: sum(counts) for n, counts in per_pod.items()}
            elif len(maps) < len(values):
                combined[key] = None
            else:
                combined[key] = {n: _mean(counts) for n, counts in per_pod.items()}
        else:
            combined[key] = values[0] if all(v == values[0] for v in values) else values
    combined["repeats"] = list(results)
    return combined


# -- one policy ----------------------------------------------------------------------------


def free_port_range(count: int, attempts: int = 200) -> int:
    """A base port with `count` free consecutive ports above it."""
    rng = random.Random()
    for _ in range(attempts):
        base = rng.randrange(20_000, 60_000 - count)
        sockets = []
        try:
            for port in range(base, base + count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(s)
                s.bind(("127.0.0.1", port))
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
        return base
    raise RuntimeError(f"no {count} consecutive free ports found")


def read_endpoints(path: Path) -> list[tuple[str, str]]:
    document = yaml.safe_load(path.read_text())
    return [(e["name"], e["address"]) for e in document["endpoints"]]


@dataclass(frozen=True)
class DataPath:
    """A running fleet with a router in front of it."""

    url: str  # where clients send
    pods: list[tuple[str, str]]  # (name, address)
    epp_metrics_url: str | None  # the EPP's /metrics; None for a peer router


@contextlib.contextmanager
def data_path(policy: Policy, options: RunOptions, workdir: Path) -> Iterator[DataPath]:
    """A fresh fleet and the policy's router in front of it."""
    with contextlib.ExitStack() as stack:
        fleet, endpoints = start_sim_fleet(
            options.pods, free_port_range(3 * options.pods), workdir, options.fleet_args()
        )
        stack.callback(fleet.stop)
        pods = read_endpoints(endpoints)
        if policy.kind == "epp":
            ports = EppPorts.free()
            epp = start_epp(endpoints, workdir, ports, policy.config, options.epp_flags())
            stack.callback(epp.stop)
            listen = free_port()
            envoy = start_envoy(
                envoy_config(listen_port=listen, epp_port=ports.grpc, admin_port=free_port()),
                workdir,
            )
            stack.callback(envoy.stop)
            url = f"http://127.0.0.1:{listen}"
            epp_metrics: str | None = f"http://127.0.0.1:{ports.metrics}/metrics"
            processes: list[ManagedProcess] = [fleet, epp, envoy]
        else:
            assert policy.peer is not None
            assert policy.peer_policy is not None
            venv = ensure_peer_venv()
            router, url = start_peer(
                policy.peer, policy.peer_policy, [a for _, a in pods], workdir, venv
            )
            stack.callback(router.stop)
            epp_metrics = None
            processes = [fleet, router]
        yield DataPath(url, pods, epp_metrics)
        for process in processes:
            if process.process is not None and process.process.poll() is not None:
                raise ProcessFailed(
                    f"{process.name} exited during the run (code"
                    f" {process.process.returncode}):\n{process.log_tail()}"
                )


def run_policy(
    policy: Policy,
    arrivals: Arrivals,
    workload: Workload,
    options: RunOptions,
    workdir: Path,
) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        with data_path(policy, options, workdir) as path:
            url, pods = path.url, path.pods
            before = read_fleet(pods)
            progress = tqdm(
                total=workload.num_requests,
                desc=f"{policy.name} ({arrivals.label()})",
                unit="req",
                disable=not options.progress,
                leave=False,
            )
            errors = 0

            def on_done(record: Record) -> None:
                nonlocal errors
                if not record.ok:
                    errors += 1
                    progress.set_postfix(errors=errors, refresh=False)
                progress.update()

            with progress:
                records, timing = asyncio.run(
                    drive(
                        workload,
                        url,
                        arrivals,
                        model=MODEL,
                        time_scale=options.time_scale,
                        seed=options.seed,
                        request_timeout_s=options.request_timeout_s,
                        on_done=on_done,
                    )
                )
            after = read_fleet(pods)
    except (ProcessFailed, OSError, subprocess.CalledProcessError) as exc:
        return failed_result(f"{type(exc).__name__}: {exc}", workload.num_requests)
    counters = {name: after[name].minus(before[name]) for name in after}
    with (workdir / "requests.jsonl").open("w") as out:
        for record in records:
            out.write(json.dumps(record.to_json()) + "\n")
    result = summarize(records, timing, counters, options.time_scale, options.max_error_rate)
    result["records_file"] = str((workdir / "requests.jsonl").relative_to(options.out))
    return result


# -- the whole run -------------------------------------------------------------------------


def _raise_keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def workload_bounds(
    workload: Workload, tokenizer: Path | None, block_size: int, pods: int
) -> Bounds:
    words = load_words(tokenizer)
    return compute_bounds(
        token_sequences(words.tokenizer, workload.nominal_order()), block_size, pods
    )


def run_benchmark(options: RunOptions) -> dict[str, Any]:
    """Every rung x every policy; writes results.json, report.md, plots into out/."""
    from bench.report import write_outputs

    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    options.out.mkdir(parents=True, exist_ok=True)
    words = load_words(options.tokenizer)
    workload = options.workload.build(words)
    bounds = workload_bounds(workload, options.tokenizer, options.block_size, options.pods)
    print(
        f"workload {workload.name}: {workload.num_requests} requests,"
        f" {bounds.prompt_tokens} prompt tokens; bounds h*={bounds.h_star:.3f}"
        f" h_random={bounds.h_random:.3f} ({options.pods} pods, blocks of"
        f" {options.block_size})",
        flush=True,
    )
    ladder = []
    started = time.monotonic()
    repeats = options.repeats
    for arrivals in options.ladder:
        rung: dict[str, Any] = {"arrivals": arrivals.to_json(), "label": arrivals.label()}
        orders = policy_orders(options.policies, repeats)
        runs: dict[str, list[dict[str, Any]]] = {p.name: [] for p in options.policies}
        for repeat, order in enumerate(orders, 1):
            tag = ""
            if repeats > 1:
                tag = f"repeat {repeat}/{repeats}"
                print(f"{arrivals.label()}, {tag}: {', '.join(p.name for p in order)}", flush=True)
            for policy in order:
                workdir = options.out / "runs" / _slug(arrivals.label()) / _slug(policy.name)
                if repeats > 1:
                    workdir = workdir / f"repeat-{repeat}"
                result = run_policy(policy, arrivals, workload, options, workdir)
                result.update(policy.describe())
                runs[policy.name].append(result)
                print(_one_line(policy.name, arrivals, result, tag), flush=True)
        results: dict[str, Any] = {}
        for policy in options.policies:
            if repeats == 1:
                results[policy.name] = runs[policy.name][0]
                continue
            combined = combine_repeats(runs[policy.name])
            combined.update(policy.describe())
            results[policy.name] = combined
            print(_one_line(policy.name, arrivals, combined, f"mean of {repeats}"), flush=True)
        # The order the policies actually ran in, one list per repeat.
        rung["policy_order"] = [[p.name for p in order] for order in orders]
        rung["policies"] = results
        ladder.append(rung)
    document = {
        "schema": 1,
        **provenance(options.command),
        "wall_seconds": round(time.monotonic() - started, 1),
        "setup": {
            "pods": options.pods,
            "time_scale": options.time_scale,
            "block_size": options.block_size,
            "num_gpu_blocks": options.num_gpu_blocks,
            "tokenizer": portable_path(options.tokenizer) if options.tokenizer else "builtin",
            # Paths in the simulator's flags are recorded as the tokenizer is: no
            # directory of this machine.
            "sim_args": [
                portable_path(Path(a)) if a.startswith("/") else a for a in options.fleet_args()
            ],
            "epp_args": options.epp_args,
            "envoy": "manifests/envoy/envoy.yaml",
            "seed": options.seed,
            "request_timeout_s": options.request_timeout_s,
            "max_error_rate": options.max_error_rate,
            "repeats": repeats,
        },
        "workload": {**workload.describe(), "prompt_tokens": bounds.prompt_tokens},
        "oracle": bounds.to_json(),
        "policies": ladder[-1]["policies"] if ladder else {},
        "ladder": ladder,
    }
    write_outputs(document, options.out)
    return document


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text).strip("-")


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _with_ci(result: dict[str, Any], key: str, spec: str) -> str:
    text = _fmt(result.get(key), spec)
    ci = result.get(f"{key}_ci95")
    return text if ci is None else f"{text} ± {format(ci, spec)}"


def _one_line(name: str, arrivals: Arrivals, result: dict[str, Any], tag: str = "") -> str:
    where = arrivals.label() + (f", {tag}" if tag else "")
    if result["status"] == "failed" and result.get("ok_requests") is None:
        return f"  {name} ({where}): FAILED: {result['failure']}"
    line = (
        f"  {name} ({where}): hit rate {_with_ci(result, 'hit_rate', '.3f')},"
        f" TTFT p50 {_with_ci(result, 'ttft_p50_s', '.3f')} s"
        f" p90 {_with_ci(result, 'ttft_p90_s', '.3f')} s,"
        f" {_with_ci(result, 'throughput_rps', '.2f')} req/s, errors {_fmt(result['errors'], 'g')},"
        f" sim lag {_fmt(result.get('sim_lag_max_s'), '.2f')} s,"
        f" client lag p50 {_fmt(result.get('client_lag_p50_s'), '.3f')} s"
        f" p99 {_fmt(result.get('client_lag_p99_s'), '.3f')} s"
        f" max {_fmt(result.get('client_lag_max_s'), '.3f')} s"
    )
    if result["status"] == "failed":
        line += f"  FAILED: {result['failure']}"
    return line
