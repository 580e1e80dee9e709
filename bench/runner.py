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
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from types import FrameType
from typing import Any, Literal, TypeGuard

import yaml
from tqdm import tqdm

from bench.bounds import Bounds, compute_bounds
from bench.client import PREFILLER_ECHO_HEADER, Arrivals, Record, RunTiming, drive
from bench.peers import PeerKind, ensure_peer_venv, parse_peer, start_peer
from bench.provenance import portable_path, provenance
from bench.stack import (
    ROOT,
    EppPorts,
    ManagedProcess,
    ProcessFailed,
    echo_request_header,
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
# The header the EPP names a disaggregated request's prefill pod in.
PREFILLER_HEADER = "x-prefiller-host-port"


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
    # A prefill/decode fleet: pods 0..prefill_pods-1 get the llm-d.ai/role `prefill`,
    # the others `decode` (`python -m sim fleet --prefill-pods`); 0: no roles.
    prefill_pods: int = 0

    def __post_init__(self) -> None:
        check_prefill_pods(self.prefill_pods, self.pods)

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
        if self.prefill_pods:
            args += ["--prefill-pods", str(self.prefill_pods)]
        return args + list(self.sim_args)


def check_prefill_pods(prefill_pods: int, pods: int) -> None:
    """ValueError unless 0 <= prefill_pods < pods: a P/D fleet needs a decode pod."""
    if prefill_pods < 0:
        raise ValueError(f"--prefill-pods must be 0 (no roles) or more, not {prefill_pods}")
    if prefill_pods and prefill_pods >= pods:
        raise ValueError(
            f"--prefill-pods must be fewer than --pods ({pods}): a prefill/decode fleet"
            f" needs at least one decode pod, and {prefill_pods} prefill pods leave none"
        )


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
    # Prefill/decode disaggregation, from `/sim/state`'s `pd` (docs/disaggregation.md):
    # the pod's llm-d.ai/role (None: no label), the prefill legs it served, the
    # decode legs it served, the prefill legs its sidecar sent (one per request the
    # EPP disaggregated to it), the KV transfers it pulled (count, simulated seconds,
    # bytes) and the prefill legs that failed, by reason (then prefilled here).
    role: str | None = None
    prefill_legs_served: int = 0
    decode_legs_served: int = 0
    prefill_legs_sent: int = 0
    kv_transfers: int = 0
    kv_transfer_s: float = 0.0
    kv_transfer_bytes: float = 0.0
    fallbacks: tuple[tuple[str, int], ...] = ()

    def minus(self, before: PodCounters) -> PodCounters:
        changed: dict[str, Any] = {}
        for f in fields(self):
            value, old = getattr(self, f.name), getattr(before, f.name)
            if f.name == "role":
                changed[f.name] = value
            elif f.name == "fallbacks":
                was = dict(old)
                changed[f.name] = tuple((k, n - was.get(k, 0)) for k, n in value)
            else:
                changed[f.name] = value - old
        return PodCounters(**changed)


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
    document = json.loads(_get(f"http://{address}/sim/state"))
    state = document["counters"]
    pd = document.get("pd") or {}
    return PodCounters(
        requests=int(state["requests"]),
        lag_s=float(state["lagSeconds"]),
        busy_s=float(state["busySeconds"]),
        role=document.get("role"),
        prefill_legs_served=int(pd.get("prefillLegsServed", 0)),
        decode_legs_served=int(pd.get("decodeLegsServed", 0)),
        prefill_legs_sent=int(pd.get("prefillLegsSent", 0)),
        kv_transfers=int(pd.get("kvTransfers", 0)),
        kv_transfer_s=float(pd.get("kvTransferSeconds", 0.0)),
        kv_transfer_bytes=float(pd.get("kvTransferBytes", 0.0)),
        fallbacks=tuple(sorted((str(k), int(n)) for k, n in (pd.get("fallbacks") or {}).items())),
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
    tpots = sorted(t for r in ok if (t := r.tpot_s) is not None)
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
        "tpot_p50_s": percentile(tpots, 0.50),
        "tpot_p90_s": percentile(tpots, 0.90),
        "tpot_p99_s": percentile(tpots, 0.99),
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
        **pd_summary(records, counters),
    }


def pd_summary(records: Sequence[Record], counters: dict[str, PodCounters]) -> dict[str, Any]:
    """A prefill/decode fleet's part of a result (nothing when no pod has a role):

    - which requests were disaggregated, from each request's own response (the
      prefill pod Envoy echoed, `Record.prefill_pod`): `pd_disaggregated`, its share
      of the requests sent, and TTFT and TPOT p50/p90 of the disaggregated requests
      and of those served whole (successful ones);
    - what the pods counted (`/sim/state` `pd`): prefill legs their sidecars sent
      (`pd_prefill_legs_sent`, one per disaggregated request that reached its decode
      pod), prefill legs served (in all and per pod), decode legs served, KV
      transfers pulled (count, mean simulated seconds, bytes), and prefill legs that
      failed and were prefilled on the decode pod instead (`pd_fallbacks`, by reason).
    """
    if not any(c.role is not None for c in counters.values()):
        return {}
    sent = [r for r in records if r.sent_s is not None]
    split = [r for r in sent if r.prefill_pod is not None]
    ok_split = [r for r in split if r.ok]
    ok_whole = [r for r in sent if r.ok and r.prefill_pod is None]
    fallbacks: dict[str, int] = {}
    for c in counters.values():
        for reason, count in c.fallbacks:
            fallbacks[reason] = fallbacks.get(reason, 0) + count
    transfers = sum(c.kv_transfers for c in counters.values())
    transfer_s = sum(c.kv_transfer_s for c in counters.values())

    def pct(rs: Sequence[Record], key: str, q: float) -> float | None:
        return percentile((v for r in rs if (v := getattr(r, key)) is not None), q)

    return {
        "pd_prefill_pods": sorted(n for n, c in counters.items() if c.role == "prefill"),
        "pd_disaggregated": len(split),
        "pd_disaggregated_share": len(split) / len(sent) if sent else None,
        "pd_prefill_pods_named": dict(Counter(str(r.prefill_pod) for r in split)),
        "pd_ttft_p50_disaggregated_s": pct(ok_split, "ttft_s", 0.50),
        "pd_ttft_p90_disaggregated_s": pct(ok_split, "ttft_s", 0.90),
        "pd_ttft_p50_whole_s": pct(ok_whole, "ttft_s", 0.50),
        "pd_ttft_p90_whole_s": pct(ok_whole, "ttft_s", 0.90),
        "pd_tpot_p50_disaggregated_s": pct(ok_split, "tpot_s", 0.50),
        "pd_tpot_p90_disaggregated_s": pct(ok_split, "tpot_s", 0.90),
        "pd_tpot_p50_whole_s": pct(ok_whole, "tpot_s", 0.50),
        "pd_tpot_p90_whole_s": pct(ok_whole, "tpot_s", 0.90),
        "pd_prefill_legs_sent": sum(c.prefill_legs_sent for c in counters.values()),
        "pd_prefill_legs_served": sum(c.prefill_legs_served for c in counters.values()),
        "pd_prefill_legs_per_pod": {n: c.prefill_legs_served for n, c in counters.items()},
        "pd_decode_legs_served": sum(c.decode_legs_served for c in counters.values()),
        "pd_kv_transfers": transfers,
        "pd_kv_transfer_mean_s": transfer_s / transfers if transfers else None,
        "pd_kv_transfer_bytes": sum(c.kv_transfer_bytes for c in counters.values()),
        "pd_fallbacks": sum(fallbacks.values()),
        "pd_fallbacks_by_reason": fallbacks,
    }


def failed_result(reason: str, requests: int) -> dict[str, Any]:
    keys = (
        "hit_rate",
        "ttft_p50_s",
        "ttft_p90_s",
        "ttft_p99_s",
        "throughput_rps",
        "tpot_p50_s",
        "tpot_p90_s",
        "tpot_p99_s",
    )
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
            config = envoy_config(listen_port=listen, epp_port=ports.grpc, admin_port=free_port())
            if options.prefill_pods:
                # Which requests the EPP disaggregated, in each response.
                echo_request_header(config, PREFILLER_HEADER, PREFILLER_ECHO_HEADER)
            envoy = start_envoy(config, workdir)
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
    names = {address: name for name, address in pods}
    for record in records:
        if record.prefill_pod is not None:
            record.prefill_pod = names.get(record.prefill_pod, record.prefill_pod)
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
            "prefill_pods": options.prefill_pods,
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
        f" TPOT p50 {_ms(result, 'tpot_p50_s')} ms p90 {_ms(result, 'tpot_p90_s')} ms,"
        f" {_with_ci(result, 'throughput_rps', '.2f')} req/s, errors {_fmt(result['errors'], 'g')},"
        f" sim lag {_fmt(result.get('sim_lag_max_s'), '.2f')} s,"
        f" client lag p50 {_fmt(result.get('client_lag_p50_s'), '.3f')} s"
        f" p99 {_fmt(result.get('client_lag_p99_s'), '.3f')} s"
        f" max {_fmt(result.get('client_lag_max_s'), '.3f')} s"
    )
    if result.get("pd_prefill_legs_served") is not None:
        line += (
            f", disaggregated {_fmt(result.get('pd_disaggregated'), 'g')}"
            f" (prefill legs served {_fmt(result['pd_prefill_legs_served'], 'g')},"
            f" fallbacks {_fmt(result.get('pd_fallbacks'), 'g')})"
        )
    if result["status"] == "failed":
        line += f"  FAILED: {result['failure']}"
    return line


def _ms(result: dict[str, Any], key: str) -> str:
    value, ci = result.get(key), result.get(f"{key}_ci95")
    text = _fmt(None if value is None else 1000 * value, ".2f")
    return text if ci is None else f"{text} ± {1000 * ci:.2f}"
