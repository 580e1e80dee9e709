"""vLLM's prefix-cache block hashes, computed for the prompts the EPP routes.

The index is keyed by the engine's own block hash (the uint64 on the wire), so a
prompt is looked up by computing the hashes vLLM will compute for it
(docs/architecture.md, "vLLM's KV events"):

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
of its last 8 bytes, which is the index key (`key_of`).

Extra keys (what besides the tokens a block's hash covers), as vLLM builds them, in
this order: the LoRA adapter, multimodal items, the `cache_salt` (block 0 only).
Their shape depends on the engine version (`ExtraKeysFormat`):

- `"tagged"` (vLLM >= 0.31): `("lora", name, path)`, `("cache_salt", salt)`.
  The adapter's *path* is hashed and KV events do not carry it, so a LoRA request
  can only be hashed when the adapter's path is configured (`HashContext.lora_path`);
- `"plain"` (vLLM 0.12 - 0.30): the adapter's name, then the salt string.

Multimodal inputs are hashed from the media content, which the EPP does not see:
such prompts get no precise score (the caller decides that, not this module).

Hashing a block costs 1.5 us (sha256) to 6 us (sha256_cbor) here, and the blocks of
a shared prefix are hashed again by every request carrying it, so `EngineHasher`
remembers (parent digest, block tokens, extra keys) -> (digest, key) for recent
blocks: a repeated prefix costs a dictionary lookup per block.
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
class HashContext:
    """What besides its tokens goes into a prompt's block hashes."""

    cache_salt: str | None = None
    lora_name: str | None = None
    # The adapter's path as the engine loaded it (`--lora-modules name=path`):
    # hashed by vLLM >= 0.31 ("tagged" extra keys).
    lora_path: str | None = None

    def hashable(self, fmt: ExtraKeysFormat) -> bool:
        """False when the engine's hashes cannot be reproduced (a LoRA request under
        the tagged format, with no adapter path configured)."""
        return not (fmt == "tagged" and self.lora_name is not None and self.lora_path is None)

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


# The memo's default size. A block in the memo costs about 380 bytes (its key,
# digest and the digest-by-key entry), so 16,384 blocks (262,144 tokens of prefix
# at 16 tokens a block) hold about 6 MB; a 50,000-block memo filled so slowly under
# a long tail of prompts that it looked like a leak for the first half hour.
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
        digest_keys: int = DEFAULT_MEMO_BLOCKS,
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
        # key -> digest of blocks hashed here, so that the alignment check can
        # recompute an event whose chain starts after a block we know.
        self._digests: dict[int, bytes] = {}
        self._digests_max = max(16, digest_keys)
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
        digests = self._digests
        if len(digests) >= self._digests_max:
            _drop_oldest(digests, self._digests_max // 4)
        digests[key] = digest
        self.computed += 1
        return hit

    def digest_for_key(self, key: int) -> bytes | None:
        """The full digest behind `key`, if this hasher computed it recently."""
        return self._digests.get(key)

    def remember(self, key: int, digest: bytes) -> None:
        digests = self._digests
        if len(digests) >= self._digests_max:
            _drop_oldest(digests, self._digests_max // 4)
        digests[key] = digest

    def prompt(self, data: bytes, context: HashContext | None = None) -> PromptBlocks:
        return PromptBlocks(self, data, context or HashContext())

    def keys(self, tokens: Sequence[int], context: HashContext | None = None) -> list[int]:
        """Every full block's key of `tokens` (for tests and tools; the pick path
        computes keys lazily through `PromptBlocks`)."""
        blocks = self.prompt(token_bytes(tokens), context)
        while len(blocks.keys) < blocks.n_blocks:
            blocks.next_key()
        return blocks.keys


def _drop_oldest(table: dict[_MemoKey, tuple[bytes, int]] | dict[int, bytes], count: int) -> None:
    """Forget the `count` oldest entries of a dict (insertion order): one pass, so
    the cost per entry stays constant however full the table is."""
    for stale in list(itertools.islice(iter(table), count)):
        del table[stale]  # type: ignore[arg-type]


class PromptBlocks:
    """The block keys of one prompt, computed block by block on demand, so a lookup
    stops hashing where no pod can match any further."""

    __slots__ = (
        "_block_bytes",
        "_extra0",
        "_extra_rest",
        "_hasher",
        "_memo",
        "_parent",
        "data",
        "keys",
        "n_blocks",
    )

    def __init__(self, hasher: EngineHasher, data: bytes, context: HashContext) -> None:
        self._hasher = hasher
        self._memo = hasher._memo
        self._block_bytes = hasher.block_bytes
        self.data = data  # the prompt's token ids (token_bytes)
        self.n_blocks = len(data) // hasher.block_bytes
        fmt = hasher.extra_keys_format
        self._extra0 = context.extra_keys(0, fmt)
        self._extra_rest = context.extra_keys(1, fmt)
        self._parent = hasher.none_hash
        self.keys: list[int] = []

    def next_key(self) -> int:
        """The key of the next block whose key is not known yet."""
        keys = self.keys
        i = len(keys)
        bb = self._block_bytes
        start = i * bb
        block = self.data[start : start + bb]
        extra = self._extra0 if i == 0 else self._extra_rest
        # The memo hit inlined (the pick path's commonest case): taken out and put
        # back at the end, as the most recently used; a miss hashes.
        memo_key = (self._parent, block, extra)
        hit = self._memo.pop(memo_key, None)
        if hit is None:
            hit = self._hasher.child(self._parent, block, extra)
        else:
            self._memo[memo_key] = hit
        self._parent, key = hit
        keys.append(key)
        return key

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    def block_data(self, first_block: int) -> bytes:
        """The token bytes from block `first_block` to the end of the full blocks."""
        bb = self._hasher.block_bytes
        return self.data[first_block * bb : self.n_blocks * bb]
