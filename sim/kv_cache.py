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

from collections import OrderedDict
from dataclasses import dataclass, field

from sim.hashing import BlockHasher, event_extra_keys
from sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block is in the prefix cache (full and hashed).
    block_hash: bytes | None = None


@dataclass(eq=False)
class TokenSequence:
    """One request's tokens as the KV cache sees them, and the blocks it holds."""

    token_ids: list[int]
    cache_salt: str | None = None
    # Hashes of every full block of token_ids (kept up to date as tokens are added).
    block_hashes: list[bytes] = field(default_factory=list)
    # Blocks held, in token order: block i holds tokens [i*B, (i+1)*B).
    blocks: list[KVBlock] = field(default_factory=list)
    # How many of `blocks` are in the prefix cache under this sequence's hashes.
    num_cached_blocks: int = 0


class BlockPool:
    """The blocks, the free queue, the hash -> block map, and the pending events."""

    def __init__(self, num_gpu_blocks: int, block_size: int) -> None:
        if num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be >= 2 (block 0 is reserved)")
        self.num_gpu_blocks = num_gpu_blocks
        self.block_size = block_size
        # vLLM's free queue starts as every block in id order; blocks go back to its
        # tail when freed. So the blocks never handed out yet are always at its head,
        # in id order, and are taken before any freed one: they are kept as a
        # counter (`_fresh`, the next one's id) and created when first taken, and the
        # queue (`_free`) holds the freed blocks only. A pool of 27,000 blocks then
        # costs nothing until it is used.
        self._created: list[KVBlock] = [KVBlock(0)]
        self.null_block = self._created[0]
        self._fresh = 1
        # Insertion-ordered: head = next freed block to hand out (and evict). An
        # OrderedDict gives O(1) removal from the middle, needed by touch().
        self._free: OrderedDict[int, KVBlock] = OrderedDict()
        self._cached: dict[bytes, dict[int, KVBlock]] = {}
        self._events: list[KVEvent] = []

    @property
    def blocks(self) -> list[KVBlock]:
        """Every block, by id (those never used are created now; for tests and reset)."""
        created = self._created
        created.extend(KVBlock(i) for i in range(len(created), self.num_gpu_blocks))
        return created

    def _take_fresh(self) -> KVBlock:
        block_id = self._fresh
        self._fresh += 1
        if block_id < len(self._created):
            return self._created[block_id]
        block = KVBlock(block_id)
        self._created.append(block)
        return block

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
        return sum(len(copies) for copies in self._cached.values())

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def cached_hashes(self) -> set[bytes]:
        return set(self._cached)

    def free_queue_ids(self) -> list[int]:
        """Block ids in eviction order (for tests and /sim/state)."""
        return [*range(self._fresh, self.num_gpu_blocks), *self._free]

    # -- operations ------------------------------------------------------------

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        copies = self._cached.get(block_hash)
        if not copies:
            return None
        for block in copies.values():
            return block  # any copy will do
        return None

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cached blocks (prefix hits), out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, count: int) -> list[KVBlock]:
        """Take `count` blocks from the head of the free queue, evicting their hashes."""
        if count > self.num_free_blocks:
            raise ValueError(f"cannot allocate {count} blocks: only {self.num_free_blocks} free")
        taken = []
        for _ in range(count):
            if self._fresh < self.num_gpu_blocks:
                block = self._take_fresh()
            else:
                _, block = self._free.popitem(last=False)
                self._evict(block)
            block.ref_cnt += 1
            taken.append(block)
        return taken

    def _evict(self, block: KVBlock) -> None:
        block_hash = block.block_hash
        if block_hash is None:
            return
        copies = self._cached[block_hash]
        del copies[block.block_id]
        if not copies:
            del self._cached[block_hash]
        block.block_hash = None
        self._events.append(BlockRemoved((block_hash,)))

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference on each block; blocks nobody holds join the free
        queue's tail in the given order (callers pass a request's blocks tail first)."""
        for block in blocks:
            block.ref_cnt -= 1
        for block in blocks:
            if block.ref_cnt == 0 and block is not self.null_block:
                self._free[block.block_id] = block

    def cache_full_blocks(self, seq: TokenSequence, start: int, end: int) -> None:
        """Put seq.blocks[start:end] (now full) into the prefix cache; one BlockStored."""
        size = self.block_size
        for index in range(start, end):
            block = seq.blocks[index]
            block_hash = seq.block_hashes[index]
            block.block_hash = block_hash
            self._cached.setdefault(block_hash, {})[block.block_id] = block
        self._events.append(
            BlockStored(
                block_hashes=tuple(seq.block_hashes[start:end]),
                parent_block_hash=seq.block_hashes[start - 1] if start > 0 else None,
                token_ids=tuple(seq.token_ids[start * size : end * size]),
                block_size=size,
                extra_keys=tuple(event_extra_keys(i, seq.cache_salt) for i in range(start, end)),
            )
        )

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is held."""
        if self.num_used_blocks != 0:
            return False
        for copies in self._cached.values():
            for block in copies.values():
                block.block_hash = None
        self._cached.clear()
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

    def new_sequence(self, token_ids: list[int], cache_salt: str | None = None) -> TokenSequence:
        seq = TokenSequence(token_ids=list(token_ids), cache_salt=cache_salt)
        self.hasher.extend(seq.block_hashes, seq.token_ids, cache_salt)
        return seq

    def append_tokens(self, seq: TokenSequence, token_ids: list[int]) -> None:
        seq.token_ids.extend(token_ids)
        self.hasher.extend(seq.block_hashes, seq.token_ids, seq.cache_salt)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_prefix_hit(self, seq: TokenSequence) -> list[KVBlock]:
        """The longest run of cached blocks matching the sequence from block 0.

        At least the last token is always left to compute (its logits give the next
        token), so a fully cached prompt hits all but its last block when the prompt
        ends on a block boundary."""
        max_blocks = (len(seq.token_ids) - 1) // self.block_size
        hits = []
        get_cached = self.pool.get_cached_block
        for block_hash in seq.block_hashes[:max_blocks]:
            block = get_cached(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(
        self,
        seq: TokenSequence,
        num_computed_tokens: int,
        num_new_tokens: int,
        hit_blocks: list[KVBlock] | None = None,
    ) -> bool:
        return self._blocks_short(seq, num_computed_tokens, num_new_tokens, hit_blocks or []) <= 0

    def _blocks_short(
        self,
        seq: TokenSequence,
        num_computed_tokens: int,
        num_new_tokens: int,
        hit_blocks: list[KVBlock],
    ) -> int:
        needed = self.blocks_needed(num_computed_tokens + num_new_tokens)
        to_allocate = max(0, needed - len(seq.blocks) - len(hit_blocks))
        # Hit blocks nobody holds are counted as free now, but touching them takes
        # them out of the free queue: they cannot also serve as new blocks.
        evictable_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
        return to_allocate - (self.pool.num_free_blocks - evictable_hits)

    def allocate_slots(
        self,
        seq: TokenSequence,
        num_computed_tokens: int,
        num_new_tokens: int,
        hit_blocks: list[KVBlock] | None = None,
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

    def free(self, seq: TokenSequence) -> None:
        """Release a finished (or preempted) sequence's blocks, tail first."""
        self.pool.free(list(reversed(seq.blocks)))
        seq.blocks = []
        seq.num_cached_blocks = 0
