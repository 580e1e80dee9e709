"""Soak: a long steady load with pod churn, watching the EPP for slow decay.

    python -m bench soak --minutes 30

Simulated pods (`bench.stack.Pods`), `epp serve` with precise prefix routing,
load scorers and the stale-metrics filter (or the config given with `--config`:
`manifests/config/default.yaml` soaks what `epp serve` runs without one), and a
real Envoy in front. For `--minutes`:

- open-loop Poisson requests at `--rate` per second through Envoy, token-id
  prompts whose system prompt is drawn from `--groups` groups with Zipf weights
  (a few hot prefixes and a long tail, so the index keeps meeting new blocks and
  must stay within its bound, `--max-index-entries`);
- churn: every `--churn-interval` seconds one pod, in turn, is killed (SIGKILL)
  and started again on its ports, an engine with an empty cache and its KV-event
  seq back at 0; or with `--fault freeze`, frozen (SIGSTOP: the kernel still
  accepts its connections, nothing answers) for `--freeze-seconds`, then thawed
  (a hung server that comes back); or with `--fault stall`, its engine stopped
  for `--stall-seconds` while its server answers everything, `/metrics` included
  (the simulator's `/sim/stall`: a hung engine behind a live API process);
- every `--sample-interval` seconds a sample: the EPP process's RSS and what it
  is made of (its /debug/memory: the C allocator's bytes in use, Python's small
  blocks, and with `--trace-memory` the bytes Python allocations hold), its index
  entries, bound and evictions by the bound (`--max-index-entries`, below the
  pods' total KV blocks so the bound is exercised), the p99 of its pick latency
  over the interval
  (`epp_scheduler_duration_seconds`, and `epp_request_processing_duration_seconds`:
  everything the EPP adds), requests ok and failed, KV-event gaps, replays and
  engine restarts seen.

With `--trace-memory FRAMES` the EPP traces its Python allocations (epp/memory.py)
and the source lines holding the most memory are read at every eighth of the run
and at its end (all kept in results.json); the report lists the lines that grew
most over the second half of the run.

The summary compares the start of the run with its end: RSS growth and its slope
over the second half (a leak shows as a steady slope once caches are warm; the
same slopes for the allocator's bytes, Python's blocks and the traced bytes tell
a structure that grows from memory the allocator keeps), the
index's largest size against its bound, p99 pick latency in the first and last
quarter (the median of the intervals' p99s; their ratio is the drift), and
errors, split into those around a pod kill or freeze (requests in flight to it,
or routed before the EPP saw it go) and any others; with `--fault freeze`, the
requests held over a second by the frozen or stalled pod (answered once it
moved again).

Writes results.json, report.md and soak.png to `--out`; a progress bar shows the
time, request rate and errors while it runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from tqdm import tqdm

from bench.longrun import (
    OpenLoop,
    Outcome,
    PrefixSpace,
    fetch_page,
    histogram,
    quantile,
    total,
)
from bench.provenance import provenance
from bench.stack import (
    Pod,
    Pods,
    ProcessFailed,
    envoy_config,
    free_port,
    start_envoy,
    start_epp_on_free_ports,
)
from bench.stats import median, percentile
from epp.memory import MAX_FRAMES, rss_bytes

# Errors within this long after a pod kill (or a freeze's end) are counted as its.
CHURN_WINDOW_S = 5.0
# A request over this long that overlapped a freeze was held by the frozen pod (the
# pods answer in milliseconds).
HELD_S = 1.0
FAULTS = ("kill", "freeze", "stall")


@dataclass(frozen=True)
class SoakOptions:
    out_dir: Path = Path("out/soak")
    minutes: float = 30.0
    pods: int = 4
    rate: float = 20.0  # requests per wall second
    groups: int = 20_000  # the prefix space
    system_len: int = 256
    question_len: int = 32
    skew: float = 1.0
    output_tokens: int = 8
    churn_interval_s: float = 60.0  # 0: no churn
    fault: str = "kill"  # what churn does to a pod: FAULTS
    freeze_s: float = 10.0  # with fault "freeze": how long a pod stays frozen
    stall_s: float = 45.0  # with fault "stall": how long a pod's engine stays stopped
    sample_interval_s: float = 5.0
    # Below the fleet's KV capacity (4 pods x 4,000 blocks), so the bound, not only
    # the engines' own evictions, keeps the index in check.
    max_index_entries: int = 12_000
    num_gpu_blocks: int = 4_000  # per pod: small, so engines evict too
    time_scale: float = 0.05
    # tracemalloc's frames in the EPP (0: not tracing): epp/memory.py.
    trace_memory_frames: int = 0
    # The EPP's config file (None: `soak_config`, precise prefix routing).
    config: Path | None = None
    # More `epp serve` arguments (e.g. ("--metrics-staleness-threshold", "1h")).
    epp_args: tuple[str, ...] = ()
    request_timeout_s: float = 60.0
    seed: int = 0
    progress: bool = False
    command: str = ""


def soak_config(max_index_entries: int) -> dict[str, Any]:
    return {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": "stale-metrics-filter"},
            {
                "type": "precise-prefix-cache-scorer",
                "name": "prefix",
                "parameters": {
                    "blockSize": 16,
                    "speculativeIndexing": True,
                    "maxIndexEntries": max_index_entries,
                },
            },
            {"type": "queue-scorer"},
            {"type": "kv-cache-utilization-scorer"},
            {"type": "active-request-scorer"},
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "stale-metrics-filter"},
                    {"pluginRef": "prefix", "weight": 3},
                    {"pluginRef": "queue-scorer", "weight": 2},
                    {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
                    {"pluginRef": "active-request-scorer", "weight": 1},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    }


@dataclass
class Sample:
    t_s: float  # since the load started
    window_s: float  # since the previous sample
    rss_bytes: int | None
    index_entries: float
    index_max_entries: float
    index_evicted_entries: float  # total so far, by the bound
    pick_p99_s: float | None  # over the interval since the previous sample
    processing_p99_s: float | None
    requests_ok: int  # answered over the interval
    requests_failed: int
    latency_p99_s: float | None  # client side, end to end, over the interval
    kv_gaps: float  # totals so far
    kv_replays: float
    kv_restarts: float
    in_flight: float
    # From the EPP's /debug/memory (None where it does not tell: not glibc, not
    # tracing, or an older EPP): epp/memory.py.
    malloc_in_use_bytes: int | None = None
    python_blocks: int | None = None
    traced_bytes: int | None = None


@dataclass
class _State:
    samples: list[Sample] = field(default_factory=list)
    kills: list[float] = field(default_factory=list)  # seconds since the load started
    freezes: list[float] = field(default_factory=list)  # each freeze's start, the same
    stalls: list[float] = field(default_factory=list)  # each engine stall's start, the same
    restarts_ready: list[float] = field(default_factory=list)
    restart_failures: list[str] = field(default_factory=list)
    sample_failures: int = 0  # samples the EPP did not answer (it died, say)
    # With --trace-memory: {"t_s": ..., "sites": [{"site", "bytes", "blocks"}, ...]}.
    site_readings: list[dict[str, Any]] = field(default_factory=list)
    started: float = 0.0  # time.monotonic() when the load started


async def _sample(
    session: aiohttp.ClientSession,
    admin: str,
    pid: int,
    load: OpenLoop,
    started: float,
    previous: dict[str, Any],
) -> Sample:
    page = await fetch_page(session, admin + "/metrics")
    memory = await _memory(session, admin)
    pick = histogram(page, "epp_scheduler_duration_seconds")
    processing = histogram(page, "epp_request_processing_duration_seconds")
    now = time.monotonic()
    seen = len(load.outcomes)
    window = load.outcomes[previous.get("seen", 0) : seen]
    sample = Sample(
        t_s=now - started,
        window_s=now - previous.get("at", started),
        rss_bytes=rss_bytes(pid),
        index_entries=total(page, "epp_kv_index_entries"),
        index_max_entries=total(page, "epp_kv_index_max_entries"),
        index_evicted_entries=total(page, "epp_kv_index_evicted_entries_total"),
        pick_p99_s=quantile(0.99, pick, previous.get("pick")),
        processing_p99_s=quantile(0.99, processing, previous.get("processing")),
        requests_ok=sum(o.ok for o in window),
        requests_failed=sum(not o.ok for o in window),
        latency_p99_s=percentile([o.latency_s for o in window if o.ok], 0.99),
        kv_gaps=total(page, "epp_kv_event_gaps_total"),
        kv_replays=total(page, "epp_kv_event_replays_total", result="requested"),
        kv_restarts=total(page, "epp_kv_index_resets_total", reason="restart"),
        in_flight=total(page, "epp_in_flight_requests"),
        malloc_in_use_bytes=memory.get("malloc_in_use_bytes"),
        python_blocks=memory.get("python_blocks"),
        traced_bytes=memory.get("traced_bytes"),
    )
    previous.update(pick=pick, processing=processing, seen=seen, at=now)
    return sample


# Source lines read at each reading of the sites (the most memory first).
SITES_READ = 60
# The fractions of the run at which the sites are read (and at its end).
SITE_READINGS_AT = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875)


async def _memory(session: aiohttp.ClientSession, admin: str, sites: int = 0) -> dict[str, Any]:
    """The EPP's /debug/memory (epp/memory.py); {} where it has none."""
    url = admin + "/debug/memory" + (f"?sites={sites}" if sites else "")
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=60)) as response:
        if response.status == 404:
            return {}
        response.raise_for_status()
        reading: dict[str, Any] = await response.json()
        return reading


async def _read_sites(
    session: aiohttp.ClientSession, admin: str, started: float, state: _State
) -> None:
    """The source lines holding the most traced memory, now (a snapshot of every
    trace in the EPP: seconds, not the sample's milliseconds)."""
    try:
        reading = await _memory(session, admin, SITES_READ)
    except (aiohttp.ClientError, TimeoutError, ValueError):
        state.sample_failures += 1
        return
    state.site_readings.append({"t_s": time.monotonic() - started, "sites": reading["sites"]})


async def _take_sample(
    session: aiohttp.ClientSession,
    admin: str,
    pid: int,
    load: OpenLoop,
    started: float,
    previous: dict[str, Any],
    state: _State,
) -> None:
    """A sample, unless the EPP does not answer: then the run goes on (its end
    says whether the EPP survived) with one sample fewer."""
    try:
        state.samples.append(await _sample(session, admin, pid, load, started, previous))
    except (aiohttp.ClientError, TimeoutError, ValueError):
        state.sample_failures += 1


def _fault_s(options: SoakOptions) -> float:
    """How long one fault lasts (a kill: no time of its own)."""
    return {"freeze": options.freeze_s, "stall": options.stall_s}.get(options.fault, 0.0)


async def _stall(pod: Pod, stalled: bool) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"http://{pod.address}/sim/stall",
            json={"stalled": stalled},
            timeout=aiohttp.ClientTimeout(total=10),
        ) as response,
    ):
        response.raise_for_status()


async def _churn(
    options: SoakOptions, pods: Pods, started: float, state: _State, stop: asyncio.Event
) -> None:
    names = list(pods.pods)
    turn = 0
    # A freeze or a stall starts every churn interval: its time is part of it.
    pause_s = options.churn_interval_s - _fault_s(options)
    while True:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), pause_s)
            return
        name = names[turn % len(names)]
        turn += 1
        if options.fault == "freeze":
            state.freezes.append(time.monotonic() - started)
            pods.freeze(name)
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), options.freeze_s)
            finally:
                pods.thaw(name)
            if stop.is_set():
                return
            continue
        if options.fault == "stall":
            state.stalls.append(time.monotonic() - started)
            await _stall(pods[name], True)
            try:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), options.stall_s)
            finally:
                await _stall(pods[name], False)
            if stop.is_set():
                return
            continue
        state.kills.append(time.monotonic() - started)
        await asyncio.to_thread(pods.kill, name)
        try:
            await asyncio.to_thread(pods.start, name)
        except ProcessFailed as exc:
            # A pod that does not come back (its port taken meanwhile, say) stays
            # down until its next turn; the run goes on and the report says so.
            state.restart_failures.append(f"{name}: {exc}".splitlines()[0])
            continue
        state.restarts_ready.append(time.monotonic() - started)


async def _run(
    options: SoakOptions, pods: Pods, url: str, admin: str, pid: int
) -> tuple[_State, list[Outcome], float]:
    space = PrefixSpace(
        options.groups, options.system_len, options.question_len, options.skew, options.seed
    )
    load = OpenLoop(
        url,
        space,
        options.rate,
        seed=options.seed,
        max_tokens=options.output_tokens,
        timeout_s=options.request_timeout_s,
    )
    state = _State()
    duration_s = options.minutes * 60.0
    stop = asyncio.Event()
    bar = tqdm(total=round(duration_s), desc="soak", unit="s") if options.progress else None
    async with aiohttp.ClientSession() as session:
        previous: dict[str, Any] = {}
        started = state.started = time.monotonic()
        # The histograms' counts before the load: the first window starts here.
        await _sample(session, admin, pid, load, started, previous)
        sending = asyncio.create_task(load.run())
        churn = (
            asyncio.create_task(_churn(options, pods, started, state, stop))
            if options.churn_interval_s > 0
            else None
        )
        next_sample = started + options.sample_interval_s
        site_readings = [started + f * duration_s for f in SITE_READINGS_AT]
        shown = 0
        try:
            while (now := time.monotonic()) < started + duration_s:
                await asyncio.sleep(min(1.0, max(0.0, next_sample - now)))
                now = time.monotonic()
                if now >= next_sample:
                    await _take_sample(session, admin, pid, load, started, previous, state)
                    next_sample += options.sample_interval_s
                if options.trace_memory_frames and site_readings and now >= site_readings[0]:
                    # Readings that came due meanwhile (a slow snapshot on a busy
                    # host) are this one: they would only repeat it.
                    while site_readings and now >= site_readings[0]:
                        site_readings.pop(0)
                    await _read_sites(session, admin, started, state)
                if bar is not None:
                    elapsed = min(round(now - started), round(duration_s))
                    bar.update(elapsed - shown)
                    shown = elapsed
                    failed = sum(not o.ok for o in load.outcomes)
                    last = state.samples[-1] if state.samples else None
                    bar.set_postfix(
                        req=len(load.outcomes),
                        errors=failed,
                        rss_mb=round((last.rss_bytes or 0) / 2**20) if last else "-",
                        kills=len(state.kills),
                        refresh=False,
                    )
        finally:
            stop.set()
            load.stop()
            if churn is not None:
                await churn
            outcomes = await sending
            if bar is not None:
                bar.close()
        # The last partial interval, answers of the last requests included.
        await _take_sample(session, admin, pid, load, started, previous, state)
        if options.trace_memory_frames:
            await _read_sites(session, admin, started, state)
    return state, outcomes, time.monotonic() - started


async def run_soak_async(options: SoakOptions) -> dict[str, Any]:
    out = options.out_dir
    out.mkdir(parents=True, exist_ok=True)
    sim_args = [
        "--hash-seed", "0",
        "--time-scale", repr(options.time_scale),
        "--output-tokens", str(options.output_tokens),
        "--num-gpu-blocks", str(options.num_gpu_blocks),
    ]  # fmt: skip
    pods = Pods(out / "pods", options.pods, sim_args)
    stops = []
    try:
        await asyncio.to_thread(pods.start)
        endpoints = pods.endpoints_file(out / "endpoints.yaml")
        config = out / "config.yaml"
        if options.config is None:
            config.write_text(
                yaml.safe_dump(soak_config(options.max_index_entries), sort_keys=False)
            )
        else:
            config.write_text(options.config.read_text(encoding="utf-8"))
        epp, ports = await asyncio.to_thread(
            start_epp_on_free_ports,
            endpoints,
            out / "epp",
            config,
            ["--debug-endpoints", *options.epp_args]
            + (
                ["--trace-memory", str(options.trace_memory_frames)]
                if options.trace_memory_frames
                else []
            ),
        )
        stops.append(epp.stop)
        assert epp.process is not None
        listen = free_port()
        envoy = await asyncio.to_thread(
            start_envoy,
            envoy_config(listen_port=listen, epp_port=ports.grpc, admin_port=free_port()),
            out / "envoy",
        )
        stops.append(envoy.stop)
        state, outcomes, wall_s = await _run(
            options,
            pods,
            f"http://127.0.0.1:{listen}",
            f"http://127.0.0.1:{ports.metrics}",
            epp.process.pid,
        )
        epp_alive = epp.process.poll() is None
    finally:
        for stop in reversed(stops):
            await asyncio.to_thread(stop)
        await asyncio.to_thread(pods.stop)
    document = {
        **provenance(options.command),
        "options": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in asdict(options).items()
            if k not in ("out_dir", "command", "progress")
        },
        "wall_s": wall_s,
        "epp_alive_at_end": epp_alive,
        "summary": summarize(state, outcomes, options.freeze_s, options.stall_s),
        "kills_s": state.kills,
        "freezes_s": state.freezes,
        "stalls_s": state.stalls,
        "restarted_s": state.restarts_ready,
        "restart_failures": state.restart_failures,
        "sample_failures": state.sample_failures,
        "samples": [asdict(s) for s in state.samples],
        "site_readings": state.site_readings,
    }
    (out / "results.json").write_text(json.dumps(document, indent=1) + "\n")
    plots = [p for p in (plot(document, out),) if p is not None]
    (out / "report.md").write_text(report(document, plots))
    return document


def _slope(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of (x, y) points (None for fewer than two)."""
    if len(points) < 2:
        return None
    mean_x = sum(x for x, _ in points) / len(points)
    mean_y = sum(y for _, y in points) / len(points)
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    if spread == 0:
        return None
    return sum((x - mean_x) * (y - mean_y) for x, y in points) / spread


def _second_half_slope(points: Sequence[tuple[float, float]]) -> float | None:
    """The slope, per minute, of the points in the second half of the run (x in
    seconds)."""
    half = [(t, y) for t, y in points if t >= points[-1][0] / 2] if points else []
    slope = _slope(half)
    return None if slope is None else slope * 60.0


def growing_sites(readings: Sequence[dict[str, Any]], count: int = 10) -> list[dict[str, Any]]:
    """The source lines whose traced memory grew most over the second half of the
    run: from the first reading of the sites at or after half the last one's time
    to the last (a line absent from a reading: under that reading's top lines,
    counted as nothing there, so its growth is an upper bound)."""
    if len(readings) < 2:
        return []
    end = readings[-1]
    start = next(r for r in readings if r is end or r["t_s"] >= end["t_s"] / 2)
    if start is end:
        start = readings[-2]
    first = {site["site"]: site for site in start["sites"]}
    last = end["sites"]
    grown = [
        {
            "site": site["site"],
            "t_first_s": start["t_s"],
            "t_last_s": end["t_s"],
            "bytes_first": first[site["site"]]["bytes"] if site["site"] in first else None,
            "bytes_last": site["bytes"],
            "growth_bytes": site["bytes"] - first.get(site["site"], {"bytes": 0})["bytes"],
            "blocks_last": site["blocks"],
        }
        for site in last
    ]
    grown.sort(key=lambda g: -g["growth_bytes"])
    return [g for g in grown[:count] if g["growth_bytes"] > 0]


def summarize(
    state: _State, outcomes: Sequence[Outcome], freeze_s: float = 0.0, stall_s: float = 0.0
) -> dict[str, Any]:
    samples = state.samples
    rss = [(s.t_s, s.rss_bytes / 2**20) for s in samples if s.rss_bytes is not None]
    malloc = [
        (s.t_s, s.malloc_in_use_bytes / 2**20) for s in samples if s.malloc_in_use_bytes is not None
    ]
    blocks = [(s.t_s, float(s.python_blocks)) for s in samples if s.python_blocks is not None]
    traced = [(s.t_s, s.traced_bytes / 2**20) for s in samples if s.traced_bytes is not None]
    quarter = max(1, len(samples) // 4)
    first, last = samples[:quarter], samples[-quarter:]
    started = state.started
    failed = [o for o in outcomes if not o.ok]

    def at_kill(o: Outcome) -> bool:
        t = o.started - started
        return any(k - (o.latency_s + 1.0) <= t <= k + CHURN_WINDOW_S for k in state.kills)

    windows = [(f, f + freeze_s) for f in state.freezes]
    windows += [(f, f + stall_s) for f in state.stalls]

    def in_fault(o: Outcome, after_s: float) -> bool:
        # In flight at some moment of a freeze or stall, or sent up to `after_s`
        # after it.
        t = o.started - started
        return any(f - o.latency_s <= t <= end + after_s for f, end in windows)

    around = [o for o in failed if at_kill(o) or in_fault(o, CHURN_WINDOW_S)]
    held = [o for o in outcomes if o.ok and o.latency_s > HELD_S and in_fault(o, 0.0)]
    errors: dict[str, int] = {}
    for o in failed:
        errors[o.error or "error"] = errors.get(o.error or "error", 0) + 1
    bound = max((s.index_max_entries for s in samples), default=0.0)
    largest = max((s.index_entries for s in samples), default=0.0)
    # A quarter's p99 is the median of its intervals' p99s (intervals without
    # picks skipped): one slow interval, a warm-up or a kill, does not make a quarter.
    pick_first, pick_last = (
        median([s.pick_p99_s for s in first]),
        median([s.pick_p99_s for s in last]),
    )
    return {
        "requests": len(outcomes),
        "ok": len(outcomes) - len(failed),
        "errors": len(failed),
        "errors_around_kills": len(around),
        "errors_other": len(failed) - len(around),
        "error_kinds": errors,
        "kills": len(state.kills),
        "freezes": len(state.freezes),
        "stalls": len(state.stalls),
        "held_by_freezes": len(held),
        "rss_start_mb": rss[0][1] if rss else None,
        "rss_end_mb": rss[-1][1] if rss else None,
        "rss_max_mb": max((mb for _, mb in rss), default=None),
        "rss_slope_second_half_mb_per_min": _second_half_slope(rss),
        "malloc_in_use_start_mb": malloc[0][1] if malloc else None,
        "malloc_in_use_end_mb": malloc[-1][1] if malloc else None,
        "malloc_in_use_slope_second_half_mb_per_min": _second_half_slope(malloc),
        "python_blocks_start": blocks[0][1] if blocks else None,
        "python_blocks_end": blocks[-1][1] if blocks else None,
        "python_blocks_slope_second_half_per_min": _second_half_slope(blocks),
        "traced_start_mb": traced[0][1] if traced else None,
        "traced_end_mb": traced[-1][1] if traced else None,
        "traced_slope_second_half_mb_per_min": _second_half_slope(traced),
        "growing_sites": growing_sites(state.site_readings),
        "index_max_entries_seen": largest,
        "index_bound": bound,
        "index_within_bound": largest <= bound if bound else None,
        "index_evicted_entries": samples[-1].index_evicted_entries if samples else 0,
        "pick_p99_first_quarter_s": pick_first,
        "pick_p99_last_quarter_s": pick_last,
        "pick_p99_drift": (pick_last / pick_first) if pick_first and pick_last else None,
        "processing_p99_first_quarter_s": median([s.processing_p99_s for s in first]),
        "processing_p99_last_quarter_s": median([s.processing_p99_s for s in last]),
        "latency_p99_s": percentile([o.latency_s for o in outcomes if o.ok], 0.99),
        "kv_gaps": samples[-1].kv_gaps if samples else 0,
        "kv_replays": samples[-1].kv_replays if samples else 0,
        "kv_engine_restarts_seen": samples[-1].kv_restarts if samples else 0,
        "in_flight_at_end": samples[-1].in_flight if samples else None,
    }


def plot(document: dict[str, Any], out: Path) -> str | None:
    samples = document["samples"]
    if not samples:
        return None
    # Imported here: `python -m bench --help` should not pay for matplotlib.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [s["t_s"] / 60 for s in samples]
    fig, axes = plt.subplots(2, 2, figsize=(12, 7.5), sharex=True)
    (rss_ax, index_ax), (pick_ax, load_ax) = axes
    rss_ax.plot(
        minutes, [(s["rss_bytes"] or 0) / 2**20 for s in samples], color="tab:blue", label="RSS"
    )
    for key, label, color in (
        ("malloc_in_use_bytes", "C allocator in use", "tab:green"),
        ("traced_bytes", "Python allocations (traced)", "tab:orange"),
    ):
        if any(s.get(key) is not None for s in samples):
            rss_ax.plot(
                minutes,
                [None if s.get(key) is None else s[key] / 2**20 for s in samples],
                color=color,
                label=label,
            )
    rss_ax.set_ylabel("EPP memory (MiB)")
    rss_ax.set_title("Memory")
    rss_ax.legend()
    index_ax.set_ylabel("index (block, pod) entries")
    index_ax.set_title("Prefix index size and its bound")
    if document["summary"]["index_within_bound"] is None:
        index_ax.text(
            0.5, 0.5, "no precise index in this config", ha="center", transform=index_ax.transAxes
        )
    else:
        index_ax.plot(minutes, [s["index_entries"] for s in samples], label="entries")
        index_ax.plot(
            minutes, [s["index_max_entries"] for s in samples], linestyle="--", label="bound"
        )
        index_ax.legend()
    for key, label in (
        ("pick_p99_s", "pick (scheduler)"),
        ("processing_p99_s", "all the EPP adds"),
    ):
        pick_ax.plot(
            minutes,
            [None if s[key] is None else s[key] * 1000 for s in samples],
            marker=".",
            label=label,
        )
    pick_ax.set_ylabel("p99 per interval (ms)")
    pick_ax.set_title("Pick latency")
    pick_ax.legend()
    load_ax.plot(minutes, [s["requests_ok"] / s["window_s"] for s in samples], label="ok/s")
    load_ax.plot(minutes, [s["requests_failed"] / s["window_s"] for s in samples], label="failed/s")
    load_ax.set_ylabel("requests per second")
    load_ax.set_title("Requests")
    load_ax.legend()
    for ax in axes.flat:
        ax.grid(True, alpha=0.3)
        for kill in document["kills_s"]:
            ax.axvline(kill / 60, color="tab:red", alpha=0.35, linewidth=0.8)
        for key, length in (("freezes_s", "freeze_s"), ("stalls_s", "stall_s")):
            for start in document.get(key, ()):
                end = start + document["options"][length]
                ax.axvspan(start / 60, end / 60, color="tab:blue", alpha=0.15)
    if document.get("freezes_s"):
        label = "minutes (blue: a pod frozen)"
    elif document.get("stalls_s"):
        label = "minutes (blue: a pod's engine stalled)"
    else:
        label = "minutes (red lines: a pod killed and restarted)"
    for ax in axes[1]:
        ax.set_xlabel(label)
    fig.tight_layout()
    fig.savefig(out / "soak.png", dpi=110)
    plt.close(fig)
    return "soak.png"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _kib(value: int | None) -> float | None:
    return None if value is None else value / 1024


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.2f} ms"


def report(document: dict[str, Any], plots: Sequence[str] = ()) -> str:
    o, s = document["options"], document["summary"]
    if s.get("freezes"):
        churn = (
            f"a pod frozen for {o['freeze_s']:g} s every {o['churn_interval_s']:g} s"
            f" ({s['freezes']} freezes)"
        )
    elif s.get("stalls"):
        churn = (
            f"a pod's engine stalled for {o['stall_s']:g} s every {o['churn_interval_s']:g} s"
            f" ({s['stalls']} stalls)"
        )
    else:
        churn = f"a pod restarted every {o['churn_interval_s']:g} s ({s['kills']} kills)"
    extra = f", `epp serve {shlex.join(o['epp_args'])}`" if o.get("epp_args") else ""
    fault = "freeze" if s.get("freezes") else "stall" if s.get("stalls") else "kill"
    lines = [
        f"Soak: {o['minutes']:g} min at {o['rate']:g} req/s, {o['pods']} pods, {churn},"
        f" {o['groups']} prefix groups, {document['machine']['cpus']} CPUs{extra}",
        "",
        "| what | start | end | |",
        "|---|---:|---:|---|",
        f"| EPP RSS | {_fmt(s['rss_start_mb'], '.1f')} MiB | {_fmt(s['rss_end_mb'], '.1f')} MiB"
        f" | max {_fmt(s['rss_max_mb'], '.1f')} MiB; second-half slope"
        f" {_fmt(s['rss_slope_second_half_mb_per_min'], '+.2f')} MiB/min |",
        f"| pick p99 (median interval, first / last quarter) | {_ms(s['pick_p99_first_quarter_s'])}"
        f" | {_ms(s['pick_p99_last_quarter_s'])} | drift x{_fmt(s['pick_p99_drift'], '.2f')} |",
        f"| EPP processing p99 | {_ms(s['processing_p99_first_quarter_s'])}"
        f" | {_ms(s['processing_p99_last_quarter_s'])} | |",
        (
            f"| index entries | | {s['index_max_entries_seen']:,.0f} (largest)"
            f" | bound {s['index_bound']:,.0f}:"
            f" {'within' if s['index_within_bound'] else 'EXCEEDED'};"
            f" {s['index_evicted_entries']:,.0f} evicted by it |"
            if s["index_within_bound"] is not None
            else "| precise index | | | none in this config |"
        ),
    ]
    for what, start, end, slope, unit in (
        ("C allocator in use", "malloc_in_use_start_mb", "malloc_in_use_end_mb",
         "malloc_in_use_slope_second_half_mb_per_min", "MiB"),
        ("Python's small blocks", "python_blocks_start", "python_blocks_end",
         "python_blocks_slope_second_half_per_min", ""),
        ("Python allocations (traced)", "traced_start_mb", "traced_end_mb",
         "traced_slope_second_half_mb_per_min", "MiB"),
    ):  # fmt: skip
        if s.get(end) is None:
            continue  # an older run, or not measured (not glibc, not tracing)
        spec = ".1f" if unit else ",.0f"
        space = " " if unit else ""
        lines.append(
            f"| {what} | {_fmt(s[start], spec)}{space}{unit} | {_fmt(s[end], spec)}{space}{unit}"
            f" | second-half slope {_fmt(s[slope], '+.3f' if unit else '+,.0f')}"
            f" {unit + '/min' if unit else 'a minute'} |"
        )
    lines += [
        "",
        f"Requests: {s['requests']}, ok {s['ok']}, errors {s['errors']} ({s['errors_around_kills']}"
        f" around a pod {fault}, {s['errors_other']} other;"
        f" {s['error_kinds'] or 'none'})"
        + (
            f"; held over {HELD_S:g} s by a {'frozen' if fault == 'freeze' else 'stalled'} pod:"
            f" {s['held_by_freezes']}"
            if fault != "kill"
            else ""
        )
        + ". Client p99"
        f" end to end {_fmt(s['latency_p99_s'], '.3f')} s. KV events: {s['kv_gaps']:g} gaps,"
        f" {s['kv_replays']:g} replays, {s['kv_engine_restarts_seen']:g} engine restarts seen."
        f" In flight at the end: {_fmt(s['in_flight_at_end'], 'g')}. EPP alive at the end:"
        f" {'yes' if document['epp_alive_at_end'] else 'NO'}.",
    ]
    grown = s.get("growing_sites") or []
    if grown:
        start_min, end_min = grown[0]["t_first_s"] / 60, grown[0]["t_last_s"] / 60
        lines += [
            "",
            f"Source lines whose traced memory grew most from minute {start_min:.1f}"
            f" to minute {end_min:.1f} (of the {SITES_READ} holding the most at"
            " each reading; a line not among them at the first counts from nothing):",
            "",
            "| line | first KiB | last KiB | growth KiB | blocks |",
            "|---|---:|---:|---:|---:|",
        ]
        lines += [
            f"| `{g['site']}` | {_fmt(_kib(g['bytes_first']), ',.0f')}"
            f" | {_kib(g['bytes_last']):,.0f} | {_kib(g['growth_bytes']):+,.0f}"
            f" | {g['blocks_last']:,} |"
            for g in grown
        ]
    if document["restart_failures"] or document["sample_failures"]:
        lines += [
            "",
            f"Pods that did not come back: {document['restart_failures'] or 'none'}; samples"
            f" the EPP did not answer: {document['sample_failures']}.",
        ]
    lines += [""] + [f"![{p}]({p})" for p in plots]
    if document["command"]:
        lines += ["", f"`{document['command']}`"]
    return "\n".join(lines) + "\n"


def run_soak(options: SoakOptions) -> dict[str, Any]:
    return asyncio.run(run_soak_async(options))


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "soak",
        help="a long steady load with pod restarts: EPP memory, index size, latency drift",
        description="Run a steady load with pod churn through Envoy and the EPP for --minutes,"
        " sampling the EPP's RSS, index size against its bound, p99 pick latency and errors."
        " Writes results.json, report.md and soak.png.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--pods", type=int, default=4)
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second")
    parser.add_argument("--groups", type=int, default=20_000, help="prefix groups")
    parser.add_argument("--system-len", type=int, default=256, help="tokens")
    parser.add_argument("--question-len", type=int, default=32, help="tokens")
    parser.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of the groups")
    parser.add_argument(
        "--churn-interval",
        type=float,
        default=60.0,
        help="seconds between pod faults (0: none)",
    )
    parser.add_argument(
        "--fault",
        choices=FAULTS,
        default="kill",
        help="what churn does to a pod: kill it (SIGKILL) and start it again, freeze it"
        " (SIGSTOP: connections accepted, nothing answered) for --freeze-seconds, or stall"
        " its engine (the server answers, /metrics included) for --stall-seconds",
    )
    parser.add_argument(
        "--freeze-seconds", type=float, default=10.0, help="how long a frozen pod stays frozen"
    )
    parser.add_argument(
        "--stall-seconds",
        type=float,
        default=45.0,
        help="how long a stalled engine stays stopped (the EPP's --stall-threshold is 30s)",
    )
    parser.add_argument("--sample-interval", type=float, default=5.0, help="seconds")
    parser.add_argument(
        "--max-index-entries",
        type=int,
        default=12_000,
        help="the index bound (below the pods' total KV blocks, so it is exercised)",
    )
    parser.add_argument("--num-gpu-blocks", type=int, default=4_000, help="per pod")
    parser.add_argument("--time-scale", type=float, default=0.05, help="the pods' time scale")
    parser.add_argument(
        "--trace-memory",
        type=int,
        default=0,
        metavar="FRAMES",
        help="run the EPP with --trace-memory FRAMES and report the source lines whose"
        " memory grew (costs the EPP CPU: its latency figures are then not comparable)",
    )
    parser.add_argument(
        "--config",
        type=Path,
        help="the EPP's config file (default: precise prefix routing with load scorers;"
        " manifests/config/default.yaml is what `epp serve` runs without one)",
    )
    parser.add_argument(
        "--epp-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one more `epp serve` argument (repeat it: --epp-arg=--metrics-staleness-threshold"
        " --epp-arg=1h)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("out/soak"))
    parser.add_argument("--no-progress", action="store_true")


def command(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if args.minutes <= 0 or args.pods < 1 or args.rate <= 0 or args.sample_interval <= 0:
        print(
            "error: --minutes, --pods, --rate and --sample-interval must be positive",
            file=sys.stderr,
        )
        return 2
    if not 0 <= args.trace_memory <= MAX_FRAMES:
        print(f"error: --trace-memory must be from 0 (off) to {MAX_FRAMES}", file=sys.stderr)
        return 2
    for fault, seconds in (("freeze", args.freeze_seconds), ("stall", args.stall_seconds)):
        if (
            args.fault == fault
            and args.churn_interval > 0
            and not 0 < seconds < args.churn_interval
        ):
            print(
                f"error: --{fault}-seconds must be positive and shorter than --churn-interval",
                file=sys.stderr,
            )
            return 2
    if args.config is not None and not args.config.is_file():
        print(f"error: --config {args.config}: no such file", file=sys.stderr)
        return 2
    options = SoakOptions(
        out_dir=args.out,
        minutes=args.minutes,
        pods=args.pods,
        rate=args.rate,
        groups=args.groups,
        system_len=args.system_len,
        question_len=args.question_len,
        skew=args.skew,
        churn_interval_s=args.churn_interval,
        fault=args.fault,
        freeze_s=args.freeze_seconds,
        stall_s=args.stall_seconds,
        sample_interval_s=args.sample_interval,
        max_index_entries=args.max_index_entries,
        num_gpu_blocks=args.num_gpu_blocks,
        time_scale=args.time_scale,
        trace_memory_frames=args.trace_memory,
        config=args.config,
        epp_args=tuple(args.epp_arg),
        seed=args.seed,
        progress=not args.no_progress and sys.stderr.isatty(),
        command="python -m bench " + shlex.join(argv),
    )
    with contextlib.suppress(KeyboardInterrupt):
        document = run_soak(options)
        print(report(document), end="")
        print(f"results: {args.out / 'results.json'}, {args.out / 'report.md'}")
        summary = document["summary"]
        healthy = (
            document["epp_alive_at_end"]
            and summary["errors_other"] == 0
            and summary["index_within_bound"] is not False
        )
        return 0 if healthy else 1
    print("\ninterrupted: everything started was stopped", file=sys.stderr)
    return 130


__all__ = ["SoakOptions", "add_parser", "command", "report", "run_soak", "summarize"]
