"""The longest consecutive cached prefix, per slot: tiers, candidates, lazy hashing,
speculative entries and anchors."""

from __future__ import annotations

from epp.kvindex.blockkeys import BlockKeys
from epp.kvindex.index import PrefixIndex, Tier
from epp.kvindex.lookup import common_blocks, longest_prefix
from epp.kvindex.speculative import SpeculativeIndex
from epp.tokenization.tokens import token_bytes

BS = 4  # a small block size keeps the prompts short


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def setup(slots: int = 3) -> tuple[BlockKeys, PrefixIndex, list[int], Tier, Tier]:
    hasher = BlockKeys(BS)
    index = PrefixIndex(10_000, {"gpu": 1.0, "cpu": 0.8})
    gpu, cpu = index.tier("gpu"), index.tier("cpu")
    assert gpu is not None
    assert cpu is not None
    return hasher, index, [index.new_slot() for _ in range(slots)], gpu, cpu


def mask(*slots: int) -> int:
    return sum(1 << s for s in slots)


def test_longest_consecutive_prefix_per_slot() -> None:
    hasher, index, (a, b, c), gpu, _ = setup()
    prompt = list(range(1, 41))  # 10 blocks
    keys = hasher.keys(prompt)
    index.store(a, gpu, keys[:3])
    index.store(b, gpu, keys[:7])
    index.store(c, gpu, keys[1:10])  # everything but block 0: no prefix hit at all
    match = longest_prefix(index, hasher.prompt(token_bytes(prompt)), mask(a, b, c))
    assert match.blocks == {a: 3, b: 7, c: 0}
    assert match.score(b) == 0.7
    assert match.score(c) == 0.0
    assert match.stop == 7
    assert match.keys == keys[:8]  # hashing stopped right after the last match


def test_a_hole_ends_the_match() -> None:
    hasher, index, (a, _, _), gpu, _ = setup()
    prompt = list(range(1, 41))
    keys = hasher.keys(prompt)
    index.store(a, gpu, keys[:2] + keys[3:])  # block 2 was evicted
    match = longest_prefix(index, hasher.prompt(token_bytes(prompt)), mask(a))
    assert match.blocks[a] == 2


def test_only_candidates_are_considered_and_hashing_stops_early() -> None:
    hasher, index, (a, b, _), gpu, _ = setup()
    prompt = list(range(1, 401))  # 100 blocks
    keys = hasher.keys(prompt)
    index.store(a, gpu, keys)
    fresh = BlockKeys(BS)
    match = longest_prefix(index, fresh.prompt(token_bytes(prompt)), mask(b))
    assert match.blocks == {b: 0}
    assert fresh.computed == 1  # block 0 missed: nothing else hashed
    assert match.stop == 0


def test_a_fully_cached_prompt_scores_one() -> None:
    hasher, index, (a, _, _), gpu, _ = setup()
    prompt = list(range(1, 23))  # 5 full blocks + 2 tokens: the tail is not a block
    index.store(a, gpu, hasher.keys(prompt))
    match = longest_prefix(index, hasher.prompt(token_bytes(prompt)), mask(a))
    assert match.blocks[a] == 5
    assert match.score(a) == 1.0
    assert match.stop == 5


def test_tiers_weigh_differently_and_the_best_tier_counts() -> None:
    hasher, index, (a, b, c), gpu, cpu = setup()
    prompt = list(range(1, 41))
    keys = hasher.keys(prompt)
    index.store(a, gpu, keys)
    index.store(b, cpu, keys)
    index.store(c, gpu, keys[:5])
    index.store(c, cpu, keys)  # on the GPU for the first half, all on the CPU
    match = longest_prefix(index, hasher.prompt(token_bytes(prompt)), mask(a, b, c))
    assert match.score(a) == 1.0
    assert abs(match.score(b) - 0.8) < 1e-9
    assert abs(match.score(c) - 0.9) < 1e-9
    assert match.blocks == {a: 10, b: 10, c: 10}


def test_empty_prompt_or_no_candidates() -> None:
    hasher, index, (a, _, _), _, _ = setup()
    assert longest_prefix(index, hasher.prompt(token_bytes([1, 2])), mask(a)).n_blocks == 0
    match = longest_prefix(index, hasher.prompt(token_bytes(list(range(8)))), 0)
    assert match.blocks == {}
    assert match.score(a) == 0.0


def test_speculative_keys_count_until_they_expire() -> None:
    hasher, index, (a, b, _), gpu, _ = setup()
    clock = Clock()
    spec = SpeculativeIndex(2.0, clock=clock)
    prompt = list(range(1, 41))
    keys = hasher.keys(prompt)
    index.store(a, gpu, keys[:4])
    spec.record([b], keys[:6])
    match = longest_prefix(index, hasher.prompt(token_bytes(prompt)), mask(a, b), spec)
    assert match.blocks == {a: 4, b: 6}
    clock.now += 2.0  # lives at least the TTL
    assert longest_prefix(index, hasher.prompt(token_bytes(prompt)), mask(b), spec).blocks == {b: 6}
    clock.now += 1.01  # and at most 1.5 x TTL
    assert longest_prefix(index, hasher.prompt(token_bytes(prompt)), mask(b), spec).blocks == {b: 0}
    assert spec.stats.entries == 0


def test_an_anchor_extends_a_sibling_without_hashing_the_rest() -> None:
    hasher, index, (a, b, _), _gpu, _ = setup()
    spec = SpeculativeIndex(2.0, clock=Clock())
    shared = list(range(1, 201))  # 50 blocks nobody has seen
    first = [*shared, 900, 901, 902, 903]
    sibling = [*shared, 700, 701, 702, 703, 704]
    # The first request: nothing cached; it stops hashing at block 0 and is sent to b.
    first_blocks = hasher.prompt(token_bytes(first))
    match = longest_prefix(index, first_blocks, mask(a, b), spec)
    assert match.stop == 0
    assert len(match.keys) == 1
    spec.record([b], match.keys[: match.stop], match.keys[0], first_blocks.data, 0,
                first_blocks.n_blocks * first_blocks.block_bytes)  # fmt: skip
    # The sibling shares 50 blocks with it: b gets them, with one block hashed.
    fresh = BlockKeys(BS)
    match = longest_prefix(index, fresh.prompt(token_bytes(sibling)), mask(a, b), spec)
    assert match.blocks == {a: 0, b: 50}
    assert match.speculative_hits == 1
    assert fresh.computed == 1
    # Another prompt with a different first block is not extended.
    other = longest_prefix(index, fresh.prompt(token_bytes([5, *shared])), mask(b), spec)
    assert other.blocks == {b: 0}


def test_an_anchor_after_a_matched_prefix() -> None:
    hasher, index, (a, b, _), gpu, _ = setup()
    spec = SpeculativeIndex(2.0, clock=Clock())
    system = list(range(1, 41))  # 10 blocks cached on a
    index.store(a, gpu, hasher.keys(system))
    first = [*system, *range(1000, 1040)]
    blocks = hasher.prompt(token_bytes(first))
    match = longest_prefix(index, blocks, mask(a, b), spec)
    assert match.stop == 10
    # Sent to b (a was busy, say): b will hold the system prompt and the rest.
    spec.record([b], match.keys[:10], match.keys[10], blocks.data, 10 * blocks.block_bytes,
                blocks.n_blocks * blocks.block_bytes)  # fmt: skip
    sibling = [*first, 5, 6, 7, 8]
    match = longest_prefix(index, hasher.prompt(token_bytes(sibling)), mask(a, b), spec)
    assert match.blocks == {a: 10, b: 20}


def test_common_blocks() -> None:
    x = bytes(range(64))
    y = bytes(range(40)) + b"\xff" * 24
    assert common_blocks(x, 0, 64, x, 0, 64, 8) == 8
    assert common_blocks(x, 0, 64, y, 0, 64, 8) == 5
    assert common_blocks(x, 8, 64, y, 8, 64, 8) == 4
    assert common_blocks(x, 0, 64, y, 0, 4, 8) == 0


def test_the_speculative_bound() -> None:
    spec = SpeculativeIndex(2.0, max_entries=10, clock=Clock())
    spec.record([0], list(range(8)))
    spec.record([0], list(range(8)))
    assert spec.stats.recorded == 1
    assert spec.stats.skipped_full == 1


def test_anchors_are_bounded_in_bytes() -> None:
    clock = Clock()
    spec = SpeculativeIndex(2.0, clock=clock, max_anchor_bytes=100)
    data = bytes(80)
    spec.record([0], [], 1, data, 0, 80)
    spec.record([0], [], 2, data, 0, 80)  # would pass the bound: no anchor
    assert len(spec.live()) == 1
    assert list(spec.anchors) == [1]
    assert spec.stats.anchor_bytes == 80
    clock.now += 3.1
    assert not spec.live()
    assert spec.stats.anchor_bytes == 0
    assert spec.anchors == {}  # expired with their bucket
