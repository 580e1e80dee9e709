"""KV events over real ZMQ sockets: live PUB framing and seq, DEALER replay, faults."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio

from sim.cli import _serve_parser, config_from_args
from sim.kv_events import AllBlocksCleared, BlockRemoved, EventBatchEncoder
from sim.publisher import END_SEQ, KVEventPublisher, PublisherConfig
from sim.server import SimPod

TIMEOUT_S = 5.0


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def start_publisher(**config: Any) -> KVEventPublisher:
    settings: dict[str, Any] = {
        "endpoint": "tcp://127.0.0.1:*",
        "replay_endpoint": "tcp://127.0.0.1:*",
    }
    settings.update(config)
    publisher = KVEventPublisher(
        PublisherConfig(**settings), EventBatchEncoder("map"), wall_clock=lambda: 1.5
    )
    await publisher.start()
    return publisher


async def subscribe(ctx: zmq.asyncio.Context, endpoint: str) -> zmq.asyncio.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    # ZMQ's slow joiner: messages published before the subscription reaches the
    # PUB socket are dropped. Give it time to arrive.
    await asyncio.sleep(0.2)
    return sub


async def recv(sock: zmq.asyncio.Socket) -> list[bytes]:
    frames: list[bytes] = await asyncio.wait_for(sock.recv_multipart(), TIMEOUT_S)
    return frames


async def replay(
    ctx: zmq.asyncio.Context, endpoint: str, start: int, legacy: bool = False
) -> list[list[bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", start.to_bytes(8, "big")])
        replies = []
        while True:
            frames = await recv(dealer)
            replies.append(frames)
            seq = frames[1] if legacy else frames[2]
            if seq == END_SEQ:
                return replies
    finally:
        dealer.close(linger=0)


async def test_live_framing_and_seq(zctx: zmq.asyncio.Context) -> None:
    publisher = await start_publisher(topic="kv@pod@model")
    try:
        sub = await subscribe(zctx, publisher.endpoint)
        for _ in range(3):
            await publisher.publish([AllBlocksCleared()])
        for expected_seq in range(3):
            topic, seq, payload = await recv(sub)
            assert topic == b"kv@pod@model"
            assert len(seq) == 8
            assert int.from_bytes(seq, "big") == expected_seq
            assert msgspec.msgpack.decode(payload) == [1.5, [{"type": "AllBlocksCleared"}], 0]
        assert publisher.last_seq == 2
    finally:
        await publisher.close()


async def test_replay_current_layout(zctx: zmq.asyncio.Context) -> None:
    publisher = await start_publisher()
    try:
        for i in range(5):
            await publisher.publish([BlockRemoved((bytes([i]) * 32,))])
        assert publisher.replay_bound_endpoint is not None
        replies = await replay(zctx, publisher.replay_bound_endpoint, 2)
        # Each reply: [delimiter, topic, seq, payload]; then the end marker.
        assert [len(r) for r in replies] == [4, 4, 4, 4]
        assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [2, 3, 4]
        assert all(r[0] == b"" and r[1] == b"" for r in replies)
        assert replies[-1] == [b"", b"", END_SEQ, b""]
        decoded = msgspec.msgpack.decode(replies[0][3])
        assert decoded[1][0]["block_hashes"] == [int.from_bytes(bytes([2]) * 8, "big")]
    finally:
        await publisher.close()


async def test_replay_legacy_layout(zctx: zmq.asyncio.Context) -> None:
    publisher = await start_publisher(replay_layout="legacy")
    try:
        for _ in range(2):
            await publisher.publish([AllBlocksCleared()])
        assert publisher.replay_bound_endpoint is not None
        replies = await replay(zctx, publisher.replay_bound_endpoint, 0, legacy=True)
        # Before vLLM 0.26: [delimiter, seq, payload], end [delimiter, ff x 8, b""].
        assert [len(r) for r in replies] == [3, 3, 3]
        assert [int.from_bytes(r[1], "big") for r in replies[:-1]] == [0, 1]
        assert replies[-1] == [b"", END_SEQ, b""]
    finally:
        await publisher.close()


async def test_replay_from_before_the_buffer(zctx: zmq.asyncio.Context) -> None:
    publisher = await start_publisher(buffer_steps=3)
    try:
        for _ in range(6):
            await publisher.publish([AllBlocksCleared()])
        assert publisher.replay_bound_endpoint is not None
        replies = await replay(zctx, publisher.replay_bound_endpoint, 0)
        # Only the last 3 batches are kept: the replay silently starts at seq 3.
        assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [3, 4, 5]
        # A start past the newest batch gets just the end marker.
        replies = await replay(zctx, publisher.replay_bound_endpoint, 99)
        assert replies == [[b"", b"", END_SEQ, b""]]
        assert publisher.stats.replay_requests == 2
    finally:
        await publisher.close()


async def test_dropped_batches_leave_a_gap_replay_fills(zctx: zmq.asyncio.Context) -> None:
    publisher = await start_publisher()
    try:
        sub = await subscribe(zctx, publisher.endpoint)
        publisher.drop_next(2)
        for _ in range(4):
            await publisher.publish([AllBlocksCleared()])
        seqs = [int.from_bytes((await recv(sub))[1], "big") for _ in range(2)]
        assert seqs == [2, 3]  # 0 and 1 never went out: a gap
        assert publisher.stats.dropped == 2
        assert publisher.replay_bound_endpoint is not None
        replies = await replay(zctx, publisher.replay_bound_endpoint, 0)
        assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [0, 1, 2, 3]

        publisher.drop_next(1, from_replay=True)
        await publisher.publish([AllBlocksCleared()])  # seq 4: gone for good
        await publisher.publish([AllBlocksCleared()])
        assert int.from_bytes((await recv(sub))[1], "big") == 5
        replies = await replay(zctx, publisher.replay_bound_endpoint, 4)
        assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [5]
    finally:
        await publisher.close()


async def test_restart_starts_seq_again(zctx: zmq.asyncio.Context) -> None:
    publisher = await start_publisher()
    try:
        sub = await subscribe(zctx, publisher.endpoint)
        for _ in range(3):
            await publisher.publish([AllBlocksCleared()])
        publisher.restart()
        assert publisher.last_seq is None
        await publisher.publish([AllBlocksCleared()])
        seqs = [int.from_bytes((await recv(sub))[1], "big") for _ in range(4)]
        assert seqs == [0, 1, 2, 0]
        assert publisher.replay_bound_endpoint is not None
        replies = await replay(zctx, publisher.replay_bound_endpoint, 0)
        assert [int.from_bytes(r[2], "big") for r in replies[:-1]] == [0]
    finally:
        await publisher.close()


async def test_malformed_replay_request_is_ignored(zctx: zmq.asyncio.Context) -> None:
    publisher = await start_publisher()
    try:
        await publisher.publish([AllBlocksCleared()])
        assert publisher.replay_bound_endpoint is not None
        dealer = zctx.socket(zmq.DEALER)
        dealer.connect(publisher.replay_bound_endpoint)
        await dealer.send_multipart([b"", b"\x00" * 8, b"extra"])
        assert not await dealer.poll(200)  # no answer
        dealer.close(linger=0)
        # The socket still serves well-formed requests.
        replies = await replay(zctx, publisher.replay_bound_endpoint, 0)
        assert len(replies) == 2
    finally:
        await publisher.close()


def test_the_high_water_mark_is_a_pod_option() -> None:
    """`--kv-events-hwm` (vLLM's `hwm`) reaches the PUB socket's settings."""
    args = _serve_parser("sim").parse_args(
        ["--port", "1", "--kv-events-port", "0", "--kv-events-hwm", "7"]
    )
    pod = SimPod(config_from_args(args))
    assert pod.publisher is not None
    assert pod.publisher.config.hwm == 7
    default = SimPod(config_from_args(_serve_parser("sim").parse_args(["--port", "1"])))
    assert default.config.kv_events_hwm == 100_000  # vLLM's default
