"""Native memory the EPP keeps per request served through Envoy: the check that an
ext_proc stream's end leaves nothing behind.

    .venv/bin/python -m tests.perf.stream_memory --requests 8000

Why: grpcio's asyncio server (1.85 and before) leaks the operation array of a read
that a client's reset cancels, and of a status it then fails to send (80 bytes
each). Envoy ends an ext_proc stream it still holds with a half-close and a reset
unless its `envoy.reloadable_features.ext_proc_graceful_grpc_close` runtime flag is
on, so every request could leak. The EPP ends a stream itself once the response is
over, and the shipped Envoy configs turn the flag on; this measures what is left.

How: this process runs `epp serve`'s app (`EppApp`, in-process, the default config)
for two simulated pods; Envoy runs as a child process with
`manifests/envoy/envoy.yaml` (ports changed), first as shipped, then without its
runtime flag (Envoy's default); a child process sends `--requests` completions
through it, `--concurrency` at a time, after a warm-up of a quarter as many. Before
and after, this process collects garbage and reads the C allocator's bytes in use
(glibc's `mallinfo2`): the difference over the requests is what the EPP kept in
native memory and in Python objects over 512 bytes. Python's small objects live in
arenas it maps itself, which this does not see; the soak's RSS covers those.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.provenance import provenance
from bench.stack import Pods, envoy_config, free_port, start_envoy
from epp.memory import malloc_in_use
from tests.epp.conftest import app_on_runner, local_options

GRACEFUL_CLOSE = "envoy.reloadable_features.ext_proc_graceful_grpc_close"


def _malloc_in_use_now() -> int:
    in_use = malloc_in_use()
    if in_use is None:
        raise SystemExit("this measurement needs glibc's mallinfo2 (the C allocator's bytes)")
    return in_use


def _send(url: str, requests: int, concurrency: int, errors: Any) -> None:
    """The load, in a child process so that its allocations are not counted."""
    import aiohttp

    async def main() -> int:
        failed = 0
        todo = iter(range(requests))
        async with aiohttp.ClientSession() as session:

            async def worker() -> None:
                nonlocal failed
                for i in todo:
                    # 50 prompts, so the prefix caches settle during the warm-up.
                    body = {"model": "sim-model", "prompt": f"{i % 50} " + "hello " * 40}
                    async with session.post(url, json={**body, "max_tokens": 4}) as response:
                        await response.read()
                        failed += response.status != 200

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        return failed

    errors.value = asyncio.run(main())


def _load(url: str, requests: int, concurrency: int) -> int:
    # Spawned, not forked: a fork would copy this process's gRPC and event loop.
    spawn = multiprocessing.get_context("spawn")
    errors = spawn.Value("i", -1)
    child = spawn.Process(target=_send, args=(url, requests, concurrency, errors))
    child.start()
    child.join()
    if child.exitcode != 0:
        raise RuntimeError(f"the load process failed (exit code {child.exitcode})")
    return int(errors.value)


def run(requests: int = 8000, concurrency: int = 8) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="stream-memory-") as tmp:
        work = Path(tmp)
        pods = Pods(work / "pods", 2, ["--time-scale", "0.01", "--output-tokens", "4"])
        pods.start()
        try:
            options = local_options(pods.endpoints_file(work / "endpoints.yaml"))
            with app_on_runner(options) as (runner, app):
                results = {}
                for name, graceful in (("shipped", True), ("without_graceful_close", False)):
                    config = envoy_config(
                        listen_port=free_port(), epp_port=app.ports["grpc"], admin_port=free_port()
                    )
                    if not graceful:
                        config.pop("layered_runtime", None)
                    listen = config["static_resources"]["listeners"][0]["address"]
                    url = (
                        f"http://127.0.0.1:{listen['socket_address']['port_value']}/v1/completions"
                    )
                    envoy = start_envoy(config, work / f"envoy-{name}")
                    try:
                        # The EPP's loop runs while the load does (the load waits).
                        warmup = runner.run(
                            asyncio.to_thread(_load, url, requests // 4, concurrency)
                        )
                        gc.collect()
                        before = _malloc_in_use_now()
                        errors = runner.run(asyncio.to_thread(_load, url, requests, concurrency))
                        gc.collect()
                        after = _malloc_in_use_now()
                    finally:
                        envoy.stop()
                    results[name] = {
                        "requests": requests,
                        "errors": warmup + errors,
                        "bytes_kept": after - before,
                        "bytes_per_request": round((after - before) / requests, 1),
                    }
                return {"requests": requests, "concurrency": concurrency, **results}
        finally:
            pods.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=8000, help="measured, per config")
    parser.add_argument("--concurrency", type=int, default=8)
    args = parser.parse_args()
    result = run(args.requests, args.concurrency)
    command = "python -m tests.perf.stream_memory " + shlex.join(sys.argv[1:])
    print(json.dumps({**provenance(command), **result}, indent=2))


if __name__ == "__main__":
    main()
