"""KV-event payloads as a vLLM engine publishes them for a prompt it cached, hashed
by the simulator's engine-faithful hasher (sim/hashing.py, checked against vLLM's
golden vectors), so that the scorer's own hashing is tested, not assumed."""

from __future__ import annotations

import time
from collections.abc import Sequence

import msgspec

from epp.datastore import Endpoint
from epp.kvindex.events import decode_batch
from epp.kvindex.service import PrecisePrefixService
from sim.hashing import BlockHasher, event_extra_keys, to_event_hash


def stored_payload(
    tokens: Sequence[int],
    *,
    salt: str | None = None,
    block_size: int = 4,
    seed: str = "0",
    algo: str = "sha256",
) -> bytes:
    """One batch with one BlockStored event for every full block of `tokens`
    (map-encoded, vLLM >= 0.24), salted like vLLM salts block 0."""
    hasher = BlockHasher(algo, seed, block_size)  # type: ignore[arg-type]
    digests = hasher.block_hashes(list(tokens), salt)
    event = {
        "type": "BlockStored",
        "block_hashes": [to_event_hash(d) for d in digests],
        "parent_block_hash": None,
        "token_ids": list(tokens[: len(digests) * block_size]),
        "block_size": block_size,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "extra_keys": [event_extra_keys(i, salt) for i in range(len(digests))],
    }
    return msgspec.msgpack.encode([time.time(), [event], 0])


def feed(service: PrecisePrefixService, endpoint: Endpoint, payload: bytes) -> None:
    """Apply a KV-event payload of `endpoint` to the service's index as its
    subscriber would, without a ZMQ socket (the ingestion is the real one)."""
    service.feed(endpoint, decode_batch(payload))
