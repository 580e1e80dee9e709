"""The lean-mode completion tracker, on a real director, datastore and config: every
routed request is ended exactly once, by its access-log entry, its timeout, the
bound, or (without any access log) the end of its ext_proc stream."""

from __future__ import annotations

import logging

import pytest

from epp.clock import VirtualClock
from epp.completion import (
    DEFAULT_MAX_WAITING,
    DEFAULT_TIMEOUT_S,
    DEFAULT_WARN_AFTER_S,
    CompletionTracker,
)
from epp.config import load_config
from epp.datastore import Datastore, EndpointSpec
from epp.director import Decision, Director
from epp.requests import parse_request
from epp.scheduling.registry import PluginRegistry
from epp.scheduling.types import ResponseInfo
from epp.telemetry import Telemetry
from tests.epp.extproc.sample_plugins import MODULE, Recorder, config


class Lean:
    """A tracker on real parts, with a clock the test moves."""

    def __init__(
        self,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_waiting: int = DEFAULT_MAX_WAITING,
        warn_after_s: float = DEFAULT_WARN_AFTER_S,
    ) -> None:
        self.datastore = Datastore()
        self.datastore.replace_all(
            [EndpointSpec("pod-a", "10.0.0.1:8000"), EndpointSpec("pod-b", "10.0.0.2:8000")]
        )
        self.telemetry = Telemetry(self.datastore)
        scheduling = load_config(
            config(("recorder", f"{MODULE}:Recorder")),
            PluginRegistry.from_entry_points(),
            datastore=self.datastore,
            metrics=self.telemetry.registry,
        )
        self.clock = VirtualClock(1000.0)
        self.director = Director(self.datastore, scheduling, self.telemetry, clock=self.clock)
        self.tracker = CompletionTracker(
            self.director,
            self.telemetry,
            timeout_s=timeout_s,
            max_waiting=max_waiting,
            warn_after_s=warn_after_s,
            clock=self.clock,
        )

    async def route(self, request_id: str) -> Decision:
        request = parse_request(
            request_id=request_id,
            method="POST",
            path="/v1/completions",
            headers={"content-type": "application/json"},
            body=b'{"model": "m", "prompt": "hi"}',
        )
        decision = await self.director.pick_endpoint(request)
        self.tracker.wait(request_id, decision)
        return decision

    def in_flight(self) -> int:
        return sum(e.in_flight for e in self.datastore.all_endpoints())

    def ended(self, request_id: str) -> list[ResponseInfo]:
        recorder = self.director.config.plugins["recorder"]
        assert isinstance(recorder, Recorder)
        return recorder.for_request(request_id)

    def ends(self, how: str) -> float:
        samples = self.telemetry.registry
        return samples.get_sample_value("epp_lean_request_ends_total", {"how": how}) or 0.0

    def waiting_gauge(self) -> float:
        value = self.telemetry.registry.get_sample_value("epp_lean_waiting_requests")
        assert value is not None
        return value


async def test_the_access_log_entry_ends_the_request() -> None:
    lean = Lean()
    await lean.route("r1")
    assert lean.in_flight() == 1
    assert lean.waiting_gauge() == 1
    assert lean.tracker.complete("r1", status=200, completed=True, duration_s=1.5)
    assert lean.in_flight() == 0
    (info,) = lean.ended("r1")
    assert info == ResponseInfo(completed=True, status=200, usage=None, duration_s=1.5)
    assert lean.ends("access_log") == 1
    assert len(lean.tracker) == 0
    assert lean.waiting_gauge() == 0


async def test_an_unknown_or_repeated_request_id_changes_nothing() -> None:
    lean = Lean()
    await lean.route("r1")
    assert not lean.tracker.complete("someone-else", status=200, completed=True, duration_s=None)
    assert lean.in_flight() == 1
    assert lean.tracker.complete("r1", status=500, completed=True, duration_s=None)
    assert not lean.tracker.complete("r1", status=200, completed=True, duration_s=None)
    assert lean.in_flight() == 0
    assert [i.status for i in lean.ended("r1")] == [500]


async def test_without_timing_the_duration_is_measured_from_the_pick() -> None:
    lean = Lean()
    await lean.route("r1")
    lean.tracker.complete("r1", status=None, completed=False, duration_s=None)
    (info,) = lean.ended("r1")
    assert not info.completed
    assert info.status is None
    assert info.duration_s >= 0.0


async def test_requests_sharing_an_id_end_one_per_entry_oldest_first() -> None:
    lean = Lean()
    first = await lean.route("dup")
    second = await lean.route("dup")
    assert lean.in_flight() == 2
    assert lean.tracker.complete("dup", status=200, completed=True, duration_s=None)
    assert first.finished
    assert not second.finished
    assert lean.in_flight() == 1
    assert lean.tracker.complete("dup", status=200, completed=True, duration_s=None)
    assert lean.in_flight() == 0
    assert len(lean.tracker) == 0


async def test_a_request_ended_elsewhere_is_dropped_not_ended_twice() -> None:
    lean = Lean()
    decision = await lean.route("r1")
    # The ext_proc stream answered an error after the pick and ended it itself.
    lean.director.finish(decision, ResponseInfo(completed=False))
    assert not lean.tracker.complete("r1", status=200, completed=True, duration_s=None)
    assert len(lean.ended("r1")) == 1
    assert lean.ends("access_log") == 0
    assert len(lean.tracker) == 0


async def test_an_overdue_request_is_ended_as_aborted() -> None:
    lean = Lean(timeout_s=600.0)
    await lean.route("old")
    lean.clock.advance(300)
    await lean.route("young")
    lean.clock.advance(299)
    assert lean.tracker.expire() == 0
    assert lean.in_flight() == 2
    lean.clock.advance(1)
    assert lean.tracker.expire() == 1
    (info,) = lean.ended("old")
    assert not info.completed
    assert lean.ended("young") == []
    assert lean.in_flight() == 1
    assert lean.ends("timeout") == 1
    # Its entry, coming late, finds nothing.
    assert not lean.tracker.complete("old", status=200, completed=True, duration_s=None)
    lean.clock.advance(300)
    assert lean.tracker.expire() == 1
    assert lean.in_flight() == 0
    assert len(lean.tracker) == 0


async def test_the_bound_ends_the_oldest_as_aborted() -> None:
    lean = Lean(max_waiting=2)
    for request_id in ("a", "b", "c"):
        await lean.route(request_id)
    assert len(lean.tracker) == 2
    (info,) = lean.ended("a")
    assert not info.completed
    assert lean.ends("overflow") == 1
    assert lean.in_flight() == 2
    assert lean.tracker.complete("b", status=200, completed=True, duration_s=None)
    assert lean.tracker.complete("c", status=200, completed=True, duration_s=None)
    assert lean.in_flight() == 0


async def test_without_an_access_log_the_stream_end_ends_the_request() -> None:
    lean = Lean()
    decision = await lean.route("r1")
    lean.tracker.stream_ended("r1", decision, status=None)
    assert lean.in_flight() == 0
    (info,) = lean.ended("r1")
    assert info.completed
    assert lean.ends("stream_end") == 1
    assert len(lean.tracker) == 0


async def test_with_an_access_log_the_stream_end_is_not_the_end() -> None:
    lean = Lean()
    lean.tracker.connected()
    decision = await lean.route("r1")
    lean.tracker.stream_ended("r1", decision, status=None)
    assert lean.in_flight() == 1
    assert lean.tracker.complete("r1", status=200, completed=True, duration_s=None)
    assert lean.in_flight() == 0


async def test_the_missing_access_log_is_reported_once_after_a_grace_period(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lean = Lean(warn_after_s=60.0)
    caplog.set_level(logging.WARNING, logger="epp.completion")
    for request_id in ("r1", "r2"):
        lean.tracker.stream_ended(request_id, await lean.route(request_id), status=None)
    lean.clock.advance(59)
    lean.tracker.expire()
    assert not caplog.records
    lean.clock.advance(1)
    lean.tracker.expire()
    lean.clock.advance(100)
    lean.tracker.expire()
    (record,) = caplog.records
    assert "access log" in record.getMessage()


async def test_an_access_log_that_connects_late_silences_the_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Envoy opens its access-log stream only when it first flushes entries: the
    # first requests after a start always end before it exists.
    lean = Lean(warn_after_s=60.0)
    caplog.set_level(logging.WARNING, logger="epp.completion")
    lean.tracker.stream_ended("r1", await lean.route("r1"), status=None)
    lean.tracker.connected()
    lean.clock.advance(120)
    lean.tracker.expire()
    assert not caplog.records


def test_the_timeout_and_the_bound_must_be_positive() -> None:
    lean_parts = Lean()
    with pytest.raises(ValueError, match="positive"):
        CompletionTracker(lean_parts.director, Telemetry(Datastore()), timeout_s=0)
    with pytest.raises(ValueError, match="positive"):
        CompletionTracker(lean_parts.director, Telemetry(Datastore()), max_waiting=0)
