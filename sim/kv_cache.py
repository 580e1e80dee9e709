"""A paged KV block pool with vLLM's prefix-caching semantics.

What routing depends on, and therefore what this reproduces:

- The pool has `num_gpu_blocks` blocks of `block_size` token slots. Block 0 is
  vLLM's reserved "null block": never handed out, so `num_gpu_blocks - 1` are usable
  and KV usage is `1 - free / (num_gpu_blocks - 1)`.
- Only *full* blocks are cached, under their chained hash (`sim.hashing`). A block
  is cached as soon as the tokens filling it are scheduled for computation, during
  prefill and during decode alike (generated tokens are cached too).
- Blocks are reference counted. A request holds its blocks until it finishes; then
  they become free but stay cached, and a later request with the same prefix takes
  them back ("touch") without recomputing.
- Free blocks sit in one queue, in the order they were freed; new blocks are taken
  from its head, so the least recently freed cached block is evicted first. A
  request frees its blocks tail first, so its last blocks are evicted before its
  first ones (a shared prefix outlives the suffixes hanging off it).
- Evicting a cached block emits `BlockRemoved`; caching emits `BlockStored` (one event
  per request and step, for the blocks that request filled); `reset_prefix_cache`
  emits `AllBlocksCleared`.
- Two blocks may hold the same hash (a request recomputing a block another one has
  cached, e.g. the last block of a fully cached prompt, which vLLM recomputes to get
  logits). Each copy is announced by its own BlockStored and each eviction by its own
  BlockRemoved, as in vLLM, even if another copy stays cached.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from sim.hashing import BlockHasher, event_extra_keys
from sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

# vLLM's reserved null block: never handed out.
NULL_BLOCK = 0


@dataclass(eq=False, slots=True)
class TokenSequence:
    """One request's tokens as the KV cache sees them, and the blocks it holds."""

    token_ids: list[int]
    cache_salt: str | None = None
    # Hashes of every full block of token_ids (kept up to date as tokens are added).
    block_hashes: list[bytes] = field(default_factory=list)
    # The ids of the blocks held, in token order: block i holds tokens [i*B, (i+1)*B).
    blocks: list[int] = field(default_factory=list)
    # How many of `blocks` are in the prefix cache under this sequence's hashes.
    num_cached_blocks: int = 0


class BlockPool:
    """The blocks, the free queue, the hash -> block map, and the pending events.

    A block is its id, 0 to num_gpu_blocks - 1; its reference count and, while it is
    in the prefix cache, its hash are kept by id (no object per block: a simulated
    fleet would have millions, and the garbage collector would walk them all)."""

    def __init__(self, num_gpu_blocks: int, block_size: int) -> None:
        if num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be >= 2 (block 0 is reserved)")
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        # An array and dicts of ints and bytes only: the garbage collector does not
        # walk them.
        self._ref_cnt = array("i", bytes(4 * num_gpu_blocks))
        self._block_hash: dict[int, bytes] = {}  # of the blocks in the prefix cache
        # vLLM's free queue starts as every block in id order; blocks go back to its
        # tail when freed. So the blocks never handed out yet are always at its head,
        # in id order, and are taken before any freed one: they are kept as a
        # counter (`_fresh`, the next one's id), and the queue (`_free`) holds the
        # freed blocks only.
        self._fresh = 1
        # Insertion-ordered: head = next freed block to hand out (and evict). An
        # OrderedDict gives O(1) removal from the middle, needed by touch().
        self._free: OrderedDict[int, None] = OrderedDict()
        # Cached blocks by hash: the oldest copy of each hash, and, only for hashes
        # with two copies or more, every copy in the order they were cached.
        self._cached: dict[bytes, int] = {}
        self._copies: dict[bytes, dict[int, None]] = {}
        self._events: list[KVEvent] = []
        # False: no events are made (nobody reads them; the routing lab without a
        # KV-event consumer). The cache itself behaves the same.
        self.record_events = True

    def ref_cnt(self, block: int) -> int:
        return self._ref_cnt[block]

    def block_hash(self, block: int) -> bytes | None:
        """The hash the block is cached under, or None."""
        return self._block_hash.get(block)

    # -- accounting -------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_gpu_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.num_gpu_blocks - self._fresh + len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        extra = sum(len(copies) - 1 for copies in self._copies.values())
        return len(self._cached) + extra

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def cached_hashes(self) -> set[bytes]:
        return set(self._cached)

    def free_queue_ids(self) -> list[int]:
        """Block ids in eviction order (for tests and /sim/state)."""
        return [*range(self._fresh, self.num_gpu_blocks), *self._free]

    def num_unheld(self, blocks: list[int]) -> int:
        """How many of `blocks` nobody holds (free, but possibly cached)."""
        ref_cnt = self._ref_cnt
        return sum(1 for block in blocks if ref_cnt[block] == 0)

    # -- operations ------------------------------------------------------------

    def get_cached_block(self, block_hash: bytes) -> int | None:
        return self._cached.get(block_hash)  # any copy will do: the oldest

    def cached_prefix(self, block_hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest run of `block_hashes` from the first one
        (`get_cached_block` of each, stopping at the first miss)."""
        cached = self._cached
        hits = []
        for block_hash in block_hashes:
            block = cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def touch(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks (prefix hits), out of the free queue."""
        ref_cnt = self._ref_cnt
        for block in blocks:
            if ref_cnt[block] == 0:
                del self._free[block]
            ref_cnt[block] += 1

    def allocate(self, count: int) -> list[int]:
        """Take `count` blocks from the head of the free queue, evicting their hashes."""
        if count > self.num_free_blocks:
            raise ValueError(f"cannot allocate {count} blocks: only {self.num_free_blocks} free")
        ref_cnt = self._ref_cnt
        # Blocks never handed out first (the head of vLLM's free queue), in id order;
        # none of them is cached.
        first = self._fresh
        end = min(first + count, self.num_gpu_blocks)
        self._fresh = end
        taken = list(range(first, end))
        for block in taken:
            ref_cnt[block] += 1
        free = self._free
        for _ in range(count - len(taken)):
            block, _ = free.popitem(last=False)
            self._evict(block)
            ref_cnt[block] += 1
            taken.append(block)
        return taken

    def _evict(self, block: int) -> None:
        block_hash = self._block_hash.pop(block, None)
        if block_hash is None:
            return
        copies = self._copies.get(block_hash)
        if copies is None:
            del self._cached[block_hash]  # its only copy
        else:
            del copies[block]
            self._cached[block_hash] = next(iter(copies))
            if len(copies) == 1:
                del self._copies[block_hash]
        if self.record_events:
            self._events.append(BlockRemoved((block_hash,)))

    def free(self, blocks: list[int]) -> None:
        """Drop one reference on each block; blocks nobody holds join the free
        queue's tail in the given order (callers pass a request's blocks tail first)."""
        ref_cnt = self._ref_cnt
        for block in blocks:
            ref_cnt[block] -= 1
        free = self._free
        for block in blocks:
            if ref_cnt[block] == 0 and block != NULL_BLOCK:
                free[block] = None

    def cache_full_blocks(self, seq: TokenSequence, start: int, end: int) -> None:
        """Put seq.blocks[start:end] (now full) into the prefix cache; one BlockStored."""
        cached = self._cached
        block_hash_of = self._block_hash
        hashes = seq.block_hashes[start:end]
        for block, block_hash in zip(seq.blocks[start:end], hashes, strict=True):
            block_hash_of[block] = block_hash
            oldest = cached.setdefault(block_hash, block)
            if oldest != block:
                copies = self._copies.get(block_hash)
                if copies is None:
                    copies = self._copies[block_hash] = {oldest: None}
                copies[block] = None
        if not self.record_events:
            return
        size = self.block_size
        # Only block 0 carries extra keys (`event_extra_keys`).
        extra_keys: tuple[list[str] | None, ...] = (None,) * (end - start)
        if start == 0 and seq.cache_salt:
            extra_keys = (event_extra_keys(0, seq.cache_salt), *extra_keys[1:])
        self._events.append(
            BlockStored(
                block_hashes=tuple(hashes),
                parent_block_hash=seq.block_hashes[start - 1] if start > 0 else None,
                token_ids=tuple(seq.token_ids[start * size : end * size]),
                block_size=size,
                extra_keys=extra_keys,
            )
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is held."""
        if self.num_used_blocks != 0:
            return False
        self._block_hash.clear()
        self._cached.clear()
        self._copies.clear()
        if self.record_events:
            self._events.append(AllBlocksCleared())
        return True

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events


class KVCacheManager:
    """Per-request block bookkeeping on top of a BlockPool (vLLM's KV cache manager)."""

    def __init__(self, pool: BlockPool, hasher: BlockHasher) -> None:
        if pool.block_size != hasher.block_size:
            raise ValueError("the pool and the hasher disagree on the block size")
        self.pool = pool
        self.hasher = hasher
        self.block_size = pool.block_size

    def new_sequence(
        self, token_ids: Sequence[int], cache_salt: str | None = None
    ) -> TokenSequence:
        seq = TokenSequence(token_ids=list(token_ids), cache_salt=cache_salt)
        self.hasher.extend(seq.block_hashes, seq.token_ids, cache_salt)
        return seq

    def append_tokens(self, seq: TokenSequence, token_ids: list[int]) -> None:
        seq.token_ids.extend(token_ids)
        self.hasher.extend(seq.block_hashes, seq.token_ids, seq.cache_salt)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_prefix_hit(self, seq: TokenSequence) -> list[int]:
        """The longest run of cached blocks matching the sequence from block 0.

        At least the last token is always left to compute (its logits give the next
        token), so a fully cached prompt hits all but its last block when the prompt
        ends on a block boundary."""
        max_blocks = (len(seq.token_ids) - 1) // self.block_size
        return self.pool.cached_prefix(seq.block_hashes[:max_blocks])

    def can_allocate(
        self,
        seq: TokenSequence,
        num_computed_tokens: int,
        num_new_tokens: int,
        hit_blocks: list[int] | None = None,
    ) -> bool:
        return self._blocks_short(seq, num_computed_tokens, num_new_tokens, hit_blocks or []) <= 0

    def _blocks_short(
        self,
        seq: TokenSequence,
        num_computed_tokens: int,
        num_new_tokens: int,
        hit_blocks: list[int],
    ) -> int:
        needed = self.blocks_needed(num_computed_tokens + num_new_tokens)
        to_allocate = max(0, needed - len(seq.blocks) - len(hit_blocks))
        # Hit blocks nobody holds are counted as free now, but touching them takes
        # them out of the free queue: they cannot also serve as new blocks.
        evictable_hits = self.pool.num_unheld(hit_blocks)
        return to_allocate - (self.pool.num_free_blocks - evictable_hits)

    def allocate_slots(
        self,
        seq: TokenSequence,
        num_computed_tokens: int,
        num_new_tokens: int,
        hit_blocks: list[int] | None = None,
    ) -> bool:
        """Make room for `num_new_tokens` more tokens after `num_computed_tokens`
        (which include the hit blocks' tokens), and cache the blocks those tokens fill.

        Returns False, changing nothing, when the pool is short of free blocks."""
        if not hit_blocks:
            # The common case, a decode step: no prefix hits, and often no new block.
            total = num_computed_tokens + num_new_tokens
            if -(-total // self.block_size) <= len(seq.blocks):
                num_full = min(total, len(seq.token_ids)) // self.block_size
                if num_full > seq.num_cached_blocks:
                    self.pool.cache_full_blocks(seq, seq.num_cached_blocks, num_full)
                    seq.num_cached_blocks = num_full
                return True
        hits = hit_blocks or []
        if hits and seq.blocks:
            raise ValueError("prefix hits are only taken by a sequence holding no blocks")
        if self._blocks_short(seq, num_computed_tokens, num_new_tokens, hits) > 0:
            return False
        if hits:
            self.pool.touch(hits)
            seq.blocks.extend(hits)
            seq.num_cached_blocks = len(hits)
        needed = self.blocks_needed(num_computed_tokens + num_new_tokens)
        if needed > len(seq.blocks):
            seq.blocks.extend(self.pool.allocate(needed - len(seq.blocks)))
        # Cache the blocks that are full once this step's tokens are computed. The
        # last sampled token is not computed yet, hence the min().
        num_full = min(num_computed_tokens + num_new_tokens, len(seq.token_ids)) // self.block_size
        if num_full > seq.num_cached_blocks:
            self.pool.cache_full_blocks(seq, seq.num_cached_blocks, num_full)
            seq.num_cached_blocks = num_full
        return True

    def allocate_for_load(self, seq: TokenSequence, hit_blocks: list[int], num_tokens: int) -> bool:
        """Blocks for the first `num_tokens` tokens of a sequence whose KV cache is
        about to be pulled from another pod: the prefix hits are taken, the rest
        allocated, and nothing more is cached (the blocks are empty until the
        transfer ends: `cache_loaded`). vLLM allocates a request waiting for remote
        KVs the same way, with block caching delayed.

        Returns False, changing nothing, when the pool is short of free blocks."""
        if seq.blocks:
            raise ValueError("only a sequence holding no blocks loads remote KVs")
        if self._blocks_short(seq, 0, num_tokens, hit_blocks) > 0:
            return False
        if hit_blocks:
            self.pool.touch(hit_blocks)
            seq.blocks.extend(hit_blocks)
            seq.num_cached_blocks = len(hit_blocks)
        needed = self.blocks_needed(num_tokens)
        if needed > len(seq.blocks):
            seq.blocks.extend(self.pool.allocate(needed - len(seq.blocks)))
        return True

    def cache_loaded(self, seq: TokenSequence, num_tokens: int) -> None:
        """The first `num_tokens` tokens' KV arrived: cache the blocks they fill."""
        num_full = min(num_tokens, len(seq.token_ids)) // self.block_size
        if num_full > seq.num_cached_blocks:
            self.pool.cache_full_blocks(seq, seq.num_cached_blocks, num_full)
            seq.num_cached_blocks = num_full

    def free(self, seq: TokenSequence) -> None:
        """Release a finished (or preempted) sequence's blocks, tail first."""
        self.pool.free(seq.blocks[::-1])
        seq.blocks = []
        seq.num_cached_blocks = 0
