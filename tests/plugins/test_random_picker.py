"""`random-picker`: uniform over the candidates, scores ignored."""

from __future__ import annotations

import random
from collections import Counter

from epp.plugins.random_picker import RandomPicker

from epp.scheduling import CycleState
from tests.plugins.helpers import context, make_endpoints, scored


def picker(max_endpoints: int = 1, seed: int = 0) -> RandomPicker:
    plugin = RandomPicker(
        RandomPicker.Parameters(max_num_of_endpoints=max_endpoints), context("random-picker")
    )
    plugin._rng = random.Random(seed)
    return plugin


def test_roughly_uniform_whatever_the_scores() -> None:
    eps = make_endpoints(4)
    plugin = picker()
    candidates = scored(eps, [1.0, 0.0, 0.0, 0.5])
    picks = 4000
    counts = Counter(plugin.pick(CycleState(), candidates)[0].name for _ in range(picks))
    assert set(counts) == {e.name for e in eps}
    for count in counts.values():
        assert abs(count - picks / 4) < picks * 0.05, counts


def test_count_and_distinct() -> None:
    eps = make_endpoints(5)
    plugin = picker(max_endpoints=3)
    candidates = scored(eps, [0.5] * 5)
    for _ in range(50):
        picked = plugin.pick(CycleState(), candidates)
        assert len(picked) == 3
        assert len(set(picked)) == 3
        assert set(picked) <= set(eps)


def test_fewer_candidates_than_asked() -> None:
    eps = make_endpoints(2)
    picked = picker(max_endpoints=4).pick(CycleState(), scored(eps, [0.1, 0.2]))
    assert sorted(e.name for e in picked) == ["ep-0", "ep-1"]


def test_no_candidates() -> None:
    assert list(picker().pick(CycleState(), [])) == []
