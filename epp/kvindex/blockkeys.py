"""The index's own block keys: a chained hash of each full block's token ids.

The precise index is keyed by a hash the EPP computes itself, from the token ids a
BlockStored event carries on the write side and from the request's tokens on the
read side, so the two agree whatever the engine's own hash is (its seed, its
`--prefix-caching-hash-algo`, its version's extra-key layout). The engine's hash is
kept only to resolve an event's parent and to apply removals (`ingest`).

    key_{-1} = ROOT_KEY
    key_i    = XXH3-64( the block's token ids (token_bytes: uint32, native order)
                        || extras(i),  seed = key_{i-1} )  &  KEY_MASK

The parent goes in as XXH3's 64-bit seed rather than as 8 more bytes of input:
XXH3 mixes its seed into every stripe of the input, and one call with no bytes to
pack and concatenate costs 0.4 us a block here against 0.65 us, on the ingestion's
hot path (keys are most of what the ingestion added over an engine-keyed index).

Like vLLM's hash, a key covers the whole prefix before its block (chained), so a
flat map from key to holders is a per-pod radix tree and two equal keys mean the
same context and tokens, but for a 2^-60 chance.

The extras are what besides the tokens makes a block's KV different, each item a
tag byte, a 4-byte little-endian length and the payload, in this order:

- `L` the LoRA adapter's name (every block, as vLLM does);
- `S` the `cache_salt` (block 0 only; through the chain it reaches every block);
- `I` an adapter known only by its engine-local int id (engines before vLLM 0.14
  publish no name): such blocks can never match a request, which names adapters;
- `X` anything else the engine hashed into the block (multimodal items, prompt
  embeddings), msgpack-encoded as the event carries it: such blocks never match a
  text prompt (requests with media get no precise score anyway).

A block without extras hashes no extras bytes at all; the token part has a fixed
length (block size x 4 bytes), so the tagged, length-prefixed suffix cannot be
confused with tokens or with another suffix.

Keys are masked to 60 bits: a 60-bit int is a 32-byte object in CPython, a 64-bit
one 40 bytes (allocator rounding), and the index and the engine-hash map keep one
per entry. The chance that two different prefixes share a key stays negligible
(about n^2 / 2^61 for n distinct blocks: 4e-5 for ten million).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import msgspec
from xxhash import xxh3_64_intdigest

from epp.tokenization.tokens import TOKEN_BYTES, token_bytes

KEY_BITS: Final = 60
KEY_MASK: Final = (1 << KEY_BITS) - 1
# The parent of every request's block 0: a fixed constant (any value works, as long
# as the write and the read side use the same).
ROOT_KEY: Final = xxh3_64_intdigest(b"envoy-epp/own-block-keys/v1") & KEY_MASK

TAG_LORA: Final = b"L"
TAG_SALT: Final = b"S"
TAG_LORA_ID: Final = b"I"
TAG_OTHER: Final = b"X"

_pack_length = struct.Struct("<I").pack
_msgpack: Final = msgspec.msgpack.Encoder()


def extra_item(tag: bytes, payload: bytes) -> bytes:
    """One tagged, length-prefixed extras item."""
    return tag + _pack_length(len(payload)) + payload


def text_item(tag: bytes, text: str) -> bytes:
    # "surrogatepass": a str decoded from msgpack is valid UTF-8, but one built
    # from a request header might carry a lone surrogate; it must not raise here.
    return extra_item(tag, text.encode("utf-8", "surrogatepass"))


def other_item(items: Sequence[object]) -> bytes:
    """Extra keys the EPP does not interpret (multimodal, prompt embeddings), as the
    event published them: deterministic bytes, never equal to a text prompt's."""
    return extra_item(TAG_OTHER, _msgpack.encode(list(items)))


def chain(parent: int, block: bytes, extras: bytes = b"") -> int:
    """The key of one block (`block`: its token bytes) after the key `parent`."""
    return xxh3_64_intdigest(block + extras if extras else block, parent) & KEY_MASK


def chain_keys(
    parent: int, data: bytes, block_bytes: int, extras: Sequence[bytes] | None = None
) -> list[int]:
    """The keys of the consecutive blocks of `data` after `parent`; `extras[j]` is
    block j's extras encoding (None: no block has extras). The ingestion's hot loop:
    no call per block but the hash itself."""
    keys: list[int] = []
    append = keys.append
    digest = xxh3_64_intdigest
    mask = KEY_MASK
    key = parent
    if extras is None:
        for start in range(0, len(data) - block_bytes + 1, block_bytes):
            key = digest(data[start : start + block_bytes], key) & mask
            append(key)
    else:
        for j, start in enumerate(range(0, len(data) - block_bytes + 1, block_bytes)):
            key = digest(data[start : start + block_bytes] + extras[j], key) & mask
            append(key)
    return keys


@dataclass(frozen=True, slots=True)
class HashContext:
    """What besides its tokens goes into a prompt's block keys."""

    cache_salt: str | None = None
    lora_name: str | None = None

    def extras(self, block_index: int) -> bytes:
        """Block `block_index`'s extras encoding, as the ingestion builds it from an
        event of a block cached for such a request."""
        out = b""
        if self.lora_name is not None:
            out += text_item(TAG_LORA, self.lora_name)
        if block_index == 0 and self.cache_salt:
            out += text_item(TAG_SALT, self.cache_salt)
        return out


class BlockKeys:
    """Computes prompts' block keys for one block size. Not thread-safe: used from
    the event loop only."""

    def __init__(self, block_size: int = 16) -> None:
        if block_size < 1:
            raise ValueError("the block size must be >= 1")
        self.block_size = block_size
        self.block_bytes = block_size * TOKEN_BYTES
        self.computed = 0  # blocks hashed for prompts (a metric)

    def prompt(self, data: bytes, context: HashContext | None = None) -> PromptBlocks:
        return PromptBlocks(self, data, context or HashContext())

    def keys(self, tokens: Sequence[int], context: HashContext | None = None) -> list[int]:
        """Every full block's key of `tokens` (for tests and tools; the pick path
        computes keys lazily through `PromptBlocks`)."""
        blocks = self.prompt(token_bytes(tokens), context)
        while len(blocks.keys) < blocks.n_blocks:
            blocks.next_key()
        return blocks.keys


class PromptBlocks:
    """The block keys of one prompt, computed block by block on demand, so a lookup
    stops hashing where no pod can match any further."""

    __slots__ = ("_block_bytes", "_extra0", "_extra_rest", "_owner", "data", "keys", "n_blocks")

    def __init__(self, owner: BlockKeys, data: bytes, context: HashContext) -> None:
        self._owner = owner
        self._block_bytes = owner.block_bytes
        self.data = data  # the prompt's token ids (token_bytes)
        self.n_blocks = len(data) // owner.block_bytes
        self._extra0 = context.extras(0)
        self._extra_rest = context.extras(1)
        self.keys: list[int] = []

    def next_key(self) -> int:
        """The key of the next block whose key is not known yet."""
        keys = self.keys
        i = len(keys)
        bb = self._block_bytes
        start = i * bb
        key = chain(
            keys[-1] if keys else ROOT_KEY,
            self.data[start : start + bb],
            self._extra0 if i == 0 else self._extra_rest,
        )
        keys.append(key)
        self._owner.computed += 1
        return key

    @property
    def block_bytes(self) -> int:
        return self._block_bytes

    def block_data(self, first_block: int) -> bytes:
        """The token bytes from block `first_block` to the end of the full blocks."""
        bb = self._block_bytes
        return self.data[first_block * bb : self.n_blocks * bb]


def event_extras(
    n_blocks: int,
    starts_at_block_0: bool,
    lora_name: str | None,
    lora_id: int | None,
    extra_keys: Sequence[object] | None,
    cache_salt: str | None = None,
) -> list[bytes] | None:
    """The extras encoding of each of a BlockStored event's blocks, built from what
    the event says; None when no block has any (the common case).

    `extra_keys` (vLLM >= 0.17) has one element per block, None or the block's
    untagged extra keys in vLLM's order: the LoRA name when there is an adapter, the
    multimodal items ((identifier, offset) tuples; plain identifier strings before
    0.19), the `cache_salt` string on the request's block 0, prompt-embeds digests.
    The salt is read as such only where it can be one: the request's block 0 (the
    event starts there: no parent) whose only key besides the adapter is one string.
    Anything else goes in as uninterpreted extras, so the block can never match a
    text prompt. Engines before 0.17 publish no extra keys: their blocks are keyed
    with the adapter alone (see docs/precise-prefix.md for what that loses).

    `cache_salt` is SGLang's field for the salt (vLLM has none): with no extra keys,
    it salts the event's first block when the event starts at the request's block 0."""
    base = b""
    if lora_name is not None:
        base = text_item(TAG_LORA, lora_name)
    elif lora_id is not None:
        # Before vLLM 0.14 only the engine's int id: no request names it, so these
        # blocks match nothing rather than count for the base model.
        base = extra_item(TAG_LORA_ID, str(lora_id).encode())
    if not extra_keys:
        if cache_salt and starts_at_block_0 and n_blocks:
            return [base + text_item(TAG_SALT, cache_salt)] + [base] * (n_blocks - 1)
        return [base] * n_blocks if base else None
    out: list[bytes] = []
    found = bool(base)
    for j in range(n_blocks):
        item = extra_keys[j] if j < len(extra_keys) else None
        encoded = base
        if item is not None:
            values = list(item) if isinstance(item, list | tuple) else [item]
            if lora_name is not None and values and values[0] == lora_name:
                values = values[1:]
            if values:
                if j == 0 and starts_at_block_0 and len(values) == 1 and isinstance(values[0], str):
                    if values[0]:  # vLLM salts only with a non-empty salt, as requests do
                        encoded += text_item(TAG_SALT, values[0])
                else:
                    encoded += other_item(values)
                found = True
        out.append(encoded)
    return out if found else None
