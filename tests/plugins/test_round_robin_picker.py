"""`round-robin-picker`: the candidates in turn; the turn moves only in pre_request."""

from __future__ import annotations

from epp.plugins.round_robin_picker import RoundRobinPicker

from epp.datastore import Endpoint
from epp.scheduling import CycleState, ProfileResult, SchedulingResult, ScoredEndpoint
from tests.plugins.helpers import context, make_endpoints, make_request, scored


def picker(max_endpoints: int = 1) -> RoundRobinPicker:
    return RoundRobinPicker(
        RoundRobinPicker.Parameters(max_num_of_endpoints=max_endpoints),
        context("round-robin-picker"),
    )


def send(plugin: RoundRobinPicker, candidates: list[ScoredEndpoint]) -> list[Endpoint]:
    """A real pick: pick, then the pre-request hook, as the director does."""
    cycle = CycleState()
    picked = list(plugin.pick(cycle, candidates))
    result = SchedulingResult("p", {"p": ProfileResult("p", tuple(picked), tuple(candidates))})
    plugin.pre_request(make_request(), cycle, result)
    return picked


def test_rotates_when_requests_are_sent() -> None:
    eps = make_endpoints(3)
    plugin = picker()
    candidates = scored(eps, [1.0, 0.0, 0.5])  # scores are ignored
    picked = [send(plugin, candidates)[0] for _ in range(7)]
    assert picked == [eps[0], eps[1], eps[2], eps[0], eps[1], eps[2], eps[0]]


def test_pick_without_pre_request_does_not_move() -> None:
    # /debug/explain picks without pre_request: it must not shift the rotation.
    eps = make_endpoints(3)
    plugin = picker()
    candidates = scored(eps, [0.0, 0.0, 0.0])
    send(plugin, candidates)
    for _ in range(5):
        assert plugin.pick(CycleState(), candidates) == [eps[1]]
    assert send(plugin, candidates) == [eps[1]]
    assert send(plugin, candidates) == [eps[2]]


def test_fallbacks_follow_the_turn() -> None:
    eps = make_endpoints(3)
    plugin = picker(max_endpoints=2)
    candidates = scored(eps, [0.0, 0.0, 0.0])
    assert send(plugin, candidates) == [eps[0], eps[1]]
    assert send(plugin, candidates) == [eps[1], eps[2]]
    assert send(plugin, candidates) == [eps[2], eps[0]]


def test_turn_wraps_when_the_candidates_shrink() -> None:
    eps = make_endpoints(4)
    plugin = picker()
    for _ in range(3):
        send(plugin, scored(eps, [0.0] * 4))
    # Turn 3 over two candidates is the second one.
    assert plugin.pick(CycleState(), scored(eps[:2], [0.0, 0.0])) == [eps[1]]


def test_no_candidates() -> None:
    assert list(picker().pick(CycleState(), [])) == []
