"""Stalled engines (epp/stalls.py), through the director on a virtual clock: a pod
where a request has waited past the threshold for its first token, with nothing
progressing there, is no candidate for a while; any progress ends it; a pod that
is only slow, a lean-mode request, or a threshold of 0 never stall anything."""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from epp.clock import VirtualClock
from epp.config import load_config
from epp.config.defaults import DEFAULT_CONFIG
from epp.datastore import Datastore, EndpointMetrics, EndpointSpec
from epp.director import Decision, Director
from epp.requests import InferenceRequest, parse_request
from epp.scheduling.registry import PluginRegistry
from epp.scheduling.types import ResponseInfo
from epp.stalls import MAX_BACKOFF
from epp.telemetry import Telemetry

PODS = ("pod-0", "pod-1", "pod-2")
ADDRESS = {name: f"10.0.0.{i + 1}:8000" for i, name in enumerate(PODS)}
THRESHOLD_S = 30.0


class Fleet:
    """Three pods scraped fine throughout, a director on a virtual clock."""

    def __init__(self, threshold_s: float = THRESHOLD_S) -> None:
        self.clock = VirtualClock(1000.0)
        self.datastore = Datastore()
        self.datastore.replace_all(EndpointSpec(n, a) for n, a in ADDRESS.items())
        self.registry = CollectorRegistry()
        config = load_config(
            DEFAULT_CONFIG,
            PluginRegistry.from_entry_points(),
            datastore=self.datastore,
            clock=self.clock,
        )
        self.director = Director(
            self.datastore,
            config,
            Telemetry(self.datastore, self.registry),
            clock=self.clock,
            stall_threshold_s=threshold_s,
        )
        self.n = 0

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        for name in PODS:  # the servers keep answering their scrapes
            self.datastore.set_metrics(
                name, EndpointMetrics(updated_at=self.clock(), staleness_s=2.0)
            )

    def request(self) -> InferenceRequest:
        self.n += 1
        body = f'{{"model": "m", "prompt": "question {self.n}"}}'.encode()
        return parse_request(
            request_id=f"r{self.n}", method="POST", path="/v1/completions", headers={}, body=body
        )

    def send(self, pod: str | None = None, reports_first_chunk: bool = True) -> Decision:
        subset = None if pod is None else [ADDRESS[pod]]
        return asyncio.run(
            self.director.pick_endpoint(
                self.request(), subset, reports_first_chunk=reports_first_chunk
            )
        )

    def candidates(self) -> list[str]:
        return [e.name for e in self.director.candidates(None)]

    def stalled_by_a_pick(self) -> list[str]:
        """Pick once (a pick starts a stall the rule finds) and answer it at once."""
        decision = self.send()
        self.director.first_chunk(decision)
        self.director.finish(decision, ResponseInfo(completed=True))
        return [e.name for e in self.director._candidates(None, record=False).stalled]

    def stalls(self) -> float:
        value = self.registry.get_sample_value("epp_endpoint_stalls_total")
        return 0.0 if value is None else value


def test_a_pod_with_a_request_waiting_and_nothing_progressing_is_left_out() -> None:
    fleet = Fleet()
    fleet.advance(1.0)
    fleet.send("pod-1")  # its first token never comes
    fleet.advance(THRESHOLD_S - 1)
    assert fleet.stalled_by_a_pick() == []  # not yet past the threshold
    fleet.advance(2.0)
    # Explain looks without starting anything: the rule is met, nothing recorded.
    explained = asyncio.run(fleet.director.explain(fleet.request()))
    assert explained["stalled"] == ["pod-1"]
    assert fleet.stalls() == 0
    assert fleet.stalled_by_a_pick() == ["pod-1"]
    assert fleet.stalls() == 1
    assert fleet.candidates() == ["pod-0", "pod-2"]
    # Fifty picks, none to pod-1.
    picked = set()
    for _ in range(50):
        decision = fleet.send()
        picked.add(decision.endpoint.name)
        fleet.director.first_chunk(decision)
        fleet.director.finish(decision, ResponseInfo(completed=True))
    assert picked == {"pod-0", "pod-2"}


def test_a_stall_lasts_while_requests_wait_there_and_ends_with_progress() -> None:
    fleet = Fleet()
    fleet.advance(1.0)
    stuck = fleet.send("pod-1")
    fleet.advance(THRESHOLD_S + 1)
    assert fleet.stalled_by_a_pick() == ["pod-1"]
    progress = fleet.datastore.get("pod-1").progress  # type: ignore[union-attr]
    # At the end of the exclusion the request still waits: had the engine moved, it
    # would have had its first token; so stalled again, for twice as long.
    fleet.advance(THRESHOLD_S + 1)
    assert fleet.stalled_by_a_pick() == ["pod-1"]
    assert progress.stalls == 2
    assert progress.excluded_until - fleet.clock() == 2 * THRESHOLD_S
    # The exclusion doubles up to its cap.
    for _ in range(4):
        fleet.advance(progress.excluded_until - fleet.clock() + 1)
        fleet.stalled_by_a_pick()
    assert progress.excluded_until - fleet.clock() == THRESHOLD_S * MAX_BACKOFF
    # The request's first token comes at last: the engine moves again, and the pod
    # is a candidate at once.
    fleet.director.first_chunk(stuck)
    assert fleet.candidates() == list(PODS)
    assert progress.stalls == 0
    assert fleet.stalls() == 6


def test_once_every_request_there_is_given_up_on_a_stalled_pod_is_tried_again() -> None:
    fleet = Fleet()
    fleet.advance(1.0)
    stuck = fleet.send("pod-1")
    fleet.advance(THRESHOLD_S + 1)
    assert fleet.stalled_by_a_pick() == ["pod-1"]
    fleet.director.finish(stuck, ResponseInfo(completed=False))  # its client gave up
    fleet.advance(THRESHOLD_S - 2)
    assert "pod-1" not in fleet.candidates()  # still excluded
    fleet.advance(3.0)
    assert "pod-1" in fleet.candidates()  # nothing waits there: a trial
    fleet.send("pod-1")
    fleet.advance(THRESHOLD_S - 1)
    assert fleet.stalled_by_a_pick() == []
    fleet.advance(2.0)
    # The trial's request waited the threshold with nothing progressing.
    assert fleet.stalled_by_a_pick() == ["pod-1"]
    progress = fleet.datastore.get("pod-1").progress  # type: ignore[union-attr]
    assert progress.stalls == 2
    assert progress.excluded_until - fleet.clock() == 2 * THRESHOLD_S


def test_a_slow_pod_whose_first_tokens_keep_coming_is_never_stalled() -> None:
    fleet = Fleet()
    fleet.advance(1.0)
    # Each request waits 40 s for its first token, but one comes every 10 s.
    waiting = [fleet.send("pod-1") for _ in range(4)]
    for _ in range(12):
        fleet.advance(10.0)
        decision = waiting.pop(0)
        fleet.director.first_chunk(decision)
        fleet.director.finish(decision, ResponseInfo(completed=True))
        waiting.append(fleet.send("pod-1"))
        assert fleet.stalled_by_a_pick() == []
    assert fleet.stalls() == 0


def test_a_completed_request_is_progress_and_one_given_up_on_is_not() -> None:
    fleet = Fleet()
    fleet.advance(1.0)
    fleet.send("pod-1")
    given_up = fleet.send("pod-1")
    fleet.advance(20.0)
    fleet.director.finish(given_up, ResponseInfo(completed=False))  # the client left
    fleet.advance(THRESHOLD_S - 10)
    assert fleet.stalled_by_a_pick() == ["pod-1"]
    other = Fleet()
    other.advance(1.0)
    other.send("pod-1")
    answered = other.send("pod-1")
    other.advance(20.0)
    # An answer is progress, whatever its status: the engine is not stuck.
    other.director.finish(answered, ResponseInfo(completed=True, status=500))
    other.advance(THRESHOLD_S - 10)
    assert other.stalled_by_a_pick() == []


def test_lean_mode_requests_and_a_threshold_of_zero_stall_nothing() -> None:
    lean = Fleet()
    lean.advance(1.0)
    lean.send("pod-1", reports_first_chunk=False)  # no first chunk will be reported
    lean.advance(10 * THRESHOLD_S)
    assert lean.stalled_by_a_pick() == []
    off = Fleet(threshold_s=0.0)
    off.advance(1.0)
    off.send("pod-1")
    off.advance(10 * THRESHOLD_S)
    assert off.stalled_by_a_pick() == []
    assert off.director.stalls.describe(off.datastore.get("pod-1"), off.clock()) == {  # type: ignore[arg-type]
        "awaitingFirstChunk": 0,
        "oldestWaitSeconds": None,
        "quietSeconds": round(off.clock(), 3),
        "stalled": False,
        "excludedForSeconds": 0.0,
        "stallsInARow": 0,
    }


def test_when_every_pod_is_stalled_all_stay_candidates() -> None:
    fleet = Fleet()
    fleet.advance(1.0)
    for pod in PODS:
        fleet.send(pod)
    fleet.advance(THRESHOLD_S + 1)
    assert fleet.candidates() == list(PODS)
    assert fleet.director.stalls.describe(fleet.datastore.get("pod-0"), fleet.clock())[  # type: ignore[arg-type]
        "stalled"
    ]
