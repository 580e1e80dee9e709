"""The EPP serving with the Kubernetes source (in-process `EppApp`, real gRPC and
admin HTTP, the simulated API server): it is ready (/readyz, gRPC health) only
once it has a complete view of the pool, and says why not until then."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from epp.app import EppApp, ServeOptions
from epp.sources.kube import KubeOptions
from sim.kubeapi import POOLS_V1, FakeKubeApi
from tests.epp.conftest import Epp
from tests.epp.extproc import envoy_client as ec
from tests.epp.sources.kube.conftest import FAST, LABELS, TOKEN

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
BODY = json.dumps({"model": "m", "prompt": "hello"}).encode()

StartKubeEpp = Callable[..., Awaitable[Epp]]


@pytest.fixture
async def start_kube_epp(tmp_path: Path) -> AsyncIterator[StartKubeEpp]:
    running: list[Epp] = []

    async def start(api: FakeKubeApi, **kube: Any) -> Epp:
        kubeconfig = api.kubeconfig(tmp_path / f"kubeconfig-{len(running)}")
        options = ServeOptions(
            kube=KubeOptions(kubeconfig=str(kubeconfig), watch=FAST, **kube),
            grpc_port=0,
            grpc_health_port=0,
            metrics_port=0,
            bind="127.0.0.1",
            debug_endpoints=True,
            shutdown_grace_s=0.5,
        )
        app = EppApp(options)
        await app.start()
        epp = Epp(app, {})
        running.append(epp)
        return epp

    yield start
    for epp in running:
        await epp.aclose()


async def health(epp: Epp, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.app.ports['health']}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)  # type: ignore[no-untyped-call]
        response = await stub.Check(health_pb2.HealthCheckRequest(service=service))
        return int(response.status)


async def readyz(epp: Epp) -> tuple[int, str]:
    async with epp.http.get(f"{epp.admin_url}/readyz") as response:
        return response.status, await response.text()


async def until_readyz(epp: Epp, status: int, says: str = "", timeout_s: float = 10.0) -> str:
    """Poll /readyz until it answers `status` with `says` in its text; the text."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        code, text = await readyz(epp)
        if code == status and says in text:
            return text
        assert asyncio.get_running_loop().time() < deadline, f"/readyz still {code}: {text}"
        await asyncio.sleep(0.01)


async def test_unreachable_api_at_start_keeps_the_epp_unready_saying_why(
    start_kube_epp: StartKubeEpp,
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    api = FakeKubeApi(token=TOKEN)
    api.port = port  # nothing listens there yet
    api.put_pool("pool", selector=LABELS, ports=[8000])
    api.put_pod("vllm-0", labels=LABELS, ip="10.0.0.1", ready=True)
    epp = await start_kube_epp(api, pool_name="pool")
    # Started (alive, answering), not ready, and saying why.
    text = await until_readyz(epp, 503, "unreachable")
    assert text.startswith("not ready: Kubernetes: cannot list inferencepools")
    assert f"the API server at http://127.0.0.1:{port} is unreachable" in text
    assert "retrying in" in text
    assert await health(epp, "liveness") == SERVING
    for service in ("", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert await health(epp, service) == NOT_SERVING
    # A request meanwhile is refused cleanly (503, the OpenAI error shape).
    reply = await ec.send_request(epp.stream(), BODY)
    assert reply.status == 503

    await api.start(port=port)
    try:
        assert await until_readyz(epp, 200) == "ready\n"
        assert await health(epp, "readiness") == SERVING
        stream = epp.stream()
        assert (await ec.route(stream, BODY)).destination == "10.0.0.1:8000"
        stream.cancel()
    finally:
        await api.stop()


async def test_the_reason_names_the_missing_rbac_verb(
    kube: FakeKubeApi, start_kube_epp: StartKubeEpp
) -> None:
    kube.put_pool("pool", selector=LABELS, ports=[8000])
    kube.put_pod("vllm-0", labels=LABELS, ip="10.0.0.1", ready=True)
    kube.forbid("watch", "inferencepools")
    kube.forbid("list", "pods")
    epp = await start_kube_epp(kube, pool_name="pool")
    text = await until_readyz(epp, 503, "RBAC")
    assert "lacks RBAC verb 'list' on resource 'pods' of the core API group" in text
    assert (
        await epp.metric(
            "epp_kubernetes_errors_total",
            {"resource": "pods", "operation": "list", "reason": "forbidden"},
        )
        >= 1
    )
    kube.allow("list", "pods")
    await until_readyz(epp, 200)
    # The pool's watch is still forbidden: the EPP serves from its list and says so
    # in the metrics (and the log), retrying with backoff.
    assert (
        await epp.wait_metric(
            "epp_kubernetes_errors_total",
            {"resource": "inferencepools", "operation": "watch", "reason": "forbidden"},
            1,
        )
        >= 1
    )


async def test_readiness_follows_the_pool(kube: FakeKubeApi, start_kube_epp: StartKubeEpp) -> None:
    kube.put_pod("vllm-0", labels=LABELS, ip="10.0.0.1", ready=True)
    epp = await start_kube_epp(kube, pool_name="pool")
    text = await until_readyz(epp, 503, "not found")
    assert "InferencePool default/pool not found; waiting for it to be created" in text

    kube.put_pool("pool", selector=LABELS, ports=[8000])
    await until_readyz(epp, 200)
    assert await health(epp, "readiness") == SERVING

    kube.delete(POOLS_V1, "default", "pool")
    text = await until_readyz(epp, 503, "deleted")
    assert "InferencePool default/pool was deleted; waiting for it to be re-created" in text
    assert await health(epp, "readiness") == NOT_SERVING
    assert await epp.debug_endpoints() == []

    kube.put_pool("pool", selector=LABELS, ports=[8000])
    await until_readyz(epp, 200)
    assert await health(epp, "readiness") == SERVING
    assert await epp.metric("epp_kubernetes_pods", {"state": "ready"}) == 1


async def test_an_empty_pool_is_ready_but_routes_nothing(
    kube: FakeKubeApi, start_kube_epp: StartKubeEpp
) -> None:
    # Standalone: no InferencePool, no pods yet. Ready (the view is complete), and
    # every request gets a clean 503 until a pod is Ready.
    epp = await start_kube_epp(kube, endpoint_selector=LABELS, endpoint_target_ports=(8000,))
    await until_readyz(epp, 200)
    reply = await ec.send_request(epp.stream(), BODY)
    assert reply.status == 503
    kube.put_pod("vllm-0", labels=LABELS, ip="10.0.0.1", ready=True)
    assert await epp.wait_metric("epp_endpoints_ready", None, 1) == 1
    stream = epp.stream()
    assert (await ec.route(stream, BODY)).destination == "10.0.0.1:8000"
    stream.cancel()
