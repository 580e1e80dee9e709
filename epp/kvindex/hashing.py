"""vLLM's prefix-cache block hashes: a reference implementation, off the routing path.

The precise index keys blocks by the EPP's own hash of their token ids
(`blockkeys`), so routing no longer needs the engine's hash. This module computes
vLLM's (docs/architecture.md, "vLLM's KV events"), checked against vLLM's golden
vectors, for what must produce engine-exact events: the benchmarks
(`bench/pick.py`) and the tests.

    h_0 = H((NONE_HASH, tuple(tokens[0:B]),   extra_keys_0 or None))
    h_i = H((h_{i-1},   tuple(tokens[iB:(i+1)B]), extra_keys_i or None))

with `NONE_HASH = H(seed)`. Only full blocks are hashed. `H` follows the engine's
`--prefix-caching-hash-algo`:

| algo          | serialisation                    | digest            |
|---------------|----------------------------------|-------------------|
| `sha256`      | `pickle.dumps(obj, protocol=5)`  | SHA-256, 32 bytes |
| `sha256_cbor` | `cbor2.dumps(obj, canonical=True)` | SHA-256, 32 bytes |
| `xxhash`      | pickle, protocol 5               | XXH3-128, 16 bytes |
| `xxhash_cbor` | canonical CBOR                   | XXH3-128, 16 bytes |

The full digest chains into the next block; KV events carry the big-endian uint64
of its last 8 bytes (`key_of`).

Extra keys, as vLLM builds them, in this order: the LoRA adapter, multimodal items,
the `cache_salt` (block 0 only). Their shape depends on the engine version
(`ExtraKeysFormat`): `"tagged"` (vLLM >= 0.31): `("lora", name, path)`,
`("cache_salt", salt)`; `"plain"` (vLLM 0.12 - 0.30): the adapter's name, then the
salt string.
"""

from __future__ import annotations

import hashlib
import itertools
import pickle
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Literal, get_args

import cbor2

from epp.tokenization.tokens import TOKEN_BYTES, TOKEN_TYPECODE, token_bytes

HashAlgo = Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
HASH_ALGOS: Final[tuple[HashAlgo, ...]] = get_args(HashAlgo)
ExtraKeysFormat = Literal["tagged", "plain"]
EXTRA_KEYS_FORMATS: Final[tuple[ExtraKeysFormat, ...]] = get_args(ExtraKeysFormat)

# What vLLM >= 0.29 hashes into NONE_HASH when PYTHONHASHSEED is unset.
DEFAULT_HASH_SEED: Final = "vllm-none-hash"
MASK64: Final = (1 << 64) - 1

ExtraKeys = tuple[object, ...] | None


def _sha256_pickle(obj: object) -> bytes:
    # Protocol 5 is what vLLM uses (pickle.HIGHEST_PROTOCOL); its output for tuples
    # of bytes, ints, strings and None is the same on every CPython we run on,
    # which the golden vectors check.
    return hashlib.sha256(pickle.dumps(obj, protocol=5)).digest()


def _sha256_cbor(obj: object) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _xxhash_pickle(obj: object) -> bytes:
    import xxhash  # only needed by the xxhash algorithms

    return bytes(xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=5)))


def _xxhash_cbor(obj: object) -> bytes:
    import xxhash

    return bytes(xxhash.xxh3_128_digest(cbor2.dumps(obj, canonical=True)))


_DIGESTS: Final[dict[str, Callable[[object], bytes]]] = {
    "sha256": _sha256_pickle,
    "sha256_cbor": _sha256_cbor,
    "xxhash": _xxhash_pickle,
    "xxhash_cbor": _xxhash_cbor,
}


def digest_function(algo: str) -> Callable[[object], bytes]:
    try:
        return _DIGESTS[algo]
    except KeyError:
        raise ValueError(
            f"unknown hash algorithm {algo!r} (expected one of {', '.join(HASH_ALGOS)})"
        ) from None


def key_of(digest: bytes) -> int:
    """The index key of a block: what vLLM publishes for its hash (the uint64 of the
    digest's last 8 bytes, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1)."""
    return int.from_bytes(digest[-8:], "big")


@dataclass(frozen=True, slots=True)
class EngineHashContext:
    """What besides its tokens goes into vLLM's block hashes of a prompt."""

    cache_salt: str | None = None
    lora_name: str | None = None
    # The adapter's path as the engine loaded it (`--lora-modules name=path`):
    # hashed by vLLM >= 0.31 ("tagged" extra keys).
    lora_path: str | None = None

    def extra_keys(self, block_index: int, fmt: ExtraKeysFormat) -> ExtraKeys:
        keys: list[object] = []
        if self.lora_name is not None:
            keys.append(
                ("lora", self.lora_name, self.lora_path) if fmt == "tagged" else self.lora_name
            )
        if block_index == 0 and self.cache_salt:
            keys.append(("cache_salt", self.cache_salt) if fmt == "tagged" else self.cache_salt)
        return tuple(keys) if keys else None


_MemoKey = tuple[bytes, bytes, ExtraKeys]


# The memo's default size (a block in it costs about 300 bytes).
DEFAULT_MEMO_BLOCKS: Final = 16_384


class EngineHasher:
    """Chained block hashes for one engine configuration, with a memo of the most
    recently used blocks (least recently used first out: a hot system prompt stays).

    Not thread-safe: used from the event loop only."""

    def __init__(
        self,
        algo: HashAlgo = "sha256",
        seed: str = DEFAULT_HASH_SEED,
        block_size: int = 16,
        extra_keys_format: ExtraKeysFormat = "tagged",
        memo_blocks: int = DEFAULT_MEMO_BLOCKS,
    ) -> None:
        if block_size < 1:
            raise ValueError("the block size must be >= 1")
        if extra_keys_format not in EXTRA_KEYS_FORMATS:
            raise ValueError(f"unknown extra-keys format {extra_keys_format!r}")
        self.algo = algo
        self.seed = seed
        self.block_size = block_size
        self.extra_keys_format: ExtraKeysFormat = extra_keys_format
        self.block_bytes = block_size * TOKEN_BYTES
        self._digest = digest_function(algo)
        self.none_hash = self._digest(seed)
        self._unpack = struct.Struct(f"={block_size}{TOKEN_TYPECODE}").unpack
        self._memo: dict[_MemoKey, tuple[bytes, int]] = {}
        self._memo_max = max(16, memo_blocks)
        self.computed = 0  # blocks actually hashed (memo misses)

    def describe(self) -> str:
        return (
            f"algo={self.algo}, seed={self.seed!r}, blockSize={self.block_size},"
            f" extraKeys={self.extra_keys_format}"
        )

    def digest(self, parent: bytes | None, tokens: tuple[int, ...], extra: ExtraKeys) -> bytes:
        """One block's digest, as the engine computes it (no memo)."""
        return self._digest((self.none_hash if parent is None else parent, tokens, extra))

    def child(self, parent: bytes, block: bytes, extra: ExtraKeys) -> tuple[bytes, int]:
        """(digest, key) of the block `block` (token bytes) after `parent`, memoised."""
        memo_key = (parent, block, extra)
        memo = self._memo
        hit = memo.pop(memo_key, None)
        if hit is not None:
            memo[memo_key] = hit  # most recently used: to the end
            return hit
        digest = self._digest((parent, self._unpack(block), extra))
        key = int.from_bytes(digest[-8:], "big")
        hit = (digest, key)
        if len(memo) >= self._memo_max:
            _drop_oldest(memo, self._memo_max // 4)
        memo[memo_key] = hit
        self.computed += 1
        return hit

    def block_digests(
        self, tokens: Sequence[int], context: EngineHashContext | None = None
    ) -> list[bytes]:
        """Every full block's digest of `tokens`, as the engine chains them."""
        context = context or EngineHashContext()
        data = token_bytes(tokens)
        bb = self.block_bytes
        parent = self.none_hash
        out: list[bytes] = []
        for i in range(len(data) // bb):
            extra = context.extra_keys(i, self.extra_keys_format)
            parent, _ = self.child(parent, data[i * bb : (i + 1) * bb], extra)
            out.append(parent)
        return out

    def keys(self, tokens: Sequence[int], context: EngineHashContext | None = None) -> list[int]:
        """Every full block's key of `tokens`: what KV events carry for them."""
        return [key_of(d) for d in self.block_digests(tokens, context)]


def _drop_oldest(table: dict[_MemoKey, tuple[bytes, int]], count: int) -> None:
    """Forget the `count` oldest entries of a dict (insertion order): one pass, so
    the cost per entry stays constant however full the table is."""
    for stale in list(itertools.islice(iter(table), count)):
        del table[stale]
