"""Decoding vLLM's KV-event payloads: golden payloads encoded by vLLM's own structs
(0.9.0 to 0.33.0, array- and map-encoded events, int and bytes hashes), and bad
input, one case each."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from epp.kvindex.events import (
    HASH_MASK,
    REJECT_BAD_EVENT,
    REJECT_BAD_HASH,
    REJECT_BAD_PAYLOAD,
    REJECT_UNKNOWN_TYPE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    WireError,
    decode_batch,
    normalise_medium,
)
from tests.testdata import load_json

MASK64 = (1 << 64) - 1
MASK60 = (1 << 60) - 1  # the decoder keeps an engine hash's low 60 bits


def _golden_keys() -> list[int]:
    golden = load_json("vllm/block_hashes.json")
    (vector,) = [v for v in golden["vectors"] if v["algo"] == "sha256_cbor"]
    return [b["event_uint64"] & MASK60 for b in vector["blocks"]]


def _vectors() -> list[dict[str, Any]]:
    return list(load_json("vllm/event_payloads.json")["vectors"])


def test_golden_payloads_decode_to_the_same_events() -> None:
    h0, h1, h2 = _golden_keys()
    vectors = _vectors()
    assert len(vectors) >= 7
    for vector in vectors:
        batch = decode_batch(bytes.fromhex(vector["payload_hex"]))
        where = f"{vector['vllm']} int={vector['int_block_hashes']}"
        assert batch.ts == 1700000000.5, where
        assert not batch.rejected, where
        version = vector["vllm"]
        # 0.9.0 batches have two elements: no data-parallel rank.
        assert batch.data_parallel_rank == (None if "0.9.0" in version else 0), where
        stored0, stored1, removed, cleared = batch.events
        assert isinstance(stored0, BlockStored), where
        assert stored0.block_hashes == [h0, h1]
        assert stored0.parent_block_hash is None
        assert stored0.token_ids == list(range(1, 33))
        assert stored0.block_size == 16
        assert stored0.medium == "gpu"  # "GPU", or none before 0.10.2
        assert isinstance(stored1, BlockStored)
        assert stored1.block_hashes == [h2]
        assert stored1.parent_block_hash == h1
        assert stored1.token_ids == list(range(33, 49))
        assert isinstance(removed, BlockRemoved)
        assert removed.block_hashes == [h0]
        assert removed.medium == "gpu"
        assert isinstance(cleared, AllBlocksCleared)
        if "0.22" in version or "0.33" in version:
            assert stored0.extra_keys == [None, None]
            assert stored0.group_idx == 0


def test_signed_hashes_are_read_as_unsigned_and_keep_their_low_60_bits() -> None:
    # Older engines publish Python hash() values: signed 64-bit ints.
    payload = msgspec.msgpack.encode(
        [1.0, [["BlockStored", [-1, -(1 << 63)], -2, [], 16, None]], 0]
    )
    (event,) = decode_batch(payload).events
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [MASK64 & MASK60, (1 << 63) & MASK60]
    assert event.parent_block_hash == (MASK64 - 1) & MASK60
    assert HASH_MASK == MASK60


@pytest.mark.parametrize("size", [8, 16, 32])
def test_bytes_hashes_give_their_last_8_bytes(size: int) -> None:
    digest = bytes(range(size))
    payload = msgspec.msgpack.encode([1.0, [{"type": "BlockRemoved", "block_hashes": [digest]}]])
    (event,) = decode_batch(payload).events
    assert isinstance(event, BlockRemoved)
    assert event.block_hashes == [int.from_bytes(digest[-8:], "big") & MASK60]


def test_unknown_fields_and_trailing_elements_are_ignored() -> None:
    payload = msgspec.msgpack.encode(
        [
            2.5,
            [
                ["BlockStored", [7], None, [1] * 16, 16, None, "CPU", None, None, 0, "x", 3,
                 "more"],
                ["BlockRemoved", [7], "cpu_pinned", 0, "future"],
                {"type": "BlockStored", "block_hashes": [8], "parent_block_hash": 7,
                 "token_ids": [], "block_size": 0, "medium": "STORAGE", "new_field": {"a": 1},
                 "locality": "REMOTE", "session_id": "s"},
                ["AllBlocksCleared", "extra"],
            ],
            1,
            "a future batch field",
        ]
    )  # fmt: skip
    batch = decode_batch(payload)
    assert not batch.rejected
    assert batch.data_parallel_rank == 1
    a, b, c, d = batch.events
    assert isinstance(a, BlockStored)
    assert a.medium == "cpu"
    assert isinstance(b, BlockRemoved)
    assert b.medium == "cpu"
    assert isinstance(c, BlockStored)
    assert c.medium == "storage"
    assert c.locality == "REMOTE"
    assert isinstance(d, AllBlocksCleared)


def test_a_map_shaped_batch_is_accepted() -> None:
    payload = msgspec.msgpack.encode({"ts": 1.0, "events": [{"type": "AllBlocksCleared"}]})
    assert isinstance(decode_batch(payload).events[0], AllBlocksCleared)


def test_medium_names_are_normalised() -> None:
    assert normalise_medium(None) == "gpu"
    assert normalise_medium("GPU") == "gpu"
    assert normalise_medium("CPU_PINNED") == "cpu"
    assert normalise_medium("SHARED_STORAGE") == "shared_storage"


# --- bad input: never fatal, counted by reason, never a wrong index entry ---------


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",  # a byte msgpack never uses
        b"not msgpack at all \xff\xfe",
        bytes.fromhex("93cb41d954fc4020000094"),  # a golden payload, truncated
    ],
    ids=["empty", "reserved-byte", "garbage", "truncated"],
)
def test_undecodable_payloads_raise_wire_errors(payload: bytes) -> None:
    with pytest.raises(WireError) as caught:
        decode_batch(payload)
    assert caught.value.reason == REJECT_BAD_PAYLOAD


@pytest.mark.parametrize(
    "document",
    [5, "batch", [1.0], ["ts", []], [1.0, {"not": "a list"}], [1.0, [], "rank"]],
    ids=["int", "string", "one-element", "string-ts", "events-map", "string-rank"],
)
def test_payloads_that_are_not_batches(document: object) -> None:
    with pytest.raises(WireError) as caught:
        decode_batch(msgspec.msgpack.encode(document))
    assert caught.value.reason == REJECT_BAD_PAYLOAD


def test_every_truncation_of_a_golden_payload_is_rejected_not_misread() -> None:
    payload = bytes.fromhex(_vectors()[-2]["payload_hex"])
    for cut in range(len(payload)):
        with pytest.raises(WireError):
            decode_batch(payload[:cut])


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (["Teleported", [1]], REJECT_UNKNOWN_TYPE),
        ({"type": "BlockMoved", "block_hashes": [1]}, REJECT_UNKNOWN_TYPE),
        ([], REJECT_BAD_EVENT),
        ([42, [1]], REJECT_BAD_EVENT),
        ("BlockStored", REJECT_BAD_EVENT),
        (["BlockStored", [1], None], REJECT_BAD_EVENT),  # too few fields
        (["BlockStored", [], None, [], 16, None], REJECT_BAD_EVENT),  # no hashes
        (["BlockStored", [1], None, "tokens", 16, None], REJECT_BAD_EVENT),
        (["BlockStored", [1], None, [], "16", None], REJECT_BAD_EVENT),
        (["BlockStored", [1], None, [], 16, None, 5], REJECT_BAD_EVENT),  # medium
        ({"type": "BlockRemoved"}, REJECT_BAD_EVENT),
        (["BlockRemoved", [b"\x01\x02\x03"]], REJECT_BAD_HASH),  # a 3-byte hash
        (["BlockRemoved", [b"\x00" * 20]], REJECT_BAD_HASH),  # 20 bytes: no engine's
        (["BlockRemoved", [1.5]], REJECT_BAD_HASH),
        (["BlockRemoved", [True]], REJECT_BAD_HASH),
        (["BlockStored", [1], "parent", [], 16, None], REJECT_BAD_HASH),
    ],
)
def test_a_bad_event_is_dropped_and_the_rest_of_its_batch_applies(
    event: object, reason: str
) -> None:
    good = ["BlockRemoved", [99], "GPU"]
    batch = decode_batch(msgspec.msgpack.encode([1.0, [good, event, good], 0]))
    assert [r for r, _ in batch.rejected] == [reason]
    assert len(batch.events) == 2
    assert all(isinstance(e, BlockRemoved) and e.block_hashes == [99] for e in batch.events)
