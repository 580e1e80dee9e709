"""End to end with simulated vLLM pods behind a real Envoy: the EPP scrapes their
/metrics and routes by load (manifests/config/load-aware.yaml), sheds sheddable
requests when the fleet is saturated, and avoids a pod whose metrics went stale."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from bench.stack import (
    ROOT,
    EppPorts,
    ManagedProcess,
    envoy_config,
    free_ports,
    start_envoy,
    start_epp_on_free_ports,
    write_endpoints_file,
)

OBJECTIVE = "x-gateway-inference-objective"
POD_HEADER = "x-sim-pod"
MODEL = "sim-model"


def config_text() -> str:
    """load-aware.yaml as shipped, plus GIE's saturation detector and a sheddable
    objective."""
    document: dict[str, Any] = yaml.safe_load(
        (ROOT / "manifests" / "config" / "load-aware.yaml").read_text()
    )
    document["plugins"].append(
        {"type": "utilization-detector", "parameters": {"metricsStalenessThreshold": "1s"}}
    )
    document["saturationDetector"] = {"pluginRef": "utilization-detector"}
    document["inferenceObjectives"] = [{"name": "batch", "priority": -1}]
    return yaml.safe_dump(document, sort_keys=False)


@dataclass
class SimStack:
    pods: dict[str, int]  # name -> HTTP port
    epp_ports: EppPorts
    envoy_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy_port}"

    @property
    def admin_url(self) -> str:
        return f"http://127.0.0.1:{self.epp_ports.metrics}"

    def pod_url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.pods[name]}"


@contextlib.contextmanager
def sim_stack(workdir: Path, pods: int = 3) -> Iterator[SimStack]:
    with contextlib.ExitStack() as cleanup:
        ports = dict(zip((f"sim-{i}" for i in range(pods)), free_ports(pods), strict=True))
        # One request at a time per pod, so a few requests make a queue.
        sims = [
            ManagedProcess(
                name,
                [
                    sys.executable, "-m", "sim", "serve", "--port", str(port), "--name", name,
                    "--max-num-seqs", "1",
                ],
                workdir / f"{name}.log",
            )
            for name, port in ports.items()
        ]  # fmt: skip
        for sim in sims:
            sim.start()
            cleanup.callback(sim.stop)
        for sim, port in zip(sims, ports.values(), strict=True):
            sim.wait_http_ok(f"http://127.0.0.1:{port}/health")
        endpoints = write_endpoints_file(
            workdir / "endpoints.yaml", [(n, f"127.0.0.1:{p}") for n, p in ports.items()]
        )
        config = workdir / "config.yaml"
        config.write_text(config_text())
        epp, epp_ports = start_epp_on_free_ports(
            endpoints,
            workdir,
            config_file=config,
            extra_args=[
                "--debug-endpoints",
                "--metrics-staleness-threshold",
                "500ms",
                "--metrics-scrape-timeout",
                "200ms",
            ],
        )
        cleanup.callback(epp.stop)
        envoy_port, admin_port = free_ports(2)
        envoy = start_envoy(
            envoy_config(listen_port=envoy_port, epp_port=epp_ports.grpc, admin_port=admin_port),
            workdir,
        )
        cleanup.callback(envoy.stop)
        yield SimStack(ports, epp_ports, envoy_port)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimStack]:
    with sim_stack(tmp_path_factory.mktemp("sim-stack")) as running:
        yield running


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def eventually(
    check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 10.0
) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def endpoints(http: aiohttp.ClientSession, stack: SimStack) -> dict[str, dict[str, Any]]:
    async with http.get(stack.admin_url + "/debug/endpoints") as response:
        return {e["name"]: e for e in await response.json()}


async def completion(
    http: aiohttp.ClientSession,
    url: str,
    prompt: str,
    max_tokens: int,
    headers: dict[str, str] | None = None,
) -> tuple[int, str | None]:
    async with http.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens},
        headers=headers or {},
    ) as response:
        await response.read()
        return response.status, response.headers.get(POD_HEADER)


@contextlib.asynccontextmanager
async def queued(
    http: aiohttp.ClientSession, stack: SimStack, pods: list[str], depth: int
) -> AsyncIterator[None]:
    """Long requests sent straight to `pods` (not through the EPP) so each has
    `depth` waiting; they are abandoned (the pod aborts them) on exit."""
    tasks = [
        asyncio.create_task(completion(http, stack.pod_url(pod), f"preload {pod} {i}", 400))
        for pod in pods
        for i in range(depth + 1)
    ]

    async def seen() -> bool:
        found = await endpoints(http, stack)
        return all(found[pod]["metrics"]["waiting"] >= depth for pod in pods)

    try:
        await eventually(seen, f"{pods} to queue {depth} requests")
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

        async def drained() -> bool:
            found = await endpoints(http, stack)
            return all(found[pod]["metrics"]["waiting"] == 0 for pod in pods)

        await eventually(drained, "the queues to drain")


async def test_a_pod_with_a_long_queue_gets_less_traffic(
    stack: SimStack, http: aiohttp.ClientSession
) -> None:
    async with queued(http, stack, ["sim-0"], depth=4):
        landed: Counter[str | None] = Counter()
        for i in range(24):
            status, pod = await completion(http, stack.url, f"question {i}", 2)
            assert status == 200
            landed[pod] += 1
    assert landed["sim-0"] <= 2, landed  # a scrape may lag a pick or two
    assert landed["sim-1"] + landed["sim-2"] >= 22


async def test_a_saturated_fleet_sheds_sheddable_requests_and_serves_the_rest(
    stack: SimStack, http: aiohttp.ClientSession
) -> None:
    served: list[asyncio.Task[tuple[int, str | None]]] = []
    async with queued(http, stack, list(stack.pods), depth=5):
        status, _ = await completion(http, stack.url, "a batch job", 2, {OBJECTIVE: "batch"})
        assert status == 429
        async with http.get(stack.admin_url + "/metrics") as response:
            assert 'epp_requests_total{outcome="shed"} 1.0' in await response.text()
        served = [
            asyncio.create_task(completion(http, stack.url, "an interactive question", 2)),
            asyncio.create_task(
                completion(http, stack.url, "another", 2, {OBJECTIVE: "unknown-objective"})
            ),
        ]

        async def admitted() -> bool:
            found = await endpoints(http, stack)
            return sum(e["inFlight"] for e in found.values()) == 2

        # Routed while the fleet is saturated; they finish once the queues go.
        await eventually(admitted, "the non-sheddable requests to be routed")
    assert [status for status, _ in await asyncio.gather(*served)] == [200, 200]
    status, _ = await completion(http, stack.url, "a batch job, later", 2, {OBJECTIVE: "batch"})
    assert status == 200


async def test_a_pod_whose_metrics_went_stale_is_avoided(
    stack: SimStack, http: aiohttp.ClientSession
) -> None:
    slow = stack.pod_url("sim-1") + "/sim/metrics-delay"
    async with http.post(slow, json={"seconds": 5}) as response:
        assert response.status == 200
    try:

        async def stale() -> bool:
            return bool((await endpoints(http, stack))["sim-1"]["metrics"]["stale"])

        await eventually(stale, "sim-1's metrics to go stale")
        described = (await endpoints(http, stack))["sim-1"]["metrics"]
        assert "no answer within 0.2s" in described["reason"]
        landed = Counter()
        for i in range(12):
            status, pod = await completion(http, stack.url, f"while stale {i}", 2)
            assert status == 200
            landed[pod] += 1
        assert landed["sim-1"] == 0, landed
        assert landed["sim-0"] > 0
        assert landed["sim-2"] > 0
    finally:
        async with http.post(slow, json={"seconds": 0}) as response:
            assert response.status == 200

    async def fresh() -> bool:
        return not (await endpoints(http, stack))["sim-1"]["metrics"]["stale"]

    await eventually(fresh, "sim-1's metrics to be fresh again")


def test_config_is_the_shipped_example_plus_admission() -> None:
    document = yaml.safe_load(config_text())
    assert [p["type"] for p in document["plugins"]][:5] == [
        "stale-metrics-filter",
        "queue-scorer",
        "kv-cache-utilization-scorer",
        "active-request-scorer",
        "max-score-picker",
    ]
    assert json.dumps(document["inferenceObjectives"]) == '[{"name": "batch", "priority": -1}]'
