"""vLLM's KV-event transport over ZMQ: a PUB socket and a ROUTER replay socket.

Live messages are 3 frames, `[topic, seq (8-byte big-endian), payload]`, one per
engine step that produced events. `seq` counts from 0 at every (re)start of the
engine and grows by one per batch.

The replay socket keeps the last `buffer_steps` batches. A DEALER sends
`[b"", start_seq]` (8-byte big-endian); the ROUTER answers with one message per kept
batch whose seq >= start_seq, oldest first, then an end marker whose seq is ff x 8.
A start older than the buffer silently starts at the oldest kept batch.

- `replay_layout="current"` (vLLM >= 0.26): replies `[b"", topic, seq, payload]`,
  end marker `[b"", b"", ff x 8, b""]`;
- `replay_layout="legacy"` (vLLM <= 0.25): replies `[b"", seq, payload]`, end marker
  `[b"", ff x 8, b""]`.
(The leading empty frame is the DEALER envelope delimiter.)

Fault injection: `drop_next(n)` makes the next n batches skip the PUB socket (their
seq numbers are still used, so subscribers see a gap); they stay in the replay
buffer unless `from_replay` is set, like a subscriber losing messages to the PUB
high-water mark while the engine still has them. `restart()` is an engine restart:
seq back to 0 and an empty replay buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import zmq
import zmq.asyncio

from sim.kv_events import EventBatchEncoder, KVEvent

log = logging.getLogger(__name__)

ReplayLayout = Literal["current", "legacy"]
REPLAY_LAYOUTS: tuple[ReplayLayout, ...] = ("current", "legacy")
END_SEQ = b"\xff" * 8


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


@dataclass(frozen=True)
class PublisherConfig:
    # e.g. "tcp://127.0.0.1:5557"; the publisher binds it.
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = ""
    # vLLM's KVEventsConfig defaults.
    buffer_steps: int = 10_000
    hwm: int = 100_000
    replay_layout: ReplayLayout = "current"


@dataclass
class PublisherStats:
    published: int = 0  # batches sent on the PUB socket
    dropped: int = 0  # batches withheld from the PUB socket on purpose
    replay_requests: int = 0


class KVEventPublisher:
    def __init__(
        self,
        config: PublisherConfig,
        encoder: EventBatchEncoder,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if config.replay_layout not in REPLAY_LAYOUTS:
            raise ValueError(f"unknown replay layout {config.replay_layout!r}")
        self.config = config
        self.encoder = encoder
        self._wall_clock = wall_clock
        self._topic = config.topic.encode("utf-8")
        self.endpoint = config.endpoint
        self.replay_bound_endpoint = config.replay_endpoint
        self._ctx = zmq.asyncio.Context()
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.next_seq = 0
        self._drop_live = 0
        self._drop_replay = 0
        self.stats = PublisherStats()

    async def start(self) -> None:
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.set_hwm(self.config.hwm)
        pub.bind(self.config.endpoint)
        # With a "*" port, ZMQ picks one: report the endpoint actually bound.
        self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self._pub = pub
        if self.config.replay_endpoint is not None:
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            # Room for a full replay plus its end marker, twice over.
            router.setsockopt(zmq.SNDHWM, 2 * (self.config.buffer_steps + 1))
            router.bind(self.config.replay_endpoint)
            self.replay_bound_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
            self._router = router
            self._replay_task = asyncio.create_task(self._serve_replay(router))

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        for sock in (self._pub, self._router):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._router = None
        self._ctx.term()

    @property
    def last_seq(self) -> int | None:
        return self.next_seq - 1 if self.next_seq else None

    @property
    def buffered(self) -> int:
        return len(self._buffer)

    @property
    def pending_drops(self) -> int:
        return self._drop_live

    def drop_next(self, count: int, from_replay: bool = False) -> None:
        self._drop_live += count
        if from_replay:
            self._drop_replay += count

    def restart(self) -> None:
        self.next_seq = 0
        self._buffer.clear()
        self._drop_live = self._drop_replay = 0

    async def publish(self, events: Sequence[KVEvent]) -> int:
        """Encode one step's events as a batch, give it the next seq, send it."""
        seq = self.next_seq
        self.next_seq += 1
        payload = self.encoder.encode(self._wall_clock(), events)
        if self._drop_replay:
            self._drop_replay -= 1
        else:
            self._buffer.append((seq, payload))
        if self._drop_live:
            self._drop_live -= 1
            self.stats.dropped += 1
            return seq
        if self._pub is not None:
            # PUB never blocks: beyond the high-water mark ZMQ drops the message
            # for that subscriber, which then sees a seq gap.
            await self._pub.send_multipart([self._topic, encode_seq(seq), payload])
            self.stats.published += 1
        return seq

    async def _serve_replay(self, router: zmq.asyncio.Socket) -> None:
        while True:
            frames = await router.recv_multipart()
            # [identity, b"", start_seq]: what a DEALER's [b"", start_seq] (or a
            # REQ's [start_seq]) looks like at the ROUTER. Anything else is ignored.
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("ignoring a malformed replay request (%d frames)", len(frames))
                continue
            identity = frames[0]
            start = int.from_bytes(frames[2], "big")
            self.stats.replay_requests += 1
            for seq, payload in list(self._buffer):
                if seq < start:
                    continue
                if self.config.replay_layout == "current":
                    reply = [identity, b"", self._topic, encode_seq(seq), payload]
                else:
                    reply = [identity, b"", encode_seq(seq), payload]
                await router.send_multipart(reply)
            if self.config.replay_layout == "current":
                await router.send_multipart([identity, b"", b"", END_SEQ, b""])
            else:
                await router.send_multipart([identity, b"", END_SEQ, b""])
