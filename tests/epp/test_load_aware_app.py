"""The load-aware plugins in a real EPP: metrics scraped from real HTTP servers,
shedding by objective priority, /debug/endpoints and /debug/explain."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import pytest

from epp import cli
from epp.datastore import Endpoint
from epp.errors import Shed
from epp.requests import InferenceRequest
from epp.scheduling import PRIORITY, CycleState, PluginContext
from tests.epp.conftest import Epp, StartEpp
from tests.epp.extproc import envoy_client as ec
from tests.epp.sources.metrics_server import MetricsServer
from tests.epp.sources.pages import vllm_page

ROOT = Path(__file__).resolve().parents[2]
OBJECTIVE = "x-gateway-inference-objective"

SHEDDING = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: utilization-detector
  parameters: {queueDepthThreshold: 5, kvCacheUtilThreshold: 0.8, metricsStalenessThreshold: 1s}
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: queue-scorer, weight: 1}
  - {pluginRef: max-score-picker}
saturationDetector: {pluginRef: utilization-detector}
inferenceObjectives:
- {name: batch, priority: -1}
- {name: interactive, priority: 10}
"""

QUEUE_ONLY = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: stale-metrics-filter
- type: queue-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: stale-metrics-filter}
  - {pluginRef: queue-scorer, weight: 1}
  - {pluginRef: max-score-picker}
"""

BODY = json.dumps({"model": "m", "prompt": "hello"}).encode()


@pytest.fixture
async def servers() -> AsyncIterator[list[MetricsServer]]:
    running = [await MetricsServer().start() for _ in range(2)]
    yield running
    for server in running:
        await server.stop()


async def until(check: Callable[[], object], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():  # type: ignore[misc]
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


async def start(
    start_epp: StartEpp, servers: list[MetricsServer], config: str, **options: object
) -> Epp:
    endpoints = {f"pod-{i}": s.address for i, s in enumerate(servers)}
    return await start_epp(endpoints=endpoints, config_text=config, **options)


async def scraped(epp: Epp, waiting: list[int]) -> None:
    async def seen() -> bool:
        found = {e["name"]: e["metrics"] for e in await epp.debug_endpoints()}
        return all(
            found[f"pod-{i}"]["waiting"] == w and not found[f"pod-{i}"]["stale"]
            for i, w in enumerate(waiting)
        )

    await until(seen)


async def status_of(epp: Epp, headers: dict[str, str]) -> int | str:
    stream = epp.stream()
    try:
        reply = await ec.send_request(stream, BODY, extra=headers)
    finally:
        stream.cancel()
    if reply.kind == "request_headers":
        return "routed"
    assert reply.kind == "immediate_response", reply.message
    assert reply.status is not None
    return reply.status


async def test_a_saturated_pool_sheds_sheddable_requests_and_serves_the_rest(
    start_epp: StartEpp, servers: list[MetricsServer]
) -> None:
    for server in servers:
        server.page = vllm_page(waiting=8, kv_usage=0.5)  # 8 / 5 >= 1: saturated
    epp = await start(start_epp, servers, SHEDDING)
    await scraped(epp, [8, 8])
    assert await status_of(epp, {OBJECTIVE: "batch"}) == 429
    assert await status_of(epp, {}) == "routed"  # no objective: priority 0
    assert await status_of(epp, {OBJECTIVE: "interactive"}) == "routed"
    assert await status_of(epp, {OBJECTIVE: "unknown"}) == "routed"  # unknown: priority 0
    assert await epp.metric("epp_requests_total", {"outcome": "shed"}) == 1

    async def all_seen() -> bool:
        # The three routed requests count as waiting until a scrape sent after
        # them comes back (utilization-detector adds them to the scraped queue).
        return all(e["routedSinceScrape"] == 0 for e in await epp.debug_endpoints())

    await until(all_seen)
    # /debug/explain says why, with the scores the request would have had.
    query = {"path": "/v1/completions", "headers": {OBJECTIVE: "batch"}, "body": json.loads(BODY)}
    async with epp.http.post(f"{epp.admin_url}/debug/explain", json=query) as response:
        explained = await response.json()
    assert explained["priority"] == -1
    assert explained["saturation"] == pytest.approx(1.6)
    assert "saturated" in explained["error"]
    assert explained["picked"] == []
    # Once the queues drain, sheddable requests are served again.
    for server in servers:
        server.page = vllm_page(waiting=1, kv_usage=0.1)
    await scraped(epp, [1, 1])
    assert await status_of(epp, {OBJECTIVE: "batch"}) == "routed"


async def test_debug_endpoints_says_why_metrics_are_not_trusted(
    start_epp: StartEpp, servers: list[MetricsServer]
) -> None:
    servers[1].page = vllm_page(waiting="NaN")
    epp = await start(
        start_epp,
        servers,
        QUEUE_ONLY,
        metrics_staleness_threshold_s=0.5,
        metrics_scrape_timeout_s=0.2,
    )

    async def described() -> dict[str, dict[str, object]]:
        return {e["name"]: e["metrics"] for e in await epp.debug_endpoints()}

    async def both_scraped() -> bool:
        found = await described()
        return all(m["ageSeconds"] is not None for m in found.values())

    await until(both_scraped)
    found = await described()
    assert found["pod-0"]["reason"] is None
    assert found["pod-0"]["error"] is None
    assert "is NaN" in str(found["pod-1"]["reason"])
    assert found["pod-1"]["missing"] == {"waiting": "vllm:num_requests_waiting is NaN"}
    servers[0].page = b"<html>maintenance</html>"

    async def pod0_stale() -> bool:
        return bool((await described())["pod-0"]["stale"])

    await until(pod0_stale)
    pod0 = (await described())["pod-0"]
    assert "none of the vllm engine's metrics" in str(pod0["error"])
    assert str(pod0["reason"]).startswith("stale: last good scrape")
    # The stale pod is filtered out: every request goes to the other one.
    for _ in range(5):
        routed = await ec.route(epp.stream(), BODY)
        assert routed.destination == servers[1].address
    assert await epp.metric("epp_metrics_stale_endpoints") == 1
    assert await epp.metric("epp_metrics_scrapes_total", {"result": "bad_page"}) >= 1


async def test_explain_does_not_update_the_approximate_index_but_routing_does(
    start_epp: StartEpp, servers: list[MetricsServer]
) -> None:
    epp = await start(start_epp, servers, APPROX)
    plugin = epp.plugin("prefix-cache-scorer")
    body = {"model": "m", "prompt": "You are a helpful assistant. " * 8}
    query = {"path": "/v1/completions", "body": body}
    for _ in range(2):
        async with epp.http.post(f"{epp.admin_url}/debug/explain", json=query) as response:
            explained = await response.json()
        assert {c["scores"]["prefix-cache-scorer"] for c in explained["candidates"]} == {0.0}
    assert plugin.own.index.size == 0
    routed = await ec.route(epp.stream(), json.dumps(body).encode())
    assert plugin.own.index.size > 0
    async with epp.http.post(f"{epp.admin_url}/debug/explain", json=query) as response:
        explained = await response.json()
    assert explained["picked"] == [routed.destination]
    best = explained["candidates"][0]
    assert best["address"] == routed.destination
    assert best["scores"]["prefix-cache-scorer"] == 1.0
    facts = {e["address"]: e["approxPrefixIndex"]["blocks"] for e in await epp.debug_endpoints()}
    assert facts[routed.destination] == plugin.own.index.size


APPROX = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: prefix-cache-scorer
  parameters: {autoTune: false, blockSizeTokens: 4}
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: prefix-cache-scorer, weight: 1}
  - {pluginRef: max-score-picker}
"""


@pytest.mark.parametrize("name", ["load-aware.yaml", "approx-prefix.yaml"])
def test_example_configs_pass_epp_validate(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["validate", str(ROOT / "manifests" / "config" / name)]) == 0
    assert "valid" in capsys.readouterr().out


def test_metrics_flags_take_gie_durations() -> None:
    args = cli.build_parser().parse_args(
        [
            "serve",
            "--endpoints-file",
            "e.yaml",
            "--refresh-metrics-interval",
            "100ms",
            "--metrics-staleness-threshold",
            "3s",
            "--metrics-scrape-timeout",
            "0.5",
        ]
    )
    assert args.refresh_metrics_interval == pytest.approx(0.1)
    assert args.metrics_staleness_threshold == 3.0
    assert args.metrics_scrape_timeout == 0.5
    defaults = cli.build_parser().parse_args(["serve", "--endpoints-file", "e.yaml"])
    assert (defaults.refresh_metrics_interval, defaults.metrics_staleness_threshold) == (0.05, 2.0)
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(
            ["serve", "--endpoints-file", "e", "--refresh-metrics-interval", "0s"]
        )


class RefusesUnlabelled:
    """An `Admitter`: refuses requests without an objective; crashes on `crash`."""

    def __init__(self, params: object, context: PluginContext) -> None:
        pass

    def admit(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> None:
        if request.objective == "crash":
            raise RuntimeError("a bug in the admitter")
        if cycle.get(PRIORITY) == 0 and request.objective is None:
            raise Shed("no objective, no service")


ADMITTER = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: tests.epp.test_load_aware_app:RefusesUnlabelled
  name: gate
- type: max-score-picker
schedulingProfiles:
- name: default
inferenceObjectives:
- {name: chat, priority: 1}
"""


async def test_admitters_may_refuse_requests_and_a_broken_one_admits(
    start_epp: StartEpp,
) -> None:
    epp = await start_epp(config_text=ADMITTER)
    assert await status_of(epp, {}) == 429
    assert await status_of(epp, {OBJECTIVE: "chat"}) == "routed"
    assert await status_of(epp, {OBJECTIVE: "crash"}) == "routed"
    query = {"path": "/v1/completions", "body": json.loads(BODY)}
    async with epp.http.post(f"{epp.admin_url}/debug/explain", json=query) as response:
        explained = await response.json()
    assert explained["error"] == "no objective, no service"
    assert explained["priority"] == 0
