"""Flow control behind the director: late binding, dispatch on a request's end,
the scrape outage, explain, and the gate off (the old admission, unchanged)."""

from __future__ import annotations

import asyncio

import pytest
from epp.plugins.utilization_detector import UtilizationDetector

from epp.clock import VirtualClock
from epp.config import SchedulingConfig, load_config
from epp.datastore import Datastore, EndpointMetrics, EndpointSpec
from epp.director import Decision, Director
from epp.errors import Shed
from epp.requests import parse_request
from epp.scheduling.registry import PluginRegistry
from epp.scheduling.types import ResponseInfo
from epp.telemetry import Telemetry

CONFIG = """\
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
featureGates: [flowControl]
plugins:
- type: queue-scorer
- type: utilization-detector
  parameters: {staleMaxConcurrency: 1}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer}]
inferenceObjectives:
- {name: batch, priority: -1}
- {name: chat, priority: 10}
"""


class Fleet:
    def __init__(self, config_text: str = CONFIG, pods: int = 1) -> None:
        self.clock = VirtualClock(100.0)
        self.datastore = Datastore()
        self.datastore.replace_all(
            [EndpointSpec(f"pod-{i}", f"10.0.0.{i + 1}:8000") for i in range(pods)]
        )
        self.config: SchedulingConfig = load_config(
            config_text,
            PluginRegistry.from_entry_points(),
            datastore=self.datastore,
            clock=self.clock,
        )
        self.director = Director(
            self.datastore, self.config, Telemetry(self.datastore), clock=self.clock
        )

    @property
    def controller(self):  # type: ignore[no-untyped-def]
        assert self.config.flow_control is not None
        return self.config.flow_control

    def pick(self, request_id: str, **headers: str) -> asyncio.Task[Decision]:
        request = parse_request(
            request_id=request_id,
            method="POST",
            path="/v1/completions",
            headers={"content-type": "application/json", **headers},
            body=b'{"model": "m", "prompt": "hi"}',
        )
        return asyncio.get_running_loop().create_task(self.director.pick_endpoint(request))

    def scrape(self, name: str, waiting: int) -> None:
        """A scrape sent and answered now: it has seen every request routed so far."""
        endpoint = self.datastore.get(name)
        assert endpoint is not None
        self.datastore.set_metrics(
            name,
            EndpointMetrics(
                waiting_requests=waiting, updated_at=self.clock(), routed_seen=endpoint.routed
            ),
        )


async def settle() -> None:
    for _ in range(10):
        await asyncio.sleep(0)


async def test_a_queued_request_is_picked_when_a_request_finishes() -> None:
    fleet = Fleet()  # no metrics yet: the detector counts our own in-flight requests
    first = fleet.pick("first")
    await settle()
    decision = first.result()
    assert decision.endpoint.in_flight == 1
    second = fleet.pick("second")
    await settle()
    assert not second.done()
    assert fleet.controller.queued == 1
    fleet.director.finish(decision, ResponseInfo(completed=True))
    await settle()
    assert second.done()
    assert second.result().endpoint.name == "pod-0"
    assert fleet.controller.queued == 0
    assert fleet.controller.picking == 0


async def test_late_binding_picks_on_the_pool_as_it_is_at_dispatch() -> None:
    fleet = Fleet()
    first = fleet.pick("first")
    await settle()
    queued = fleet.pick("queued")
    await settle()
    # While it waits, the pool changes: pod-0 goes, pod-9 comes.
    fleet.datastore.replace_all([EndpointSpec("pod-9", "10.0.0.9:8000")])
    fleet.director.finish(first.result(), ResponseInfo(completed=True))
    await settle()
    assert queued.result().endpoint.name == "pod-9"


async def test_higher_priority_objectives_go_first() -> None:
    fleet = Fleet()
    first = fleet.pick("first")
    await settle()
    batch = fleet.pick("batch", **{"x-llm-d-inference-objective": "batch"})
    chat = fleet.pick("chat", **{"x-gateway-inference-objective": "chat"})
    plain = fleet.pick("plain")
    await settle()
    assert fleet.controller.queued == 3
    order: list[str] = []
    current = first.result()
    for _ in range(3):
        fleet.director.finish(current, ResponseInfo(completed=True))
        await settle()
        (done,) = [t for t in (batch, chat, plain) if t.done() and t.get_name() not in order]
        order.append(done.get_name())
        current = done.result()
    names = {batch.get_name(): "batch", chat.get_name(): "chat", plain.get_name(): "plain"}
    assert [names[n] for n in order] == ["chat", "plain", "batch"]


async def test_the_gate_counts_what_it_let_through_before_the_next_scrape() -> None:
    # Two pods, queue threshold 3, both scraped empty a moment ago. Without counting
    # the requests routed since that scrape, the gate would read 0.0 until the next
    # one and let all twelve through at once (through Envoy: pods 80 deep).
    config = CONFIG.replace("{staleMaxConcurrency: 1}", "{queueDepthThreshold: 3}")
    fleet = Fleet(config, pods=2)
    for name in ("pod-0", "pod-1"):
        fleet.scrape(name, waiting=0)
    tasks = [fleet.pick(f"r{i}") for i in range(12)]
    await settle()
    assert sum(t.done() for t in tasks) == 6  # mean (unseen / 3) reaches 1.0
    assert fleet.controller.queued == 6
    fleet.controller.notify()  # a request's end: still nothing new from the pods
    await settle()
    assert fleet.controller.queued == 6
    # The next scrapes: each engine admitted all but one of its three.
    for name in ("pod-0", "pod-1"):
        fleet.scrape(name, waiting=1)
    fleet.controller.notify()  # the recheck pass after the refresh interval
    await settle()
    # Two more each would make (1 + 2) / 3 = 1.0; the pass may overshoot that by a
    # pick still under way (not yet on an endpoint, so not yet counted).
    assert 1 <= fleet.controller.queued <= 2
    assert 10 <= sum(e.routed for e in fleet.datastore.ready_endpoints()) <= 11


async def test_a_scrape_outage_does_not_freeze_dispatch() -> None:
    config = CONFIG.replace("{staleMaxConcurrency: 1}", "{staleMaxConcurrency: 4}")
    fleet = Fleet(config)
    fleet.scrape("pod-0", waiting=10)  # fresh metrics: the engine's queue is full
    detector = fleet.config.plugins["utilization-detector"]
    assert isinstance(detector, UtilizationDetector)
    endpoints = fleet.datastore.ready_endpoints()
    # Nothing of ours in flight: the idle floor lets one through.
    first = fleet.pick("first")
    await settle()
    held = [fleet.pick(f"held-{i}") for i in range(2)]
    await settle()
    assert fleet.controller.queued == 2  # saturated by fresh metrics: they wait
    # The scrapes stop: 200 ms later the metrics are stale. llm-d's reading would
    # call the pool saturated until the scrapes come back; ours falls back to the
    # requests in flight (1 of 4 here), and the next event lets them through.
    fleet.clock.advance(0.3)
    assert detector.saturation(endpoints) == 1.0
    assert detector.dispatch_saturation(endpoints) == pytest.approx(0.25)
    fleet.controller.notify()  # the recheck timer's pass, one refresh interval later
    await settle()
    assert all(t.done() for t in held)
    assert fleet.controller.queued == 0
    # ... and it is still bounded: 3 in flight of 4, the fourth fills the pod.
    fourth = fleet.pick("fourth")
    await settle()
    assert fourth.done()
    fifth = fleet.pick("fifth")
    await settle()
    assert not fifth.done()
    fleet.director.finish(first.result(), ResponseInfo(completed=True))
    await settle()
    assert fifth.done()


async def test_explain_shows_where_the_request_would_wait() -> None:
    fleet = Fleet()
    first = fleet.pick("first")
    await settle()
    request = parse_request(
        request_id="x",
        method="POST",
        path="/v1/completions",
        headers={
            "content-type": "application/json",
            "x-llm-d-inference-objective": "batch",
            "x-llm-d-inference-fairness-id": "tenant-7",
        },
        body=b'{"model": "m", "prompt": "hi"}',
    )
    out = await fleet.director.explain(request)
    facts = out["flowControl"]
    assert facts["band"] == -1
    assert facts["flow"] == "tenant-7"
    assert facts["wouldQueue"] is True
    assert "saturation 1.00" in facts["reason"]
    assert out["priority"] == -1
    assert "error" not in out  # not shed: it would wait
    assert fleet.controller.queued == 0  # explain changes nothing
    fleet.director.finish(first.result(), ResponseInfo(completed=True))


async def test_gate_off_sheds_sheddable_requests_as_before() -> None:
    config = CONFIG.replace("featureGates: [flowControl]\n", "")
    fleet = Fleet(config)
    assert fleet.config.flow_control is None
    fleet.scrape("pod-0", waiting=10)
    batch = fleet.pick("batch", **{"x-gateway-inference-objective": "batch"})
    plain = fleet.pick("plain")
    await settle()
    with pytest.raises(Shed, match="priority -1 < 0"):
        batch.result()
    assert plain.result().endpoint.name == "pod-0"  # priority 0: always admitted
