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

Load: `--load F` offers F times the fleet's capacity as the lab defines it
(`fleet_capacity_rps`, docs/lab.md#capacity); the setup records the capacity.

Flow control: every request is served, shed (the router answered 429/503 itself:
`shed`, `shed_kinds`, not errors) or failed, and the run checks that they add up to
the requests sent (`check_accounted`). With an EPP, its flow-control metrics are
read after the run and its queue sampled during it (`flow_control`); the tenants
workload gets the lab's tenant summary (`tenants`, bench/lab/tenants.py). Before
anything starts, a flow-control policy is checked against the bench's Envoy and the
client's timeout: none may cut a request waiting its TTL (`check_waits`); the TTL
is multiplied by the time scale unless `scale_ttl` is off (`scaled_config`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import signal
import subprocess
import threading
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
from bench.client import (
    PREFILLER_ECHO_HEADER,
    ROUTED_HEADER,
    SHED_PREFIX,
    Arrivals,
    Record,
    RunTiming,
    drive,
    is_shed,
    trace_speed,
)
from bench.lab.tenants import over_seeds_tenants, tenants_summary
from bench.lab.workload import capacity_rps, from_workload
from bench.peers import PeerKind, ensure_peer_venv, parse_peer, start_peer
from bench.provenance import portable_path, provenance
from bench.stack import (
    ROOT,
    ManagedProcess,
    ProcessFailed,
    add_routed_header,
    check_queue_wait,
    echo_request_header,
    envoy_config,
    free_port,
    start_envoy,
    start_epp_on_free_ports,
    start_sim_fleet,
)
from bench.stats import ci95, percentile
from bench.workloads import (
    OBJECTIVE_MIX,
    Words,
    Workload,
    WorkloadSpec,
    load_words,
    token_sequences,
)
from epp.config.errors import Problems
from epp.config.flowcontrol import feature_gates
from epp.durations import parse_duration
from epp.sources.metrics import read_series
from sim.latency import LatencyModel

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
            return {"kind": "epp", "config": portable_path(self.config)}
        assert self.peer is not None
        return {"kind": "peer", "router": self.peer.name, "policy": self.peer_policy}


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
    # Flow control's TTLs (and the config's other durations on the EPP's clock,
    # `CLOCK_DURATIONS`) multiplied by the time scale (`scaled_config`), so that a
    # request may wait as many simulated seconds as the config says; False: the
    # config's durations as written, in wall seconds.
    scale_ttl: bool = True

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


def http_get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10.0) as response:
        body: bytes = response.read()
        return body


def read_counters(address: str) -> PodCounters:
    values = parse_counters(http_get(f"http://{address}/metrics"))
    document = json.loads(http_get(f"http://{address}/sim/state"))
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
    # Shed requests (the router answered 429/503 itself) are neither served nor
    # errors: a client can act on them (bench/client.py `is_shed`).
    shed = [r for r in records if is_shed(r)]
    errors = [r for r in records if not r.ok and not is_shed(r)]
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
    shed_kinds: dict[str, int] = {}
    for r in shed:
        kind = (r.error or "")[len(SHED_PREFIX) :].strip() or "?"
        shed_kinds[kind] = shed_kinds.get(kind, 0) + 1
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
        "shed": len(shed),
        "shed_kinds": dict(sorted(shed_kinds.items())),
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
    - `tenants` (the tenants workload): the lab's mean over seeds of each repeat's
      own summary (`tenants_run`), bench/lab/tenants.py `over_seeds_tenants`;
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
        elif key in ("records_file", "tenants_run"):
            continue
        elif key == "tenants":
            runs = [r.get("tenants_run") for r in results]
            known = [t for t in runs if t is not None]
            combined[key] = over_seeds_tenants(known) if len(known) == len(runs) else None
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
            if key in ("error_kinds", "shed_kinds"):
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


def read_endpoints(path: Path) -> list[tuple[str, str]]:
    document = yaml.safe_load(path.read_text())
    return [(e["name"], e["address"]) for e in document["endpoints"]]


@dataclass(frozen=True)
class DataPath:
    """A running fleet with a router in front of it."""

    url: str  # where clients send
    pods: list[tuple[str, str]]  # (name, address)
    epp_metrics_url: str | None  # the EPP's /metrics; None for a peer router
    epp_pid: int | None = None  # the `epp serve` process (bench/idle_cpu.py reads its CPU)


@contextlib.contextmanager
def data_path(policy: Policy, options: RunOptions, workdir: Path) -> Iterator[DataPath]:
    """A fresh fleet and the policy's router in front of it."""
    with contextlib.ExitStack() as stack:
        fleet, endpoints = start_sim_fleet(options.pods, workdir, options.fleet_args())
        stack.callback(fleet.stop)
        pods = read_endpoints(endpoints)
        if policy.kind == "epp":
            assert policy.config is not None
            config_file = epp_config_file(policy.config, options, workdir)
            epp, ports = start_epp_on_free_ports(
                endpoints, workdir, config_file, options.epp_flags()
            )
            stack.callback(epp.stop)
            listen = free_port()
            config = envoy_config(listen_port=listen, epp_port=ports.grpc, admin_port=free_port())
            if options.prefill_pods:
                # Which requests the EPP disaggregated, in each response.
                echo_request_header(config, PREFILLER_HEADER, PREFILLER_ECHO_HEADER)
            # When the EPP let each request go (its wait in flow control's queue).
            add_routed_header(config, ROUTED_HEADER)
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
        epp_pid = None
        if policy.kind == "epp" and epp.process is not None:
            epp_pid = epp.process.pid
        yield DataPath(url, pods, epp_metrics, epp_pid)
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

            watch = QueueWatch(path.epp_metrics_url) if path.epp_metrics_url else None
            with progress, watch if watch is not None else contextlib.nullcontext():
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
            epp_page = http_get(path.epp_metrics_url) if path.epp_metrics_url else None
            flow_control = (
                flow_control_figures(epp_page, watch)
                if epp_page is not None and watch is not None
                else None
            )
    except (ProcessFailed, OSError, subprocess.CalledProcessError) as exc:
        return failed_result(f"{type(exc).__name__}: {exc}", workload.num_requests)
    check_accounted(records, workload.num_requests)
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
    if flow_control is not None:
        result["flow_control"] = flow_control
    if options.prefill_pods and epp_page is not None:
        result.update(pd_decisions(epp_page))
    if workload.name == "tenants":
        run = tenants_of_run(records, workload, arrivals, policy, flow_control)
        result["tenants_run"] = run
        result["tenants"] = over_seeds_tenants([run])
    return result


def check_accounted(records: Sequence[Record], sent: int) -> None:
    """Every request of the workload has its record, and each was served, shed or
    failed with a reason: served + shed + failed == sent, none left hanging."""
    served = sum(1 for r in records if r.ok)
    shed = sum(1 for r in records if is_shed(r))
    failed = sum(1 for r in records if not r.ok and not is_shed(r) and r.error is not None)
    if len(records) != sent or served + shed + failed != sent:
        raise RuntimeError(
            f"accounting: {sent} requests sent, {len(records)} records: {served} served +"
            f" {shed} shed + {failed} failed (the rest neither answered nor failed)"
        )


# The EPP's count of its P/D profile handler's decisions
# (plugins/disagg_profile_handler.py), by llm-d's decision types.
PD_DECISIONS = "epp_disagg_decision_total"
PD_SPLIT_DECISIONS = ("prefill-decode", "encode-prefill-decode")


def pd_decisions(page: bytes) -> dict[str, int]:
    """What the EPP says it decided for the requests it routed on a P/D fleet:
    `pd_epp_decided` (all its decisions) and `pd_epp_disaggregated` (those with a
    prefill leg), summed over its handlers and models; nothing when it counted
    none (a config without a P/D handler). Beside `pd_disaggregated`, read from
    the responses, it tells a request the EPP split whose response did not say so."""
    decided = disaggregated = 0
    for sample in read_series(page, PD_DECISIONS).samples:
        count = int(sample.value)
        decided += count
        if sample.labels.get("decision_type") in PD_SPLIT_DECISIONS:
            disaggregated += count
    if not decided:
        return {}
    return {"pd_epp_decided": decided, "pd_epp_disaggregated": disaggregated}


# -- tenants and flow control ----------------------------------------------------------

# The EPP's flow-control series (epp/flowcontrol/metrics.py); the dispatch-pass
# counter exists from the start whenever flow control is on.
FC_QUEUE_SIZE = "epp_flow_control_queue_size"
FC_QUEUE_BYTES = "epp_flow_control_queue_bytes"
FC_PASSES = "epp_flow_control_dispatch_passes_total"
FC_REQUESTS = "epp_flow_control_requests_total"
FC_WAIT = "epp_flow_control_request_queue_duration_seconds"
# A request dispatched after more than the wait histogram's first bucket (1 ms) has
# waited in the queue: a request let through at once is dispatched in microseconds.
FC_WAITED_AFTER = "0.001"
# Wall seconds between two samples of the queue's size during a run.
QUEUE_SAMPLE_INTERVAL_S = 0.2


def series_sum(page: bytes, name: str) -> float | None:
    """The sum of a series' samples on a Prometheus page; None when it is not there."""
    read = read_series(page, name)
    return sum(s.value for s in read.samples) if read.samples else None


def queue_now(page: bytes) -> tuple[int, int]:
    """Requests and bytes waiting in flow control, all bands and flows."""
    return int(series_sum(page, FC_QUEUE_SIZE) or 0), int(series_sum(page, FC_QUEUE_BYTES) or 0)


class QueueWatch:
    """Samples the EPP's queue size every QUEUE_SAMPLE_INTERVAL_S in a thread while
    the run lasts (a context manager): the peak the run saw. A sample is a scrape
    of the EPP's /metrics, a few milliseconds of its CPU."""

    def __init__(self, metrics_url: str, interval_s: float = QUEUE_SAMPLE_INTERVAL_S) -> None:
        self.url = metrics_url
        self.interval_s = interval_s
        self.peak = 0
        self.peak_bytes = 0
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="queue-watch", daemon=True)

    def __enter__(self) -> QueueWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                size, size_bytes = queue_now(http_get(self.url))
            except OSError:
                continue  # a scrape that failed under load: the next one counts
            self.samples += 1
            self.peak = max(self.peak, size)
            self.peak_bytes = max(self.peak_bytes, size_bytes)


def flow_control_figures(page: bytes, watch: QueueWatch | None) -> dict[str, Any] | None:
    """What the EPP's metrics say of flow control after a run (None: it was off):
    the queue's sampled peak, what is left in it, dispatch passes, requests by
    outcome, and per priority band how many were dispatched after waiting
    (`waited_priority_<p>`). Flat numbers, so repeats average them."""
    passes = series_sum(page, FC_PASSES)
    if passes is None:
        return None
    size, size_bytes = queue_now(page)
    figures: dict[str, Any] = {
        "queue_peak": max(watch.peak if watch else 0, size),
        "queue_peak_bytes": max(watch.peak_bytes if watch else 0, size_bytes),
        "queue_samples": watch.samples if watch else 0,
        "queued_at_end": size,
        "dispatch_passes": int(passes),
    }
    for sample in read_series(page, FC_REQUESTS).samples:
        key = f"outcome_{sample.labels.get('outcome', '?')}"
        figures[key] = figures.get(key, 0) + int(sample.value)
    dispatched: dict[str, float] = {}
    at_once: dict[str, float] = {}
    for sample in read_series(page, FC_WAIT + "_count").samples:
        if sample.labels.get("outcome") == "dispatched":
            dispatched[sample.labels["priority"]] = sample.value
    for sample in read_series(page, FC_WAIT + "_bucket").samples:
        labels = sample.labels
        if labels.get("outcome") == "dispatched" and labels.get("le") == FC_WAITED_AFTER:
            at_once[labels["priority"]] = sample.value
    for priority, count in dispatched.items():
        figures[f"waited_priority_{priority}"] = int(count - at_once.get(priority, 0.0))
    return figures


def config_objectives(config: Path) -> dict[str, int]:
    """An EndpointPickerConfig's `inferenceObjectives`: name -> priority."""
    document = yaml.safe_load(config.read_text(encoding="utf-8")) or {}
    return {
        str(o["name"]): int(o.get("priority") or 0)
        for o in document.get("inferenceObjectives") or []
        if isinstance(o, dict) and "name" in o
    }


def waited_by_objective(
    policy: Policy, flow_control: dict[str, Any] | None
) -> dict[str, int | None]:
    """Per objective of the tenants workload, requests the EPP dispatched after a
    wait (its metrics count them per priority band): 0 for an EPP without flow
    control (nothing waits in it); None when unknown (a peer router, objectives
    sharing a band)."""
    names = [name for name, _ in OBJECTIVE_MIX]
    if policy.kind != "epp" or policy.config is None:
        return dict.fromkeys(names)
    if flow_control is None:
        return dict.fromkeys(names, 0)
    # An objective the config does not name is priority 0 (epp/director.py).
    defined = config_objectives(policy.config)
    priority = {name: defined.get(name, 0) for name in names}
    shared = {p for p in priority.values() if list(priority.values()).count(p) > 1}
    return {
        name: None if p in shared else int(flow_control.get(f"waited_priority_{p}", 0))
        for name, p in priority.items()
    }


def tenants_window(workload: Workload, arrivals: Arrivals) -> tuple[float, float]:
    """The tenants workload's burst window in the run's simulated seconds: its own
    (in the workload's time units) divided by the speed its arrival times were
    scaled by (`bench.client.trace_speed`)."""
    start, end = workload.params["burst_window"]
    speed = trace_speed(workload.sessions, arrivals.rate)
    return float(start) / speed, float(end) / speed


def tenants_of_run(
    records: Sequence[Record],
    workload: Workload,
    arrivals: Arrivals,
    policy: Policy,
    flow_control: dict[str, Any] | None,
) -> dict[str, Any]:
    """The lab's tenant summary (bench/lab/tenants.py) of a `bench run`: each
    record with its request's headers and when Envoy let it go upstream."""
    headers = {(s.id, i): t.headers for s in workload.sessions for i, t in enumerate(s.turns)}
    sent = [(r, headers[(r.session, r.turn)], r.routed_s) for r in records]
    router = {"flow_control": flow_control} if flow_control is not None else {}
    return tenants_summary(
        sent,
        tenants_window(workload, arrivals),
        router,
        int(workload.params["output_len"]),
        waited_by_objective(policy, flow_control),
    )


# -- load and timeouts ---------------------------------------------------------------------

# Added to flow control's TTL for the pick after the wait, as the Helm chart does
# (`envoy.timeouts.flowControlHeadroom`): every timeout that counts a queued
# request's wait must be at least TTL + this.
QUEUE_WAIT_HEADROOM_S = 30.0


def fleet_capacity_rps(workload: Workload, words: Words, pods: int) -> float:
    """The fleet's capacity as the lab defines it (docs/lab.md#capacity: every
    request's prompt prefilled with nothing cached, its output tokens at the
    compute roofline; pods / the mean), with the step-time model the simulated
    pods run (`sim.latency.LatencyModel`'s defaults: `python -m sim` changes only
    its KV-transfer figures, which the capacity does not use)."""
    return capacity_rps(from_workload(workload, words), pods, LatencyModel())


def flow_control_ttl(config: Path) -> float | None:
    """Flow control's queue-wait budget in seconds (`defaultRequestTTL`, 60 s when
    unset; math.inf for 0s: no TTL), or None when the config's gate is off."""
    document = yaml.safe_load(config.read_text(encoding="utf-8")) or {}
    gates, _ = feature_gates(document.get("featureGates"), Problems())
    if not gates.get("flowControl"):
        return None
    ttl = parse_duration(str((document.get("flowControl") or {}).get("defaultRequestTTL", "60s")))
    return ttl if ttl > 0 else math.inf


# Plugin parameters that are durations on the EPP's clock (type, parameter): a
# benchmark whose pods run slower than real time scales them with the TTLs.
CLOCK_DURATIONS = (("predicted-ttft-scorer", "workWeightBusyForS"),)


def _clock_durations(document: dict[str, Any]) -> list[tuple[dict[str, Any], str]]:
    """(its plugin's `parameters`, its name) of each `CLOCK_DURATIONS` entry the
    config sets."""
    found = []
    for plugin in document.get("plugins") or []:
        parameters = plugin.get("parameters") or {}
        for kind, name in CLOCK_DURATIONS:
            if plugin.get("type") == kind and name in parameters:
                found.append((parameters, name))
    return found


def _has_clock_durations(config: Path) -> bool:
    return bool(_clock_durations(yaml.safe_load(config.read_text(encoding="utf-8")) or {}))


def clock_scale(config: Path, options: RunOptions) -> float:
    """What the config's durations on the EPP's clock (flow control's TTLs, the
    `CLOCK_DURATIONS`) are multiplied by in this run: the time scale (wall seconds
    per simulated second) when `options.scale_ttl` and the config has one, else 1."""
    if not options.scale_ttl or options.time_scale == 1.0:
        return 1.0
    if flow_control_ttl(config) is None and not _has_clock_durations(config):
        return 1.0
    return options.time_scale


def scaled_config(text: str, scale: float) -> str:
    """An EndpointPickerConfig with its durations on the EPP's clock multiplied by
    `scale`: flow control's TTLs (`defaultRequestTTL`, 60 s when unset, and
    `noEndpointRequestTTL` when set) when its gate is on, and the plugin parameters
    of `CLOCK_DURATIONS`. The EPP runs on wall time while the pods run `scale` times
    slower than real time: a TTL of 30 s would be 30 / scale simulated seconds, so a
    run at --time-scale 10 would shed after 3 s of simulated waiting what the lab
    lets wait 30."""
    document = yaml.safe_load(text)
    gates, _ = feature_gates(document.get("featureGates"), Problems())
    if gates.get("flowControl"):
        section = document.setdefault("flowControl", {}) or {}
        document["flowControl"] = section
        for key, default in (("defaultRequestTTL", "60s"), ("noEndpointRequestTTL", None)):
            value = section.get(key, default)
            if value is not None:
                section[key] = f"{parse_duration(str(value)) * scale:g}s"
    for parameters, name in _clock_durations(document):
        parameters[name] = float(parameters[name]) * scale
    dumped: str = yaml.safe_dump(document, sort_keys=False)
    return dumped


def epp_config_file(config: Path, options: RunOptions, workdir: Path) -> Path:
    """The config file `epp serve` gets: the policy's own, or its copy with its
    durations on the EPP's clock scaled (`scaled_config`) in `workdir`."""
    scale = clock_scale(config, options)
    if scale == 1.0:
        return config
    path = workdir / f"{config.stem}.clock-x{scale:g}.yaml"
    path.write_text(scaled_config(config.read_text(encoding="utf-8"), scale), encoding="utf-8")
    return path


def check_waits(policies: Sequence[Policy], options: RunOptions) -> None:
    """ValueError unless a request may wait its whole TTL in the EPP's queue before
    anything else gives up on it: the bench's Envoy (as `data_path` builds it) and
    the client's own timeout (`--request-timeout`, simulated seconds x the time
    scale: the EPP's TTL is in wall seconds)."""
    for policy in policies:
        if policy.kind != "epp" or policy.config is None:
            continue
        ttl = flow_control_ttl(policy.config)
        if ttl is None:
            continue
        ttl *= clock_scale(policy.config, options)
        wait = ttl + QUEUE_WAIT_HEADROOM_S
        try:
            check_queue_wait(envoy_config(listen_port=1, epp_port=1, admin_port=1), wait)
        except ValueError as exc:
            raise ValueError(f"policy {policy.name}: {exc}") from exc
        client = options.request_timeout_s * options.time_scale
        if client < wait:
            raise ValueError(
                f"policy {policy.name}: the client gives up after {client:g} wall seconds"
                f" (--request-timeout x --time-scale), before a request waiting its flow"
                f" control TTL ({ttl:g} wall seconds) plus {QUEUE_WAIT_HEADROOM_S:g}s is answered:"
                " raise --request-timeout"
            )


# -- the whole run -------------------------------------------------------------------------


def _interrupt_on_sigterm(signum: int, frame: FrameType | None) -> None:
    # A SIGTERM is handled as Ctrl-C is, by whatever SIGINT handler is in force. Raising
    # KeyboardInterrupt here instead would land in whichever callback the loop is
    # running, and aiohttp's protocol callbacks turn any exception into one failed
    # request: the run would go on. Inside `asyncio.run` the SIGINT handler cancels
    # the main task and the run ends with KeyboardInterrupt once it has unwound.
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler):
        handler(signal.SIGINT, frame)
    else:  # SIGINT ignored (started in the background): SIGTERM still stops the run
        raise KeyboardInterrupt


def stop_on_sigterm() -> None:
    """From now on SIGTERM stops this process as Ctrl-C does (a KeyboardInterrupt that
    unwinds every `with` block, so everything started is stopped)."""
    signal.signal(signal.SIGTERM, _interrupt_on_sigterm)


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

    stop_on_sigterm()
    options.out.mkdir(parents=True, exist_ok=True)
    check_waits(options.policies, options)
    words = load_words(options.tokenizer)
    workload = options.workload.build(words)
    capacity = fleet_capacity_rps(workload, words, options.pods)
    # `--load`: F x capacity, in requests per second; Poisson arrivals start
    # sessions, a multi-turn workload's at that many requests' worth of sessions.
    share = len(workload.sessions) / workload.num_requests
    rungs = [a.with_capacity(capacity, share) for a in options.ladder]
    bounds = workload_bounds(workload, options.tokenizer, options.block_size, options.pods)
    print(
        f"workload {workload.name}: {workload.num_requests} requests,"
        f" {bounds.prompt_tokens} prompt tokens; bounds h*={bounds.h_star:.3f}"
        f" h_random={bounds.h_random:.3f} ({options.pods} pods, blocks of"
        f" {options.block_size}); capacity {capacity:.2f} requests/s with no cache hit"
        " (docs/lab.md#capacity)",
        flush=True,
    )
    ladder = []
    started = time.monotonic()
    repeats = options.repeats
    for arrivals in rungs:
        offered = _offered_rps(arrivals, share)
        rung: dict[str, Any] = {
            "arrivals": arrivals.to_json(),
            "label": arrivals.label(),
            # Offered requests per second, and as a multiple of the fleet's capacity.
            "offered_rps": offered,
            "load": offered / capacity if offered is not None else None,
        }
        if workload.name == "tenants":
            rung["burst_window_s"] = list(tenants_window(workload, arrivals))
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
            "capacity_rps": capacity,
            "capacity_definition": "docs/lab.md#capacity (the pods' step-time model)",
            **(
                {"burst_window_s": ladder[-1]["burst_window_s"]}
                if ladder and "burst_window_s" in ladder[-1]
                else {}
            ),
            "seed": options.seed,
            "request_timeout_s": options.request_timeout_s,
            "max_error_rate": options.max_error_rate,
            "repeats": repeats,
            "prefill_pods": options.prefill_pods,
            # Flow control's TTLs in wall seconds = the config's x this.
            "flow_control_ttl_scale": {
                p.name: clock_scale(p.config, options)
                for p in options.policies
                if p.config is not None and flow_control_ttl(p.config) is not None
            },
            # The config's other durations on the EPP's clock (`CLOCK_DURATIONS`),
            # in wall seconds = the config's x this.
            "clock_duration_scale": {
                p.name: clock_scale(p.config, options)
                for p in options.policies
                if p.config is not None and _has_clock_durations(p.config)
            },
        },
        "workload": {**workload.describe(), "prompt_tokens": bounds.prompt_tokens},
        "oracle": bounds.to_json(),
        "policies": ladder[-1]["policies"] if ladder else {},
        "ladder": ladder,
    }
    write_outputs(document, options.out)
    return document


def _offered_rps(arrivals: Arrivals, sessions_per_request: float) -> float | None:
    """Requests per second the arrivals offer (None: closed loop, or a trace at its
    own timestamps, whose rate is whatever they say)."""
    if arrivals.rate is None or math.isinf(arrivals.rate):
        return None
    if arrivals.kind == "poisson":
        return arrivals.rate / sessions_per_request
    return arrivals.rate


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
        f" shed {_fmt(result.get('shed'), 'g')},"
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
