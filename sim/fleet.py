"""`python -m sim fleet`: N simulated pods, each its own process, and their endpoints file.

Ports, for `--n N --base-port P` (defaults, each base can be moved):

- pod i (named `sim-i`) serves HTTP on P + i;
- publishes KV events on K + i, K = `--kv-events-base-port` (default P + N);
- answers replay requests on R + i, R = `--replay-base-port` (default P + 2N).

So by default the fleet uses the 3N ports P .. P + 3N - 1. With `--prefill-pods M`
(a prefill/decode fleet) pods 0..M-1 get the role `prefill` and the others
`decode`: each pod is started with `--role` and its endpoints-file entry carries
the label `llm-d.ai/role`, which the EPP's role filters read. Once every pod answers
`/health`, the fleet writes the endpoints file the EPP reads (`--endpoints-file`,
with `name`, `address`, `kvEvents`, `kvEventsReplay`: docs/architecture.md,
"Processes, ports, the endpoints file"), atomically, then runs
until SIGINT/SIGTERM and stops every pod (SIGTERM, then SIGKILL after a grace
period). If a pod dies, the fleet stops the others and exits non-zero.
"""

from __future__ import annotations

import http.client
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, Any

import yaml

# The pods' role label (llm-d's; sim.server.ROLE_LABEL, not imported: the fleet does
# not load the server).
ROLE_LABEL = "llm-d.ai/role"

STOP_GRACE_S = 10.0
READY_TIMEOUT_S = 60.0
# How much of a dead pod's log the fleet prints (a traceback fits).
POD_LOG_TAIL_LINES = 12


@dataclass(frozen=True)
class FleetPod:
    name: str
    http_port: int
    kv_events_port: int | None
    replay_port: int | None
    role: str | None = None  # its llm-d.ai/role label


def plan_fleet(
    n: int,
    base_port: int,
    kv_events_base_port: int | None = None,
    replay_base_port: int | None = None,
    name_prefix: str = "sim",
    kv_events: bool = True,
    prefill_pods: int = 0,
) -> list[FleetPod]:
    if n < 1:
        raise ValueError("--n must be >= 1")
    if not 0 <= prefill_pods < n:
        raise ValueError("--prefill-pods must be in 0..n-1 (a P/D fleet needs a decode pod)")
    kv_base = base_port + n if kv_events_base_port is None else kv_events_base_port
    replay_base = base_port + 2 * n if replay_base_port is None else replay_base_port
    pods = [
        FleetPod(
            name=f"{name_prefix}-{i}",
            http_port=base_port + i,
            kv_events_port=kv_base + i if kv_events else None,
            replay_port=replay_base + i if kv_events else None,
            role=None if not prefill_pods else "prefill" if i < prefill_pods else "decode",
        )
        for i in range(n)
    ]
    ports = [p for pod in pods for p in (pod.http_port, pod.kv_events_port, pod.replay_port) if p]
    if len(set(ports)) != len(ports):
        raise ValueError("the HTTP, KV-event and replay port ranges overlap")
    if any(not 0 < p < 65536 for p in ports):
        raise ValueError("ports must be in 1..65535")
    return pods


def _client_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "::", "*") else host


def endpoints_document(pods: Sequence[FleetPod], host: str) -> dict[str, Any]:
    address = _client_host(host)
    entries = []
    for pod in pods:
        entry: dict[str, Any] = {"name": pod.name, "address": f"{address}:{pod.http_port}"}
        if pod.kv_events_port is not None:
            entry["kvEvents"] = f"tcp://{address}:{pod.kv_events_port}"
        if pod.replay_port is not None:
            entry["kvEventsReplay"] = f"tcp://{address}:{pod.replay_port}"
        if pod.role is not None:
            entry["labels"] = {ROLE_LABEL: pod.role}
        entries.append(entry)
    return {"endpoints": entries}


def write_endpoints_file(path: Path, document: dict[str, Any]) -> None:
    # Write then rename: a watcher never reads a half-written file.
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")
    partial.write_text(yaml.safe_dump(document, sort_keys=False))
    os.replace(partial, path)


def pod_argv(pod: FleetPod, host: str, serve_args: Sequence[str]) -> list[str]:
    argv = [sys.executable, "-m", "sim", "serve", "--host", host]
    argv += ["--port", str(pod.http_port), "--name", pod.name]
    if pod.kv_events_port is not None:
        argv += ["--kv-events-port", str(pod.kv_events_port)]
    if pod.replay_port is not None:
        argv += ["--replay-port", str(pod.replay_port)]
    if pod.role is not None:
        argv += ["--role", pod.role]
    return argv + list(serve_args)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return bool(response.status == 200)
    except (urllib.error.URLError, OSError, http.client.HTTPException):
        # HTTPException too: polling a port nobody listens on yet can connect the
        # client to itself (a TCP simultaneous open, when the kernel picks the
        # target port as the ephemeral source port), and then the "response" is
        # the request itself, a bad status line.
        return False


class _Stop:
    """Set by SIGINT/SIGTERM; the main loop polls it."""

    def __init__(self) -> None:
        self.requested = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True


def run_fleet(
    pods: Sequence[FleetPod],
    host: str,
    endpoints_file: Path,
    serve_args: Sequence[str],
    log_dir: Path | None = None,
) -> int:
    stop = _Stop()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    processes: list[tuple[FleetPod, subprocess.Popen[bytes]]] = []
    logs: list[IO[bytes]] = []
    try:
        for pod in pods:
            out: IO[bytes] | None = None
            if log_dir is not None:
                log_dir.mkdir(parents=True, exist_ok=True)
                out = (log_dir / f"{pod.name}.log").open("wb")
                logs.append(out)
            process = subprocess.Popen(
                pod_argv(pod, host, serve_args),
                stdout=out,
                stderr=subprocess.STDOUT if out is not None else None,
            )
            processes.append((pod, process))
        deadline = time.monotonic() + READY_TIMEOUT_S
        address = _client_host(host)
        for pod, process in processes:
            url = f"http://{address}:{pod.http_port}/health"
            while not _healthy(url):
                if stop.requested:
                    return 130
                if process.poll() is not None:
                    _report_exit(pod, process.returncode, log_dir)
                    return 1
                if time.monotonic() > deadline:
                    print(f"fleet: {pod.name} not ready after {READY_TIMEOUT_S:.0f}s", flush=True)
                    return 1
                time.sleep(0.05)
        write_endpoints_file(endpoints_file, endpoints_document(pods, host))
        print(f"fleet: {len(pods)} pods ready, endpoints in {endpoints_file}", flush=True)
        while not stop.requested:
            for pod, process in processes:
                if process.poll() is not None:
                    _report_exit(pod, process.returncode, log_dir)
                    return 1
            time.sleep(0.2)
        return 0
    finally:
        _stop_all([p for _, p in processes])
        for log in logs:
            log.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        print("fleet: stopped", flush=True)


def _report_exit(pod: FleetPod, code: int | None, log_dir: Path | None) -> None:
    """Say which pod died and, when it has a log file, why: the caller of the fleet
    (bench) shows only the fleet's own output."""
    print(f"fleet: {pod.name} exited with code {code}", flush=True)
    if log_dir is None:
        return  # the pod wrote to the fleet's own stdout and stderr
    try:
        lines = (log_dir / f"{pod.name}.log").read_text(errors="replace").splitlines()
    except OSError:
        return
    for line in lines[-POD_LOG_TAIL_LINES:]:
        print(f"{pod.name}: {line}", flush=True)


def _stop_all(processes: Sequence[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for process in processes:
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
