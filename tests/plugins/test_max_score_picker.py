"""`max-score-picker`: highest total wins, ties broken at random, fallbacks in order."""

from __future__ import annotations

import random
from collections import Counter

import msgspec
import pytest
from epp.plugins.max_score_picker import MaxScorePicker

from epp.scheduling import CycleState
from tests.plugins.helpers import context, make_endpoints, scored


def picker(max_endpoints: int = 1, seed: int = 0) -> MaxScorePicker:
    plugin = MaxScorePicker(
        MaxScorePicker.Parameters(max_num_of_endpoints=max_endpoints), context("max-score-picker")
    )
    plugin._rng = random.Random(seed)
    return plugin


def test_highest_score_wins() -> None:
    eps = make_endpoints(4)
    plugin = picker()
    candidates = scored(eps, [0.2, 0.9, 0.5, 0.89])
    for _ in range(50):
        assert plugin.pick(CycleState(), candidates) == [eps[1]]


def test_ties_are_broken_randomly() -> None:
    eps = make_endpoints(4)
    plugin = picker()
    candidates = scored(eps, [0.7, 0.1, 0.7, 0.7])
    counts = Counter(plugin.pick(CycleState(), candidates)[0].name for _ in range(600))
    # Every tied endpoint gets chosen, about equally; the lower one never.
    assert set(counts) == {"ep-0", "ep-2", "ep-3"}
    assert all(count > 120 for count in counts.values()), counts


def test_fallbacks_in_score_order() -> None:
    eps = make_endpoints(5)
    plugin = picker(max_endpoints=3)
    candidates = scored(eps, [0.1, 0.8, 0.3, 0.9, 0.5])
    assert plugin.pick(CycleState(), candidates) == [eps[3], eps[1], eps[4]]


def test_fallbacks_with_ties_keep_score_order() -> None:
    eps = make_endpoints(4)
    plugin = picker(max_endpoints=4)
    candidates = scored(eps, [0.5, 1.0, 0.5, 0.0])
    seen_orders = set()
    for _ in range(100):
        picked = plugin.pick(CycleState(), candidates)
        assert picked[0] is eps[1]
        assert set(picked[1:3]) == {eps[0], eps[2]}
        assert picked[3] is eps[3]
        seen_orders.add(tuple(e.name for e in picked))
    assert len(seen_orders) == 2  # the tie among the fallbacks is broken both ways


def test_more_endpoints_asked_than_available() -> None:
    eps = make_endpoints(2)
    assert picker(max_endpoints=5).pick(CycleState(), scored(eps, [0.1, 0.2])) == [eps[1], eps[0]]


def test_single_and_no_candidates() -> None:
    (ep,) = make_endpoints(1)
    plugin = picker(max_endpoints=3)
    assert plugin.pick(CycleState(), scored([ep], [0.0])) == [ep]
    assert list(plugin.pick(CycleState(), [])) == []


def test_parameters() -> None:
    assert msgspec.convert({}, MaxScorePicker.Parameters).max_num_of_endpoints == 1
    params = msgspec.convert({"maxNumOfEndpoints": 3}, MaxScorePicker.Parameters)
    assert params.max_num_of_endpoints == 3
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"maxNumOfEndpoints": 0}, MaxScorePicker.Parameters)
