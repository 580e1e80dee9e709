"""`python -m bench overhead`: what the EPP adds to each request, through real Envoy.

One Envoy process has four listeners in front of the same upstreams:
- `direct`: Envoy routes round-robin to the upstreams itself (no ext_proc);
- `null`: Envoy asks a do-nothing ext_proc server (bench/null_epp.py) with GIE's
  protocol: the floor that the protocol alone costs in Python;
- `epp`: Envoy asks `epp serve` over ext_proc with GIE's protocol (full-duplex
  streamed request and response bodies, manifests/envoy/envoy.yaml) and routes to
  the endpoint it picks;
- `epp-lean`: the same EPP process in lean mode (manifests/envoy/envoy-lean.yaml):
  ext_proc for the request only, the end of each request from Envoy's gRPC access log.
The upstreams are an Envoy serving a fixed OpenAI-shaped answer (direct_response),
so they cost next to nothing and the difference between the listeners is the
ext_proc round trip. The paths are measured in alternating rounds in one run, so
machine noise hits all alike, and the report gives medians and p99.

Throughput: a closed loop with many clients through each ext_proc listener in turn;
the server process's CPU time is read from /proc, giving CPU per routed request
(for `epp-lean` including the access-log entries it reads).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

from bench.provenance import provenance
from bench.stack import (
    ManagedProcess,
    add_direct_listener,
    add_epp_listener,
    add_lean_listener,
    envoy_config,
    free_port,
    start_envoy,
    start_epp_on_free_ports,
    write_endpoints_file,
)
from bench.stats import latency_ms

UPSTREAM_ANSWER = json.dumps(
    {
        "object": "text_completion",
        "choices": [{"index": 0, "text": " ok", "finish_reason": "length"}],
        "usage": {"prompt_tokens": 64, "completion_tokens": 1, "total_tokens": 65},
    }
)


def upstream_envoy_config(ports: list[int], admin_port: int) -> dict[str, Any]:
    """An Envoy answering every request on each port with a fixed JSON body."""
    listeners = []
    for port in ports:
        listeners.append(
            {
                "name": f"upstream-{port}",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
                "filter_chains": [
                    {
                        "filters": [
                            {
                                "name": "envoy.filters.network.http_connection_manager",
                                "typed_config": {
                                    "@type": "type.googleapis.com/envoy.extensions.filters"
                                    ".network.http_connection_manager.v3.HttpConnectionManager",
                                    "stat_prefix": f"upstream_{port}",
                                    "route_config": {
                                        "virtual_hosts": [
                                            {
                                                "name": "all",
                                                "domains": ["*"],
                                                "routes": [
                                                    {
                                                        "match": {"prefix": "/"},
                                                        "direct_response": {
                                                            "status": 200,
                                                            "body": {
                                                                "inline_string": UPSTREAM_ANSWER
                                                            },
                                                        },
                                                        "response_headers_to_add": [
                                                            {
                                                                "header": {
                                                                    "key": "content-type",
                                                                    "value": "application/json",
                                                                }
                                                            }
                                                        ],
                                                    }
                                                ],
                                            }
                                        ]
                                    },
                                    "http_filters": [
                                        {
                                            "name": "envoy.filters.http.router",
                                            "typed_config": {
                                                "@type": "type.googleapis.com/envoy.extensions"
                                                ".filters.http.router.v3.Router"
                                            },
                                        }
                                    ],
                                },
                            }
                        ]
                    }
                ],
            }
        )
    return {
        "admin": {
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}
        },
        "static_resources": {"listeners": listeners},
    }


@dataclass(frozen=True)
class LatencyStats:
    requests: int
    errors: int
    p50_ms: float
    p90_ms: float
    p99_ms: float
    mean_ms: float
    rps: float


def summarize(latencies: list[float], errors: int, wall_s: float) -> LatencyStats:
    """The latencies (seconds, any order) of one arm; NaN percentiles without any."""
    return LatencyStats(
        requests=len(latencies),
        errors=errors,
        **latency_ms(latencies),
        rps=len(latencies) / wall_s if wall_s > 0 else 0.0,
    )


async def closed_loop(
    url: str, body: bytes, concurrency: int, requests: int, progress: tqdm[Any] | None = None
) -> tuple[list[float], int, float]:
    """`requests` POSTs with `concurrency` clients; returns latencies, errors, wall time."""
    latencies: list[float] = []
    errors = 0
    remaining = requests
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    headers = {"content-type": "application/json"}
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client() -> None:
            nonlocal remaining, errors
            while remaining > 0:
                remaining -= 1
                started = time.perf_counter()
                try:
                    async with session.post(url, data=body, headers=headers) as response:
                        await response.read()
                        ok = response.status == 200
                except aiohttp.ClientError:
                    ok = False
                if ok:
                    latencies.append(time.perf_counter() - started)
                else:
                    errors += 1
                if progress is not None:
                    progress.update()

        wall_started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        wall = time.perf_counter() - wall_started
    return latencies, errors, wall


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


@dataclass(frozen=True)
class OverheadOptions:
    out_dir: Path
    requests_c1: int = 3000
    requests_c32: int = 12000
    rounds: int = 3
    throughput_requests: int = 20000
    throughput_concurrency: int = 64
    prompt_bytes: int = 200
    upstreams: int = 2
    command: str = ""  # the command line, for the result file


def _body(prompt_bytes: int) -> bytes:
    return json.dumps(
        {"model": "sim-model", "prompt": "x" * prompt_bytes, "max_tokens": 1}
    ).encode()


PATHS = {
    "direct": "Envoy direct",
    "null": "Envoy + null ext_proc",
    "epp": "Envoy + EPP",
    "epp-lean": "Envoy + EPP, lean",
}
# The paths through an ext_proc server, whose CPU the throughput run measures.
SERVED = ("null", "epp", "epp-lean")


async def _measure(
    options: OverheadOptions, urls: dict[str, str], servers: dict[str, ManagedProcess]
) -> dict[str, Any]:
    body = _body(options.prompt_bytes)
    results: dict[str, Any] = {}
    for url in urls.values():  # warm up connections and code paths
        await closed_loop(url, body, 8, 500)

    for concurrency, total in ((1, options.requests_c1), (32, options.requests_c32)):
        per_round = max(1, total // options.rounds)
        samples: dict[str, list[float]] = {name: [] for name in urls}
        errors = dict.fromkeys(urls, 0)
        walls = dict.fromkeys(urls, 0.0)
        steps = per_round * options.rounds * len(urls)
        with tqdm(total=steps, desc=f"latency c={concurrency}", unit="req") as bar:
            for _ in range(options.rounds):
                # Alternate the paths so noise on this shared machine hits each alike.
                for name, url in urls.items():
                    latencies, errs, wall = await closed_loop(
                        url, body, concurrency, per_round, bar
                    )
                    samples[name] += latencies
                    errors[name] += errs
                    walls[name] += wall
        stats = {name: summarize(samples[name], errors[name], walls[name]) for name in urls}
        results[f"c{concurrency}"] = {
            **{name: asdict(s) for name, s in stats.items()},
            "added_p50_ms": stats["epp"].p50_ms - stats["direct"].p50_ms,
            "added_p99_ms": stats["epp"].p99_ms - stats["direct"].p99_ms,
            "floor_p50_ms": stats["null"].p50_ms - stats["direct"].p50_ms,
            "floor_p99_ms": stats["null"].p99_ms - stats["direct"].p99_ms,
            "added_lean_p50_ms": stats["epp-lean"].p50_ms - stats["direct"].p50_ms,
            "added_lean_p99_ms": stats["epp-lean"].p99_ms - stats["direct"].p99_ms,
        }

    throughput: dict[str, Any] = {}
    for name in SERVED:
        process = servers[name].process
        assert process is not None
        cpu_before = process_cpu_seconds(process.pid)
        with tqdm(total=options.throughput_requests, desc=f"throughput {name}", unit="req") as bar:
            latencies, errs, wall = await closed_loop(
                urls[name], body, options.throughput_concurrency, options.throughput_requests, bar
            )
        cpu = process_cpu_seconds(process.pid) - cpu_before
        sustained = summarize(latencies, errs, wall)
        throughput[name] = {
            "concurrency": options.throughput_concurrency,
            **asdict(sustained),
            "cpu_s": cpu,
            "cpu_us_per_request": cpu / max(1, sustained.requests) * 1e6,
            "cpu_utilisation": cpu / wall if wall > 0 else 0.0,
        }
    results["throughput"] = throughput
    return results


def run_overhead(options: OverheadOptions) -> dict[str, Any]:
    out = options.out_dir
    out.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as cleanup:
        upstream_ports = [free_port() for _ in range(options.upstreams)]
        upstreams = [f"127.0.0.1:{port}" for port in upstream_ports]
        upstream = start_envoy(upstream_envoy_config(upstream_ports, free_port()), out / "upstream")
        cleanup.callback(upstream.stop)
        endpoints = write_endpoints_file(
            out / "endpoints.yaml", [(f"up-{i}", a) for i, a in enumerate(upstreams)]
        )
        epp, ports = start_epp_on_free_ports(endpoints, out)
        cleanup.callback(epp.stop)
        null_port, null_ready = free_port(), free_port()
        null = ManagedProcess(
            "null-epp",
            [
                sys.executable, "-m", "bench.null_epp", "--port", str(null_port),
                "--destination", upstreams[0], "--ready-port", str(null_ready),
            ],
            out / "null-epp.log",
        ).start()  # fmt: skip
        cleanup.callback(null.stop)
        null.wait_http_ok(f"http://127.0.0.1:{null_ready}/readyz")
        listen = {name: free_port() for name in PATHS}
        config = envoy_config(
            listen_port=listen["epp"], epp_port=ports.grpc, admin_port=free_port()
        )
        add_epp_listener(config, "null", listen["null"], null_port)
        add_lean_listener(config, "epp-lean", listen["epp-lean"])
        add_direct_listener(config, "direct", listen["direct"], upstreams)
        front = start_envoy(config, out / "front")
        cleanup.callback(front.stop)
        urls = {name: f"http://127.0.0.1:{listen[name]}/v1/completions" for name in PATHS}
        servers = {"null": null, "epp": epp, "epp-lean": epp}
        results = asyncio.run(_measure(options, urls, servers))
    results.update(provenance(options.command))
    results["options"] = {
        k: str(v) if isinstance(v, Path) else v
        for k, v in asdict(options).items()
        if k != "command"
    }
    (out / "overhead.json").write_text(json.dumps(results, indent=2))
    (out / "overhead.md").write_text(report(results))
    return results


def report(results: dict[str, Any]) -> str:
    lines = [
        "| concurrency | path | requests | errors | p50 ms | p90 ms | p99 ms | req/s |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key in ("c1", "c32"):
        for path, label in PATHS.items():
            s = results[key][path]
            lines.append(
                f"| {key[1:]} | {label} | {s['requests']} | {s['errors']} | {s['p50_ms']:.3f} |"
                f" {s['p90_ms']:.3f} | {s['p99_ms']:.3f} | {s['rps']:.0f} |"
            )
    lines.append("")
    for key in ("c1", "c32"):
        r = results[key]
        lines.append(
            f"- concurrency {key[1:]}: the EPP adds p50 {r['added_p50_ms']:+.3f} ms,"
            f" p99 {r['added_p99_ms']:+.3f} ms; of which the ext_proc protocol alone"
            f" (null picker) p50 {r['floor_p50_ms']:+.3f} ms, p99 {r['floor_p99_ms']:+.3f} ms;"
            f" in lean mode it adds p50 {r['added_lean_p50_ms']:+.3f} ms,"
            f" p99 {r['added_lean_p99_ms']:+.3f} ms"
        )
    for name in SERVED:
        t = results["throughput"][name]
        lines.append(
            f"- sustained, {PATHS[name]}, concurrency {t['concurrency']}: {t['rps']:.0f} req/s"
            f" ({t['errors']} errors); server CPU {t['cpu_us_per_request']:.0f} µs per request,"
            f" {t['cpu_utilisation'] * 100:.0f}% of one core"
        )
    return "\n".join(lines) + "\n"
