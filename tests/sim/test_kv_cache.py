"""The block pool and KV cache manager: vLLM's prefix-caching semantics."""

from __future__ import annotations

import pytest

from sim.hashing import BlockHasher
from sim.kv_cache import BlockPool, KVCacheManager, TokenSequence
from sim.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

B = 4


def manager(num_gpu_blocks: int = 9) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_gpu_blocks, B), BlockHasher("sha256", "0", B))


def prefill(kv: KVCacheManager, tokens: list[int]) -> tuple[TokenSequence, int]:
    """Admit a sequence like the scheduler does; returns it and its hit tokens."""
    seq = kv.new_sequence(tokens)
    hits = kv.find_prefix_hit(seq)
    computed = len(hits) * B
    assert kv.allocate_slots(seq, computed, len(tokens) - computed, hits)
    return seq, computed


def test_block_zero_is_reserved() -> None:
    kv = manager(9)
    assert kv.pool.num_usable_blocks == 8
    assert kv.pool.free_queue_ids() == list(range(1, 9))
    seq, _ = prefill(kv, list(range(10)))
    assert seq.blocks == [1, 2, 3]  # blocks are ids
    assert kv.pool.usage() == pytest.approx(3 / 8)


def test_only_full_blocks_are_cached_and_announced() -> None:
    kv = manager()
    seq, hit = prefill(kv, list(range(10)))
    assert hit == 0
    assert seq.num_cached_blocks == 2
    (event,) = kv.pool.take_events()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == tuple(seq.block_hashes[:2])
    assert event.parent_block_hash is None
    assert event.token_ids == tuple(range(8))
    assert kv.pool.cached_hashes() == set(seq.block_hashes[:2])


def test_prefix_hit_and_ref_counts() -> None:
    kv = manager()
    a, _ = prefill(kv, list(range(10)))
    b, hit = prefill(kv, [*range(8), 99, 98, 97])
    assert hit == 8
    # The shared blocks are held twice; b's own third block is new.
    assert [kv.pool.ref_cnt(blk) for blk in b.blocks] == [2, 2, 1]
    assert b.blocks[:2] == a.blocks[:2]
    a_third = a.blocks[2]
    kv.free(a)
    assert [kv.pool.ref_cnt(blk) for blk in b.blocks] == [1, 1, 1]
    # Only a's third block (partial, unhashed) became free.
    assert kv.pool.free_queue_ids()[-1] == a_third
    kv.free(b)
    assert all(kv.pool.ref_cnt(blk) == 0 for blk in range(kv.pool.num_gpu_blocks))
    assert kv.pool.num_free_blocks == kv.pool.num_usable_blocks
    # Free, but still cached: a third request hits them.
    _, hit = prefill(kv, list(range(9)))
    assert hit == 8


def test_a_fully_cached_prompt_recomputes_its_last_block() -> None:
    kv = manager()
    a, _ = prefill(kv, list(range(8)))
    kv.free(a)
    kv.pool.take_events()
    b, hit = prefill(kv, list(range(8)))
    # The last token must be computed to sample from it: block 1 is recomputed
    # into a second copy of the same hash, announced again.
    assert hit == 4
    (event,) = kv.pool.take_events()
    assert isinstance(event, BlockStored)
    assert event.block_hashes == (b.block_hashes[1],)
    assert event.parent_block_hash == b.block_hashes[0]
    assert kv.pool.num_cached_blocks == 3  # block 0 once, block 1 twice


def test_lru_eviction_order_and_block_removed() -> None:
    kv = manager(9)  # 8 usable blocks
    a, _ = prefill(kv, list(range(100, 108)))  # 2 blocks
    b, _ = prefill(kv, list(range(200, 212)))  # 3 blocks
    a_ids = list(a.blocks)
    b_ids = list(b.blocks)
    kv.free(a)
    kv.free(b)  # freed later: evicted later; each request tail first
    # Never-used blocks first, then a's blocks tail first, then b's tail first.
    assert kv.pool.free_queue_ids() == [6, 7, 8, *reversed(a_ids), *reversed(b_ids)]
    kv.pool.take_events()
    # A request of 6 blocks takes the 3 never-used ones, then evicts a's tail,
    # a's head, then b's tail.
    c = kv.new_sequence(list(range(300, 324)))
    assert kv.allocate_slots(c, 0, 24)
    removed = [e for e in kv.pool.take_events() if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [
        (a.block_hashes[1],),
        (a.block_hashes[0],),
        (b.block_hashes[2],),
    ]
    assert {b.block_hashes[0], b.block_hashes[1]} <= kv.pool.cached_hashes()
    assert a.block_hashes[0] not in kv.pool.cached_hashes()


def test_decode_tokens_are_cached_when_a_block_fills() -> None:
    kv = manager()
    seq, _ = prefill(kv, list(range(6)))  # block 0 full, block 1 half
    kv.pool.take_events()
    computed = 6
    for generated in (50, 51, 52):
        kv.append_tokens(seq, [generated])
        # Decode: the token sampled last step is computed this step.
        assert kv.allocate_slots(seq, computed, 1)
        computed += 1
    # Computed tokens: 6 prompt + 50, 51 -> block 1 (4, 5, 50, 51) is full.
    (event,) = kv.pool.take_events()
    assert isinstance(event, BlockStored)
    assert event.token_ids == (4, 5, 50, 51)
    assert event.parent_block_hash == seq.block_hashes[0]
    assert seq.num_cached_blocks == 2


def test_pool_exhaustion_changes_nothing() -> None:
    kv = manager(5)  # 4 usable
    a, _ = prefill(kv, list(range(12)))  # 3 blocks
    refs = range(kv.pool.num_gpu_blocks)
    before = (kv.pool.num_free_blocks, [kv.pool.ref_cnt(blk) for blk in refs])
    b = kv.new_sequence(list(range(50, 58)))  # needs 2, 1 free
    assert not kv.allocate_slots(b, 0, 8)
    assert (kv.pool.num_free_blocks, [kv.pool.ref_cnt(blk) for blk in refs]) == before
    assert b.blocks == []
    kv.free(a)
    assert kv.allocate_slots(b, 0, 8)


def test_free_cached_hits_do_not_count_twice() -> None:
    """Touching a free cached block takes it out of the free queue, so it cannot
    also be counted as room for new blocks."""
    kv = manager(5)  # 4 usable
    a, _ = prefill(kv, list(range(8)))  # 2 cached blocks
    kv.free(a)
    b = kv.new_sequence([*range(8), *range(90, 101)])  # 19 tokens: 5 blocks > 4
    hits = kv.find_prefix_hit(b)
    assert len(hits) == 2
    assert kv.pool.num_free_blocks == 4
    assert not kv.can_allocate(b, 8, 11, hits)
    assert kv.can_allocate(b, 8, 8, hits)


def test_reset_prefix_cache() -> None:
    kv = manager()
    a, _ = prefill(kv, list(range(8)))
    kv.pool.take_events()
    assert not kv.pool.reset_prefix_cache()  # a still holds blocks
    kv.free(a)
    assert kv.pool.reset_prefix_cache()
    assert kv.pool.take_events() == [AllBlocksCleared()]
    assert kv.pool.cached_hashes() == set()
    assert kv.find_prefix_hit(kv.new_sequence(list(range(9)))) == []


def test_duplicate_copies_are_each_removed() -> None:
    kv = manager(4)  # 3 usable
    a, _ = prefill(kv, list(range(8)))
    kv.free(a)
    b, _ = prefill(kv, list(range(8)))  # hits block 0, recomputes block 1 (a 2nd copy)
    kv.free(b)
    kv.pool.take_events()
    c = kv.new_sequence(list(range(100, 112)))
    assert kv.allocate_slots(c, 0, 12)  # evicts all three cached blocks
    removed = [e.block_hashes[0] for e in kv.pool.take_events() if isinstance(e, BlockRemoved)]
    assert sorted(removed) == sorted([a.block_hashes[0], a.block_hashes[1], a.block_hashes[1]])
    assert kv.pool.cached_hashes() == set(c.block_hashes)
