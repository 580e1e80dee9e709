"""epp/lru.py: evicting from an `LRU` by hand, in order and without keeping what
was evicted."""

from __future__ import annotations

import gc
import weakref

import pytest

from epp.kvindex.index import UNBOUNDED
from epp.lru import LRU, pop_least_recent


class Key:
    """A key that can be watched: its weak reference dies when nothing holds it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __hash__(self) -> int:
        return self.n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Key) and other.n == self.n


def test_the_least_recently_used_goes_first() -> None:
    lru: LRU[int, None] = LRU(UNBOUNDED)
    for n in range(5):
        lru[n] = None
    lru[0] = None  # used again: now the most recent
    assert [pop_least_recent(lru) for _ in range(5)] == [1, 2, 3, 4, 0]
    assert len(lru) == 0


def test_an_empty_lru_is_a_key_error() -> None:
    with pytest.raises(KeyError, match="the LRU is empty"):
        pop_least_recent(LRU(4))


def test_an_evicted_key_and_its_value_are_freed() -> None:
    # lru-dict's own popitem keeps them (and the pair it returns) for good.
    lru: LRU[Key, Key] = LRU(UNBOUNDED)
    keys = [Key(n) for n in range(100)]
    values = [Key(1000 + n) for n in range(100)]
    for n in range(100):
        lru[keys[n]] = values[n]
    watched = [weakref.ref(k) for k in keys] + [weakref.ref(v) for v in values]
    del keys, values
    popped = [pop_least_recent(lru) for _ in range(100)]
    assert [k.n for k in popped] == list(range(100))
    del popped
    gc.collect()
    assert [w for w in watched if w() is not None] == []
