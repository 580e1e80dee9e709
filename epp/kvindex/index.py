"""The prefix index: which KV-event stream holds which block, in which medium.

Logically it is a radix tree of block keys per pod. Because a block key is a
*chained* hash (`blockkeys`: it already encodes every block before it), the tree needs
no explicit edges: a flat map from block key to the set of holders is the tree, and
"the longest cached prefix" is a walk over the prompt's keys that stops at the first
block a pod does not hold (`lookup`).

Layout, chosen for speed and memory in CPython:

- one `dict[int, int]` per medium tier ("gpu", "cpu", ...): block key (the EPP's
  own, `blockkeys`) -> bitmask of holders. The engine's hashes, which removals
  name, are mapped to these keys per stream by the ingestion (`ingest`);
- a holder is a *slot*: one KV-event stream (an endpoint, or one data-parallel rank
  of it). Equal masks share one int object (interned), so a (block, slot) entry
  costs about one dict entry plus the key's int;
- clearing a slot (AllBlocksCleared, an engine restart, the pod leaving the pool)
  is O(1): the slot is retired and the stream gets a fresh one. Lookups only ever
  ask about live slots, so the retired bits are invisible at once; `sweep` removes
  them from the maps later, in slices, off the pick path, and then frees the slot
  for reuse;
- each slot keeps, per tier, the XOR of a *mark* of each block it holds (updated
  with every entry added or removed, so reading it is O(1)): a fingerprint of its
  block set. The KV-event ingestion marks a block with the engine's own hash, so
  the fingerprint is the XOR of the engine's hashes, which a test or an operator
  compares with the engine's own block table, or two replicas' indexes with each
  other, without listing millions of keys (equal but for a 2^-64 chance). An
  eviction by the bound XORs the key, not the mark it was stored with (the index
  does not keep marks): after one, the fingerprint of a slot stored with marks no
  longer means anything, as the index no longer mirrors the engine anyway;
- the bound is on (block, slot) entries. Past it the oldest blocks go, a batch at a
  time; a block moves to the young end whenever a stream stores it again, so the
  eviction is least-recently-stored first. Engines report their own evictions
  (BlockRemoved): the bound only catches what events lost.

Nothing here is thread-safe, and nothing needs to be: the EPP runs on one event
loop, and every method returns without awaiting.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import reduce
from operator import xor
from typing import Final

# A bound never reached: an LRU whose capacity its owner enforces itself, a sweep
# without slices.
UNBOUNDED: Final = 1 << 62
# Interned masks: beyond this many distinct masks, sharing is dropped and restarted.
_MAX_INTERNED: Final = 65_536
# Entries evicted at once when the bound is passed (a fraction of the bound).
_EVICT_FRACTION: Final = 64


@dataclass
class Tier:
    """One medium: its weight in scores and its block map."""

    name: str
    weight: float
    blocks: dict[int, int] = field(default_factory=dict)


@dataclass
class IndexStats:
    entries: int = 0  # live (block, slot) entries, all tiers
    evicted_entries: int = 0  # removed to stay within the bound
    evictions: int = 0  # eviction passes
    swept_slots: int = 0


def bits(mask: int) -> Iterator[int]:
    """The slot numbers set in `mask`, lowest first."""
    while mask:
        low = mask & -mask
        yield low.bit_length() - 1
        mask ^= low


def _digest_of_repeats(keys: Sequence[int], marks: Sequence[int], again: list[int]) -> int:
    """The XOR of the marks of the occurrences in `keys` that `store` found held: all
    of a key's if it was held before the call, else all but its first."""
    listed = Counter(keys)
    held = Counter(again)
    seen: Counter[int] = Counter()
    digest = 0
    for key, mark in zip(keys, marks, strict=True):
        if key in held and (held[key] == listed[key] or seen[key]):
            digest ^= mark
        seen[key] += 1
    return digest


class PrefixIndex:
    def __init__(self, max_entries: int, tier_weights: Mapping[str, float]) -> None:
        if max_entries < 1:
            raise ValueError("max_entries must be >= 1")
        if not tier_weights:
            raise ValueError("at least one medium tier is needed")
        self.max_entries = max_entries
        # Highest weight first: a block in several tiers of a slot counts at the best.
        self.tiers: list[Tier] = [
            Tier(name, weight)
            for name, weight in sorted(tier_weights.items(), key=lambda kv: -kv[1])
        ]
        self._tier_by_name = {t.name: t for t in self.tiers}
        self.stats = IndexStats()
        # Per slot: live entries per tier name.
        self._counts: dict[int, dict[str, int]] = {}
        # Per slot: the XOR of the keys it holds, per tier name.
        self._digests: dict[int, dict[str, int]] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._dead_mask = 0  # retired slots whose bits may still be in the maps
        self._masks: dict[int, int] = {}

    # -- slots --------------------------------------------------------------------

    def new_slot(self) -> int:
        slot = self._free_slots.pop() if self._free_slots else self._take_slot()
        self._counts[slot] = {t.name: 0 for t in self.tiers}
        self._digests[slot] = {t.name: 0 for t in self.tiers}
        return slot

    def _take_slot(self) -> int:
        slot = self._next_slot
        self._next_slot += 1
        return slot

    def retire_slot(self, slot: int) -> None:
        """Forget everything `slot` holds, in O(1); its bits are swept out later."""
        counts = self._counts.pop(slot, None)
        if counts is None:
            return
        del self._digests[slot]
        self.stats.entries -= sum(counts.values())
        self._dead_mask |= 1 << slot

    def slot_blocks(self, slot: int) -> dict[str, int]:
        """Live entries of `slot` per tier name."""
        return dict(self._counts.get(slot, {}))

    def slot_digest(self, slot: int) -> dict[str, int]:
        """The XOR of the keys `slot` holds, per tier name (0: none)."""
        return dict(self._digests.get(slot, {}))

    def is_live(self, slot: int) -> bool:
        return slot in self._counts

    @property
    def pending_sweep(self) -> bool:
        return self._dead_mask != 0

    # -- writes (the KV-event ingestion) ---------------------------------------------

    def tier(self, name: str) -> Tier | None:
        return self._tier_by_name.get(name)

    def _intern(self, mask: int) -> int:
        # Small ints are shared by CPython already; larger masks are shared here.
        if mask < 257:
            return mask
        masks = self._masks
        shared = masks.get(mask)
        if shared is None:
            if len(masks) >= _MAX_INTERNED:
                masks.clear()
            masks[mask] = mask
            return mask
        return shared

    def store(
        self,
        slot: int,
        tier: Tier,
        keys: Sequence[int],
        marks: Sequence[int] | None = None,
        held: list[int] | None = None,
    ) -> int:
        """Record that `slot` holds `keys` in `tier`; returns how many were new.
        Storing a held block again only refreshes its age (idempotent); such keys
        are appended to `held` when it is given. The slot's digest XORs `marks`
        (parallel to `keys`; the keys themselves when None)."""
        counts = self._counts.get(slot)
        if counts is None:
            return 0  # retired meanwhile: nothing of it may come back
        bit = 1 << slot
        blocks = tier.blocks
        pop = blocks.pop
        intern = self._intern
        again: list[int] = []
        for key in keys:
            old = pop(key, 0)
            if old & bit:
                blocks[key] = old  # re-inserted: now the youngest
                again.append(key)
                continue
            new = old | bit
            # Masks below 257 are CPython's shared small ints already.
            blocks[key] = new if new < 257 else intern(new)
        added = len(keys) - len(again)
        # The digest of what was added: all the marks, less those of the keys held
        # already (usually none).
        digest = reduce(xor, keys if marks is None else marks, 0)
        if again:
            if held is not None:
                held.extend(again)
            digest ^= _digest_of_repeats(keys, keys if marks is None else marks, again)
        if added:
            counts[tier.name] += added
            self._digests[slot][tier.name] ^= digest
            self.stats.entries += added
            if self.stats.entries > self.max_entries:
                self._evict()
        return added

    def remove(
        self, slot: int, tier: Tier, keys: Sequence[int], marks: Sequence[int] | None = None
    ) -> int:
        """`slot` no longer holds `keys` in `tier`; returns how many it held. The
        slot's digest XORs `marks` (parallel to `keys`; the keys when None)."""
        counts = self._counts.get(slot)
        if counts is None:
            return 0
        bit = 1 << slot
        blocks = tier.blocks
        removed = 0
        digest = 0
        for key, mark in zip(keys, keys if marks is None else marks, strict=True):
            old = blocks.get(key, 0)
            if not old & bit:
                continue
            rest = old & ~bit
            if rest:
                blocks[key] = self._intern(rest)
            else:
                del blocks[key]
            removed += 1
            digest ^= mark
        if removed:
            counts[tier.name] -= removed
            self._digests[slot][tier.name] ^= digest
            self.stats.entries -= removed
        return removed

    def holds(self, slot: int, key: int) -> bool:
        """Whether `slot` holds `key` in any tier."""
        bit = 1 << slot
        return any(tier.blocks.get(key, 0) & bit for tier in self.tiers)

    def _evict(self) -> None:
        """Drop the least recently stored blocks until 1/64 of the bound is free."""
        target = self.max_entries - max(1, self.max_entries // _EVICT_FRACTION)
        live = ~self._dead_mask
        counts = self._counts
        digests = self._digests
        self.stats.evictions += 1
        # Take from every tier in proportion to its size, oldest first.
        while self.stats.entries > target:
            total = sum(len(t.blocks) for t in self.tiers) or 1
            excess = self.stats.entries - target
            progressed = False
            for tier in self.tiers:
                if not tier.blocks:
                    continue
                share = max(1, excess * len(tier.blocks) // total)
                for key in list(itertools.islice(iter(tier.blocks), share)):
                    mask = tier.blocks.pop(key) & live
                    for slot in bits(mask):
                        counts[slot][tier.name] -= 1
                        digests[slot][tier.name] ^= key
                        self.stats.entries -= 1
                        self.stats.evicted_entries += 1
                    progressed = True
            if not progressed:
                break

    # -- the sweeper ------------------------------------------------------------------

    def sweep(self, budget: int = UNBOUNDED) -> Iterator[None]:
        """Remove retired slots' bits from the maps, then free those slots.

        A generator: it yields after every `budget` keys, so a caller on the event
        loop can let requests run between slices (`for _ in index.sweep(20_000):
        await asyncio.sleep(0)`). Slots retired while it runs are left for the next
        sweep."""
        dead = self._dead_mask
        if not dead:
            return
        keep = ~dead
        done = 0
        for tier in self.tiers:
            blocks = tier.blocks
            # A snapshot of the keys (one C-level copy): the maps may change while
            # this yields.
            for key in list(blocks):
                mask = blocks.get(key)
                if mask is not None and mask & dead:
                    rest = mask & keep
                    if rest:
                        blocks[key] = self._intern(rest)
                    else:
                        del blocks[key]
                done += 1
                if done % budget == 0:
                    yield
        self._dead_mask &= ~dead
        freed = list(bits(dead))
        self._free_slots.extend(freed)
        self.stats.swept_slots += len(freed)
        # Shared masks may still name the freed slots: start sharing afresh.
        self._masks.clear()

    def sweep_now(self) -> None:
        for _ in self.sweep():
            pass

    # -- reads --------------------------------------------------------------------

    def holders(self, key: int) -> int:
        """The mask of slots holding `key` in any tier (retired slots included:
        callers intersect with the slots they ask about)."""
        mask = 0
        for tier in self.tiers:
            mask |= tier.blocks.get(key, 0)
        return mask

    def physical_keys(self) -> int:
        return sum(len(t.blocks) for t in self.tiers)
