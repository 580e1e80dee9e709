"""vLLM's KV-event wire format: decoding the msgpack payload of one ZMQ message.

The payload (third frame of a live message) is a msgpack array
`[ts, events, data_parallel_rank]` (two elements before vLLM 0.9.1; a map-shaped
batch is accepted too, as cheap insurance). Each event is a tagged union, `type` in
`BlockStored`, `BlockRemoved`, `AllBlocksCleared`:

- up to vLLM 0.23 an array, the tag first, then the fields in declaration order;
- from vLLM 0.24 a map keyed by field name, the tag under `"type"`.

Unknown trailing elements and unknown keys are ignored, missing trailing fields take
their defaults, so every version from 0.9 on decodes (docs/architecture.md, "vLLM's
KV events", lists the fields per version). Block hashes are normalised to what the
index's engine-hash map keys (`ingest`): the low 60 bits of the unsigned 64-bit
value vLLM publishes (ints, signed ones from older engines included), or of the
last 8 bytes, big-endian, of a digest sent as bytes
(`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`: 32 or 16 bytes). 60 bits, because a
60-bit int is 8 bytes smaller in CPython than a 64-bit one, the map holds one per
cached block, and masking here costs nothing more than masking to 64 bits; two
blocks of one engine share the low 60 bits with a 2^-60 chance. Medium names are
lower-cased ("GPU", "cpu", "CPU_PINNED" -> "gpu", "cpu", "cpu"); no medium (before
vLLM 0.10.2) means the GPU.

The batch is decoded without a schema (msgspec builds plain lists and dicts, which
is as fast as typed structs here and tolerates every version's shape), then each
event is checked on its own: a malformed event is dropped and reported in
`EventBatch.rejected`, the rest of its batch still applies.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Final

import msgspec

MASK64: Final = (1 << 64) - 1
END_SEQ: Final = MASK64  # the replay end marker's seq (ff x 8)
# Engine block hashes keep their low 60 bits (the module docstring says why).
HASH_MASK: Final = (1 << 60) - 1
DIGEST_SIZES: Final = frozenset({8, 16, 32})

# Producer-specific medium names, after lower-casing, and what they mean here.
MEDIUM_ALIASES: Final = {"cpu_pinned": "cpu"}
DEFAULT_MEDIUM: Final = "gpu"

# Why an event (or a whole batch) was not applied; metric label values.
REJECT_BAD_PAYLOAD: Final = "bad_payload"  # not msgpack, truncated, not a batch
REJECT_BAD_EVENT: Final = "malformed_event"
REJECT_UNKNOWN_TYPE: Final = "unknown_event_type"
REJECT_BAD_HASH: Final = "bad_hash"


class WireError(Exception):
    """A payload that is not a KV-event batch at all."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


class _BadEvent(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    medium: str
    lora_id: int | None = None
    lora_name: str | None = None
    # One element per block: None, or the block's extra keys (untagged).
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    # vLLM >= 0.26: "LOCAL" or "REMOTE" (a block held elsewhere); None before.
    locality: str | None = None
    # SGLang names a request's salt in a field of its own (vLLM puts it in
    # extra_keys); it applies to the request's first block.
    cache_salt: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str
    group_idx: int | None = None
    locality: str | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(slots=True)
class EventBatch:
    ts: float
    events: list[Event]
    data_parallel_rank: int | None = None
    # (reason, detail) of each event dropped from the batch.
    rejected: list[tuple[str, str]] = field(default_factory=list)


_decoder: Final = msgspec.msgpack.Decoder()


def decode_batch(payload: bytes) -> EventBatch:
    """Decode one payload; raises `WireError` if it is not a batch at all."""
    try:
        raw = _decoder.decode(payload)
    except (msgspec.DecodeError, RecursionError, UnicodeDecodeError) as exc:
        # msgspec reports a string that is not UTF-8 as a UnicodeDecodeError, not a
        # DecodeError: it is bad input like the rest, and must not escape (the
        # stream would restart, replay the same bytes and fail again).
        raise WireError(REJECT_BAD_PAYLOAD, f"not a msgpack document: {exc}") from None
    if isinstance(raw, list):
        if len(raw) < 2:
            raise WireError(REJECT_BAD_PAYLOAD, f"a batch has 2 or 3 elements, got {len(raw)}")
        ts, events = raw[0], raw[1]
        rank = raw[2] if len(raw) > 2 else None
    elif isinstance(raw, dict):
        ts, events, rank = raw.get("ts"), raw.get("events"), raw.get("data_parallel_rank")
    else:
        raise WireError(REJECT_BAD_PAYLOAD, f"a batch is an array, got {type(raw).__name__}")
    if type(ts) not in (float, int) or not isinstance(events, list):
        raise WireError(REJECT_BAD_PAYLOAD, "a batch is [ts: float, events: list, dp_rank]")
    if rank is not None and type(rank) is not int:
        raise WireError(REJECT_BAD_PAYLOAD, f"data_parallel_rank must be an int, got {rank!r}")
    batch = EventBatch(float(ts), [], rank)
    append = batch.events.append
    for event in events:
        try:
            append(_event(event))
        except _BadEvent as bad:
            batch.rejected.append((bad.reason, str(bad)))
    return batch


def _event(raw: Any) -> Event:
    if type(raw) is list:
        if not raw:
            raise _BadEvent(REJECT_BAD_EVENT, "an empty event array")
        tag = raw[0]
        if tag == "BlockStored":
            if len(raw) < 5:
                raise _BadEvent(REJECT_BAD_EVENT, f"BlockStored with {len(raw)} elements")
            return _stored(
                raw[1],
                raw[2],
                raw[3],
                raw[4],
                raw[5] if len(raw) > 5 else None,
                raw[6] if len(raw) > 6 else None,
                raw[7] if len(raw) > 7 else None,
                raw[8] if len(raw) > 8 else None,
                raw[9] if len(raw) > 9 else None,
                None,  # locality is map-only (vLLM >= 0.26)
                None,  # so is SGLang's cache_salt
            )
        if tag == "BlockRemoved":
            if len(raw) < 2:
                raise _BadEvent(REJECT_BAD_EVENT, "BlockRemoved without block hashes")
            return _removed(
                raw[1], raw[2] if len(raw) > 2 else None, raw[3] if len(raw) > 3 else None, None
            )
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
        raise _unknown(tag)
    if type(raw) is dict:
        tag = raw.get("type")
        if tag == "BlockStored":
            if "block_hashes" not in raw:
                raise _BadEvent(REJECT_BAD_EVENT, "BlockStored without block_hashes")
            get = raw.get
            return _stored(
                raw["block_hashes"],
                get("parent_block_hash"),
                get("token_ids", []),
                get("block_size", 0),
                get("lora_id"),
                get("medium"),
                get("lora_name"),
                get("extra_keys"),
                get("group_idx"),
                get("locality"),
                get("cache_salt"),
            )
        if tag == "BlockRemoved":
            if "block_hashes" not in raw:
                raise _BadEvent(REJECT_BAD_EVENT, "BlockRemoved without block_hashes")
            return _removed(
                raw["block_hashes"], raw.get("medium"), raw.get("group_idx"), raw.get("locality")
            )
        if tag == "AllBlocksCleared":
            return AllBlocksCleared()
        raise _unknown(tag)
    raise _BadEvent(REJECT_BAD_EVENT, f"an event is an array or a map, got {type(raw).__name__}")


def _unknown(tag: object) -> _BadEvent:
    if isinstance(tag, str):
        return _BadEvent(REJECT_UNKNOWN_TYPE, f"unknown event type {tag[:64]!r}")
    return _BadEvent(REJECT_BAD_EVENT, f"an event's tag must be a string, got {tag!r:.64}")


def normalise_hash(value: object) -> int:
    """A block hash from the wire as the index's map keys it (its low 60 bits)."""
    if type(value) is int:
        return value & HASH_MASK
    if type(value) is bytes:
        if len(value) not in DIGEST_SIZES:
            raise _BadEvent(
                REJECT_BAD_HASH, f"a {len(value)}-byte block hash (expected 8, 16 or 32)"
            )
        return int.from_bytes(value[-8:], "big") & HASH_MASK
    raise _BadEvent(REJECT_BAD_HASH, f"a block hash must be an int or bytes, got {value!r:.64}")


def _hashes(value: object) -> list[int]:
    if type(value) is not list or not value:
        raise _BadEvent(REJECT_BAD_EVENT, "block_hashes must be a non-empty list")
    # `type(h) is int` also keeps booleans out (bool is a subclass of int).
    return [h & HASH_MASK if type(h) is int else normalise_hash(h) for h in value]


def normalise_medium(value: object) -> str:
    if value is None:
        return DEFAULT_MEDIUM
    if type(value) is not str:
        raise _BadEvent(REJECT_BAD_EVENT, f"medium must be a string, got {value!r:.64}")
    name = value.lower()
    return MEDIUM_ALIASES.get(name, name)


def _optional(value: object, kind: type, name: str) -> Any:
    if value is None or type(value) is kind:
        return value
    raise _BadEvent(REJECT_BAD_EVENT, f"{name} must be {kind.__name__} or null, got {value!r:.64}")


def _stored(
    hashes: object,
    parent: object,
    tokens: object,
    block_size: object,
    lora_id: object,
    medium: object,
    lora_name: object,
    extra_keys: object,
    group_idx: object,
    locality: object,
    cache_salt: object,
) -> BlockStored:
    keys = _hashes(hashes)
    if type(tokens) is not list:
        raise _BadEvent(REJECT_BAD_EVENT, "token_ids must be a list")
    if type(block_size) is not int:
        raise _BadEvent(REJECT_BAD_EVENT, f"block_size must be an int, got {block_size!r:.64}")
    return BlockStored(
        block_hashes=keys,
        parent_block_hash=None if parent is None else normalise_hash(parent),
        token_ids=tokens,
        block_size=block_size,
        medium=normalise_medium(medium),
        lora_id=_optional(lora_id, int, "lora_id"),
        lora_name=_optional(lora_name, str, "lora_name"),
        extra_keys=_optional(extra_keys, list, "extra_keys"),
        group_idx=_optional(group_idx, int, "group_idx"),
        locality=_optional(locality, str, "locality"),
        cache_salt=_optional(cache_salt, str, "cache_salt"),
    )


def _removed(hashes: object, medium: object, group_idx: object, locality: object) -> BlockRemoved:
    keys = _hashes(hashes)
    return BlockRemoved(
        block_hashes=keys,
        medium=normalise_medium(medium),
        group_idx=_optional(group_idx, int, "group_idx"),
        locality=_optional(locality, str, "locality"),
    )
