"""The least-recently-used maps the prefix indexes keep (lru-dict's `LRU`: a C hash
map in recency order), and the one way to evict from one by hand.

Never call `LRU.popitem()`. In lru-dict 1.4.1 (the release pinned, and the latest)
it takes one reference too many on the (key, value) pair it returns, so every
pair popped stays in memory for good, and its key and value with it: about 90
bytes for an int key, at every eviction, for the life of the process (lru-dict's
issue 64). Peeking at the least recent item and deleting it frees all of it, and
so does the eviction of an `LRU` bounded by its own size.
"""

from __future__ import annotations

from typing import TypeVar

from lru import LRU

K = TypeVar("K")
V = TypeVar("V")

__all__ = ["LRU", "pop_least_recent"]


def pop_least_recent(lru: LRU[K, V]) -> K:
    """Remove the least recently used key of a non-empty `lru` and return it."""
    item = lru.peek_last_item()
    if item is None:
        raise KeyError("pop_least_recent(): the LRU is empty")
    key = item[0]
    del lru[key]
    return key
