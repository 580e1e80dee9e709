"""`epp serve` as a whole: health services, the admin server, start-up failures."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from epp.app import EppApp, ServeOptions, StartupError
from epp.config import load_config
from epp.scheduling import CycleState, Endpoint, InferenceRequest, PluginContext
from epp.scheduling.registry import PluginRegistry
from tests.epp.conftest import Epp, StartEpp, write_endpoints
from tests.epp.extproc import envoy_client as ec

SERVING = health_pb2.HealthCheckResponse.SERVING
ROUND_ROBIN = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: round-robin-picker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: round-robin-picker
"""


async def health_status(epp: Epp, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{epp.app.ports['health']}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)  # type: ignore[no-untyped-call]
        response = await stub.Check(health_pb2.HealthCheckRequest(service=service))
        return int(response.status)


async def test_grpc_health_serves_gies_services(epp: Epp) -> None:
    for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert await health_status(epp, service) == SERVING, service


async def test_grpc_health_does_not_know_other_services(epp: Epp) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await health_status(epp, "some.other.Service")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_an_app_that_has_not_started_is_not_ready(tmp_path: Path) -> None:
    endpoints = tmp_path / "endpoints.yaml"
    write_endpoints(endpoints, {"a": "10.0.0.1:8000"})
    app = EppApp(ServeOptions(endpoints_file=str(endpoints)))
    assert app.not_ready_reason() == "starting"


async def test_healthz_and_readyz(epp: Epp) -> None:
    async with epp.http.get(f"{epp.admin_url}/healthz") as response:
        assert response.status == 200
    async with epp.http.get(f"{epp.admin_url}/readyz") as response:
        assert response.status == 200
        assert (await response.text()).strip() == "ready"


async def test_debug_endpoints_are_off_unless_asked_for(start_epp: StartEpp) -> None:
    epp = await start_epp(debug_endpoints=False)
    async with epp.http.get(f"{epp.admin_url}/debug/endpoints") as response:
        assert response.status == 404
    async with epp.http.post(f"{epp.admin_url}/debug/explain", json={"path": "/"}) as response:
        assert response.status == 404
    async with epp.http.get(f"{epp.admin_url}/debug/memory") as response:
        assert response.status == 404


async def test_debug_memory_reads_the_process(epp: Epp) -> None:
    async with epp.http.get(f"{epp.admin_url}/debug/memory") as response:
        assert response.status == 200
        reading = await response.json()
    # This process (the test runs the EPP in it): tens of MiB resident, Python's
    # blocks in the tens of thousands at least; not tracing, so no sites.
    assert reading["rss_bytes"] > 10 * 2**20
    assert reading["python_blocks"] > 10_000
    assert reading["tracing"] is False
    assert reading["traced_bytes"] is None
    assert reading["sites"] == []


@pytest.mark.parametrize("sites", ["-1", "501", "ten", "1.5"])
async def test_debug_memory_refuses_a_bad_site_count(epp: Epp, sites: str) -> None:
    async with epp.http.get(f"{epp.admin_url}/debug/memory?sites={sites}") as response:
        assert response.status == 400
        body = await response.json()
    assert "sites must be a whole number from 0 to 500" in body["error"]["message"]
    assert repr(sites) in body["error"]["message"]


async def test_metrics_count_requests_by_outcome_and_time_the_plugins(epp: Epp) -> None:
    body = json.dumps({"model": "m", "prompt": "hello"}).encode()
    routed = await ec.route(epp.stream(), body)
    assert routed.destination in epp.addresses
    bad = await ec.send_request(epp.stream(), b"{not json")
    assert bad.status == 400

    assert await epp.metric("epp_requests_total", {"outcome": "routed"}) == 1
    assert await epp.metric("epp_requests_total", {"outcome": "bad_request"}) == 1
    assert await epp.metric("epp_endpoints_ready") == 3
    assert await epp.metric("epp_scheduler_duration_seconds_count") == 1
    picker = {
        "extension_point": "picker",
        "plugin_type": "max-score-picker",
        "plugin_name": "max-score-picker",
    }
    assert await epp.metric("epp_plugin_duration_seconds_count", picker) == 1


async def test_explain_shows_the_pick_and_changes_nothing(start_epp: StartEpp) -> None:
    epp = await start_epp(config_text=ROUND_ROBIN)
    query = {"path": "/v1/completions", "body": {"model": "m", "prompt": "hi"}}

    async def explain() -> dict[str, object]:
        async with epp.http.post(f"{epp.admin_url}/debug/explain", json=query) as response:
            assert response.status == 200
            result: dict[str, object] = await response.json()
            return result

    first = await explain()
    assert first["profile"] == "default"
    assert {c["address"] for c in first["candidates"]} == epp.addresses  # type: ignore[union-attr]
    # Explaining again gives the same answer: the round-robin turn did not move and
    # nothing was counted in flight.
    assert (await explain())["picked"] == first["picked"]
    assert await epp.total_in_flight() == 0
    # A real request is sent where explain said it would go.
    routed = await ec.route(epp.stream(), json.dumps(query["body"]).encode())
    assert [routed.destination] == first["picked"]


async def test_explain_rejects_a_bad_query_with_an_openai_error(epp: Epp) -> None:
    async with epp.http.post(f"{epp.admin_url}/debug/explain", data=b"[1, 2]") as response:
        assert response.status == 400
        error = (await response.json())["error"]
    assert error["code"] == 400
    assert '"path"' in error["message"]
    query = {"path": "/v1/completions", "body": {"prompt": "no model"}}
    async with epp.http.post(f"{epp.admin_url}/debug/explain", json=query) as response:
        assert response.status == 400
        assert "`model`" in (await response.json())["error"]["message"]


def test_startup_error_lists_every_bad_input(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("kind: Nope\n")
    endpoints = tmp_path / "endpoints.yaml"
    endpoints.write_text("endpoints:\n- {name: a, address: not-an-address}\n")
    with pytest.raises(StartupError) as info:
        EppApp(ServeOptions(endpoints_file=str(endpoints), config_file=str(config)))
    message = str(info.value)
    assert "kind" in message
    assert "apiVersion" in message
    assert "endpoints[0].address" in message


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_broken_config_never_starts_a_server(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text(
        "apiVersion: inference.networking.x-k8s.io/v1alpha1\nkind: EndpointPickerConfig\n"
        "plugins:\n- type: max-score-picker\n  parameters: {maxNumOfEndpoints: many}\n"
        "schedulingProfiles:\n- name: default\n  plugins:\n  - pluginRef: max-score-picker\n"
    )
    endpoints = tmp_path / "endpoints.yaml"
    write_endpoints(endpoints, {"a": "10.0.0.1:8000"})
    ports = [_free_port() for _ in range(3)]
    done = subprocess.run(
        [
            sys.executable, "-m", "epp", "serve", "--bind", "127.0.0.1",
            "--config", str(config), "--endpoints-file", str(endpoints),
            "--grpc-port", str(ports[0]), "--grpc-health-port", str(ports[1]),
            "--metrics-port", str(ports[2]),
        ],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 1
    assert "plugins[0].parameters.maxNumOfEndpoints" in done.stderr
    assert "line 5" in done.stderr
    assert all(_port_is_free(port) for port in ports)


def test_a_taken_port_is_a_clear_error(tmp_path: Path) -> None:
    endpoints = tmp_path / "endpoints.yaml"
    write_endpoints(endpoints, {"a": "10.0.0.1:8000"})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable, "-m", "epp", "serve", "--bind", "127.0.0.1",
                "--endpoints-file", str(endpoints), "--grpc-port", "0",
                "--grpc-health-port", "0", "--metrics-port", str(port),
            ],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    assert done.returncode == 1
    assert "cannot start" in done.stderr
    assert str(port) in done.stderr


def test_a_taken_grpc_port_is_a_clear_error(tmp_path: Path) -> None:
    endpoints = tmp_path / "endpoints.yaml"
    write_endpoints(endpoints, {"a": "10.0.0.1:8000"})
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable, "-m", "epp", "serve", "--bind", "127.0.0.1",
                "--endpoints-file", str(endpoints), "--grpc-port", str(port),
                "--grpc-health-port", "0", "--metrics-port", "0",
            ],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr


class Ticker:
    """A service, like the precise prefix service with its KV-event feed: built by
    the framework from its plugin's parameters, run by the server, read by the
    plugin, with facts for /debug/endpoints and metrics of its own."""

    runs: ClassVar[list[str]] = []

    def __init__(self, name: str) -> None:
        self.name = name
        self.ticks = 0
        self.ticked_three_times = asyncio.Event()

    async def run(self) -> None:
        Ticker.runs.append("started")
        try:
            while True:
                self.ticks += 1
                if self.ticks == 3:
                    self.ticked_three_times.set()
                await asyncio.sleep(0.01)
        finally:
            Ticker.runs.append("stopped")

    def describe_endpoint(self, endpoint: Endpoint) -> Mapping[str, Any]:
        return {"ticks": self.ticks, "seen": endpoint.name}

    def collector(self) -> Collector:
        ticker = self

        class Ticks(Collector):
            def collect(self) -> Iterator[Metric]:
                yield GaugeMetricFamily("test_ticks", "Ticks so far.", value=ticker.ticks)

        return Ticks()


class TickingScorer:
    """A scorer that reads the service it declares."""

    Service = staticmethod(lambda params, context: Ticker(context.name))

    def __init__(self, params: object, context: PluginContext) -> None:
        assert isinstance(context.service, Ticker)
        self.ticker = context.service

    def score(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Mapping[Endpoint, float]:
        return dict.fromkeys(endpoints, min(1.0, self.ticker.ticks / 100))


SERVICE_CONFIG = f"""\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: {__name__}:TickingScorer
  name: ticker
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: ticker
"""


async def test_a_plugins_service_runs_with_the_server(start_epp: StartEpp) -> None:
    Ticker.runs.clear()
    epp = await start_epp(config_text=SERVICE_CONFIG)
    ticker = epp.plugin("ticker").ticker
    await asyncio.wait_for(ticker.ticked_three_times.wait(), 5)
    assert Ticker.runs == ["started"]
    entries = await epp.debug_endpoints()
    assert all(e["ticks"] >= 3 and e["seen"] == e["name"] for e in entries)
    async with epp.http.get(f"{epp.admin_url}/metrics") as response:
        assert "test_ticks " in await response.text()
    await epp.aclose()
    assert Ticker.runs == ["started", "stopped"]


def test_validating_a_config_starts_no_service() -> None:
    Ticker.runs.clear()
    config = load_config(SERVICE_CONFIG, PluginRegistry.from_entry_points())
    assert list(config.services) == ["ticker"]
    assert config.plugins["ticker"].ticker is config.services["ticker"]
    assert Ticker.runs == []
