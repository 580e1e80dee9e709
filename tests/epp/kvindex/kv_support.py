"""Shared pieces of the KV-event tests: a subscriber over a real index, a hand-driven
publisher speaking vLLM's wire format (docs/architecture.md, "vLLM's KV events") for
exact control, and helpers."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from epp.clock import Clock
from epp.datastore import Datastore, Endpoint, EndpointSpec
from epp.kvindex.alignment import AlignmentChecker
from epp.kvindex.events import HASH_MASK
from epp.kvindex.index import PrefixIndex
from epp.kvindex.ingest import PreciseIndex
from epp.kvindex.subscriber import KVEventStream, KVEventSubscriber, SubscriberSettings

END_SEQ = b"\xff" * 8
FAST = SubscriberSettings(
    replay_timeout_s=0.5, reconnect_interval_s=0.05, reconnect_interval_max_s=0.2, heartbeat_s=0
)


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 5.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or predicate}")
        await asyncio.sleep(0.01)


@dataclass
class Harness:
    datastore: Datastore
    precise: PreciseIndex
    subscriber: KVEventSubscriber
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def endpoint(self, name: str) -> Endpoint:
        endpoint = self.datastore.get(name)
        assert endpoint is not None, name
        return endpoint

    def stream(self, name: str, rank: int = 0) -> KVEventStream:
        return self.subscriber.streams[self.endpoint(name)][rank][0]

    def keys(self, name: str) -> set[int]:
        """The engine's block hashes (as the map keeps them: `engine_hash`) whose
        keys the index says `name` holds (any tier, any rank)."""
        endpoint = self.datastore.get(name)
        if endpoint is None:
            return set()
        index = self.precise.index
        return {
            engine
            for stream in self.precise.streams(endpoint)
            for engine, key in stream.engine_keys.items()
            if index.holds(stream.slot, key)
        }

    def own_keys(self, name: str) -> set[int]:
        """The index's own keys `name` holds (any tier, any rank)."""
        endpoint = self.datastore.get(name)
        if endpoint is None:
            return set()
        mask = sum(1 << s.slot for s in self.precise.streams(endpoint))
        return {
            key
            for tier in self.precise.index.tiers
            for key, holders in tier.blocks.items()
            if holders & mask
        }

    def set_endpoints(self, specs: list[EndpointSpec]) -> None:
        self.datastore.replace_all(specs)

    async def start(self) -> None:
        """Run the subscriber and the index's sweeper, as the precise prefix service
        does."""
        self.tasks = [
            asyncio.create_task(self.subscriber.run()),
            asyncio.create_task(self.precise.run_sweeper()),
        ]
        await asyncio.sleep(0)

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task


def make_harness(
    specs: list[EndpointSpec],
    settings: SubscriberSettings = FAST,
    wall_clock: Clock = time.time,
) -> Harness:
    """No hash settings: the index keys blocks by their token ids, whatever the
    engines' seeds."""
    datastore = Datastore()
    datastore.replace_all(specs)
    precise = PreciseIndex(
        PrefixIndex(1_000_000, {"gpu": 1.0, "cpu": 0.8}),
        16,
        AlignmentChecker(16, clock=time.monotonic),
        None,
    )
    subscriber = KVEventSubscriber(datastore, precise, settings, wall_clock=wall_clock)
    return Harness(datastore, precise, subscriber)


def engine_hash(value: int) -> int:
    """An engine block hash as the index's map keeps it."""
    return value & HASH_MASK


def block_tokens(engine_hash: int, block_size: int = 16) -> list[int]:
    """Token ids for the block the hand-written events call `engine_hash`: distinct
    per hash, so distinct hashes give distinct keys."""
    base = (engine_hash * block_size) % (1 << 31)
    return [base + i for i in range(block_size)]


def batch(*events: dict[str, Any], rank: int = 0, ts: float | None = None) -> bytes:
    """A payload of map-encoded events (vLLM >= 0.24), stamped `ts` (default: now,
    as vLLM stamps it)."""
    return msgspec.msgpack.encode([time.time() if ts is None else ts, list(events), rank])


def stored(
    hashes: list[int], parent: int | None = None, medium: str = "GPU", tokens: bool = True
) -> dict[str, Any]:
    """A BlockStored of blocks with made-up tokens (`block_tokens`), or none (an
    offload connector's event)."""
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": [t for h in hashes for t in block_tokens(h)] if tokens else [],
        "block_size": 16,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }


def removed(hashes: list[int], medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


@dataclass
class RawPublisher:
    """vLLM's publisher, driven by hand: an XPUB (a PUB that also tells when a
    subscriber's subscription arrived, so no message is sent before it) and a replay
    ROUTER answering from the batches sent so far."""

    layout: str = "current"  # replay replies with a topic frame (vLLM >= 0.26) or not
    port: int | None = None
    context: zmq.asyncio.Context = field(default_factory=zmq.asyncio.Context)
    sent: dict[int, bytes] = field(default_factory=dict)
    replay_requests: int = 0

    def __post_init__(self) -> None:
        self.pub = self.context.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        try:
            if self.port is None:
                self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
            else:
                self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        except zmq.ZMQError:
            self.context.destroy(0)  # nothing left behind for the garbage collector
            raise
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self._replay_task = asyncio.create_task(self._serve_replay())

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_address(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    async def wait_subscribed(self, timeout_s: float = 5.0) -> None:
        frame = await asyncio.wait_for(self.pub.recv(), timeout_s)
        assert frame[:1] == b"\x01", frame

    async def send(self, seq: int, payload: bytes, live: bool = True, topic: bytes = b"") -> None:
        self.sent[seq] = payload
        if live:
            await self.pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])

    async def send_frames(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    async def _serve_replay(self) -> None:
        while True:
            identity, _, start = await self.router.recv_multipart()
            self.replay_requests += 1
            first = int.from_bytes(start, "big")
            for seq in sorted(s for s in self.sent if s >= first):
                seq_frame = seq.to_bytes(8, "big")
                body = [b"", seq_frame, self.sent[seq]]
                if self.layout == "current":
                    body = [b"", b"", seq_frame, self.sent[seq]]
                await self.router.send_multipart([identity, *body])
            end = [b"", b"", END_SEQ, b""] if self.layout == "current" else [b"", END_SEQ, b""]
            await self.router.send_multipart([identity, *end])

    async def close(self) -> None:
        self._replay_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._replay_task
        self.pub.close(0)
        self.router.close(0)
        self.context.destroy(0)


Starter = Callable[..., Awaitable[Any]]
