"""`python -m bench.lab.calibrate`: what the real stack adds to a request's TTFT
outside the engine, to set the lab's delays from.

Every path (straight to a simulated pod; through Envoy and `epp serve` with a
config; through a peer router), each on a fresh fleet of one pod, is up at once,
and requests are sent one at a time (nothing queues), in rounds: each round one
chat request of a prompt nobody has sent before goes down every path, in an order
drawn afresh each round, so a host whose speed drifts (a shared machine's does,
by tens of percent within minutes) slows every path alike. For each request the
client's TTFT (sent to first token) and the engine's own
(`vllm:time_to_first_token_seconds`: from the engine taking the request to its
first token, read from the pod's /metrics before and after) are measured; their
difference is the time spent outside the engine: the client, the router, HTTP,
the pod's parsing, chat template and tokenization, and the first chunk's way
back. A line a + b x prompt tokens is fitted per path through the two sizes'
medians. The direct path's line is the pod's own overhead; a router's is the
direct line plus what the router adds. What one router adds over another is
read from the rounds themselves: the median of the per-round differences, with a
95% bootstrap interval (`paired`, against round-robin's path), much tighter than
the difference of two medians.

Then the two staleness delays (`Delays.kv_event_s`, `Delays.metrics_latency_s`),
from the EPP's own histograms: Envoy and `epp serve` with the `precise-prefix`
config (which follows the pods' KV events) in front of a small fleet under a
moderate open-loop load of chat requests sharing a few long prefixes. Before and
after the load the EPP's /metrics is read; over the load's window:

- `epp_kv_event_lag_seconds`: a live KV-event batch's `ts` to the batch applied
  to the index, both on this host's wall clock (no skew). The simulated pod
  stamps time.time() as it sends the step's events, after the step, where recent
  vLLM stamps them too (`Scheduler.update_from_output`; older versions stamped
  and published in `schedule`, before the forward pass). vLLM then hands the
  batch to its publisher thread, which encodes and sends it; the simulator
  encodes and sends at once: the simulator adds no delay of its own, and vLLM's
  thread hop (a queue, and the GIL of a busy engine process) is not in these
  figures;
- `epp_metrics_scrape_duration_seconds`: a scrape of one pod started to its facts
  in the datastore.

Median and p90 are interpolated within the histograms' buckets (as Prometheus'
histogram_quantile does), so they are as fine as the buckets; the mean is exact
(sum / count). Both figures include every wait on a loaded event loop: on a
machine busy with other work they are high (the load average is recorded before
and after).

    python -m bench.lab.calibrate --out docs/results/lab-calibration
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import shlex
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from bench.client import Record, send
from bench.provenance import provenance
from bench.runner import (
    RunOptions,
    data_path,
    resolve_policy,
)
from bench.workloads import WorkloadSpec, default_tokenizer_dir, load_words
from epp.sources.metrics import read_series

SIZES = (128, 2048)
TTFT = "vllm:time_to_first_token_seconds"
PATHS = ("direct", "round-robin", "default", "precise-prefix", "sglang-router")
PARTS = ("paths", "staleness")

# The staleness part: the config that follows KV events, and the EPP's histograms
# of the two delays (docs/precise-prefix.md, README.md).
STALENESS_POLICY = "precise-prefix"
KV_EVENT_LAG = "epp_kv_event_lag_seconds"
KV_EVENT_LAG_NEGATIVE = "epp_kv_event_lag_negative"
SCRAPE_DURATION = "epp_metrics_scrape_duration_seconds"


def _engine_ttft(address: str) -> tuple[float, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10.0) as response:
        page = response.read()
    total = sum(s.value for s in read_series(page, TTFT + "_sum").samples)
    count = sum(s.value for s in read_series(page, TTFT + "_count").samples)
    return total, count


async def _measure(
    targets: dict[str, tuple[str, str]], bodies: list[bytes], rng: random.Random
) -> dict[str, list[float]]:
    """Outside-the-engine time of each request down each path (name -> (url, pod
    address)), sent one at a time: request i goes down every path in round i, in
    an order drawn for the round."""
    out: dict[str, list[float]] = {name: [] for name in targets}
    names = list(targets)
    async with aiohttp.ClientSession() as http:
        for i, body in enumerate(bodies):
            rng.shuffle(names)
            for name in names:
                url, address = targets[name]
                before = _engine_ttft(address)
                record = Record(session=i, turn=0, group=-1, scheduled_s=0.0)
                await send(http, f"{url}/v1/chat/completions", body, record, 1.0, 60.0)
                after = _engine_ttft(address)
                if not record.ok or record.ttft_s is None or after[1] != before[1] + 1:
                    raise RuntimeError(
                        f"request {i} on {name} ({url}): {record.error or 'no TTFT'}"
                    )
                out[name].append(record.ttft_s - (after[0] - before[0]))
    return out


def paired(
    values: Sequence[float], reference: Sequence[float], rng: random.Random, draws: int = 2000
) -> dict[str, float]:
    """The median of the per-round differences `values[i] - reference[i]`, and its
    95% interval by the bootstrap (`draws` resamples of the rounds)."""
    if len(values) != len(reference) or not values:
        raise ValueError("paired needs two equally long, non-empty series of rounds")
    differences = [v - r for v, r in zip(values, reference, strict=True)]
    medians = sorted(
        statistics.median(rng.choices(differences, k=len(differences))) for _ in range(draws)
    )
    return {
        "median_s": statistics.median(differences),
        "low_s": medians[int(0.025 * draws)],
        "high_s": medians[int(0.975 * draws) - 1],
    }


def _fit(points: dict[int, float]) -> tuple[float, float]:
    (x0, y0), (x1, y1) = sorted(points.items())
    slope = (y1 - y0) / (x1 - x0)
    return y0 - slope * x0, slope


def run(
    out: Path,
    requests: int,
    command: str,
    parts: tuple[str, ...] = PARTS,
    staleness: StalenessLoad | None = None,
    paths: Sequence[str] = PATHS,
) -> dict[str, Any]:
    document: dict[str, Any] = {}
    if "paths" in parts:
        document.update(measure_paths(out, requests, command, paths))
    if "staleness" in parts:
        document["staleness"] = measure_staleness(staleness or StalenessLoad())
    document = {**provenance(command), **document}
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    return document


def measure_paths(
    out: Path, requests: int, command: str, names: Sequence[str] = PATHS
) -> dict[str, Any]:
    """The fixed and per-token cost of each path outside the engine, and what each
    adds over round-robin's, round by round."""
    tokenizer = default_tokenizer_dir()
    words = load_words(tokenizer)
    rng = random.Random("calibrate")
    warmup = 5
    bodies = {
        size: [
            json.dumps(
                {
                    "model": "sim-model",
                    "messages": [{"role": "user", "content": words.text(rng, size)}],
                    "max_tokens": 4,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            ).encode()
            for _ in range(requests + warmup)
        ]
        for size in SIZES
    }
    options = RunOptions(
        out=out,
        workload=WorkloadSpec("shared-prefix"),
        policies=[],
        ladder=[],
        pods=1,
        tokenizer=tokenizer,
        progress=False,
        command=command,
    )
    samples: dict[str, dict[int, list[float]]] = {name: {} for name in names}
    with contextlib.ExitStack() as stack:
        targets: dict[str, tuple[str, str]] = {}
        for name in names:
            policy = resolve_policy("round-robin" if name == "direct" else name)
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="calibrate-"))
            path = stack.enter_context(data_path(policy, options, Path(workdir)))
            address = path.pods[0][1]
            targets[name] = (f"http://{address}" if name == "direct" else path.url, address)
        for size in SIZES:
            measured = asyncio.run(_measure(targets, bodies[size], rng))
            for name, values in measured.items():
                samples[name][size] = values[warmup:]
    paths: dict[str, Any] = {}
    for name in names:
        medians = {size: statistics.median(values) for size, values in samples[name].items()}
        a, b = _fit(medians)
        paths[name] = {
            "median_s": {str(k): v for k, v in medians.items()},
            "fixed_s": a,
            "per_token_s": b,
            "samples_s": {str(k): [round(v, 6) for v in vs] for k, vs in samples[name].items()},
        }
    direct = paths.get("direct")
    for path in paths.values():
        if direct is not None:
            path["added_fixed_s"] = path["fixed_s"] - direct["fixed_s"]
            path["added_per_token_s"] = path["per_token_s"] - direct["per_token_s"]
    if "round-robin" in samples:
        reference = samples["round-robin"]
        draws = random.Random("calibrate-bootstrap")
        for name, path in paths.items():
            path["over_round_robin_s"] = {
                str(size): paired(values, reference[size], draws)
                for size, values in samples[name].items()
            }
    return {
        "sizes": list(SIZES),
        "requests": requests,
        "method": "interleaved",
        "paths": paths,
    }


# -- the staleness delays ---------------------------------------------------------------------


@dataclass(frozen=True)
class StalenessLoad:
    """The fleet and the load the two staleness delays are measured under."""

    pods: int = 4
    rate: float = 8.0  # requests per second, Poisson arrivals
    duration_s: float = 20.0
    groups: int = 8  # distinct shared prefixes
    prefix_tokens: int = 512  # about; words of the tokenizer, one token each
    suffix_tokens: int = 64
    max_tokens: int = 32


@dataclass(frozen=True)
class Histogram:
    """A Prometheus histogram read off a page, summed over its labels other than
    `le`: the cumulative count at each upper bound (+Inf last), the sum."""

    buckets: tuple[tuple[float, float], ...]
    total: float

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    def minus(self, before: Histogram) -> Histogram:
        """The observations made between `before` and this one."""
        if not before.buckets:
            return self
        earlier = dict(before.buckets)
        return Histogram(
            tuple((le, count - earlier.get(le, 0.0)) for le, count in self.buckets),
            self.total - before.total,
        )

    def quantile(self, q: float) -> float | None:
        """Prometheus' histogram_quantile: linear within the bucket the q-th
        observation falls in, from 0 for the first; the highest finite bound if it
        falls in +Inf. None without observations."""
        if self.count <= 0:
            return None
        rank = q * self.count
        lower, below = 0.0, 0.0
        for le, count in self.buckets:
            if count >= rank:
                if math.isinf(le):
                    return lower
                return lower + (le - lower) * (rank - below) / (count - below)
            lower, below = le, count
        return lower

    def summary(self) -> dict[str, Any]:
        count = self.count
        return {
            "count": int(count),
            "median_s": self.quantile(0.5),
            "p90_s": self.quantile(0.9),
            "mean_s": self.total / count if count else None,
            # le -> observations <= le, as the page has them (cumulative).
            "buckets": {"+Inf" if math.isinf(le) else repr(le): int(n) for le, n in self.buckets},
        }


def read_histogram(page: str, name: str) -> Histogram:
    """Histogram `name` of a Prometheus text page (empty if it is not there)."""
    by_le: dict[float, float] = {}
    total = 0.0
    for family in text_string_to_metric_families(page):
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name == f"{name}_bucket":
                le = float(sample.labels["le"])
                by_le[le] = by_le.get(le, 0.0) + sample.value
            elif sample.name == f"{name}_sum":
                total += sample.value
    return Histogram(tuple(sorted(by_le.items())), total)


def read_counter(page: str, name: str) -> float:
    """Counter `name` (without `_total`) summed over its labels; 0 if absent."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(page)
        if family.name == name
        for sample in family.samples
        if sample.name == f"{name}_total"
    )


def read_gauge(page: str, name: str) -> float:
    """Gauge `name` summed over its labels; 0 if absent."""
    return sum(
        sample.value
        for family in text_string_to_metric_families(page)
        if family.name == name
        for sample in family.samples
        if sample.name == name
    )


def _page(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10.0) as response:
        text: str = response.read().decode("utf-8")
    return text


@contextlib.contextmanager
def _precise_stack(load: StalenessLoad, workdir: Path) -> Iterator[tuple[str, str]]:
    """Pods publishing KV events, `epp serve` with the precise-prefix config, Envoy:
    yields the URL clients send to and the EPP's /metrics URL."""
    policy = resolve_policy(STALENESS_POLICY)
    options = RunOptions(
        out=workdir,
        workload=WorkloadSpec("shared-prefix"),
        policies=[],
        ladder=[],
        pods=load.pods,
        tokenizer=default_tokenizer_dir(),
        progress=False,
    )
    with data_path(policy, options, workdir) as path:
        metrics_url = path.epp_metrics_url
        assert metrics_url is not None
        deadline = time.monotonic() + 30.0
        # Load only once every pod's KV events are followed, or the first batches
        # would arrive through the resync's replay (not observed) or be missed.
        while read_gauge(_page(metrics_url), "epp_kv_event_stream_live") < len(path.pods):
            if time.monotonic() > deadline:
                raise RuntimeError("the EPP did not connect to every pod's KV events in 30 s")
            time.sleep(0.1)
        yield path.url, metrics_url


def _staleness_bodies(load: StalenessLoad, count: int) -> list[bytes]:
    """Chat requests: one of `groups` long shared prefixes, then a text of their own."""
    words = load_words(default_tokenizer_dir())
    rng = random.Random("calibrate-staleness")
    prefixes = [words.text(rng, load.prefix_tokens) for _ in range(load.groups)]
    bodies = []
    for _ in range(count):
        prefix = rng.choice(prefixes)
        bodies.append(
            json.dumps(
                {
                    "model": "sim-model",
                    "messages": [
                        {"role": "system", "content": prefix},
                        {"role": "user", "content": words.text(rng, load.suffix_tokens)},
                    ],
                    "max_tokens": load.max_tokens,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
            ).encode()
        )
    return bodies


async def _open_loop(url: str, bodies: list[bytes], gaps: list[float]) -> list[Record]:
    """Each body sent at its due time (after the gaps before it), whatever the
    answers of the others."""
    records = [Record(session=i, turn=0, group=-1, scheduled_s=0.0) for i in range(len(bodies))]
    async with aiohttp.ClientSession() as http:
        tasks = []
        for body, record, gap in zip(bodies, records, gaps, strict=True):
            await asyncio.sleep(gap)
            tasks.append(
                asyncio.create_task(
                    send(http, f"{url}/v1/chat/completions", body, record, 1.0, 60.0)
                )
            )
        await asyncio.gather(*tasks)
    return records


def measure_staleness(load: StalenessLoad) -> dict[str, Any]:
    """The KV-event lag and the scrape duration, read off the EPP's histograms over
    `load`."""
    rng = random.Random("calibrate-staleness-arrivals")
    count = max(1, round(load.rate * load.duration_s))
    gaps = [rng.expovariate(load.rate) for _ in range(count)]
    bodies = _staleness_bodies(load, count)
    with (
        tempfile.TemporaryDirectory(prefix="calibrate-staleness-") as workdir,
        _precise_stack(load, Path(workdir)) as (url, metrics_url),
    ):
        load_before = os.getloadavg()
        before = _page(metrics_url)
        started = time.monotonic()
        records = asyncio.run(_open_loop(url, bodies, gaps))
        elapsed = time.monotonic() - started
        time.sleep(0.5)  # the last steps' events and a scrape or two land
        after = _page(metrics_url)
        load_after = os.getloadavg()
    errors = [r.error for r in records if not r.ok]
    if len(errors) > 0.05 * len(records):
        raise RuntimeError(f"{len(errors)} of {len(records)} requests failed: {errors[:3]}")
    lag = read_histogram(after, KV_EVENT_LAG).minus(read_histogram(before, KV_EVENT_LAG))
    scrape = read_histogram(after, SCRAPE_DURATION).minus(read_histogram(before, SCRAPE_DURATION))
    negative = read_counter(after, KV_EVENT_LAG_NEGATIVE) - read_counter(
        before, KV_EVENT_LAG_NEGATIVE
    )
    return {
        "policy": STALENESS_POLICY,
        "pods": load.pods,
        "rate_per_s": load.rate,
        "requests": len(records),
        "failed": len(errors),
        "load_s": round(elapsed, 3),
        "prompt": {
            "groups": load.groups,
            "prefix_tokens": load.prefix_tokens,
            "suffix_tokens": load.suffix_tokens,
            "max_tokens": load.max_tokens,
        },
        "load_average_1m": {"before": round(load_before[0], 2), "after": round(load_after[0], 2)},
        "quantiles": "interpolated within the histogram buckets; mean_s = sum / count (exact)",
        "kv_event_lag": {**lag.summary(), "negative": int(negative)},
        "metrics_scrape": scrape.summary(),
    }


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m bench.lab.calibrate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("out/lab-calibration"))
    parser.add_argument("--requests", type=int, default=40, help="per prompt size and path")
    parser.add_argument(
        "--parts",
        default=",".join(PARTS),
        help="what to measure, comma-separated: paths (the TTFT added outside the engine),"
        " staleness (the KV-event lag and the metrics scrape duration)",
    )
    parser.add_argument(
        "--paths",
        default=",".join(PATHS),
        help="the paths measured side by side, comma-separated: direct (straight to the"
        " pod), any --policy name of `python -m bench run` (an EPP config or a peer"
        " router); round-robin's is the reference the others are paired against",
    )
    defaults = StalenessLoad()
    parser.add_argument("--staleness-pods", type=int, default=defaults.pods)
    parser.add_argument(
        "--staleness-rate", type=float, default=defaults.rate, help="requests per second"
    )
    parser.add_argument(
        "--staleness-seconds", type=float, default=defaults.duration_s, help="of load"
    )
    args = parser.parse_args(argv)
    parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
    unknown = sorted(set(parts) - set(PARTS))
    if unknown or not parts:
        parser.error(f"--parts: one or more of {', '.join(PARTS)} (not {', '.join(unknown)})")
    paths = tuple(p.strip() for p in args.paths.split(",") if p.strip())
    if "direct" not in paths or len(set(paths)) != len(paths):
        parser.error("--paths: direct and each other path once, comma-separated")
    if "paths" in parts:
        for name in paths:
            if name != "direct":
                try:
                    resolve_policy(name)
                except (ValueError, FileNotFoundError) as error:
                    parser.error(f"--paths: {error}")
    load = StalenessLoad(
        pods=args.staleness_pods, rate=args.staleness_rate, duration_s=args.staleness_seconds
    )
    command = "python -m bench.lab.calibrate " + shlex.join(argv)
    document = run(args.out, args.requests, command, parts, load, paths)
    for name, path in document.get("paths", {}).items():
        medians = ", ".join(f"{k} tokens {v * 1000:.2f} ms" for k, v in path["median_s"].items())
        paired_note = "".join(
            f"; over round-robin at {k} tokens {d['median_s'] * 1000:+.2f} ms"
            f" [{d['low_s'] * 1000:+.2f}, {d['high_s'] * 1000:+.2f}]"
            for k, d in path.get("over_round_robin_s", {}).items()
            if name != "round-robin"
        )
        print(
            f"{name:<16} {medians}; fixed {path['fixed_s'] * 1000:.2f} ms +"
            f" {path['per_token_s'] * 1e6:.2f} us/token (added over direct:"
            f" {path['added_fixed_s'] * 1000:.2f} ms"
            f" + {path['added_per_token_s'] * 1e6:.2f} us/token){paired_note}"
        )
    staleness = document.get("staleness")
    if staleness is not None:
        for label, key, extra in (
            ("kv-event lag", "kv_event_lag", "negative {negative}"),
            ("metrics scrape", "metrics_scrape", ""),
        ):
            figures = staleness[key]
            note = "; " + extra.format(**figures) if extra else ""
            print(
                f"{label:<16} median {_ms(figures['median_s'])}, p90 {_ms(figures['p90_s'])},"
                f" mean {_ms(figures['mean_s'])} (n={figures['count']}{note})"
            )
        averages = staleness["load_average_1m"]
        print(
            f"{'':<16} {staleness['pods']} pods, {staleness['requests']} requests at"
            f" {staleness['rate_per_s']:g}/s over {staleness['load_s']:.1f} s"
            f" ({staleness['failed']} failed); load average {averages['before']:.2f} before,"
            f" {averages['after']:.2f} after ({document['machine']['cpus']} CPUs); quantiles"
            " interpolated within buckets"
        )
    return 0


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.2f} ms"


if __name__ == "__main__":
    sys.exit(main())
