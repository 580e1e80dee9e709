"""Block hashes against vectors computed with vLLM's own hashing code."""

from __future__ import annotations

import random

import pytest

from sim import hashing
from sim.hashing import (
    DEFAULT_HASH_SEED,
    BlockHasher,
    HashAlgo,
    block_extra_keys,
    event_extra_keys,
    resolve_hash_seed,
    to_event_hash,
)
from tests.sim.conftest import load_json


def _token_range(spec: str) -> list[int]:
    first, last = spec.split("..")
    return list(range(int(first), int(last) + 1))


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
def test_golden_block_hashes(algo: str) -> None:
    golden = load_json("vllm/block_hashes.json")
    (vector,) = [v for v in golden["vectors"] if v["algo"] == algo]
    hasher = BlockHasher(algo, vector["effective_seed_string"], golden["block_size"])  # type: ignore[arg-type]
    assert hasher.none_hash.hex() == vector["NONE_HASH"]

    tokens = [t for block in vector["blocks"] for t in _token_range(block["token_ids"])]
    assert tokens == [t for block in golden["blocks_token_ids"] for t in block]
    hashes = hasher.block_hashes(tokens)
    assert len(hashes) == len(vector["blocks"])
    for digest, block in zip(hashes, vector["blocks"], strict=True):
        assert digest.hex() == block["block_hash_hex"]
        assert to_event_hash(digest) == block["event_uint64"]
        # The same 64 bits seen as signed, as some msgpack decoders yield them.
        assert (
            to_event_hash(digest) - (1 << 64) * (block["event_int64"] < 0) == block["event_int64"]
        )
    parents = [None] + [to_event_hash(h) for h in hashes[:-1]]
    assert parents == [b["event_parent_uint64"] for b in vector["blocks"]]


# sha256_cbor over tokens 1..48 for other seeds, from the same vLLM-computed tables
# (docs/architecture.md, "vLLM's KV events"): the seed is PYTHONHASHSEED, else
# "vllm-none-hash".
SEEDED_EVENT_HASHES = {
    "42": [16300212363532267629, 8671309795006503672, 3527878332947511115],
    DEFAULT_HASH_SEED: [8866452693264111234, 807986237951177663, 10877177626832001922],
}


@pytest.mark.parametrize("seed", sorted(SEEDED_EVENT_HASHES))
def test_seeds(seed: str) -> None:
    hasher = BlockHasher("sha256_cbor", seed, 16)
    hashes = hasher.block_hashes(list(range(1, 49)))
    assert [to_event_hash(h) for h in hashes] == SEEDED_EVENT_HASHES[seed]


def test_xxhash_cbor() -> None:
    # From the same vLLM-computed tables: xxhash_cbor over tokens 1..48, seed "0".
    hashes = BlockHasher("xxhash_cbor", "0", 16).block_hashes(list(range(1, 49)))
    assert [to_event_hash(h) for h in hashes] == [
        882618318818381833,
        12890060145260523405,
        18288806581693545612,
    ]
    assert all(len(h) == 16 for h in hashes)  # XXH3-128


def test_default_algo_unset_seed() -> None:
    hasher = BlockHasher("sha256", resolve_hash_seed({}), 16)
    assert [to_event_hash(h) for h in hasher.block_hashes(list(range(1, 49)))] == [
        1403909460543360175,
        1643945449041937783,
        17267691262617277681,
    ]


def test_seed_comes_from_pythonhashseed() -> None:
    assert resolve_hash_seed({}) == "vllm-none-hash"
    assert resolve_hash_seed({"PYTHONHASHSEED": "0"}) == "0"
    assert resolve_hash_seed({"PYTHONHASHSEED": "42", "OTHER": "x"}) == "42"


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        # vLLM >= 0.31 tags the salt; up to 0.30 it was the bare string.
        ("tagged", 9301669309045965076),
        ("plain", 5868617810805868339),
    ],
)
def test_cache_salt_in_block_zero(fmt: str, expected: int) -> None:
    hasher = BlockHasher("sha256_cbor", "0", 16, fmt)  # type: ignore[arg-type]
    salted = hasher.block_hashes(list(range(1, 33)), cache_salt="salt-A")
    plain = hasher.block_hashes(list(range(1, 33)))
    assert to_event_hash(salted[0]) == expected
    # Only block 0 carries the salt, but every later hash chains from it.
    assert salted[0] != plain[0]
    assert salted[1] == hasher.hash_block(salted[0], list(range(17, 33)), None)


def test_extra_keys_shapes() -> None:
    assert block_extra_keys(0, "s", "tagged") == (("cache_salt", "s"),)
    assert block_extra_keys(0, "s", "plain") == ("s",)
    assert block_extra_keys(1, "s", "tagged") is None
    assert block_extra_keys(0, None, "tagged") is None
    assert event_extra_keys(0, "s") == ["s"]
    assert event_extra_keys(1, "s") is None


def test_only_full_blocks_and_incremental_extension() -> None:
    hasher = BlockHasher("sha256", "0", 4)
    tokens = list(range(11))
    assert len(hasher.block_hashes(tokens)) == 2
    hashes: list[bytes] = []
    grown: list[int] = []
    for token in [*tokens, 11]:
        grown.append(token)
        hasher.extend(hashes, grown)
    assert hashes == hasher.block_hashes(list(range(12)))


def test_memoised_hashes_are_the_digests() -> None:
    hasher = BlockHasher("sha256_cbor", "0", 16)
    first = hasher.block_hashes(list(range(1, 49)))
    again = hasher.block_hashes(list(range(1, 49)))  # served from the memo
    fresh = BlockHasher("sha256_cbor", "0", 16).block_hashes(list(range(1, 49)))
    assert first == again == fresh
    assert to_event_hash(first[2]) == 5191110061519319221


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor"])
@pytest.mark.parametrize("salt", [None, "salt-A"])
def test_extend_chains_hash_block_through_memo_hits_and_misses(
    algo: HashAlgo, salt: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `extend` is the chain of `hash_block` calls, whatever the memo holds: shared
    # prefixes (hits, then misses), and a memo emptied partway.
    monkeypatch.setattr(hashing, "HASH_MEMO_ENTRIES", 7)
    hasher = BlockHasher(algo, "0", 4, "plain")
    rng = random.Random(5)
    prefix = [rng.randrange(10**6) for _ in range(24)]
    for _ in range(6):
        tokens = prefix[: rng.randrange(25)] + [rng.randrange(10**6) for _ in range(30)]
        expected: list[bytes] = []
        for i in range(len(tokens) // 4):
            parent = expected[-1] if expected else None
            extra = block_extra_keys(i, salt, "plain")
            expected.append(hasher.hash_block(parent, tokens[4 * i : 4 * i + 4], extra))
        hashes = hasher.block_hashes(tokens[:9], salt)
        hasher.extend(hashes, tokens, salt)
        assert hashes == expected == BlockHasher(algo, "0", 4, "plain").block_hashes(tokens, salt)


def test_unknown_algo() -> None:
    with pytest.raises(ValueError, match="unknown hash algorithm"):
        BlockHasher("md5", "0", 16)  # type: ignore[arg-type]
