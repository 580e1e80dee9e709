"""`weighted-random-picker`: chosen in proportion to the score."""

from __future__ import annotations

import random
from collections import Counter

from epp.plugins.weighted_random_picker import WeightedRandomPicker

from epp.scheduling import CycleState
from tests.plugins.helpers import context, make_endpoints, scored


def picker(max_endpoints: int = 1, seed: int = 0) -> WeightedRandomPicker:
    plugin = WeightedRandomPicker(
        WeightedRandomPicker.Parameters(max_num_of_endpoints=max_endpoints),
        context("weighted-random-picker"),
    )
    plugin._rng = random.Random(seed)
    return plugin


def test_frequencies_proportional_to_score() -> None:
    eps = make_endpoints(4)
    weights = [0.1, 0.2, 0.3, 0.4]
    plugin = picker(seed=7)
    candidates = scored(eps, weights)
    picks = 20000
    counts = Counter(plugin.pick(CycleState(), candidates)[0].name for _ in range(picks))
    for endpoint, weight in zip(eps, weights, strict=True):
        share = counts[endpoint.name] / picks
        assert abs(share - weight) < 0.02, (endpoint.name, share, weight)


def test_zero_scores_only_after_positive_ones() -> None:
    eps = make_endpoints(5)
    plugin = picker(max_endpoints=5, seed=3)
    candidates = scored(eps, [0.0, 0.05, 0.0, 0.9, 0.0])
    tails = set()
    for _ in range(300):
        picked = plugin.pick(CycleState(), candidates)
        assert len(picked) == 5
        assert set(picked[:2]) == {eps[1], eps[3]}
        assert set(picked[2:]) == {eps[0], eps[2], eps[4]}
        tails.add(tuple(e.name for e in picked[2:]))
    assert len(tails) == 6  # the zero-score tail is shuffled uniformly: all orders appear


def test_a_low_positive_score_still_beats_zero() -> None:
    eps = make_endpoints(2)
    plugin = picker(seed=1)
    candidates = scored(eps, [0.0, 1e-6])
    for _ in range(200):
        assert plugin.pick(CycleState(), candidates) == [eps[1]]


def test_all_zero_is_uniform() -> None:
    eps = make_endpoints(3)
    plugin = picker(seed=11)
    candidates = scored(eps, [0.0, 0.0, 0.0])
    picks = 3000
    counts = Counter(plugin.pick(CycleState(), candidates)[0].name for _ in range(picks))
    for endpoint in eps:
        assert abs(counts[endpoint.name] - picks / 3) < picks * 0.05, counts


def test_count_and_distinct() -> None:
    eps = make_endpoints(6)
    plugin = picker(max_endpoints=4, seed=5)
    for _ in range(50):
        picked = plugin.pick(CycleState(), scored(eps, [0.3, 0.1, 0.0, 1.0, 0.5, 0.2]))
        assert len(picked) == 4
        assert len(set(picked)) == 4
    assert plugin.pick(CycleState(), []) == []
    assert len(picker(max_endpoints=9).pick(CycleState(), scored(eps[:2], [0.1, 0.2]))) == 2


def test_seeded_picks_are_reproducible() -> None:
    eps = make_endpoints(5)
    candidates = scored(eps, [0.2, 0.2, 0.2, 0.2, 0.2])
    one, two = picker(seed=42), picker(seed=42)
    first = [one.pick(CycleState(), candidates)[0].name for _ in range(20)]
    second = [two.pick(CycleState(), candidates)[0].name for _ in range(20)]
    assert first == second
    assert len(set(first)) > 1
