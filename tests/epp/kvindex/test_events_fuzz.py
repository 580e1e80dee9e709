"""Property-based tests of the KV-event decoder and its ingestion into the prefix
index: random bytes, mutated golden payloads (encoded by vLLM's own structs), and
random but well-formed event sequences in every encoding vLLM has used.

The invariants: decoding never raises anything but `WireError`; applying whatever
decodes never raises; and the index never holds an entry the events did not
justify (for well-formed sequences: exactly the entries they justify). The index
keys blocks by its own hash of their tokens; what it holds is read back as the
engine hashes whose keys it holds (the stream's map), which is what events name."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.datastore import Datastore, Endpoint, EndpointSpec
from epp.kvindex.alignment import AlignmentChecker
from epp.kvindex.events import HASH_MASK, BlockStored, WireError, decode_batch
from epp.kvindex.index import PrefixIndex, bits
from epp.kvindex.ingest import PreciseIndex, StreamIndex
from tests.fuzzing import examples
from tests.testdata import load_json

MASK64 = (1 << 64) - 1
TIERS = {"gpu": 1.0, "cpu": 0.8}


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    # Malformed input is logged once per cause by design; thousands of examples
    # would only fill the captured log.
    logging.disable(logging.ERROR)
    yield
    logging.disable(logging.NOTSET)


@functools.cache
def _golden_payloads() -> list[bytes]:
    return [
        bytes.fromhex(v["payload_hex"]) for v in load_json("vllm/event_payloads.json")["vectors"]
    ]


@dataclass
class Sink:
    precise: PreciseIndex
    stream: StreamIndex

    def own_entries(self) -> dict[str, set[int]]:
        """tier -> the index keys the stream holds, read from the block maps."""
        bit = 1 << self.stream.slot
        return {
            tier.name: {key for key, mask in tier.blocks.items() if mask & bit}
            for tier in self.precise.index.tiers
        }

    def entries(self) -> dict[str, set[int]]:
        """tier -> the engine hashes whose keys the stream holds there."""
        own = self.own_entries()
        return {
            tier: {h for h, key in self.stream.engine_keys.items() if key in keys}
            for tier, keys in own.items()
        }


def new_sink(max_entries: int = 1_000_000, block_size: int = 16) -> Sink:
    datastore = Datastore()
    datastore.replace_all([EndpointSpec(name="pod", address="10.0.0.1:8000")])
    endpoint = datastore.get("pod")
    assert isinstance(endpoint, Endpoint)
    precise = PreciseIndex(
        PrefixIndex(max_entries, TIERS),
        block_size,
        AlignmentChecker(block_size, 1, clock=time.monotonic),
        None,
    )
    return Sink(precise, precise.add_stream(endpoint, 0))


def assert_consistent(sink: Sink) -> None:
    """The index's own bookkeeping agrees with its block maps."""
    index = sink.precise.index
    held = sink.own_entries()
    assert index.slot_blocks(sink.stream.slot) == {t: len(keys) for t, keys in held.items()}
    # Retired slots' bits stay in the maps until the sweeper runs: only live ones count.
    live = 1 << sink.stream.slot
    held_bits = sum(
        bin(mask & live).count("1") for tier in index.tiers for mask in tier.blocks.values()
    )
    assert index.stats.entries == held_bits
    assert index.stats.entries <= index.max_entries
    # The map only names keys the events computed: every hash it keeps was named by
    # a BlockStored, and the map stays within its bound.
    assert len(sink.stream.engine_keys) <= index.max_entries


def justified(payload: bytes) -> set[int]:
    """Every block key a BlockStored event of this payload names (after decoding)."""
    try:
        batch = decode_batch(payload)
    except WireError:
        return set()
    return {k for e in batch.events if isinstance(e, BlockStored) for k in e.block_hashes}


# ---------------------------------------------------------------------------
# Garbage in


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=8)
    | st.binary(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=12,
)


@settings(max_examples=examples(300))
@given(st.binary(max_size=300))
def test_random_bytes_decode_or_fail_with_a_wire_error(payload: bytes) -> None:
    sink = new_sink()
    try:
        batch = decode_batch(payload)
    except WireError:
        return
    sink.stream.apply(batch)
    assert set().union(*sink.entries().values()) <= justified(payload)
    assert_consistent(sink)


@st.composite
def mutated_golden(draw: st.DrawFn) -> bytes:
    payload = bytearray(draw(st.sampled_from(_golden_payloads())))
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "set", "truncate", "insert", "delete"]))
        at = draw(st.integers(0, max(0, len(payload) - 1)))
        if kind == "flip" and payload:
            payload[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set" and payload:
            payload[at] = draw(st.integers(0, 255))
        elif kind == "truncate":
            del payload[at:]
        elif kind == "insert":
            payload[at:at] = draw(st.binary(min_size=1, max_size=9))
        elif kind == "delete":
            del payload[at : at + draw(st.integers(1, 9))]
    return bytes(payload)


@settings(max_examples=examples(300))
@given(mutated_golden())
def test_mutated_golden_payloads_never_put_an_unjustified_entry_in_the_index(
    payload: bytes,
) -> None:
    sink = new_sink()
    try:
        batch = decode_batch(payload)
    except WireError:
        return
    sink.stream.apply(batch)
    counters = sink.stream.counters
    # Every decoded event is applied, ignored or rejected by the ingestion (a block
    # size or token count it cannot use), once; the decoder's rejections come on top.
    by_ingestion = sum(counters.rejected.values()) - len(batch.rejected)
    assert by_ingestion >= 0
    applied = counters.events_applied + sum(counters.ignored.values()) + by_ingestion
    assert applied == len(batch.events)
    assert set().union(*sink.entries().values()) <= justified(payload)
    assert_consistent(sink)


tags = st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other"])
field_names = st.sampled_from(
    ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
     "medium", "lora_name", "extra_keys", "group_idx", "locality"]
)  # fmt: skip


@st.composite
def near_valid_stored(draw: st.DrawFn) -> dict[str, Any]:
    """A BlockStored event close enough to valid that the alignment check runs on
    it, with any field swapped for junk: the paths random bytes rarely reach."""
    n = draw(st.integers(1, 3))
    # Mostly real ids, sometimes one no engine would send.
    token = st.integers(0, 2**32 - 1) | st.sampled_from([-1, 2**32, 2**64 - 1, 1.5, "7", None, [1]])
    event: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": draw(st.lists(st.integers(0, MASK64), min_size=n, max_size=n)),
        "parent_block_hash": draw(st.none() | st.integers(0, MASK64)),
        "token_ids": draw(st.lists(token, min_size=16 * n, max_size=16 * n)),
        "block_size": 16,
        "extra_keys": draw(st.none() | st.lists(msgpack_values, max_size=n + 1)),
        "lora_name": draw(st.none() | st.text(max_size=4) | msgpack_values),
        "medium": draw(st.sampled_from(["GPU", "cpu", None])),
    }
    for name in draw(st.lists(field_names, max_size=2)):
        event[name] = draw(msgpack_values | tags)
    return event


junk_events = (
    st.tuples(tags, st.lists(msgpack_values, max_size=11)).map(lambda t: [t[0], *t[1]])
    | st.dictionaries(field_names, msgpack_values | tags, max_size=11)
    | near_valid_stored()
    | msgpack_values
)


@settings(max_examples=examples(150))
@given(st.lists(junk_events, max_size=5), st.sampled_from(["array", "map", "short"]))
def test_junk_events_are_rejected_one_by_one_and_never_raise(events: list[Any], shape: str) -> None:
    batch: Any = {
        "array": [1.5, events, 0],
        "map": {"ts": 1.5, "events": events, "data_parallel_rank": 0},
        "short": [1.5, events],
    }[shape]
    payload = msgspec.msgpack.encode(batch)
    sink = new_sink()
    decoded = decode_batch(payload)  # a well-formed batch: only its events may be bad
    assert len(decoded.events) + len(decoded.rejected) == len(events)
    sink.stream.apply(decoded)
    assert set().union(*sink.entries().values()) <= justified(payload)
    assert_consistent(sink)


@settings(max_examples=examples(150))
@given(near_valid_stored())
def test_the_alignment_check_never_raises(event: dict[str, Any]) -> None:
    """Regressions (from when the check re-hashed events; the name is cited in
    docs/reliability.md): a non-list extra key after block 0 raised TypeError (and
    the rest of its batch was lost); ids that are not uint32 cannot be encoded. The
    ingestion, which now checks block sizes and token ids, keys such events with
    uninterpreted extras or rejects them (`bad_token_ids`), and never raises."""
    payload = msgspec.msgpack.encode([1.5, [event], 0])
    decoded = decode_batch(payload)
    sink = new_sink()
    sink.stream.apply(decoded)
    assert set().union(*sink.entries().values()) <= justified(payload)
    assert sink.stream.alignment.aligned is not False  # block size 16: it agrees
    assert_consistent(sink)


# ---------------------------------------------------------------------------
# Well-formed sequences: the index holds exactly what they justify


KEYS = st.integers(0, 40).map(lambda i: (i * 0x9E3779B97F4A7C15) & MASK64)  # a small pool


def tokens_of(key: int) -> list[int]:
    """The tokens of the block an engine calls `key` (distinct per key of the pool)."""
    base = (key & HASH_MASK) % (2**32 - 16)
    return [base + i for i in range(16)]


MEDIA = {"GPU": "gpu", "gpu": "gpu", "CPU": "cpu", "cpu": "cpu", "CPU_PINNED": "cpu", "DISK": None}


@dataclass(frozen=True)
class Op:
    kind: str  # stored, removed, cleared
    keys: tuple[int, ...] = ()
    medium: str | None = None  # None: the field is absent (before vLLM 0.10.2: GPU)
    group: int | None = None
    locality: str | None = None


ops = st.one_of(
    st.builds(
        Op,
        st.just("stored"),
        st.lists(KEYS, min_size=1, max_size=6).map(tuple),
        st.none() | st.sampled_from(sorted(MEDIA)),
        st.none() | st.sampled_from([0, 1]),
        st.none() | st.sampled_from(["LOCAL", "REMOTE"]),
    ),
    st.builds(
        Op,
        st.just("removed"),
        st.lists(KEYS, min_size=1, max_size=6).map(tuple),
        st.none() | st.sampled_from(sorted(MEDIA)),
        st.none() | st.sampled_from([0, 1]),
    ),
    st.just(Op("cleared")),
)


def wire_hash(key: int, how: str) -> Any:
    """A key as engines put it on the wire: uint64, a signed int64 (older
    engines), or the digest's bytes (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)."""
    if how == "signed":
        return key - (1 << 64) if key >= 1 << 63 else key
    if how == "bytes":
        return b"\x5a" * 24 + key.to_bytes(8, "big")
    return key


def encode_all(op: Op, shape: str, how: str) -> list[Any]:
    """The events of one op. A store is one single-block event per key (no parent):
    an engine's hash always names the same tokens after the same parent, which
    arbitrary runs of keys from a small pool would not respect."""
    if op.kind != "stored":
        return [encode(op, shape, how)]
    return [encode(replace(op, keys=(key,)), shape, how) for key in op.keys]


def encode(op: Op, shape: str, how: str) -> Any:
    hashes = [wire_hash(k, how) for k in op.keys]
    if op.kind == "cleared":
        return ["AllBlocksCleared"] if shape == "array" else {"type": "AllBlocksCleared"}
    if op.kind == "removed":
        if shape == "array":
            return ["BlockRemoved", hashes, op.medium, op.group]
        event: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": hashes}
        if op.medium is not None:
            event["medium"] = op.medium
        if op.group is not None:
            event["group_idx"] = op.group
        return event
    tokens = [t for key in op.keys for t in tokens_of(key)]
    if shape == "array":  # vLLM <= 0.23: fields in declaration order, then unknown ones
        return ["BlockStored", hashes, None, tokens, 16, None, op.medium, None, None,
                op.group, "full_attention", None]  # fmt: skip
    event = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": tokens,
        "block_size": 16,
        "lora_id": None,
        "future_field": [1],  # unknown keys are ignored
    }
    if op.medium is not None:
        event["medium"] = op.medium
    if op.group is not None:
        event["group_idx"] = op.group
    if op.locality is not None:
        event["locality"] = op.locality
    return event


def model_apply(model: dict[str, set[int]], op: Op) -> None:
    """What vLLM's events mean for the index (docs/architecture.md, "vLLM's KV
    events"; epp/kvindex/ingest.py)."""
    if op.kind == "cleared":
        for keys in model.values():
            keys.clear()
        return
    tier = MEDIA[op.medium] if op.medium is not None else "gpu"
    if tier is None or op.group or op.locality == "REMOTE":
        return  # another KV-cache group, a remote block, a medium without a weight
    keys = {key & HASH_MASK for key in op.keys}  # as the decoder normalises them
    if op.kind == "stored":
        model[tier].update(keys)
    else:
        model[tier].difference_update(keys)


@settings(max_examples=examples(200))
@given(
    st.lists(st.lists(ops, min_size=1, max_size=5), min_size=1, max_size=6),
    st.sampled_from(["array", "map"]),
    st.sampled_from(["uint", "signed", "bytes"]),
)
def test_well_formed_sequences_leave_exactly_the_blocks_they_justify(
    batches: list[list[Op]], shape: str, how: str
) -> None:
    sink = new_sink()
    model: dict[str, set[int]] = {name: set() for name in TIERS}
    for batch in batches:
        events = [e for op in batch for e in encode_all(op, shape, how)]
        payload = msgspec.msgpack.encode([1.5, events, 0])
        decoded = decode_batch(payload)
        assert not decoded.rejected
        sink.stream.apply(decoded)
        for op in batch:
            # Array-encoded events (vLLM <= 0.23) have no locality field.
            model_apply(model, op if shape == "map" else replace(op, locality=None))
        assert sink.entries() == model
        assert_consistent(sink)


@settings(max_examples=examples(100))
@given(st.lists(st.lists(ops, min_size=1, max_size=5), min_size=1, max_size=8))
def test_a_bounded_index_holds_a_subset_of_what_the_events_justify(
    batches: list[list[Op]],
) -> None:
    sink = new_sink(max_entries=8)
    model: dict[str, set[int]] = {name: set() for name in TIERS}
    for batch in batches:
        events = [e for op in batch for e in encode_all(op, "map", "uint")]
        sink.stream.apply(decode_batch(msgspec.msgpack.encode([1.5, events, 0])))
        for op in batch:
            model_apply(model, op)
        for tier, keys in sink.entries().items():
            assert keys <= model[tier]
        assert_consistent(sink)
    # Retired slots never leak back: after a sweep only live slots remain anywhere.
    sink.precise.index.sweep_now()
    live = {sink.stream.slot}
    for tier in sink.precise.index.tiers:
        for mask in tier.blocks.values():
            assert set(bits(mask)) <= live
