"""A real EPP (`epp.app.EppApp`) running in-process on the test's event loop, with
a real endpoints file, real gRPC ports and the real admin HTTP server.

    async def test_x(epp: Epp) -> None:              # default config, 3 endpoints
        stream = epp.stream()                        # an ext_proc stream, as Envoy opens it
        log = epp.access_log()                       # an access-log stream (lean mode)
        ...

    async def test_y(start_epp: StartEpp) -> None:   # anything else
        epp = await start_epp(config_text=..., max_body_bytes=1000, endpoints={})
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from epp._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from epp.app import EppApp, ServeOptions
from epp.extproc.stream import RequestStream
from tests.epp.extproc.als_client import AccessLogStream
from tests.epp.extproc.envoy_client import EnvoyStream

ENDPOINTS = {
    "pod-a": "10.0.0.1:8000",
    "pod-b": "10.0.0.2:8000",
    "pod-c": "10.0.0.3:8000",
}


class Epp:
    """A running EPP and the means to talk to it."""

    def __init__(self, app: EppApp, endpoints: dict[str, str]) -> None:
        self.app = app
        self.endpoints = endpoints
        self.addresses = set(endpoints.values())
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{app.ports['grpc']}")
        self.admin_url = f"http://127.0.0.1:{app.ports['metrics']}"
        self.http = aiohttp.ClientSession()

    def stream(self) -> EnvoyStream:
        return EnvoyStream(self.channel)

    def access_log(self) -> AccessLogStream:
        return AccessLogStream(self.channel)

    def plugin(self, name: str) -> Any:
        return self.app.director.config.plugins[name]

    async def debug_endpoints(self) -> list[dict[str, Any]]:
        async with self.http.get(f"{self.admin_url}/debug/endpoints") as response:
            assert response.status == 200
            data: list[dict[str, Any]] = await response.json()
            return data

    async def in_flight(self) -> dict[str, int]:
        """`inFlight` per endpoint address, from /debug/endpoints."""
        return {e["address"]: e["inFlight"] for e in await self.debug_endpoints()}

    async def total_in_flight(self) -> int:
        return sum((await self.in_flight()).values())

    async def wait_in_flight(self, expected: int, timeout_s: float = 5.0) -> int:
        """Poll until the total in-flight count is `expected`; the last value seen.

        The end of a stream is processed by the server after the client has moved
        on, so the count is allowed a moment to settle; the caller asserts."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            total = await self.total_in_flight()
            if total == expected or asyncio.get_running_loop().time() > deadline:
                return total
            await asyncio.sleep(0.01)

    async def metric(self, name: str, labels: dict[str, str] | None = None) -> float:
        """The value of one sample on /metrics (0.0 if it is absent)."""
        async with self.http.get(f"{self.admin_url}/metrics") as response:
            assert response.status == 200
            text = await response.text()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and (labels is None or sample.labels == labels):
                    return float(sample.value)
        return 0.0

    async def wait_metric(
        self, name: str, labels: dict[str, str] | None, expected: float, timeout_s: float = 5.0
    ) -> float:
        """Poll until a sample reaches `expected`; the last value seen."""
        deadline = asyncio.get_running_loop().time() + timeout_s
        while True:
            value = await self.metric(name, labels)
            if value >= expected or asyncio.get_running_loop().time() > deadline:
                return value
            await asyncio.sleep(0.01)

    async def aclose(self) -> None:
        await self.http.close()
        await self.channel.close()
        await self.app.stop()


StartEpp = Callable[..., Awaitable[Epp]]


def write_endpoints(
    path: Path, endpoints: dict[str, str], labels: dict[str, dict[str, str]] | None = None
) -> None:
    """`labels`: endpoint name -> its labels (none for the others)."""
    labels = labels or {}
    document = {
        "endpoints": [
            {"name": n, "address": a, **({"labels": labels[n]} if n in labels else {})}
            for n, a in endpoints.items()
        ]
    }
    path.write_text(yaml.safe_dump(document), encoding="utf-8")


def local_options(endpoints_file: Path, **fields: Any) -> ServeOptions:
    """`ServeOptions` for an in-process EPP on loopback, on ports the OS picks;
    `fields`: any other option."""
    return ServeOptions(
        endpoints_file=str(endpoints_file),
        bind="127.0.0.1",
        grpc_port=0,
        grpc_health_port=0,
        metrics_port=0,
        **fields,
    )


@contextlib.contextmanager
def app_on_runner(options: ServeOptions) -> Iterator[tuple[asyncio.Runner, EppApp]]:
    """An EPP started on an event loop of its own, for module-scoped fixtures whose
    (synchronous, hypothesis-driven) tests drive it through `runner.run`."""
    runner = asyncio.Runner()
    app = EppApp(options)
    try:
        runner.run(app.start())
        yield runner, app
    finally:
        runner.run(app.stop())
        runner.close()


@pytest.fixture
async def start_epp(tmp_path: Path) -> AsyncIterator[StartEpp]:
    """Start EPPs with the given endpoints, config text and body limit; all are
    stopped at teardown."""
    running: list[Epp] = []

    async def start(
        endpoints: dict[str, str] | None = None,
        config_text: str | None = None,
        max_body_bytes: int | None = None,
        lean_completion_timeout_s: float | None = None,
        debug_endpoints: bool = True,
        labels: dict[str, dict[str, str]] | None = None,
        **options: Any,
    ) -> Epp:
        """`options`: more `ServeOptions` fields (metrics scraping flags, say);
        `labels`: endpoint name -> its labels."""
        pool = ENDPOINTS if endpoints is None else endpoints
        endpoints_file = tmp_path / f"endpoints-{len(running)}.yaml"
        write_endpoints(endpoints_file, pool, labels)
        extra: dict[str, Any] = dict(options)
        if max_body_bytes is not None:
            extra["max_body_bytes"] = max_body_bytes
        if lean_completion_timeout_s is not None:
            extra["lean_completion_timeout_s"] = lean_completion_timeout_s
        app = EppApp(
            local_options(
                endpoints_file,
                config_text=config_text,
                debug_endpoints=debug_endpoints,
                shutdown_grace_s=0.5,
                **extra,
            )
        )
        await app.start()
        epp = Epp(app, dict(pool))
        running.append(epp)
        return epp

    yield start
    for epp in running:
        await epp.aclose()


@pytest.fixture
async def epp(start_epp: StartEpp) -> Epp:
    """The EPP with its default config and three endpoints."""
    return await start_epp()


class HandledMessages:
    """Counts the messages the EPP's streams have finished handling, by kind, so a
    test can act once the server has really read what it sent (the only way to know
    it when the protocol says the EPP must not answer yet)."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self._changed = asyncio.Condition()

    async def record(self, kind: str) -> None:
        async with self._changed:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            self._changed.notify_all()

    async def wait_for(self, kind: str, count: int = 1, timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s), self._changed:
            await self._changed.wait_for(lambda: self.counts.get(kind, 0) >= count)


@pytest.fixture
def handled(monkeypatch: pytest.MonkeyPatch) -> HandledMessages:
    """Observe `RequestStream.handle` (it still does all its real work)."""
    seen = HandledMessages()
    real_handle = RequestStream.handle

    async def handle(self: RequestStream, message: pb.ProcessingRequest) -> list[Any]:
        try:
            return await real_handle(self, message)
        finally:
            await seen.record(message.WhichOneof("request") or "")

    monkeypatch.setattr(RequestStream, "handle", handle)
    return seen
