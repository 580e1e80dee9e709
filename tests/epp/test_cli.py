"""`epp serve`'s flags: the endpoint source (an endpoints file, an InferencePool, or a
label selector with ports), what goes with which, and what the process says when
it cannot start."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from epp.app import ServeOptions
from epp.cli import UsageError, build_parser, serve_options
from epp.sources.kube import KubeOptions, KvEventPorts


def options(*argv: str) -> ServeOptions:
    return serve_options(build_parser().parse_args(["serve", *argv]))


def test_an_inference_pool() -> None:
    parsed = options(
        "--pool-name", "pool", "--pool-namespace", "llm", "--kv-events-port", "5557",
        "--kv-events-replay-port", "5600", "--kube-watch-timeout", "30s",
        "--config-reload-interval", "0", "--config-drain-timeout", "2m",
    )  # fmt: skip
    assert parsed.endpoints_file is None
    kube = parsed.kube
    assert isinstance(kube, KubeOptions)
    assert (kube.pool_name, kube.pool_namespace, kube.pool_group) == (
        "pool",
        "llm",
        "inference.networking.k8s.io",
    )
    assert kube.kv_events == KvEventPorts(5557, 5600)
    assert kube.watch.watch_timeout_s == 30.0
    assert parsed.config_reload_interval_s == 0.0
    assert parsed.config_drain_timeout_s == 120.0


def test_the_stall_threshold_takes_zero_and_refuses_a_negative(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert options("--endpoints-file", "e.yaml").stall_threshold_s == 30.0
    assert options("--endpoints-file", "e.yaml", "--stall-threshold", "0").stall_threshold_s == 0
    assert options("--endpoints-file", "e.yaml", "--stall-threshold", "2m").stall_threshold_s == 120
    with pytest.raises(SystemExit):
        options("--endpoints-file", "e.yaml", "--stall-threshold=-1s")
    assert "--stall-threshold: '-1s' is not a duration" in capsys.readouterr().err


def test_standalone_selector_and_ports() -> None:
    kube = options(
        "--endpoint-selector", "app=vllm,tier=gpu", "--endpoint-target-ports", "8000,8001"
    ).kube
    assert kube is not None
    assert kube.endpoint_selector == {"app": "vllm", "tier": "gpu"}
    assert kube.endpoint_target_ports == (8000, 8001)
    assert kube.pool_name is None


def test_the_pool_namespace_defaults_to_the_pods_namespace(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("NAMESPACE", "from-downward-api")
    kube = options("--pool-name", "p").kube
    assert kube is not None
    assert kube.pool_namespace == "from-downward-api"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ((), "give exactly one endpoint source"),
        (("--endpoints-file", "e.yaml", "--pool-name", "p"), "; both were given"),
        (("--pool-name", "p", "--endpoint-target-ports", "8000"), "are exclusive"),
        (("--endpoint-selector", "app=x"), "needs --endpoint-target-ports PORT"),
        (("--endpoint-target-ports", "8000"), "needs --endpoint-selector k=v"),
        (("--endpoints-file", "e.yaml", "--kv-events-port", "5557"), "for Kubernetes discovery"),
        (("--endpoints-file", "e.yaml", "--kubeconfig", "kc"), "--kubeconfig: for Kubernetes"),
        (("--pool-name", "p", "--kv-events-replay-port", "5558"), "needs --kv-events-port"),
        (("--endpoints-file", "e.yaml", "--trace-memory", "4"), "needs --debug-endpoints"),
        (
            ("--endpoints-file", "e.yaml", "--debug-endpoints", "--trace-memory", "101"),
            "at most 100 frames, got 101",
        ),
    ],
)
def test_combinations_that_cannot_work(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        options(*argv)


@pytest.mark.parametrize(
    "argv",
    [
        ("--endpoint-selector", "app"),
        ("--endpoint-selector", "bad key=x"),
        ("--endpoint-target-ports", "http"),
        ("--endpoint-target-ports", "8000,8000"),
        ("--pool-group", "example.com"),
        ("--trace-memory", "0"),
    ],
)
def test_malformed_flags_are_refused_by_the_parser(
    argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["serve", *argv])
    assert info.value.code == 2
    assert argv[0] in capsys.readouterr().err


def test_no_cluster_credentials_is_a_clear_start_up_error(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "KUBECONFIG": str(tmp_path / "none"), "HOME": str(tmp_path)}
    done = subprocess.run(
        [
            sys.executable, "-m", "epp", "serve", "--pool-name", "p", "--bind", "127.0.0.1",
            "--grpc-port", "0", "--grpc-health-port", "0", "--metrics-port", "0",
        ],
        capture_output=True, text=True, timeout=60, check=False, env=env,
    )  # fmt: skip
    assert done.returncode == 1
    assert "not running in a cluster (KUBERNETES_SERVICE_HOST is unset)" in done.stderr
    assert "give --kubeconfig FILE or set KUBECONFIG" in done.stderr
    assert "Traceback" not in done.stderr


def test_flag_defaults_are_the_serve_options_defaults() -> None:
    # One default per setting (epp/defaults.py): what `epp serve` runs without a
    # flag is what ServeOptions holds when built without the command line.
    assert options("--endpoints-file", "e.yaml") == ServeOptions(endpoints_file="e.yaml")


def test_kubernetes_flag_defaults_are_the_kube_options_defaults(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("NAMESPACE", raising=False)
    assert options("--pool-name", "p").kube == KubeOptions(pool_name="p")


@pytest.mark.parametrize("taken", ["--grpc-port", "--grpc-health-port", "--metrics-port"])
def test_a_port_in_use_is_a_clear_start_up_error(tmp_path: Path, taken: str) -> None:
    # Each listener fails at its own step of the start: the ones bound before it
    # are closed again, and the process says which port, without a traceback.
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text("endpoints:\n- {name: pod-a, address: 127.0.0.1:1}\n")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        ports = {"--grpc-port": "0", "--grpc-health-port": "0", "--metrics-port": "0"}
        ports[taken] = str(port)
        done = subprocess.run(
            [
                sys.executable, "-m", "epp", "serve", "--endpoints-file", str(endpoints),
                "--bind", "127.0.0.1", *(item for pair in ports.items() for item in pair),
            ],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    assert done.returncode == 1
    assert "cannot start" in done.stderr
    assert str(port) in done.stderr
    assert "Traceback" not in done.stderr
    assert "never awaited" not in done.stderr
