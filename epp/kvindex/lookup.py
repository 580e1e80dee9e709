"""The longest cached prefix of a prompt, per KV-event stream (slot).

The walk goes over the prompt's blocks from block 0, hashing each block only when
it is reached, and keeps the set of slots that hold every block so far. A slot's
match ends at the first block it does not hold (a prefix hit needs consecutive
blocks from the start); the walk, and the hashing, stop as soon as no candidate
slot is left. Each matched block counts with the weight of the best medium the slot
holds it in (GPU 1.0, CPU 0.8, ... as configured), speculative entries at the top
weight. See `speculative` for anchors.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from epp.kvindex.blockkeys import PromptBlocks
from epp.kvindex.index import PrefixIndex, bits
from epp.kvindex.speculative import Anchor, SpeculativeIndex


@dataclass(slots=True)
class PrefixMatch:
    n_blocks: int  # full blocks in the prompt
    # slot -> matched blocks weighted by medium, in blocks at the top weight
    weighted: dict[int, float] = field(default_factory=dict)
    # slot -> consecutive blocks matched from block 0 (unweighted)
    blocks: dict[int, int] = field(default_factory=dict)
    # The keys computed: the matched prefix, then the first block nobody held.
    keys: list[int] = field(default_factory=list)
    # The first block no candidate held (n_blocks when some slot held them all).
    stop: int = 0
    speculative_hits: int = 0  # slots whose match was extended by speculative entries

    def score(self, slot: int) -> float:
        """Matched fraction of the prompt's blocks, weighted, in [0, 1]."""
        if not self.n_blocks:
            return 0.0
        return min(1.0, self.weighted.get(slot, 0.0) / self.n_blocks)


def common_blocks(a: bytes, a_start: int, a_end: int, b: bytes, b_start: int, b_end: int,
                  block_bytes: int) -> int:  # fmt: skip
    """How many whole blocks `a[a_start:a_end]` and `b[b_start:b_end]` share from
    their starts (a memcmp or a few: a binary search over the block count)."""
    n = min(a_end - a_start, b_end - b_start) // block_bytes
    if n <= 0:
        return 0
    va, vb = memoryview(a), memoryview(b)
    if va[a_start : a_start + n * block_bytes] == vb[b_start : b_start + n * block_bytes]:
        return n
    lo, hi = 0, n  # the first `lo` blocks agree; the first `hi` do not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        size = mid * block_bytes
        if va[a_start : a_start + size] == vb[b_start : b_start + size]:
            lo = mid
        else:
            hi = mid
    return lo


def longest_prefix(
    index: PrefixIndex,
    blocks: PromptBlocks,
    candidates: int,
    speculative: SpeculativeIndex | None = None,
) -> PrefixMatch:
    """Walk `blocks` over the index for the slots in the `candidates` mask."""
    n = blocks.n_blocks
    block_bytes = blocks.block_bytes
    match = PrefixMatch(n)
    if n == 0 or not candidates:
        return match
    top = index.tiers[0].weight
    tiers = [(t.weight, t.blocks) for t in index.tiers if t.blocks]
    spec_tables: list[dict[int, int]] = []
    anchors: dict[int, list[Anchor]] = {}
    if speculative is not None:
        spec_tables = [bucket.keys for bucket in speculative.live() if bucket.keys]
        anchors = speculative.anchors
    length = match.blocks
    deficit: dict[int, float] = {}
    extended: dict[int, int] = {}
    active = candidates
    # Media whose entries all weigh `top` (the usual case: only GPU blocks): a
    # block's holders are a plain OR of their masks; the rest are weighed per block.
    plain = [table for weight, table in tiers if weight == top]
    weighted = [(weight, table) for weight, table in tiers if weight != top]
    only = plain[0] if len(plain) == 1 else None
    next_key = blocks.next_key
    i = 0
    while i < n:
        key = next_key()
        if anchors:
            found = anchors.get(key)
            if found:
                _extend(found, i, active, blocks, block_bytes, extended)
        if only is not None:
            held = only.get(key, 0) & active
        else:
            held = 0
            for table in plain:
                held |= table.get(key, 0)
            held &= active
        # Speculative entries and lower media only matter for the slots the top
        # medium did not already cover (usually none, past the first block).
        missing = active & ~held
        if missing and spec_tables:
            for table in spec_tables:
                held |= table.get(key, 0) & missing
            missing = active & ~held
        if missing and weighted:
            held |= _held_weighted(weighted, key, missing, top, deficit)
        dropped = active & ~held
        if dropped:
            for slot in bits(dropped):
                length[slot] = i
        active = held
        if not active:
            break
        i += 1
    match.stop = i
    match.keys = blocks.keys
    for slot in bits(active):
        length[slot] = n
    scores = match.weighted
    for slot, matched in length.items():
        total = matched * top - deficit.get(slot, 0.0)
        more = extended.get(slot, 0) - matched
        if more > 0:
            total += more * top
            match.speculative_hits += 1
            length[slot] = matched + more
        if total > 0:
            scores[slot] = total / top
    return match


def _held_weighted(
    tiers: list[tuple[float, dict[int, int]]],
    key: int,
    missing: int,
    top: float,
    deficit: dict[int, float],
) -> int:
    """Which of the `missing` slots hold `key` in a lower medium; each is charged
    the difference between the top weight and its best such medium's (tiers come
    best first)."""
    held = 0
    for weight, blocks in tiers:
        mask = blocks.get(key, 0) & missing & ~held
        if mask:
            held |= mask
            for slot in bits(mask):
                deficit[slot] = deficit.get(slot, 0.0) + (top - weight)
    return held


def _extend(
    anchors: list[Anchor],
    i: int,
    active: int,
    blocks: PromptBlocks,
    block_bytes: int,
    extended: dict[int, int],
) -> None:
    """Speculative anchors at block `i`: a slot that holds blocks 0..i-1 and was
    picked for a prompt whose block `i` has this key will hold, from `i` on, as many
    blocks as the two prompts share."""
    start = i * block_bytes
    end = blocks.n_blocks * block_bytes
    for anchor in anchors:
        if not (active >> anchor.slot) & 1:
            continue
        shared = common_blocks(
            blocks.data, start, end, anchor.data, anchor.offset, anchor.end, block_bytes
        )
        if i + shared > extended.get(anchor.slot, 0):
            extended[anchor.slot] = i + shared
