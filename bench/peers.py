"""Peer routers on the same simulated fleet: SGLang's router and vLLM's router.

Both come from PyPI (pinned, with their dependencies, in bench/peers-requirements.txt)
and are installed on demand into their own virtualenv, `.venv-peers`, never into the
project's `.venv`. `ensure_peer_venv()` creates or updates it when the requirements
changed (a stamp file holds their hash); `make peers` does the same.

How each is launched (both are a Rust router behind a Python launcher):

- `sglang-router` 0.3.2: `python -m sglang_router.launch_router --host H --port P
  --worker-urls URL... --policy cache_aware --prometheus-port Q --log-level warn`;
- `vllm-router` 0.1.17: `vllm-router --host H --port P --worker-urls URL...
  --policy cache_aware --prometheus-port Q --log-level warning`.

Both would bind a Prometheus exporter on port 29000 by default (two at once collide),
hence `--prometheus-port`. Every other setting is the package's default; for
`cache_aware` that is cache_threshold 0.3, balance_abs_threshold 64,
balance_rel_threshold 1.5 in both.

What they ask of the workers (seen on the wire against the simulator):

- sglang-router: first an HTTP/2 (gRPC) connection attempt to tell gRPC workers from
  HTTP ones, then `GET /health`, then `GET /server_info`, `/get_server_info`,
  `/model_info`, `/get_model_info` for metadata: a 404 is accepted (the worker's
  model is then "unknown", which routes every model). Health checks: `GET /health`
  every 60 s.
- vllm-router: `GET /health` until a worker answers, then `GET /health` every 60 s;
  with `cache_aware`, for every chat request `POST /v1/chat/completions/render` (vLLM's
  render endpoint: the prompt's token ids), falling back to `POST /tokenize` when that
  fails. The simulator serves both (sim/server.py), so it routes as it would in front
  of vLLM.

Both answer `GET /readiness` with `{"status": "ready", "healthy_workers": n, ...}` once
their workers are registered: that is what `start_peer` waits for. Both pass the
worker's response headers through, `x-sim-pod` included.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from bench.stack import ROOT, ManagedProcess, ProcessFailed, free_port

PEER_VENV = ROOT / ".venv-peers"
REQUIREMENTS = ROOT / "bench" / "peers-requirements.txt"
STAMP = ".installed"


@dataclass(frozen=True)
class PeerKind:
    name: str
    default_policy: str
    log_level: str

    def argv(
        self, venv: Path, port: int, metrics_port: int, workers: Sequence[str], policy: str
    ) -> list[str]:
        python = str(venv / "bin" / "python")
        if self.name == "sglang-router":
            head = [python, "-m", "sglang_router.launch_router"]
        else:
            head = [python, "-m", "vllm_router.launch_router"]
        return [
            *head,
            "--host", "127.0.0.1",
            "--port", str(port),
            "--worker-urls", *(f"http://{w}" for w in workers),
            "--policy", policy,
            "--prometheus-port", str(metrics_port),
            "--log-level", self.log_level,
        ]  # fmt: skip


PEERS = {
    "sglang-router": PeerKind("sglang-router", "cache_aware", "warn"),
    "vllm-router": PeerKind("vllm-router", "cache_aware", "warning"),
}


def _requirements_hash() -> str:
    return hashlib.sha256(REQUIREMENTS.read_bytes()).hexdigest()


def peer_venv_ready(venv: Path = PEER_VENV) -> bool:
    stamp = venv / STAMP
    return stamp.is_file() and stamp.read_text().strip() == _requirements_hash()


def ensure_peer_venv(venv: Path = PEER_VENV) -> Path:
    """Create (or update) the peers' virtualenv; returns it. Needs PyPI the first time."""
    if peer_venv_ready(venv):
        return venv
    print(f"installing the peer routers into {venv} (pinned: {REQUIREMENTS.name})", flush=True)
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run(
        [
            str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet",
            "--disable-pip-version-check", "-r", str(REQUIREMENTS),
        ],
        check=True,
    )  # fmt: skip
    (venv / STAMP).write_text(_requirements_hash() + "\n")
    return venv


def parse_peer(spec: str) -> tuple[PeerKind, str] | None:
    """`sglang-router` or `vllm-router`, optionally `:policy`; None if not a peer."""
    name, _, policy = spec.partition(":")
    kind = PEERS.get(name)
    if kind is None:
        return None
    return kind, policy or kind.default_policy


def _ready_workers(url: str) -> int:
    try:
        with urllib.request.urlopen(url + "/readiness", timeout=1.0) as response:
            body = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException):
        return -1
    if not isinstance(body, dict):
        return -1
    healthy = body.get("healthy_workers")
    return healthy if isinstance(healthy, int) else -1


def start_peer(
    kind: PeerKind,
    policy: str,
    workers: Sequence[str],
    workdir: Path,
    venv: Path = PEER_VENV,
    timeout_s: float = 60.0,
) -> tuple[ManagedProcess, str]:
    """Start a peer router in front of `workers` (ip:port); returns it and its URL once
    every worker is registered and healthy."""
    port, metrics_port = free_port(), free_port()
    process = ManagedProcess(
        kind.name,
        kind.argv(venv, port, metrics_port, workers, policy),
        workdir / f"{kind.name}.log",
    ).start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    try:
        while _ready_workers(url) < len(workers):
            if process.process is not None and process.process.poll() is not None:
                code = process.process.returncode
                raise ProcessFailed(f"{kind.name} exited with code {code}:\n{process.log_tail()}")
            if time.monotonic() > deadline:
                raise ProcessFailed(
                    f"{kind.name}: workers not ready after {timeout_s:.0f}s:\n{process.log_tail()}"
                )
            time.sleep(0.1)
    except BaseException:
        process.stop()
        raise
    return process, url
