"""KV-cache events: what the block pool reports, and vLLM's msgpack encoding of them.

The block pool emits plain dataclasses (`BlockStored`, `BlockRemoved`,
`AllBlocksCleared`) carrying full digests. `EventBatchEncoder` turns one engine
step's events into the payload vLLM puts in the third ZMQ frame, byte for byte:

- the batch is always a msgpack array `[ts, events, data_parallel_rank]`;
- `format="map"` (vLLM >= 0.24): each event is a map keyed by field name with the
  tag under `"type"`; fields that default to None and are None are left out
  (msgspec `omit_defaults`), the fields of vLLM 0.33 are known;
- `format="array"` (vLLM <= 0.23): each event is an array, tag first, then every
  field of vLLM 0.22/0.23 in declaration order, trailing nulls included (msgspec
  does not omit defaults in array-like structs);
- block hashes are the uint64 of the digest's last 8 bytes (`int_hashes=True`,
  vLLM's default) or the raw digest bytes (like `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`).

The msgspec structs below are configured the way vLLM configures its own (array-like
batch, tagged union, `omit_defaults`, `gc=False`), so identical events and timestamps
give identical bytes; tests check that against payloads encoded by vLLM's code.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from sim.hashing import to_event_hash

MEDIUM_GPU = "GPU"
# The only KV-cache group kind the simulator has (one group of full attention).
KV_CACHE_SPEC_KIND = "full_attention"

EventFormat = Literal["map", "array"]
EVENT_FORMATS: tuple[EventFormat, ...] = ("map", "array")


# --- what the block pool emits -------------------------------------------------


@dataclass(frozen=True)
class BlockStored:
    """Blocks that just became full and were added to the prefix cache."""

    block_hashes: tuple[bytes, ...]
    # Hash of the block before the first stored one; None when that is block 0.
    parent_block_hash: bytes | None
    # The tokens of all stored blocks, concatenated (len = blocks x block_size).
    token_ids: tuple[int, ...]
    block_size: int
    # One element per stored block: None, or the block's untagged extra keys.
    extra_keys: tuple[list[str] | None, ...]


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks evicted (their memory reused for other tokens)."""

    block_hashes: tuple[bytes, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The whole prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

# --- vLLM's wire structs ----------------------------------------------------------

WireHash = int | bytes


class _Batch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


# Map-encoded events (vLLM >= 0.24; fields as of 0.33).
class _MapEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _MapBlockStored(_MapEvent, tag="BlockStored"):
    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[str] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class _MapBlockRemoved(_MapEvent, tag="BlockRemoved"):
    block_hashes: list[WireHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _MapAllBlocksCleared(_MapEvent, tag="AllBlocksCleared"):
    pass


# Array-encoded events (vLLM <= 0.23; fields as of 0.22/0.23).
class _ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class _ArrayBlockStored(_ArrayEvent, tag="BlockStored"):
    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[str] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _ArrayBlockRemoved(_ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[WireHash]
    medium: str | None
    group_idx: int | None = None


class _ArrayAllBlocksCleared(_ArrayEvent, tag="AllBlocksCleared"):
    pass


@dataclass(frozen=True)
class EventBatchEncoder:
    """Encodes one engine step's events as vLLM's msgpack payload."""

    format: EventFormat = "map"
    int_hashes: bool = True
    data_parallel_rank: int = 0

    def __post_init__(self) -> None:
        if self.format not in EVENT_FORMATS:
            raise ValueError(f"unknown KV-event format {self.format!r}")

    def _hash(self, digest: bytes) -> WireHash:
        return to_event_hash(digest) if self.int_hashes else digest

    def _wire(self, event: KVEvent) -> msgspec.Struct:
        array = self.format == "array"
        if isinstance(event, BlockStored):
            stored = _ArrayBlockStored if array else _MapBlockStored
            return stored(
                block_hashes=[self._hash(h) for h in event.block_hashes],
                parent_block_hash=(
                    None if event.parent_block_hash is None else self._hash(event.parent_block_hash)
                ),
                token_ids=list(event.token_ids),
                block_size=event.block_size,
                lora_id=None,
                medium=MEDIUM_GPU,
                lora_name=None,
                extra_keys=list(event.extra_keys),
                group_idx=0,
                kv_cache_spec_kind=KV_CACHE_SPEC_KIND,
            )
        if isinstance(event, BlockRemoved):
            removed = _ArrayBlockRemoved if array else _MapBlockRemoved
            return removed(
                block_hashes=[self._hash(h) for h in event.block_hashes],
                medium=MEDIUM_GPU,
                group_idx=0,
            )
        return _ArrayAllBlocksCleared() if array else _MapAllBlocksCleared()

    def encode(self, ts: float, events: Sequence[KVEvent]) -> bytes:
        batch = _Batch(
            ts=ts,
            events=[self._wire(e) for e in events],
            data_parallel_rank=self.data_parallel_rank,
        )
        return msgspec.msgpack.encode(batch)
