"""The flow-control policy plugins (llm-d's names) and the utilization detector's
dispatch reading."""

from __future__ import annotations

import msgspec
import pytest
from epp.plugins.fcfs_ordering_policy import FcfsOrderingPolicy
from epp.plugins.global_strict_fairness_policy import GlobalStrictFairnessPolicy
from epp.plugins.program_aware_fairness import ProgramAwareFairness
from epp.plugins.round_robin_fairness_policy import RoundRobinFairnessPolicy
from epp.plugins.soft_reflective_ceiling_policy import SoftReflectiveCeilingPolicy
from epp.plugins.static_usage_limit_policy import StaticUsageLimitPolicy
from epp.plugins.utilization_detector import UtilizationDetector

from epp.clock import VirtualClock
from epp.datastore import EndpointMetrics
from epp.flowcontrol import FlowQueue, QueueItem
from epp.requests import InferenceRequest, parse_request
from epp.scheduling import CycleState, NoParameters, ResponseInfo, SchedulingResult
from epp.scheduling.types import Usage
from tests.plugins.helpers import context, make_endpoints

FCFS = FcfsOrderingPolicy(NoParameters(), context("fcfs"))


def flow(flow_id: str, *enqueued_at: float) -> FlowQueue:
    queue = FlowQueue(flow_id, FCFS)
    for i, at in enumerate(enqueued_at):
        queue.push(QueueItem(f"{flow_id}-{i}", flow_id, 0, 1, enqueued_at=at, seq=int(at * 1000)))
    return queue


def test_round_robin_takes_turns_and_skips_to_the_next_id() -> None:
    policy = RoundRobinFairnessPolicy(NoParameters(), context("rr"))
    state = policy.new_state()
    a, b, c = flow("a", 1.0), flow("b", 2.0), flow("c", 3.0)
    picks = [policy.pick_flow([a, b, c], state, 0.0) for _ in range(4)]
    assert [p.flow_id for p in picks if p is not None] == ["a", "b", "c", "a"]
    # `b` emptied meanwhile: the turn after `a` is `c`.
    assert policy.pick_flow([a, c], state, 0.0) is c
    # Each band has its own cursor.
    assert policy.pick_flow([a, b, c], policy.new_state(), 0.0) is a


def test_global_strict_takes_the_earliest_head() -> None:
    policy = GlobalStrictFairnessPolicy(NoParameters(), context("gs"))
    a, b = flow("a", 5.0, 6.0), flow("b", 2.0)
    assert policy.pick_flow([a, b], policy.new_state(), 10.0) is b


def request(fairness_id: str) -> InferenceRequest:
    return parse_request(
        request_id="r",
        method="POST",
        path="/v1/completions",
        headers={"x-llm-d-inference-fairness-id": fairness_id},
        body=b'{"model": "m", "prompt": "p"}',
    )


def finish(policy: ProgramAwareFairness, program: str, prompt: int, completion: int) -> None:
    policy.post_response(
        request(program),
        CycleState(),
        SchedulingResult("default", {}),
        ResponseInfo(completed=True, usage=Usage(prompt, completion)),
    )


def test_program_aware_serves_the_least_served_program_first() -> None:
    clock = VirtualClock(0.0)
    policy = ProgramAwareFairness(ProgramAwareFairness.Parameters(), context("paf", clock))
    finish(policy, "heavy", prompt=1000, completion=500)  # 2000 weighted tokens
    finish(policy, "light", prompt=100, completion=50)  # 200
    assert policy.attained_service("heavy", 0.0) == 2000
    heavy, light = flow("heavy", 0.0), flow("light", 1.0)  # heavy has waited longer
    assert policy.pick_flow([heavy, light], None, 2.0) is light
    # A new program has had nothing: it goes first.
    fresh = flow("new", 1.5)
    assert policy.pick_flow([heavy, light, fresh], None, 2.0) is fresh


def test_program_aware_decays_service_and_forgets_idle_programs() -> None:
    clock = VirtualClock(0.0)
    params = ProgramAwareFairness.Parameters(
        las_half_life_seconds=60, eviction_ttl_seconds=100, eviction_sweep_seconds=10
    )
    policy = ProgramAwareFairness(params, context("paf", clock))
    finish(policy, "p", prompt=1000, completion=0)
    assert policy.attained_service("p", 60.0) == pytest.approx(500)
    assert policy.attained_service("p", 120.0) == pytest.approx(250)
    clock.advance(200)
    finish(policy, "q", prompt=1, completion=0)  # the sweep runs on the request path
    assert "p" not in policy.programs


def test_program_aware_rejects_unknown_strategies() -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"strategy": "wfq"}, ProgramAwareFairness.Parameters)


def test_static_usage_limit() -> None:
    policy = StaticUsageLimitPolicy(
        StaticUsageLimitPolicy.Parameters(threshold=0.8), context("static")
    )
    assert list(policy.compute_limits(0.5, [5, 0, -1])) == [0.8, 0.8, 0.8]


def test_soft_reflective_ceiling() -> None:
    policy = SoftReflectiveCeilingPolicy(SoftReflectiveCeilingPolicy.Parameters(), context("soft"))
    assert list(policy.compute_limits(0.9, [0])) == [1.0]  # one band: always open
    # Low saturation: every band's reflective ceiling is above it.
    assert list(policy.compute_limits(0.2, [2, 1, 0])) == [1.0, 1.0, 1.0]
    # Saturated: only the top band keeps its 1.0 (and the controller stops it at 1.0).
    assert list(policy.compute_limits(1.0, [2, 1, 0])) == [1.0, 0.0, 0.0]
    # s = 0.75 with 3 bands: ceilings 1, 0.625, 0.25: the lower two are past theirs
    # and open on one call in round(0.75 / 0.25) = 3, together.
    opened = [list(policy.compute_limits(0.75, [2, 1, 0])) for _ in range(6)]
    assert all(c[0] == 1.0 and c[1] == c[2] for c in opened)
    assert sum(c[1] == 1.0 for c in opened) == 2
    # s = 0.5: band 1's ceiling 0.75 is above it (open); band 2's 0.5 is not.
    ceilings = [list(policy.compute_limits(0.5, [2, 1, 0])) for _ in range(2)]
    assert all(c[:2] == [1.0, 1.0] for c in ceilings)


def test_the_highest_band_may_keep_going_past_saturation() -> None:
    params = msgspec.convert({"highestBandCeiling": 1.5}, SoftReflectiveCeilingPolicy.Parameters)
    policy = SoftReflectiveCeilingPolicy(params, context("soft"))
    # Past saturation the others are closed; the top band's ceiling is 1.5, so the
    # controller dispatches it until the pool reads 1.5.
    assert list(policy.compute_limits(1.2, [2, 1, 0])) == [1.5, 0.0, 0.0]
    assert list(policy.compute_limits(0.2, [2, 1, 0])) == [1.5, 1.0, 1.0]
    assert list(policy.compute_limits(1.2, [0])) == [1.5]
    with pytest.raises(msgspec.ValidationError, match="highestBandCeiling"):
        msgspec.convert({"highestBandCeiling": 0.9}, SoftReflectiveCeilingPolicy.Parameters)


def test_utilization_detector_judges_stale_endpoints_by_in_flight_for_dispatch() -> None:
    clock = VirtualClock(100.0)
    params = UtilizationDetector.Parameters(stale_max_concurrency=4)
    detector = UtilizationDetector(params, context("utilization-detector", clock))
    fresh, stale = make_endpoints(2)
    fresh.metrics = EndpointMetrics(waiting_requests=5, updated_at=clock())  # full: 1.0
    stale.metrics = EndpointMetrics(waiting_requests=0, updated_at=clock() - 10)
    stale.in_flight = 2
    # Admission (gate off) is unchanged: stale counts as saturated.
    assert detector.saturation([fresh, stale]) == pytest.approx(1.0)
    # Dispatch: the stale one by its in-flight count, 2 of 4.
    assert detector.dispatch_saturation([fresh, stale]) == pytest.approx((1.0 + 0.5) / 2)
    unreachable = make_endpoints(1)[0]
    unreachable.metrics = EndpointMetrics(updated_at=clock(), unreachable=True)
    assert detector.dispatch_saturation([unreachable]) == 0.0
    assert detector.dispatch_saturation([]) == 1.0
