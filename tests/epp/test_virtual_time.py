"""The scheduler, its plugins and the precise prefix service on a virtual clock,
with no sockets: what a simulation of the fleet needs.

The config is a real EndpointPickerConfig built by the real loader; KV events go
straight into the precise prefix service (`feed`); metrics are written into the
datastore as the scraper would, stamped with the virtual clock; picks go through
the real director. Nothing opens a network socket (connecting or binding one
fails the test), and the time every decision is made at is the virtual clock's.
"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from epp.clock import VirtualClock
from epp.config import load_config
from epp.datastore import Datastore, EndpointMetrics, EndpointSpec
from epp.director import Director
from epp.kvindex.events import decode_batch
from epp.kvindex.service import PrecisePrefixService
from epp.requests import parse_request
from epp.scheduling.registry import PluginRegistry
from epp.scheduling.types import ResponseInfo
from epp.telemetry import Telemetry
from tests.plugins.engine_events import stored_payload

CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: precise-prefix-cache-scorer
  name: precise
  parameters: {blockSize: 4, hashSeed: "0", speculativeIndexing: true, speculativeTTL: 2s}
- type: queue-scorer
- type: max-score-picker
  parameters: {seed: 7}
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: precise
    weight: 2
  - pluginRef: queue-scorer
  - pluginRef: max-score-picker
"""
PODS = ("pod-a", "pod-b", "pod-c")


@pytest.fixture(autouse=True)
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a socket was connected or bound")

    for method in ("connect", "connect_ex", "bind"):
        monkeypatch.setattr(socket.socket, method, refuse)


class Fleet:
    """The EPP's scheduling side, built as the server builds it, on a virtual clock."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.datastore = Datastore()
        self.datastore.replace_all(
            EndpointSpec(name, f"10.0.0.{i + 1}:8000") for i, name in enumerate(PODS)
        )
        telemetry = Telemetry(self.datastore)
        config = load_config(
            CONFIG, PluginRegistry.from_entry_points(), datastore=self.datastore, clock=clock
        )
        service = config.services["precise"]
        assert isinstance(service, PrecisePrefixService)
        self.precise = service
        self.director = Director(self.datastore, config, telemetry, clock=clock)
        self.endpoints = {e.name: e for e in self.datastore.all_endpoints()}

    def cached(self, pod: str, tokens: list[int]) -> None:
        """`pod`'s engine reports the blocks of `tokens` cached (its KV events)."""
        self.precise.feed(self.endpoints[pod], decode_batch(stored_payload(tokens)))

    def queues(self, **waiting: int) -> None:
        """A scrape of every pod's metrics, now on the virtual clock."""
        for pod in PODS:
            metrics = EndpointMetrics(waiting_requests=waiting.get(pod, 0), updated_at=self.clock())
            self.datastore.set_metrics(pod, metrics)

    def pick(self, tokens: list[int]) -> str:
        request = parse_request(
            request_id="r",
            method="POST",
            path="/v1/completions",
            headers={"content-type": "application/json"},
            body=b'{"model": "m", "max_tokens": 1, "prompt": %s}' % str(tokens).encode(),
        )
        decision = asyncio.run(self.director.pick_endpoint(request))
        self.director.finish(decision, ResponseInfo(completed=True))
        return decision.endpoint.name


def prompt(seed: int, blocks: int = 8) -> list[int]:
    return [seed * 1000 + i for i in range(blocks * 4)]


def test_the_pod_holding_the_prefix_wins_and_time_is_virtual() -> None:
    clock = VirtualClock(100.0)
    fleet = Fleet(clock)
    fleet.queues(**{"pod-b": 5})  # pod-b has a queue
    fleet.cached("pod-b", prompt(1))
    assert fleet.pick(prompt(1)) == "pod-b"  # the cached prefix outweighs the queue

    # Metrics go stale on the virtual clock, not the wall clock: past the 2 s
    # threshold the queue scorer scores every pod neutrally.
    assert fleet.endpoints["pod-b"].metrics.known("waiting", clock())
    clock.advance(3.0)
    assert not fleet.endpoints["pod-b"].metrics.known("waiting", clock())
    started = time.monotonic()
    clock.advance(3600.0)  # an hour passes in no time
    assert time.monotonic() - started < 1.0


def test_speculative_entries_live_on_the_virtual_clock() -> None:
    clock = VirtualClock(100.0)
    fleet = Fleet(clock)
    fleet.queues()
    first = fleet.pick(prompt(2))  # nobody holds it: the seeded picker chooses
    # Before any KV event arrives, the same prompt sticks to the same pod: the pick
    # was recorded as a speculative entry.
    clock.advance(1.0)
    fleet.queues()
    assert fleet.pick(prompt(2)) == first
    # Past 1.5 x the TTL the entries are gone, and with them the pull to that pod.
    clock.advance(3.5)
    fleet.queues(**{first: 3})  # and that pod now has a queue
    assert fleet.pick(prompt(2)) != first


def test_the_same_run_twice_decides_the_same() -> None:
    def run() -> list[str]:
        clock = VirtualClock(0.0)
        fleet = Fleet(clock)
        picks = []
        for step in range(30):
            clock.advance(0.25)
            fleet.queues(**{PODS[step % 3]: step % 4})
            if step % 5 == 0:
                fleet.cached(PODS[step % 2], prompt(step % 4))
            picks.append(fleet.pick(prompt(step % 6)))
        return picks

    first = run()
    assert run() == first
    assert len(set(first)) > 1  # a run that picks one pod throughout proves little
