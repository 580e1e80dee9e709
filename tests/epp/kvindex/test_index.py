"""The prefix index: store, remove, clear, idempotence, the bound, tiers, sweeping."""

from __future__ import annotations

import random

import pytest

from epp.kvindex.index import PrefixIndex, bits

WEIGHTS = {"gpu": 1.0, "cpu": 0.8}


def make(max_entries: int = 1000) -> PrefixIndex:
    return PrefixIndex(max_entries, WEIGHTS)


def test_store_and_remove() -> None:
    index = make()
    a, b = index.new_slot(), index.new_slot()
    gpu = index.tier("gpu")
    assert gpu is not None
    assert index.store(a, gpu, [1, 2, 3]) == 3
    assert index.store(b, gpu, [2]) == 1
    assert index.holders(1) == 1 << a
    assert index.holders(2) == (1 << a) | (1 << b)
    assert index.stats.entries == 4
    assert index.remove(a, gpu, [2, 3, 99]) == 2  # 99 was never stored: ignored
    assert index.holders(2) == 1 << b
    assert index.holders(3) == 0
    assert 3 not in gpu.blocks  # an empty key is gone, not kept as 0
    assert index.slot_blocks(a) == {"gpu": 1, "cpu": 0}
    assert index.stats.entries == 2


def test_storing_again_is_idempotent() -> None:
    index = make()
    slot = index.new_slot()
    gpu = index.tier("gpu")
    assert gpu is not None
    index.store(slot, gpu, [1, 2])
    assert index.store(slot, gpu, [1, 2]) == 0
    assert index.stats.entries == 2
    assert index.slot_blocks(slot)["gpu"] == 2
    index.remove(slot, gpu, [1])
    index.remove(slot, gpu, [1])  # removing twice too
    assert index.slot_blocks(slot)["gpu"] == 1


def test_tiers_are_kept_apart() -> None:
    index = make()
    slot = index.new_slot()
    gpu, cpu = index.tier("gpu"), index.tier("cpu")
    assert gpu is not None
    assert cpu is not None
    index.store(slot, gpu, [1])
    index.store(slot, cpu, [1, 2])
    index.remove(slot, gpu, [1])  # evicted from the GPU, still offloaded to the CPU
    assert index.holders(1) == 1 << slot
    assert index.slot_blocks(slot) == {"gpu": 0, "cpu": 2}
    assert index.tier("disk") is None


def test_retiring_a_slot_hides_it_at_once_and_the_sweep_frees_it() -> None:
    index = make()
    a, b = index.new_slot(), index.new_slot()
    gpu = index.tier("gpu")
    assert gpu is not None
    index.store(a, gpu, [1, 2, 3])
    index.store(b, gpu, [3])
    index.retire_slot(a)
    assert index.stats.entries == 1
    assert not index.is_live(a)
    assert index.store(a, gpu, [4]) == 0  # a retired slot takes nothing in
    assert index.pending_sweep
    # Lookups only ask about live slots, so the stale bits are harmless until swept.
    index.sweep_now()
    assert not index.pending_sweep
    assert dict(gpu.blocks) == {3: 1 << b}
    assert index.new_slot() == a  # reused once swept


def test_the_sweep_works_in_slices_while_the_index_changes() -> None:
    index = make(100_000)
    a, b = index.new_slot(), index.new_slot()
    gpu = index.tier("gpu")
    assert gpu is not None
    index.store(a, gpu, range(1000))
    index.store(b, gpu, range(500, 1500))
    index.retire_slot(a)
    slices = 0
    for _ in index.sweep(budget=100):
        slices += 1
        index.store(b, gpu, [10_000 + slices])  # events keep coming meanwhile
    assert slices >= 9
    assert all(mask == 1 << b for mask in gpu.blocks.values())
    assert len(gpu.blocks) == 1000 + slices
    assert index.stats.entries == len(gpu.blocks)


def test_the_bound_evicts_the_least_recently_stored_blocks() -> None:
    index = make(max_entries=640)
    slot = index.new_slot()
    gpu = index.tier("gpu")
    assert gpu is not None
    index.store(slot, gpu, range(600))
    index.store(slot, gpu, [0])  # stored again: now the youngest
    index.store(slot, gpu, range(600, 700))
    assert index.stats.entries <= 640
    assert index.stats.evicted_entries > 0
    assert index.stats.evictions >= 1
    assert 0 in gpu.blocks  # refreshed, kept
    assert 1 not in gpu.blocks  # the oldest went
    assert 699 in gpu.blocks
    assert index.slot_blocks(slot)["gpu"] == index.stats.entries == len(gpu.blocks)


def test_eviction_counts_every_holder_of_an_evicted_block() -> None:
    index = make(max_entries=64)
    a, b = index.new_slot(), index.new_slot()
    gpu = index.tier("gpu")
    assert gpu is not None
    index.store(a, gpu, range(40))
    index.store(b, gpu, range(40))  # 80 entries on 40 keys: over the bound
    assert index.stats.entries <= 64
    total = index.slot_blocks(a)["gpu"] + index.slot_blocks(b)["gpu"]
    assert total == index.stats.entries


def test_masks_of_many_slots_are_shared_objects() -> None:
    index = make(100_000)
    slots = [index.new_slot() for _ in range(16)]
    gpu = index.tier("gpu")
    assert gpu is not None
    for slot in slots[8:]:
        index.store(slot, gpu, range(1000))
    masks = {id(m) for m in gpu.blocks.values()}
    assert len(masks) == 1  # 1000 keys, one int object for their mask


def test_bits() -> None:
    assert list(bits(0)) == []
    assert list(bits(0b1010_0001)) == [0, 5, 7]
    assert list(bits(1 << 70)) == [70]


def test_invalid_bounds() -> None:
    with pytest.raises(ValueError, match="max_entries"):
        PrefixIndex(0, WEIGHTS)
    with pytest.raises(ValueError, match="tier"):
        PrefixIndex(10, {})


def _xor(keys: set[int]) -> int:
    digest = 0
    for key in keys:
        digest ^= key
    return digest


def test_the_digest_is_the_xor_of_the_keys_each_slot_holds() -> None:
    """Against a model kept as plain sets, through stores, removals, repeated
    stores, evictions by the bound and a retired slot."""
    rng = random.Random(7)
    index = make(max_entries=300)
    slots = [index.new_slot() for _ in range(3)]
    model: dict[tuple[int, str], set[int]] = {(s, t): set() for s in slots for t in WEIGHTS}
    for _ in range(2000):
        slot = rng.choice(slots)
        name = rng.choice(list(WEIGHTS))
        tier = index.tier(name)
        assert tier is not None
        keys = [rng.randrange(1, 1 << 64) if rng.random() < 0.3 else rng.randrange(1, 400)]
        keys += [rng.randrange(1, 400) for _ in range(rng.randrange(0, 4))]
        if rng.random() < 0.7:
            index.store(slot, tier, keys)
            model[slot, name].update(keys)
        else:
            index.remove(slot, tier, keys)
            model[slot, name].difference_update(keys)
        if index.stats.evictions:
            # The bound dropped entries: the model learns which from the maps.
            for (s, t), held in model.items():
                tier_blocks = index.tier(t).blocks  # type: ignore[union-attr]
                held.intersection_update(k for k in held if tier_blocks.get(k, 0) >> s & 1)
        for s in slots:
            digest = index.slot_digest(s)
            for t in WEIGHTS:
                assert digest[t] == _xor(model[s, t])
                assert index.slot_blocks(s)[t] == len(model[s, t])
    assert index.stats.evictions > 0
    index.retire_slot(slots[0])
    assert index.slot_digest(slots[0]) == {}
    fresh = index.new_slot()
    assert index.slot_digest(fresh) == {"gpu": 0, "cpu": 0}
