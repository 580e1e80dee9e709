"""A simulated Kubernetes API server (sim/kubeapi.py, real HTTP list + watch) and
the EPP's Kubernetes source pointed at it through the official client, with a
kubeconfig file like a user's.

    async def test_x(kube: FakeKubeApi, start_source: StartSource) -> None:
        kube.put_pool("pool", selector={"app": "vllm"}, ports=[8000])
        run = await start_source(pool_name="pool")
        await run.until(lambda: len(run.datastore.ready_endpoints()) == 1)
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from epp.datastore import Datastore
from epp.sources.kube import KubeOptions, WatchSettings
from epp.sources.kube.source import KubernetesEndpointSource
from sim.kubeapi import FakeKubeApi

TOKEN = "test-token"
# Fast enough for tests: watches end after 1-2 s, a silent one is dead 0.5 s later,
# retries start at 20 ms.
FAST = WatchSettings(
    watch_timeout_s=1.0,
    read_grace_s=0.5,
    connect_timeout_s=1.0,
    list_timeout_s=2.0,
    backoff_initial_s=0.02,
    backoff_max_s=0.2,
    min_watch_s=0.0,
)
LABELS = {"app": "vllm"}


class SourceRun:
    """A running source with its datastore."""

    def __init__(
        self, source: KubernetesEndpointSource, datastore: Datastore, registry: CollectorRegistry
    ) -> None:
        self.source = source
        self.datastore = datastore
        self.registry = registry
        self.task: asyncio.Task[None] | None = None
        self.status_calls = 0

    def endpoints(self) -> dict[str, tuple[str, bool]]:
        """name -> (address, ready)."""
        return {e.name: (e.address, e.ready) for e in self.datastore.all_endpoints()}

    def ready(self) -> set[str]:
        return {e.name for e in self.datastore.ready_endpoints()}

    def metric(self, name: str, **labels: str) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0

    async def until(
        self, condition: Callable[[], bool], timeout_s: float = 10.0, what: str = ""
    ) -> None:
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not condition():
            if asyncio.get_running_loop().time() > deadline:
                raise AssertionError(
                    f"timed out waiting for {what or condition}: endpoints {self.endpoints()},"
                    f" synced {self.datastore.synced}, reason {self.source.not_ready_reason()}"
                )
            await asyncio.sleep(0.005)

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.task = None


StartSource = Callable[..., Awaitable[SourceRun]]


@pytest.fixture
async def kube() -> AsyncIterator[FakeKubeApi]:
    api = FakeKubeApi(token=TOKEN, bookmark_interval_s=0.2)
    await api.start()
    yield api
    await api.stop()


@pytest.fixture
async def start_source(kube: FakeKubeApi, tmp_path: Path) -> AsyncIterator[StartSource]:
    runs: list[SourceRun] = []
    kubeconfig = kube.kubeconfig(tmp_path / "kubeconfig")

    async def start(run: bool = True, **options: Any) -> SourceRun:
        options.setdefault("kubeconfig", str(kubeconfig))
        options.setdefault("watch", FAST)
        datastore = Datastore()
        registry = CollectorRegistry()
        holder: list[SourceRun] = []

        def on_status() -> None:
            holder[0].status_calls += 1

        source = KubernetesEndpointSource(
            KubeOptions(**options),
            datastore,
            registry=registry,
            on_status=on_status,
            rng=random.Random(7),
        )
        source_run = SourceRun(source, datastore, registry)
        holder.append(source_run)
        if run:
            source_run.task = asyncio.create_task(source.run())
        runs.append(source_run)
        return source_run

    yield start
    for source_run in runs:
        await source_run.stop()
