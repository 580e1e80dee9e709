"""`python -m bench.lab.calibrate`: what the real stack adds to a request's TTFT
outside the engine, to set the lab's delays from.

For each path (straight to a simulated pod; through Envoy and `epp serve` with a
config; through a peer router) on a fresh fleet of one pod, requests are sent one
at a time (nothing queues), each a chat request with a prompt nobody has sent
before, of two sizes. For each request the client's TTFT (sent to first token) and
the engine's own (`vllm:time_to_first_token_seconds`: from the engine taking the
request to its first token, read from the pod's /metrics before and after) are
measured; their difference is the time spent outside the engine: the client, the
router, HTTP, the pod's parsing, chat template and tokenization, and the first
chunk's way back. A line a + b x prompt tokens is fitted per path through the two
sizes' medians. The direct path's line is the pod's own overhead; a router's is
the direct line plus what the router adds.

    python -m bench.lab.calibrate --out docs/results/lab-calibration
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from bench.client import Record, send
from bench.provenance import provenance
from bench.runner import RunOptions, data_path, resolve_policy
from bench.workloads import WorkloadSpec, default_tokenizer_dir, load_words
from epp.sources.metrics import read_series

SIZES = (128, 2048)
TTFT = "vllm:time_to_first_token_seconds"
PATHS = ("direct", "round-robin", "default", "precise-prefix", "sglang-router")


def _engine_ttft(address: str) -> tuple[float, float]:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10.0) as response:
        page = response.read()
    total = sum(s.value for s in read_series(page, TTFT + "_sum").samples)
    count = sum(s.value for s in read_series(page, TTFT + "_count").samples)
    return total, count


async def _measure(url: str, address: str, bodies: list[bytes]) -> list[float]:
    """Outside-the-engine time of each request, sent one at a time."""
    out = []
    async with aiohttp.ClientSession() as http:
        for i, body in enumerate(bodies):
            before = _engine_ttft(address)
            record = Record(session=i, turn=0, group=-1, scheduled_s=0.0)
            await send(http, f"{url}/v1/chat/completions", body, record, 1.0, 60.0)
            after = _engine_ttft(address)
            if not record.ok or record.ttft_s is None or after[1] != before[1] + 1:
                raise RuntimeError(f"request {i} on {url}: {record.error or 'no TTFT'}")
            out.append(record.ttft_s - (after[0] - before[0]))
    return out


def _fit(points: dict[int, float]) -> tuple[float, float]:
    (x0, y0), (x1, y1) = sorted(points.items())
    slope = (y1 - y0) / (x1 - x0)
    return y0 - slope * x0, slope


def run(out: Path, requests: int, command: str) -> dict[str, Any]:
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
    paths: dict[str, Any] = {}
    for name in PATHS:
        policy = resolve_policy("round-robin" if name == "direct" else name)
        with (
            tempfile.TemporaryDirectory(prefix="calibrate-") as workdir,
            data_path(policy, options, Path(workdir)) as (url, pods),
        ):
            address = pods[0][1]
            target = f"http://{address}" if name == "direct" else url
            medians = {}
            samples = {}
            for size in SIZES:
                values = asyncio.run(_measure(target, address, bodies[size]))[warmup:]
                samples[size] = [round(v, 6) for v in values]
                medians[size] = statistics.median(values)
            a, b = _fit(medians)
            paths[name] = {
                "median_s": {str(k): v for k, v in medians.items()},
                "fixed_s": a,
                "per_token_s": b,
                "samples_s": {str(k): v for k, v in samples.items()},
            }
        time.sleep(0.5)
    direct = paths["direct"]
    for path in paths.values():
        path["added_fixed_s"] = path["fixed_s"] - direct["fixed_s"]
        path["added_per_token_s"] = path["per_token_s"] - direct["per_token_s"]
    document = {**provenance(command), "sizes": list(SIZES), "requests": requests, "paths": paths}
    out.mkdir(parents=True, exist_ok=True)
    (out / "calibration.json").write_text(json.dumps(document, indent=2) + "\n", encoding="utf-8")
    return document


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m bench.lab.calibrate",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", type=Path, default=Path("out/lab-calibration"))
    parser.add_argument("--requests", type=int, default=40, help="per prompt size and path")
    args = parser.parse_args(argv)
    document = run(args.out, args.requests, "python -m bench.lab.calibrate " + shlex.join(argv))
    for name, path in document["paths"].items():
        medians = ", ".join(f"{k} tokens {v * 1000:.2f} ms" for k, v in path["median_s"].items())
        print(
            f"{name:<16} {medians}; fixed {path['fixed_s'] * 1000:.2f} ms +"
            f" {path['per_token_s'] * 1e6:.2f} us/token (added over direct:"
            f" {path['added_fixed_s'] * 1000:.2f} ms"
            f" + {path['added_per_token_s'] * 1e6:.2f} us/token)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
