"""End to end with Kubernetes discovery: a real `epp serve --pool-name` process
watching the simulated API server (sim/kubeapi.py) through the official client,
real Envoy, and simulated vLLM pods as the pool's pods. Each pod has its own
loopback address and they share the pool's target port, as pods do.

Requests reach a pod once the API says it is Ready, and stop reaching one once the
API deleted it, although its process still answers."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from bench.stack import (
    envoy_config,
    free_ports,
    start_envoy,
    start_epp_on_free_ports,
    start_sim,
)
from sim.kubeapi import KubeApiThread
from tests.integration.conftest import CONFIG

POD_HEADER = "x-sim-pod"
SELECTION_HEADER = "test-epp-endpoint-selection"
LABELS = {"app": "sim"}
# Loopback addresses for the pods: 127.0.0.0/8 is all local on Linux.
POD_IPS = {"sim-a": "127.0.0.2", "sim-b": "127.0.0.3"}


@dataclass
class KubeStack:
    kube: KubeApiThread
    port: int  # the pool's target port, on every pod's address
    envoy_port: int
    epp_admin: str

    def address(self, pod: str) -> str:
        return f"{POD_IPS[pod]}:{self.port}"

    def send(self, pod: str | None = None) -> tuple[int, str | None]:
        """One completion through Envoy (aimed at `pod`'s address by the testing
        filter); (HTTP status, the pod that answered)."""
        headers = {"content-type": "application/json"}
        if pod is not None:
            headers[SELECTION_HEADER] = self.address(pod)
        body = json.dumps({"model": "sim-model", "prompt": "hello", "max_tokens": 2}).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.envoy_port}/v1/completions", body, headers
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.headers.get(POD_HEADER)
        except urllib.error.HTTPError as error:
            return error.code, error.headers.get(POD_HEADER)


def eventually(check: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@contextlib.contextmanager
def kube_stack(workdir: Path) -> Iterator[KubeStack]:
    with contextlib.ExitStack() as cleanup:
        kube = KubeApiThread(token="e2e-token", bookmark_interval_s=0.5).start()
        cleanup.callback(kube.stop)
        kubeconfig = kube.call(kube.api.kubeconfig, workdir / "kubeconfig")
        # Drawn together: the simulators may not have bound theirs when Envoy's are drawn.
        port, envoy_port, admin_port = free_ports(3)
        sims = [start_sim(port, workdir, name, host=ip, wait=False) for name, ip in POD_IPS.items()]
        for sim in sims:
            cleanup.callback(sim.stop)
        for sim, ip in zip(sims, POD_IPS.values(), strict=True):
            sim.wait_http_ok(f"http://{ip}:{port}/health")
        # sim-a serves; sim-b runs but is not Ready yet as far as the API knows.
        kube.call(kube.api.put_pool, "pool", selector=LABELS, ports=[port])
        kube.call(kube.api.put_pod, "sim-a", labels=LABELS, ip=POD_IPS["sim-a"], ready=True)
        kube.call(kube.api.put_pod, "sim-b", labels=LABELS, ip=POD_IPS["sim-b"], ready=False)
        config = workdir / "config.yaml"
        config.write_text(CONFIG)
        epp, ports = start_epp_on_free_ports(
            None,
            workdir,
            config_file=config,
            extra_args=[
                "--pool-name", "pool", "--pool-namespace", "default",
                "--kubeconfig", str(kubeconfig), "--debug-endpoints",
            ],
        )  # fmt: skip
        cleanup.callback(epp.stop)
        envoy = start_envoy(
            envoy_config(listen_port=envoy_port, epp_port=ports.grpc, admin_port=admin_port),
            workdir,
        )
        cleanup.callback(envoy.stop)
        yield KubeStack(kube, port, envoy_port, f"http://127.0.0.1:{ports.metrics}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeStack]:
    with kube_stack(tmp_path_factory.mktemp("kube-stack")) as running:
        yield running


def test_requests_reach_a_pod_once_ready_and_stop_once_it_is_deleted(stack: KubeStack) -> None:
    api = stack.kube.api
    # Only the Ready pod serves; the other one is known but not routed to.
    assert {stack.send() for _ in range(8)} == {(200, "sim-a")}
    status, pod = stack.send("sim-b")
    assert status != 200
    assert pod is None  # the EPP refused it: no pod saw it

    stack.kube.call(api.update_pod, "sim-b", ready=True)
    eventually(lambda: stack.send("sim-b") == (200, "sim-b"), "sim-b to be routed to")
    seen = {stack.send()[1] for _ in range(40)}
    assert seen == {"sim-a", "sim-b"}

    # Deleted from the API: its process still answers, but no request goes there.
    stack.kube.call(api.delete_pod, "sim-a")
    eventually(lambda: stack.send("sim-a")[0] != 200, "sim-a to leave the pool")
    assert {stack.send() for _ in range(20)} == {(200, "sim-b")}
    with urllib.request.urlopen(f"{stack.epp_admin}/debug/endpoints", timeout=5) as response:
        endpoints = json.load(response)
    assert [(e["name"], e["address"], e["ready"]) for e in endpoints] == [
        ("sim-b", stack.address("sim-b"), True)
    ]

    # Re-created (a new pod of the same name), not Ready: still not routed.
    stack.kube.call(api.put_pod, "sim-a", labels=LABELS, ip=POD_IPS["sim-a"], ready=False)
    eventually(lambda: b"sim-a" in _get(f"{stack.epp_admin}/debug/endpoints"), "sim-a listed")
    assert {stack.send() for _ in range(20)} == {(200, "sim-b")}


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as response:
        body: bytes = response.read()
        return body
