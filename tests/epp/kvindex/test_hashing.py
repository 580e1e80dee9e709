"""The reference implementation of vLLM's block hashes (what the benchmarks and the
tests use to publish engine-exact events) against vectors computed with vLLM's own
code."""

from __future__ import annotations

import pytest

from epp.kvindex.hashing import (
    DEFAULT_HASH_SEED,
    EngineHashContext,
    EngineHasher,
    key_of,
)
from epp.tokenization.tokens import token_bytes, token_ids
from tests.testdata import load_json, token_range

TOKENS = list(range(1, 49))


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_golden_block_hashes(algo: str) -> None:
    golden = load_json("vllm/block_hashes.json")
    (vector,) = [v for v in golden["vectors"] if v["algo"] == algo]
    hasher = EngineHasher(algo, vector["effective_seed_string"], golden["block_size"])  # type: ignore[arg-type]
    assert hasher.none_hash.hex() == vector["NONE_HASH"]
    tokens = [t for block in vector["blocks"] for t in token_range(block["token_ids"])]
    assert hasher.keys(tokens) == [b["event_uint64"] for b in vector["blocks"]]
    # The full digests chain: recomputed block by block they match too.
    parent = None
    for block in vector["blocks"]:
        digest = hasher.digest(parent, tuple(token_range(block["token_ids"])), None)
        assert digest.hex() == block["block_hash_hex"]
        parent = digest


# From the research tables computed with vLLM's code (sha256_cbor over tokens 1..48,
# or block 0 with extra keys, PYTHONHASHSEED=0 unless said otherwise).
SEEDED = [
    ("sha256_cbor", "42", [16300212363532267629, 8671309795006503672, 3527878332947511115]),
    ("sha256_cbor", DEFAULT_HASH_SEED, [8866452693264111234, 807986237951177663,
                                        10877177626832001922]),
    ("sha256", DEFAULT_HASH_SEED, [1403909460543360175, 1643945449041937783,
                                   17267691262617277681]),
    ("xxhash_cbor", "0", [882618318818381833, 12890060145260523405, 18288806581693545612]),
]  # fmt: skip


@pytest.mark.parametrize(("algo", "seed", "expected"), SEEDED)
def test_seeds_and_algorithms(algo: str, seed: str, expected: list[int]) -> None:
    assert EngineHasher(algo, seed, 16).keys(TOKENS) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("fmt", "context", "expected"),
    [
        ("plain", EngineHashContext(cache_salt="salt-A"), 5868617810805868339),
        ("tagged", EngineHashContext(cache_salt="salt-A"), 9301669309045965076),
        ("plain", EngineHashContext(lora_name="my-lora"), 15444946753610453501),
        (
            "tagged",
            EngineHashContext(lora_name="my-lora", lora_path="/adapters/my-lora"),
            411323766930391962,
        ),
    ],
)
def test_extra_keys(fmt: str, context: EngineHashContext, expected: int) -> None:
    hasher = EngineHasher("sha256_cbor", "0", 16, fmt)  # type: ignore[arg-type]
    keys = hasher.keys(TOKENS, context)
    assert keys[0] == expected
    if context.cache_salt:
        # The salt goes into block 0 only, but block 0's hash chains into the rest.
        assert keys[1:] != hasher.keys(TOKENS)[1:]


def test_the_memo_gives_the_same_keys_and_skips_the_hashing() -> None:
    hasher = EngineHasher("sha256", "0", 16, memo_blocks=1000)
    first = hasher.keys(TOKENS)
    computed = hasher.computed
    assert hasher.keys(TOKENS) == first
    assert hasher.computed == computed  # all three from the memo
    fresh = EngineHasher("sha256", "0", 16)
    assert fresh.keys(TOKENS) == first


def test_the_memo_stays_bounded() -> None:
    hasher = EngineHasher("sha256", "0", 4, memo_blocks=64)
    for start in range(0, 4000, 4):
        hasher.keys(list(range(start, start + 8)))
    assert len(hasher._memo) <= 64


def test_block_digests_chain_to_the_keys() -> None:
    hasher = EngineHasher("sha256", "0", 16)
    digests = hasher.block_digests(TOKENS)
    assert [key_of(d) for d in digests] == hasher.keys(TOKENS)
    assert hasher.digest(digests[0], tuple(TOKENS[16:32]), None) == digests[1]


def test_token_bytes_round_trip_and_refuse_out_of_range_ids() -> None:
    assert token_ids(token_bytes([0, 1, 151_000, 2**32 - 1])) == [0, 1, 151_000, 2**32 - 1]
    with pytest.raises(OverflowError):
        token_bytes([2**32])
    with pytest.raises(OverflowError):
        token_bytes([-1])


def test_unknown_algorithm() -> None:
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        EngineHasher("md5", "0", 16)  # type: ignore[arg-type]


def test_the_memo_keeps_the_blocks_used_most_recently() -> None:
    hasher = EngineHasher("sha256", "0", 4, memo_blocks=64)
    hot = list(range(100_000, 100_004))
    for start in range(0, 2000, 4):
        hasher.keys(list(range(start, start + 4)))  # a long tail of one-off blocks
        hasher.keys(hot)  # and a system prompt in every request
    # The system prompt was hashed once: the tail went through the memo around it.
    assert hasher.computed == 500 + 1
    hasher.keys([0, 1, 2, 3])
    assert hasher.computed == 502  # the tail's oldest block was dropped
