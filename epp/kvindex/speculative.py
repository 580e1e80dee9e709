"""Speculative index entries: what a pod is about to cache, recorded at pick time.

Between the pick and the engine's BlockStored events there are tens to hundreds of
milliseconds (queueing, prefill). A burst of requests sharing a new prefix would
all look cold in that window and scatter over the pool. So when a request is sent to
a pod, its prompt's blocks are recorded there for a short TTL (llm-d's
`speculativeIndexing`), and the siblings that follow stick to that pod.

Two kinds of entries, so that recording costs no hashing:

- **keys**: the block keys the lookup already computed (the matched prefix), put
  on the chosen pod's slots;
- **an anchor**: at the first block nobody held (where the lookup stopped
  hashing), the chosen slot and the prompt's remaining token bytes. A later prompt
  that reaches the same block key has, by construction of the chained hash, the
  same context and the same tokens before it; the blocks after the anchor then
  match exactly as far as the two prompts' token bytes agree, which a memcmp tells
  without hashing anything.

Expiry is by generations: entries go into the current bucket, which is replaced
every TTL/2; a bucket is dropped once its newest entry is TTL old. So an entry lives
between TTL and 1.5 x TTL, and expiring costs O(1) per bucket.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Final

MAX_ANCHORS_PER_KEY: Final = 8


@dataclass(frozen=True, slots=True)
class Anchor:
    slot: int
    data: bytes  # the recorded prompt's token bytes (shared, not copied)
    offset: int  # where the anchored block starts in `data`
    end: int  # where its last full block ends
    bucket: int  # the generation it was recorded in (it expires with it)


@dataclass
class Bucket:
    generation: int
    created: float
    keys: dict[int, int] = field(default_factory=dict)  # key -> slot mask
    anchor_keys: list[int] = field(default_factory=list)
    size: int = 0
    anchor_bytes: int = 0


@dataclass
class SpeculativeStats:
    recorded: int = 0  # picks recorded
    skipped_full: int = 0  # picks not recorded: the bound was reached
    entries: int = 0  # live key entries + anchors
    anchor_bytes: int = 0  # prompt bytes the live anchors keep alive


class SpeculativeIndex:
    """Keys live in per-generation buckets (a lookup ORs the live buckets' masks);
    anchors live in one map across generations (a lookup is one dict access per
    block), each removed when its generation expires."""

    def __init__(
        self,
        ttl_s: float,
        max_entries: int = 500_000,
        clock: Callable[[], float] = time.monotonic,
        max_anchor_bytes: int = 64 * 1024 * 1024,
    ) -> None:
        if ttl_s <= 0:
            raise ValueError("the speculative TTL must be > 0")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        # Anchors keep their prompt's token bytes alive: bounded too (a burst of
        # 100k-token prompts must not hold gigabytes for the TTL).
        self.max_anchor_bytes = max_anchor_bytes
        self._span = ttl_s / 2
        self._clock = clock
        self._buckets: deque[Bucket] = deque()
        self._generation = 0
        self.anchors: dict[int, list[Anchor]] = {}
        self.stats = SpeculativeStats()

    def live(self) -> Sequence[Bucket]:
        """The buckets still in force (expired ones are dropped first, with their
        anchors)."""
        buckets = self._buckets
        if buckets:
            horizon = self._clock() - self.ttl_s - self._span
            while buckets and buckets[0].created <= horizon:
                gone = buckets.popleft()
                self.stats.entries -= gone.size
                self.stats.anchor_bytes -= gone.anchor_bytes
                for key in gone.anchor_keys:
                    kept = [a for a in self.anchors.get(key, ()) if a.bucket != gone.generation]
                    if kept:
                        self.anchors[key] = kept
                    else:
                        self.anchors.pop(key, None)
        return buckets

    def record(
        self,
        slots: Sequence[int],
        keys: Sequence[int],
        anchor_key: int | None = None,
        data: bytes = b"",
        offset: int = 0,
        end: int = 0,
    ) -> None:
        """The chosen endpoint's `slots` will hold `keys`, and, if `anchor_key` is
        given, the blocks of `data[offset:end]` from the block `anchor_key` on."""
        self.live()
        added = len(keys) * len(slots) + (len(slots) if anchor_key is not None else 0)
        if self.stats.entries + added > self.max_entries:
            self.stats.skipped_full += 1
            return
        now = self._clock()
        buckets = self._buckets
        if not buckets or now - buckets[-1].created >= self._span:
            self._generation += 1
            buckets.append(Bucket(self._generation, now))
        bucket = buckets[-1]
        mask = 0
        for slot in slots:
            mask |= 1 << slot
        table = bucket.keys
        for key in keys:
            table[key] = table.get(key, 0) | mask
        if (
            anchor_key is not None
            and end > offset
            and self.stats.anchor_bytes + (end - offset) <= self.max_anchor_bytes
        ):
            listed = self.anchors.setdefault(anchor_key, [])
            if len(listed) < MAX_ANCHORS_PER_KEY:
                for slot in slots:
                    listed.append(Anchor(slot, data, offset, end, bucket.generation))
                bucket.anchor_keys.append(anchor_key)
                bucket.anchor_bytes += end - offset
                self.stats.anchor_bytes += end - offset
        bucket.size += added
        self.stats.entries += added
        self.stats.recorded += 1
