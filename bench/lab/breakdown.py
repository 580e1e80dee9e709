"""Where each request's TTFT went: the lab's answer to "what is this policy's p90
made of, and what could lower it".

A request served whole (not disaggregated) has its TTFT cut into five parts that
add up to it:

- **floor**: its TTFT floor (bench/lab/floor.py): alone on an idle pod holding
  the longest prefix any earlier request left (h*), through the cheapest router;
- **miss**: the floor for the prefix its pod did hold, minus the floor: the
  prefill (and pod overhead) of tokens some pod had cached but not this one;
- **queue**: from its arrival at the engine to its first step: the work ahead of
  it on that pod;
- **batch**: from its first step to its first token, beyond that prefill alone:
  the batch-mates its steps carried (decoding requests, other prompts' chunks)
  and any preemption;
- **other**: the rest: the router's path and the way back beyond the cheapest
  router's (a negative share when this router's path is the cheaper one).

Queue is placement (a less busy pod would have started it sooner), miss is
affinity (the pod holding the prefix would have skipped that prefill), batch is
the decode load of the pod it joined, other is the router's own cost. Each run
reports the mean of every part over all its requests served whole and over its
tail: those whose TTFT is at or above the p90 of theirs.

The parts are read from the engine's own times (`EngineRequest.arrival_time`,
`first_scheduled_time`, `first_token_time`) and its cached tokens; h* per request
comes from the same pass as the run's bounds (bench/bounds.py), on that seed's
own requests.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.lab.epp import Delays
from bench.lab.floor import outside_engine_s, prefill_alone_s, request_floor_s
from bench.stats import percentile
from sim.engine import EngineConfig
from sim.latency import LatencyModel

PARTS = ("floor", "miss", "queue", "batch", "other")
SCOPES = ("all", "tail")
# The result keys: the mean of each part over each scope, in seconds.
PART_KEYS = tuple(f"ttft_{scope}_{part}_s" for scope in SCOPES for part in PARTS)

# A request's (session id, turn index): what ties it to its h*.
RequestKey = tuple[int, int]


@dataclass(frozen=True, slots=True)
class ServedWhole:
    """What the lab saw of one request its (only) pod prefilled, in seconds."""

    key: RequestKey
    ttft_s: float
    prompt_tokens: int
    cached_tokens: int  # found in its pod's cache when first scheduled
    queue_s: float  # engine arrival to first step
    prefill_s: float  # first step to first token


def ttft_parts(
    request: ServedWhole,
    star_hit: int,
    engine: EngineConfig,
    latency: LatencyModel,
    delays: Delays,
) -> dict[str, float]:
    """The request's TTFT as the five parts of the module docstring (they sum to
    `request.ttft_s`), in seconds."""
    prompt = request.prompt_tokens
    floor = request_floor_s(prompt, star_hit, engine, latency, delays)
    alone = prefill_alone_s(prompt, request.cached_tokens, engine, latency)
    held = outside_engine_s(prompt - request.cached_tokens, delays) + alone  # its floor
    batch = request.prefill_s - alone
    other = request.ttft_s - held - request.queue_s - batch
    return {
        "floor": floor,
        "miss": held - floor,
        "queue": request.queue_s,
        "batch": batch,
        "other": other,
    }


def summarize_parts(
    requests: Sequence[ServedWhole],
    star_hits: Mapping[RequestKey, int],
    engine: EngineConfig,
    latency: LatencyModel,
    delays: Delays,
) -> dict[str, float | None]:
    """`PART_KEYS`: the mean of each part over all `requests` and over their tail
    (TTFT at or above their p90); None for a run with nothing served whole. A
    request with no h* (not in `star_hits`) is an error: the bounds were computed
    on other requests."""
    if not requests:
        return dict.fromkeys(PART_KEYS)
    missing = [r.key for r in requests if r.key not in star_hits]
    if missing:
        raise ValueError(
            f"TTFT breakdown: {len(missing)} requests have no h* (first: session"
            f" {missing[0][0]}, turn {missing[0][1]}); the bounds were computed on"
            " other requests"
        )
    parts = [ttft_parts(r, star_hits[r.key], engine, latency, delays) for r in requests]
    p90 = percentile(sorted(r.ttft_s for r in requests), 0.9)
    assert p90 is not None
    tail = [p for p, r in zip(parts, requests, strict=True) if r.ttft_s >= p90]
    out: dict[str, float | None] = {}
    for scope, chosen in (("all", parts), ("tail", tail)):
        for part in PARTS:
            out[f"ttft_{scope}_{part}_s"] = sum(p[part] for p in chosen) / len(chosen)
    return out


def report_lines(policies: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """report.md's table of the parts, per policy and scope, in ms (mean over seeds
    of each run's mean); nothing when no policy has them."""
    rows = [
        (name, r)
        for name, r in policies.items()
        if all(isinstance(r.get(k), float) for k in PART_KEYS)
    ]
    if not rows:
        return []
    lines = [
        "Where the TTFT went (bench/lab/breakdown.py): each request served whole, its TTFT"
        " cut into its floor (alone on an idle pod holding h*), its prefix misses (the"
        " extra prefill for what its pod did not hold), its queue (arrival at the engine"
        " to its first step), its batch (first step to first token beyond that prefill"
        " alone) and the router's path beyond the cheapest; mean ms over all of a run's"
        " requests and over its tail (TTFT at or above its p90), mean over seeds:",
        "",
        "| policy | requests | floor | miss | queue | batch | other | TTFT |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in rows:
        for scope, label in (("all", "all"), ("tail", "tail (≥ p90)")):
            values = [r[f"ttft_{scope}_{part}_s"] * 1e3 for part in PARTS]
            cells = " | ".join(f"{v:.1f}" for v in values)
            lines.append(f"| {name} | {label} | {cells} | {sum(values):.1f} |")
    return [*lines, ""]
