"""The engine's counters and histograms, and `/metrics` in vLLM's Prometheus text.

Names, types and label sets follow vLLM's v1 metrics (`engine="0"`, `model_name`),
rendered the way prometheus_client renders them (counters' HELP/TYPE lines carry the
`_total` suffix, values are floats). Written out by hand rather than with
prometheus_client so each pod owns its numbers outright (a fleet test may run
several pods in one process) and an engine restart can start them from zero, as a
new vLLM process would. Times are in simulated seconds (see `sim.engine.SimClock`).
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

# vLLM's bucket boundaries for these histograms.
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
    2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
# vLLM's NIXL connector's buckets: transfer duration (seconds) and bytes per transfer
# (2 KiB to 8 GiB, every other power of two).
NIXL_XFER_TIME_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0,
)  # fmt: skip
NIXL_BYTES_BUCKETS = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
    60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip


@dataclass
class Histogram:
    bounds: Sequence[float]
    counts: list[int] = field(default_factory=list)  # per bucket, not cumulative
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)  # last one: +Inf

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value
        self.count += 1


@dataclass
class EngineStats:
    """Everything the engine counts since it (re)started."""

    requests_received: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    # In tokens, like vLLM: tokens looked up in the prefix cache / found there.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    preemptions: int = 0
    steps: int = 0
    # Simulated seconds the steps should have taken (the latency model's sum), and
    # how far behind that the engine ran (Python too slow for the time scale).
    busy_s: float = 0.0
    lag_s: float = 0.0
    aborted: int = 0
    finished: Counter[str] = field(default_factory=Counter)  # by finish reason
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(E2E_BUCKETS))
    # Prefill/decode disaggregation. The KV connector's lookups (vLLM counts, per
    # request that asks for remote KVs, its tokens and those the connector supplies).
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    # KV transfers pulled by this pod as a decode pod (vLLM's NIXL connector metrics):
    # their durations (simulated seconds) and sizes.
    nixl_xfer_time: Histogram = field(default_factory=lambda: Histogram(NIXL_XFER_TIME_BUCKETS))
    nixl_bytes_transferred: Histogram = field(default_factory=lambda: Histogram(NIXL_BYTES_BUCKETS))
    # Requests served as prefill legs (kv_transfer_params.do_remote_decode) and as
    # decode legs (do_remote_prefill): not vLLM metrics; /sim/state shows them.
    prefill_legs: int = 0
    decode_legs: int = 0


@dataclass(frozen=True)
class Gauges:
    running: int
    waiting: int
    kv_cache_usage: float
    block_size: int
    num_gpu_blocks: int
    hash_algo: str


def _labels(pairs: dict[str, str]) -> str:
    def escape(value: str) -> str:
        return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in pairs.items()) + "}"


def _number(value: float) -> str:
    return repr(float(value))


# Why a sidecar prefilled locally instead of on the prefill pod (sim/server.py).
FALLBACK_REASONS = ("connect", "timeout", "status", "body")


def render(
    model: str,
    stats: EngineStats,
    gauges: Gauges,
    role: str | None = None,
    sidecar: Mapping[str, int] | None = None,
) -> str:
    """`role`: the pod's P/D role, if any (its KV-connector metrics are shown);
    `sidecar`: the sidecar's fallbacks by reason, if it plays one."""
    base = {"engine": "0", "model_name": model}
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str) -> None:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")

    def sample(name: str, value: float, extra: dict[str, str] | None = None) -> None:
        lines.append(f"{name}{_labels({**base, **(extra or {})})} {_number(value)}")

    def gauge(name: str, help_text: str, value: float) -> None:
        family(name, "gauge", help_text)
        sample(name, value)

    def counter(name: str, help_text: str, value: float) -> None:
        family(name + "_total", "counter", help_text)
        sample(name + "_total", value)

    def histogram(name: str, help_text: str, hist: Histogram) -> None:
        family(name, "histogram", help_text)
        cumulative = 0
        for bound, count in zip(hist.bounds, hist.counts, strict=False):
            cumulative += count
            sample(name + "_bucket", cumulative, {"le": _number(bound)})
        sample(name + "_bucket", hist.count, {"le": "+Inf"})
        sample(name + "_count", hist.count)
        sample(name + "_sum", hist.total)

    gauge(
        "vllm:num_requests_running",
        "Requests in the running batch.",
        gauges.running,
    )
    gauge("vllm:num_requests_waiting", "Requests queued, not yet running.", gauges.waiting)
    gauge(
        "vllm:kv_cache_usage_perc",
        "Fraction of KV blocks held by requests (0..1).",
        gauges.kv_cache_usage,
    )
    family("vllm:cache_config_info", "gauge", "KV cache configuration (value is always 1).")
    sample(
        "vllm:cache_config_info",
        1.0,
        {
            "block_size": str(gauges.block_size),
            "cache_dtype": "auto",
            "enable_prefix_caching": "True",
            "num_cpu_blocks": "None",
            "num_gpu_blocks": str(gauges.num_gpu_blocks),
            "prefix_caching_hash_algo": gauges.hash_algo,
        },
    )
    counter(
        "vllm:prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
        stats.prefix_cache_queries,
    )
    counter(
        "vllm:prefix_cache_hits",
        "Prompt tokens found in the prefix cache.",
        stats.prefix_cache_hits,
    )
    counter(
        "vllm:num_preemptions",
        "Requests preempted (blocks freed, recomputed later).",
        stats.preemptions,
    )
    counter("vllm:prompt_tokens", "Prompt tokens received.", stats.prompt_tokens)
    counter("vllm:generation_tokens", "Tokens generated.", stats.generation_tokens)
    family("vllm:request_success_total", "counter", "Finished requests by finish reason.")
    for reason in ("stop", "length", "abort"):
        sample("vllm:request_success_total", stats.finished[reason], {"finished_reason": reason})
    histogram(
        "vllm:time_to_first_token_seconds",
        "Time to first token, simulated seconds.",
        stats.ttft,
    )
    histogram(
        "vllm:e2e_request_latency_seconds",
        "Request latency from arrival to last token, simulated seconds.",
        stats.e2e,
    )
    # vLLM's KV-connector metrics (a pod with a role: P/D disaggregation).
    if role is not None:
        counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector cross-instance cache sharing,"
            " in terms of number of queried tokens.",
            stats.external_prefix_cache_queries,
        )
        counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector cross-instance cache sharing,"
            " in terms of number of cached tokens.",
            stats.external_prefix_cache_hits,
        )
        histogram(
            "vllm:nixl_xfer_time_seconds",
            "Histogram of transfer duration for NIXL KV Cache transfers, simulated seconds.",
            stats.nixl_xfer_time,
        )
        histogram(
            "vllm:nixl_bytes_transferred",
            "Histogram of bytes transferred per NIXL KV Cache transfers.",
            stats.nixl_bytes_transferred,
        )
        counter(
            "vllm:nixl_num_failed_transfers",
            "Number of failed NIXL KV Cache transfers (the simulator's never fail).",
            0,
        )
    if sidecar is not None:
        # Not vLLM's: the decode-side sidecar the simulated pod plays (sim/server.py).
        family(
            "sim:pd_prefill_fallbacks_total",
            "counter",
            "Disaggregated requests whose prefill leg failed; prefilled locally instead.",
        )
        for reason in FALLBACK_REASONS:
            sample("sim:pd_prefill_fallbacks_total", sidecar.get(reason, 0), {"reason": reason})
    return "\n".join(lines) + "\n"
