"""KV-event payloads, byte for byte against payloads encoded by vLLM's own structs."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from sim.engine import Engine, EngineConfig
from sim.hashing import BlockHasher
from sim.kv_cache import BlockPool, KVCacheManager
from sim.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatchEncoder,
    KVEvent,
)
from tests.sim.conftest import load_json

TS = 1700000000.5  # the golden payloads' timestamp
BLOCK = 16


def golden_events() -> list[KVEvent]:
    """The events behind every golden payload: sha256_cbor, seed "0", tokens 1..48."""
    h0, h1, h2 = BlockHasher("sha256_cbor", "0", BLOCK).block_hashes(list(range(1, 49)))
    return [
        BlockStored((h0, h1), None, tuple(range(1, 33)), BLOCK, (None, None)),
        BlockStored((h2,), h1, tuple(range(33, 49)), BLOCK, (None,)),
        BlockRemoved((h0,)),
        AllBlocksCleared(),
    ]


def golden_vector(version: str, int_hashes: bool) -> dict[str, Any]:
    vectors = load_json("vllm/event_payloads.json")["vectors"]
    (vector,) = [
        v
        for v in vectors
        if v["vllm"].startswith(f"vllm=={version} ") and v["int_block_hashes"] == int_hashes
    ]
    return vector  # type: ignore[no-any-return]


CASES = [
    # (vLLM version of the golden payload, our format)
    ("0.22.1", "array"),  # last release with array-encoded events
    ("0.33.0", "map"),  # map-encoded events (vLLM >= 0.24)
]


@pytest.mark.parametrize(("version", "fmt"), CASES)
@pytest.mark.parametrize("int_hashes", [True, False], ids=["int-hashes", "bytes-hashes"])
def test_payload_bytes_match_vllm(version: str, fmt: str, int_hashes: bool) -> None:
    vector = golden_vector(version, int_hashes)
    encoder = EventBatchEncoder(fmt, int_hashes)  # type: ignore[arg-type]
    payload = encoder.encode(TS, golden_events())
    assert payload.hex() == vector["payload_hex"]
    assert len(payload) == vector["payload_len"]


def test_array_events_carry_every_field() -> None:
    decoded = msgspec.msgpack.decode(EventBatchEncoder("array").encode(TS, golden_events()))
    ts, events, dp_rank = decoded
    assert (ts, dp_rank) == (TS, 0)
    assert [len(e) for e in events] == [12, 12, 4, 1]  # tag + 11 / tag + 3 / tag
    assert events[0][-1] is None  # kv_cache_spec_sliding_window, a trailing null


def test_map_events_leave_out_none_defaults() -> None:
    _, events, _ = msgspec.msgpack.decode(EventBatchEncoder("map").encode(TS, golden_events()))
    stored = events[0]
    assert stored["type"] == "BlockStored"
    assert stored["medium"] == "GPU"
    assert stored["parent_block_hash"] is None  # required: present even when None
    assert "locality" not in stored
    assert "kv_cache_spec_sliding_window" not in stored
    assert events[3] == {"type": "AllBlocksCleared"}


def test_salted_block_zero_extra_keys() -> None:
    event = BlockStored((b"\x01" * 32,), None, tuple(range(16)), 16, (["salt-A"],))
    _, events, _ = msgspec.msgpack.decode(EventBatchEncoder("map").encode(TS, [event]))
    assert events[0]["extra_keys"] == [["salt-A"]]
    assert events[0]["block_hashes"] == [int.from_bytes(b"\x01" * 8, "big")]


def test_block_pool_emits_the_golden_events() -> None:
    """A block pool serving two requests produces vLLM's events for them.

    Request A (tokens 1..33) fills blocks 0 and 1; request B (1..49) hits both and
    fills block 2. Their BlockStored events, with the golden payload's eviction and
    reset appended, encode to the bytes vLLM produced."""
    kv = KVCacheManager(BlockPool(8, BLOCK), BlockHasher("sha256_cbor", "0", BLOCK))
    a = kv.new_sequence(list(range(1, 34)))
    assert kv.allocate_slots(a, 0, 33)
    kv.free(a)
    b = kv.new_sequence(list(range(1, 50)))
    hits = kv.find_prefix_hit(b)
    assert len(hits) == 2
    assert kv.allocate_slots(b, 32, 17, hits)
    events = kv.pool.take_events()
    expected = golden_events()
    assert events == expected[:2]
    payload = EventBatchEncoder("map").encode(TS, [*events, *expected[2:]])
    assert payload.hex() == golden_vector("0.33.0", True)["payload_hex"]


async def test_engine_batches_one_step_of_events() -> None:
    """The engine publishes one batch per step that produced events."""

    class Collect:
        def __init__(self) -> None:
            self.batches: list[list[KVEvent]] = []

        async def publish(self, events: Any) -> int:
            self.batches.append(list(events))
            return len(self.batches) - 1

    sink = Collect()
    engine = Engine(
        EngineConfig(num_gpu_blocks=16, block_size=4, time_scale=0.01, hash_seed="0"),
        answer_token_ids=[7],
        sink=sink,
    )
    engine.start()
    try:
        outputs: asyncio.Queue[Any] = asyncio.Queue()
        engine.add_request(
            list(range(1, 10)), max_tokens=4, finish_reason="length", outputs=outputs
        )
        for _ in range(4):
            await asyncio.wait_for(outputs.get(), 5)
    finally:
        await engine.stop()
    # Prefill stores blocks 0-1 (8 of 9 tokens); decode fills block 2 with
    # token 9 and three generated tokens once the third generated token is computed
    # (the 4th and last is sampled but never computed).
    assert [[type(e).__name__ for e in batch] for batch in sink.batches] == [
        ["BlockStored"],
        ["BlockStored"],
    ]
    stored = sink.batches[1][0]
    assert isinstance(stored, BlockStored)
    assert stored.token_ids == (9, 7, 7, 7)
    assert stored.parent_block_hash == sink.batches[0][0].block_hashes[-1]  # type: ignore[union-attr]
