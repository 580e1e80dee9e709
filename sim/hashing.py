"""vLLM's prefix-cache block hashes.

A KV block is identified by a chained hash over full blocks of token ids:

    h_0 = H((NONE_HASH, tuple(tokens[0:B]),  extra_keys_0))
    h_i = H((h_{i-1},   tuple(tokens[iB:(i+1)B]), extra_keys_i))

with `NONE_HASH = H(seed)`. `H` follows vLLM's `--prefix-caching-hash-algo`:

- `sha256` (vLLM's default since 0.10.2): SHA-256 of `pickle.dumps(obj, protocol=5)`;
- `sha256_cbor`: SHA-256 of the canonical CBOR encoding of `obj` (the cross-language one);
- `xxhash`, `xxhash_cbor`: XXH3-128 of the same two serialisations (16 bytes).

The digest chains into the next block. KV events carry, by
default, the unsigned 64-bit integer made of the digest's last 8 bytes (big-endian);
`to_event_hash` does that.

The seed is `PYTHONHASHSEED` when it is set, else the fixed string `"vllm-none-hash"`
(vLLM >= 0.29 for the sha256 algorithms; older versions, and the xxhash ones, draw a
random seed per process: give the simulator `--hash-seed` to play such an engine).

Extra keys (`extra_keys_i`) are `None` unless the block carries something besides its
tokens. The simulator has no LoRA and no multimodal inputs, so the only extra key is
the request's `cache_salt`, on block 0 only. Its shape depends on the vLLM version:

- `"tagged"` (vLLM >= 0.31, the default here): `(("cache_salt", salt),)`;
- `"plain"` (vLLM 0.9 - 0.30): `(salt,)`.

KV events publish the untagged form in both cases (`["salt"]` for block 0).
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import cbor2
import xxhash

HashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
HASH_ALGOS: tuple[HashAlgo, ...] = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")

ExtraKeysFormat = Literal["tagged", "plain"]
EXTRA_KEYS_FORMATS: tuple[ExtraKeysFormat, ...] = ("tagged", "plain")

# vLLM >= 0.29 hashes this string when PYTHONHASHSEED is unset.
DEFAULT_HASH_SEED = "vllm-none-hash"

# What the tuple hashed for one block looks like; extra keys are tuples of
# strings or of tagged tuples.
ExtraKeys = tuple[object, ...] | None

# Hashing a block (serialise + SHA-256) costs microseconds, and shared prefixes are
# hashed again by every request carrying them: a hasher remembers this many recent
# (parent, tokens, extra keys) -> digest results (~400 bytes each), emptied when full.
HASH_MEMO_ENTRIES = 32_768


# Bound once: hashing is the simulator's hottest call after the scheduler's.
_sha256 = hashlib.sha256
_pickle_dumps = pickle.dumps


def _sha256_pickle(obj: object) -> bytes:
    # Protocol 5 is what vLLM asks for (pickle.HIGHEST_PROTOCOL on Python >= 3.8);
    # its output for tuples of bytes, ints, strings and None is stable across
    # CPython versions, which the golden vectors confirm.
    return _sha256(_pickle_dumps(obj, 5)).digest()


def _sha256_cbor(obj: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _xxhash_pickle(obj: object) -> bytes:
    return bytes(xxhash.xxh3_128_digest(_pickle_dumps(obj, 5)))


def _xxhash_cbor(obj: object) -> bytes:
    return bytes(xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True)))


def digest_function(algo: HashAlgo) -> Callable[[object], bytes]:
    if algo == "sha256":
        return _sha256_pickle
    if algo == "sha256_cbor":
        return _sha256_cbor
    if algo == "xxhash":
        return _xxhash_pickle
    if algo == "xxhash_cbor":
        return _xxhash_cbor
    raise ValueError(f"unknown hash algorithm {algo!r} (expected one of {HASH_ALGOS})")


def resolve_hash_seed(environ: Mapping[str, str]) -> str:
    """The NONE_HASH seed vLLM would use in an environment like `environ`."""
    seed = environ.get("PYTHONHASHSEED")
    return DEFAULT_HASH_SEED if seed is None else seed


def to_event_hash(digest: bytes) -> int:
    """The integer vLLM publishes for a block hash (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)."""
    return int.from_bytes(digest[-8:], "big")


def block_extra_keys(block_index: int, cache_salt: str | None, fmt: ExtraKeysFormat) -> ExtraKeys:
    """The extra keys hashed with block `block_index` (the salt goes into block 0 only)."""
    if block_index != 0 or not cache_salt:
        return None
    if fmt == "tagged":
        return (("cache_salt", cache_salt),)
    return (cache_salt,)


def event_extra_keys(block_index: int, cache_salt: str | None) -> list[str] | None:
    """The per-block `extra_keys` element of a BlockStored event (tags stripped)."""
    if block_index != 0 or not cache_salt:
        return None
    return [cache_salt]


@dataclass(frozen=True)
class BlockHasher:
    """Chained block hashes for one engine configuration (algo, seed, block size)."""

    algo: HashAlgo = "sha256"
    seed: str = DEFAULT_HASH_SEED
    block_size: int = 16
    extra_keys_format: ExtraKeysFormat = "tagged"
    none_hash: bytes = field(init=False, repr=False)
    _digest: Callable[[object], bytes] = field(init=False, repr=False, compare=False)
    _memo: dict[tuple[bytes, tuple[int, ...], ExtraKeys], bytes] = field(
        init=False, repr=False, compare=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if self.extra_keys_format not in EXTRA_KEYS_FORMATS:
            raise ValueError(f"unknown extra-keys format {self.extra_keys_format!r}")
        digest = digest_function(self.algo)
        # Frozen dataclass: derived fields are set once, here.
        object.__setattr__(self, "_digest", digest)
        object.__setattr__(self, "none_hash", digest(self.seed))

    def hash_block(
        self, parent: bytes | None, block_tokens: Sequence[int], extra_keys: ExtraKeys
    ) -> bytes:
        key = (self.none_hash if parent is None else parent, tuple(block_tokens), extra_keys)
        digest = self._memo.get(key)
        if digest is None:
            digest = self._digest(key)
            if len(self._memo) >= HASH_MEMO_ENTRIES:
                self._memo.clear()
            self._memo[key] = digest
        return digest

    def extend(
        self, hashes: list[bytes], token_ids: Sequence[int], cache_salt: str | None = None
    ) -> None:
        """Append to `hashes` the hashes of the full blocks of `token_ids` it lacks.

        `hashes` holds the hashes of the first len(hashes) blocks of `token_ids`; this
        is how a request's hashes follow its tokens as generated tokens fill blocks."""
        # `hash_block` of each block in turn, inlined: a long prompt has thousands.
        size = self.block_size
        start = len(hashes)
        end = len(token_ids) // size
        if start >= end:
            return
        memo = self._memo
        digest = self._digest
        # `_sha256_pickle` is written out below for the default algorithm (a call
        # less per block).
        pickled = digest is _sha256_pickle
        tokens = tuple(token_ids[start * size : end * size])
        parent = hashes[start - 1] if start else self.none_hash
        # Once a block is not in the memo, the ones after it hardly ever are (each
        # chains on the one before; one is there only if a sequence grew past it since
        # the memo was last emptied), so they are not looked up, only remembered. The
        # memo only saves work: the hashes are the same either way.
        look_up = True
        for index in range(start, end):
            extra = (
                block_extra_keys(0, cache_salt, self.extra_keys_format)
                if index == 0 and cache_salt
                else None
            )
            at = (index - start) * size
            key = (parent, tokens[at : at + size], extra)
            found = memo.get(key) if look_up else None
            if found is None:
                look_up = False
                found = _sha256(_pickle_dumps(key, 5)).digest() if pickled else digest(key)
                if len(memo) >= HASH_MEMO_ENTRIES:
                    memo.clear()
                memo[key] = found
            hashes.append(found)
            parent = found

    def block_hashes(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[bytes]:
        hashes: list[bytes] = []
        self.extend(hashes, token_ids, cache_salt)
        return hashes
