"""The KV-event subscriber: one ZMQ SUB socket per endpoint (and data-parallel rank),
keeping the prefix index in step with what each engine really caches.

Transport facts (docs/architecture.md, "vLLM's KV events"): a live message is
`[topic, seq (8-byte big-endian), msgpack payload]`; `seq` starts at 0 when the
engine starts and grows by one per batch. A replay ROUTER, when the engine has one,
answers a DEALER's `[b"", start_seq]` with every kept batch from `start_seq` on,
then an end marker (seq ff x 8); replies are `[topic, seq, payload]` from vLLM 0.26
and `[seq, payload]` before, and a start older than the buffer silently starts
later. Data-parallel rank r publishes on port + r, with its own seq space.

Each stream is an explicit state machine (`StreamState`):

    CONNECTING --handshake--> LIVE --gap / late join / reconnect--> REPLAYING --> LIVE
        ^                      |  \\--seq went back (engine restart)--> RESETTING --> LIVE
        +----publisher gone----+

and the sequence rules, with `last` the last batch applied and `live` the highest
seq seen on the live socket:

- `seq == last + 1`: apply;
- first message with `seq > 0` (the engine was already running): replay from 0 to
  learn what it caches;
- `seq <= live`: the live stream went back: the engine restarted and its cache is
  gone; clear the endpoint's entries and start over (replaying from 0 if needed);
- `live < seq <= last`: a batch a replay already applied, skipped;
- `seq > last + 1`: a gap (the PUB socket dropped messages): replay from `last`.
  The replay's first batch must be `last` again, byte for byte: that proves the
  engine is the one we were following (a restarted engine has other batches under
  the same numbers). If it is not, or the buffer no longer reaches back to
  `last + 1`, the lost events cannot be recovered: the endpoint's entries are
  cleared (counted) and rebuilt from what the buffer still has;
- after the publisher went away and came back (ZMQ reconnects by itself, with
  exponential backoff), the next batch is verified the same way even if it looks
  contiguous.

Draining is done in slices (`drain_batch` messages), yielding to the event loop
between them, so a busy publisher never holds up a pick; decoding and applying a
batch never awaits.

The lag of each live batch (this host's wall clock once it is applied, minus the
batch's `ts`, the engine's wall clock when it took the step's events) goes into the
stream's `lag` histogram (`epp_kv_event_lag_seconds`): how stale the index is behind
the engine. Replayed batches are left out: their `ts` is as old as the buffer (a
resync at start-up replays batches from before the EPP subscribed), which says
nothing about propagation. Across hosts the two clocks' skew adds in; a negative lag
(the engine's clock ahead) is observed as 0 and counted apart, never dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from epp.clock import Clock
from epp.datastore import Datastore, Endpoint
from epp.kvindex.events import END_SEQ, EventBatch, WireError, decode_batch
from epp.kvindex.ingest import PreciseIndex, StreamIndex
from epp.logs import LogOnce
from epp.promutil import LATENCY_BUCKETS, BucketCounts

log = logging.getLogger(__name__)

REJECT_FRAME_COUNT: Final = "frame_count"
REJECT_BAD_SEQ: Final = "bad_seq"
REPLAY_CHUNK: Final = 256  # replayed batches applied between two yields


class StreamState(enum.Enum):
    CONNECTING = "connecting"  # no publisher connected (yet, or any more)
    LIVE = "live"  # connected, batches applied in sequence
    REPLAYING = "replaying"  # catching up through the replay socket
    RESETTING = "resetting"  # clearing the entries of a restarted engine
    STOPPED = "stopped"


@dataclass(frozen=True)
class SubscriberSettings:
    topic: str = ""  # SUB topic prefix ("" = everything; vLLM's topic is "" by default)
    replay: bool = True
    dp_size: int = 1
    # For endpoints without explicit addresses (Kubernetes pods): the engine's
    # KV-event and replay ports on the endpoint's IP.
    port: int | None = None
    replay_port: int | None = None
    replay_timeout_s: float = 2.0
    reconnect_interval_s: float = 0.1
    reconnect_interval_max_s: float = 5.0
    heartbeat_s: float = 5.0  # 0: no ZMTP heartbeats
    # After live batches, this long without another: ask the replay socket whether
    # the stream's last batches were lost (0: never ask).
    tail_check_s: float = 1.0
    receive_hwm: int = 100_000  # vLLM's default PUB high-water mark
    drain_batch: int = 64


@dataclass
class StreamStatus:
    state: StreamState = StreamState.CONNECTING
    last_seq: int | None = None  # the last batch applied
    live_seq: int | None = None  # the highest seq seen on the live socket
    messages: int = 0
    gaps: int = 0  # seq gaps, and tails found lost (`tail_losses`)
    tail_checks: int = 0
    tail_losses: int = 0  # a tail check found batches never received
    replays: int = 0
    replay_failures: int = 0  # no answer, or nothing usable
    partial_replays: int = 0  # the buffer no longer reached back far enough
    restarts: int = 0
    connects: int = 0
    disconnects: int = 0
    late_joins: int = 0
    state_since: float = field(default_factory=time.monotonic)
    # Live batches' lag (wall now - ts) when applied, in seconds; negative lags are
    # observed as 0 and counted here, with how far ahead they were, summed.
    lag: BucketCounts = field(default_factory=lambda: BucketCounts(LATENCY_BUCKETS))
    lag_negative: int = 0
    lag_negative_s: float = 0.0


def _split_tcp(address: str) -> tuple[str, int] | None:
    if not address.startswith("tcp://"):
        return None
    host, sep, port = address[len("tcp://") :].rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host, int(port)


def offset_address(address: str, rank: int) -> str:
    """The address data-parallel rank `rank` publishes on (vLLM's rule)."""
    if rank == 0:
        return address
    tcp = _split_tcp(address)
    if tcp is not None:
        host, port = tcp
        return f"tcp://{host}:{port + rank}"
    if address.startswith("inproc://"):
        return f"{address}_dp{rank}"
    raise ValueError(f"{address}: only tcp:// and inproc:// addresses have data-parallel ranks")


def kv_event_addresses(
    endpoint: Endpoint, settings: SubscriberSettings
) -> tuple[str | None, str | None]:
    """(PUB address, replay address) of an endpoint's engine: from the endpoints
    file when it names them, else the endpoint's IP with the configured ports."""
    spec = endpoint.spec
    host = endpoint.address.rsplit(":", 1)[0]
    pub = spec.kv_events
    if pub is None and settings.port is not None:
        pub = f"tcp://{host}:{settings.port}"
    replay = spec.kv_events_replay
    if replay is None and settings.replay_port is not None and pub is not None:
        replay = f"tcp://{host}:{settings.replay_port}"
    return pub, replay


AddressFunction = Callable[[Endpoint, SubscriberSettings], tuple[str | None, str | None]]


class _ReplayOutcome(enum.Enum):
    DONE = "done"  # every kept batch after `last` applied
    RESTARTED = "restarted"  # the batch at `last` differs: another engine instance
    LOST = "lost"  # the buffer no longer reaches back to `last + 1`
    FAILED = "failed"  # no answer in time, or only garbage


class KVEventStream:
    """One endpoint's (one DP rank's) KV-event stream."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        sink: StreamIndex,
        address: str,
        replay_address: str | None,
        settings: SubscriberSettings,
        log_once: LogOnce,
        wall_clock: Clock = time.time,
    ) -> None:
        self.context = context
        self.sink = sink
        self.address = address
        self.replay_address = replay_address if settings.replay else None
        self.settings = settings
        # The batches' `ts` is the engine's time.time(): their lag is read on this
        # host's wall clock, not on the monotonic clock decisions are made by.
        self.wall_clock = wall_clock
        self.status = StreamStatus()
        self._log_once = log_once
        self._last_digest: int | None = None
        self._suspect = False  # reconnected: verify continuity before trusting it
        self._tail_unchecked = False  # live batches came since the last tail check

    @property
    def label(self) -> str:
        return self.sink.label

    def _set_state(self, state: StreamState) -> None:
        if self.status.state is not state:
            self.status.state = state
            self.status.state_since = time.monotonic()

    def _socket_options(self, sock: zmq.asyncio.Socket, address: str) -> None:
        s = self.settings
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, max(1, int(s.reconnect_interval_s * 1000)))
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, max(1, int(s.reconnect_interval_max_s * 1000)))
        if s.heartbeat_s > 0:
            sock.setsockopt(zmq.HEARTBEAT_IVL, int(s.heartbeat_s * 1000))
            sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(s.heartbeat_s * 3000))
        if "[" in address:
            sock.setsockopt(zmq.IPV6, 1)

    async def run(self) -> None:
        """Follow the stream until cancelled; never raises because of the peer."""
        sub = self.context.socket(zmq.SUB)
        self._socket_options(sub, self.address)
        sub.setsockopt(zmq.RCVHWM, self.settings.receive_hwm)
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        try:
            sub.connect(self.address)
            sub.setsockopt(zmq.SUBSCRIBE, self.settings.topic.encode("utf-8"))
            # The same socket, without asyncio futures: draining ready messages with
            # NOBLOCK costs a C call each.
            receiver: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)
            monitor_receiver: zmq.Socket[bytes] = zmq.Socket.shadow(monitor.underlying)
            poller = zmq.asyncio.Poller()
            poller.register(sub, zmq.POLLIN)
            poller.register(monitor, zmq.POLLIN)
            tail_check_ms = round(self.settings.tail_check_s * 1000)
            while True:
                quiet = tail_check_ms if self._tail_unchecked and tail_check_ms > 0 else None
                ready = dict(await poller.poll(quiet))
                if not ready:
                    await self._check_tail()
                    continue
                if monitor in ready:
                    await self._monitor(monitor_receiver)
                if sub in ready:
                    await self._drain(receiver)
        finally:
            self._set_state(StreamState.STOPPED)
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(0)
            sub.close(0)

    async def _monitor(self, monitor: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            event = parse_monitor_message(frames)
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.status.connects += 1
                if self.status.state is StreamState.CONNECTING:
                    self._set_state(StreamState.LIVE)
                log.info("KV events from %s: connected to %s", self.label, self.address)
                if self.replay_address is None:
                    continue
                # Do not wait for the engine's next batch (an idle engine may send
                # none for long): learn its state now, or check it is the engine
                # followed before the connection broke.
                if self.status.last_seq is None:
                    await self._resync()
                else:
                    await self._recover()
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.status.disconnects += 1
                self._set_state(StreamState.CONNECTING)
                # Events may be lost while away, and the engine may restart: check
                # continuity on the next batch, whatever its number.
                self._suspect = self.status.last_seq is not None
                log.warning(
                    "KV events from %s: publisher %s went away; reconnecting (its index"
                    " entries are kept until it is back and checked)",
                    self.label,
                    self.address,
                )

    async def _drain(self, receiver: zmq.Socket[bytes]) -> None:
        for _ in range(self.settings.drain_batch):
            try:
                frames = receiver.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._tail_unchecked = True
            await self.handle(frames)
        # More may be waiting: let requests run first.
        await asyncio.sleep(0)

    # -- one live message ---------------------------------------------------------------

    async def handle(self, frames: list[bytes]) -> None:
        status = self.status
        status.messages += 1
        if len(frames) != 3:
            self.sink.reject(
                REJECT_FRAME_COUNT,
                f"a message of {len(frames)} frames (expected topic, seq, payload)",
            )
            return
        _topic, seq_frame, payload = frames
        if len(seq_frame) != 8:
            self.sink.reject(REJECT_BAD_SEQ, f"a {len(seq_frame)}-byte seq frame (expected 8)")
            return
        seq = int.from_bytes(seq_frame, "big")
        if seq == END_SEQ:
            self.sink.reject(REJECT_BAD_SEQ, "the replay end marker on the live socket")
            return
        if status.state is StreamState.CONNECTING:
            self._set_state(StreamState.LIVE)
        if status.live_seq is not None and seq <= status.live_seq:
            self._engine_restarted(seq)
        status.live_seq = seq
        last = status.last_seq
        if last is None:
            if seq > 0 and self.replay_address is not None:
                # The engine was running before we subscribed: its batches 0..seq-1
                # hold the blocks it caches now.
                status.late_joins += 1
                await self._resync()
            elif seq > 0:
                status.late_joins += 1
                self._log_once(
                    (self.label, "late-join"),
                    logging.WARNING,
                    "KV events from %s start at seq %d and no replay socket is configured:"
                    " blocks cached before are unknown until the engine stores them again",
                    self.label,
                    seq,
                )
            self._catch_up(seq, payload)
            return
        if seq <= last:
            return  # already applied by a replay
        if seq == last + 1 and not self._suspect:
            self._apply(seq, payload, live=True)
            return
        if seq > last + 1:
            status.gaps += 1
            log.info(
                "KV events from %s: seq %d after %d (%d batches lost); recovering",
                self.label,
                seq,
                last,
                seq - last - 1,
            )
        await self._recover()
        self._catch_up(seq, payload)

    def _catch_up(self, seq: int, payload: bytes) -> None:
        """Apply the live batch `seq` after a replay (which may have covered it)."""
        status = self.status
        if status.live_seq is None or seq > status.live_seq:
            status.live_seq = seq  # a replay that found a new engine forgot it
        last = status.last_seq
        if last is not None and seq <= last:
            return
        if last is not None and seq > last + 1:
            # Even the replay could not close the gap: what lies between is lost.
            self._clear("gap")
        self._apply(seq, payload, live=True)

    def _engine_restarted(self, seq: int) -> None:
        self.status.restarts += 1
        log.warning(
            "KV events from %s: seq went back from %s to %d: the engine restarted; its"
            " index entries are cleared",
            self.label,
            self.status.live_seq,
            seq,
        )
        self._forget_engine("restart")

    def _forget_engine(self, reason: str) -> None:
        """The engine followed so far is gone (or its history lost): clear its
        entries and follow the stream afresh."""
        self._set_state(StreamState.RESETTING)
        self._clear(reason)
        self.status.last_seq = None
        self.status.live_seq = None
        self._suspect = False
        self._set_state(StreamState.LIVE)

    def _clear(self, reason: str) -> None:
        self.sink.clear(reason)
        self._last_digest = None

    def _apply(self, seq: int, payload: bytes, *, live: bool) -> None:
        """Decode and apply batch `seq`; `live`: it came on the PUB socket (not from
        a replay), so its lag is observed."""
        self.status.last_seq = seq
        self._last_digest = hash(payload)
        try:
            batch = decode_batch(payload)
        except WireError as exc:
            # Its seq is used up: the events are lost (a replay would return the same
            # bytes), and counted.
            self.sink.reject(exc.reason, exc.detail)
            return
        self.sink.apply(batch)
        if live and not self.sink.closed:
            self._observe_lag(batch)

    def _observe_lag(self, batch: EventBatch) -> None:
        ts = batch.ts
        # vLLM always stamps time.time(); 0 (or NaN, inf) is a producer that does
        # not stamp its batches, whose "lag" would be meaningless.
        if not (ts > 0.0 and math.isfinite(ts)):
            return
        lag = self.wall_clock() - ts
        status = self.status
        if lag < 0.0:
            # The engine's clock is ahead of ours by more than the true lag, which
            # is unknown. Observed as 0, so the histogram still counts every batch,
            # and counted apart with its size, so the skew shows instead of vanishing.
            status.lag_negative += 1
            status.lag_negative_s -= lag
            lag = 0.0
        status.lag.observe(lag)

    # -- recovery -----------------------------------------------------------------------

    async def _check_tail(self) -> None:
        """The stream went quiet after live batches: ask the replay socket for what
        follows the last batch applied. A PUB socket at its high-water mark drops
        the newest batches without a trace; a gap shows only when a later batch
        arrives, and an engine that has gone idle may send none for a long time,
        its last blocks unknown (or its last evictions still credited) until then.
        Drops happen only while batches wait unread for this subscriber, so one
        check after the last of them suffices."""
        self._tail_unchecked = False
        status = self.status
        last = status.last_seq
        if self.replay_address is None or last is None or status.state is not StreamState.LIVE:
            return  # a reconnection checks continuity on its own
        status.tail_checks += 1
        await self._recover()
        if status.last_seq is not None and status.last_seq > last:
            status.tail_losses += 1
            status.gaps += 1
            log.info(
                "KV events from %s: batches %d to %d never arrived (the publisher's"
                " high-water mark, most likely); recovered from its replay socket",
                self.label,
                last + 1,
                status.last_seq,
            )

    async def _recover(self) -> None:
        """After a gap or a reconnection: replay from the last batch applied, which
        must come back unchanged."""
        self._suspect = False
        status = self.status
        last = status.last_seq
        assert last is not None
        if self.replay_address is None:
            if status.live_seq is not None and status.live_seq > last + 1:
                self._log_once(
                    (self.label, "no-replay"),
                    logging.WARNING,
                    "KV events from %s: batches lost and no replay socket configured: its"
                    " index entries are cleared and rebuilt from new events",
                    self.label,
                )
            return
        outcome = await self._replay(last, self._last_digest)
        if outcome is _ReplayOutcome.DONE:
            return
        if outcome is _ReplayOutcome.FAILED:
            status.replay_failures += 1
            if status.live_seq is not None and status.live_seq > last + 1:
                self._log_once(
                    (self.label, "replay-failed"),
                    logging.WARNING,
                    "KV events from %s: the replay socket %s gave nothing usable: the index"
                    " entries of this endpoint are cleared and rebuilt from new events",
                    self.label,
                    self.replay_address,
                )
            return  # _catch_up clears if the gap is still open
        if outcome is _ReplayOutcome.RESTARTED:
            status.restarts += 1
            log.warning(
                "KV events from %s: the engine is not the one followed before (batch %d"
                " differs): it restarted; its index entries are cleared",
                self.label,
                last,
            )
            self._forget_engine("restart")
        else:
            status.partial_replays += 1
            log.warning(
                "KV events from %s: the replay buffer no longer holds the lost batches:"
                " the index entries of this endpoint are cleared and rebuilt from what it"
                " still holds",
                self.label,
            )
            self._forget_engine("gap")
        await self._resync()

    async def _resync(self) -> None:
        """Learn the engine's state from its whole replay buffer (the stream's index
        is empty at this point)."""
        outcome = await self._replay(0, None)
        if outcome is _ReplayOutcome.FAILED:
            self.status.replay_failures += 1
            self._log_once(
                (self.label, "resync-failed"),
                logging.WARNING,
                "KV events from %s: the replay socket %s did not answer: blocks cached before"
                " are unknown until the engine stores them again",
                self.label,
                self.replay_address,
            )

    async def _replay(self, start: int, overlap_digest: int | None) -> _ReplayOutcome:
        """Ask for the batches from `start` and apply those after the last applied.

        With `overlap_digest`, the first batch must be `start` with that digest.
        Without, a first batch after `start` means the buffer lost the oldest ones."""
        assert self.replay_address is not None
        status = self.status
        status.replays += 1
        self._set_state(StreamState.REPLAYING)
        dealer = self.context.socket(zmq.DEALER)
        self._socket_options(dealer, self.replay_address)
        first = True
        applied = 0
        try:
            dealer.connect(self.replay_address)
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                # asyncio.timeout, not wait_for: on Python 3.11, wait_for loses a
                # cancellation that arrives as the reply does, and the stream then
                # outlives its cancel (seen as a hung shutdown under load).
                try:
                    async with asyncio.timeout(self.settings.replay_timeout_s):
                        frames = await dealer.recv_multipart()
                except TimeoutError:
                    return _ReplayOutcome.FAILED
                parsed = self._replay_reply(frames)
                if parsed is None:
                    continue
                seq, payload = parsed
                if seq == END_SEQ:
                    if first and overlap_digest is not None:
                        # Nothing kept from `start` on: this is not the engine whose
                        # batch `start` we applied.
                        return _ReplayOutcome.RESTARTED
                    return _ReplayOutcome.DONE
                if first:
                    first = False
                    if overlap_digest is not None:
                        if seq == start:
                            if hash(payload) != overlap_digest:
                                return _ReplayOutcome.RESTARTED
                            continue
                        if seq > start + 1:
                            return _ReplayOutcome.LOST
                    elif seq > start:
                        status.partial_replays += 1
                        self._log_once(
                            (self.label, "partial-resync"),
                            logging.WARNING,
                            "KV events from %s: the replay buffer starts at seq %d: blocks"
                            " cached before that are unknown until stored again",
                            self.label,
                            seq,
                        )
                last = status.last_seq
                if last is not None:
                    if seq <= last:
                        continue
                    if seq > last + 1:
                        # A hole inside the buffer (batches it never kept).
                        if overlap_digest is not None:
                            return _ReplayOutcome.LOST
                        # Learning from scratch: what came before the hole may have
                        # been undone inside it; keep what follows it only.
                        status.partial_replays += 1
                        self._clear("gap")
                self._apply(seq, payload, live=False)
                applied += 1
                if applied % REPLAY_CHUNK == 0:
                    await asyncio.sleep(0)
        except zmq.ZMQError as exc:
            log.warning("KV events from %s: replay failed: %s", self.label, exc)
            return _ReplayOutcome.FAILED
        finally:
            dealer.close(0)
            self._set_state(StreamState.LIVE)

    def _replay_reply(self, frames: list[bytes]) -> tuple[int, bytes] | None:
        """(seq, payload) of one replay reply: `[b"", topic, seq, payload]` (vLLM >=
        0.26) or `[b"", seq, payload]` (before); the empty delimiter is optional."""
        if frames and frames[0] == b"" and len(frames) in (3, 4):
            frames = frames[1:]
        if len(frames) == 3:
            _topic, seq_frame, payload = frames
        elif len(frames) == 2:
            seq_frame, payload = frames
        else:
            self.sink.reject("replay_frame_count", f"a replay reply of {len(frames)} frames")
            return None
        if len(seq_frame) != 8:
            self.sink.reject(REJECT_BAD_SEQ, f"a {len(seq_frame)}-byte seq in a replay reply")
            return None
        return int.from_bytes(seq_frame, "big"), payload


class KVEventSubscriber:
    """Follows the KV events of every endpoint of the pool that publishes them."""

    def __init__(
        self,
        datastore: Datastore,
        index: PreciseIndex,
        settings: SubscriberSettings,
        addresses: AddressFunction = kv_event_addresses,
        wall_clock: Clock = time.time,
        follow_datastore: bool = True,
    ) -> None:
        """`wall_clock`: this host's wall-clock time (Unix seconds), which the
        engines' batch timestamps are compared with for their lag.

        `follow_datastore`: subscribe to the pool's endpoints as the datastore
        reports them (the default). False: only to the endpoints an owner reports
        with `endpoints_changed` (llm-d's endpoint notifications), as they come and
        go, from before or after `run` starts."""
        if settings.dp_size < 1:
            raise ValueError("dp_size must be >= 1")
        self.datastore = datastore
        self.follow_datastore = follow_datastore
        # Without follow_datastore: the endpoints reported in the pool, in the
        # order reported (subscribed when `run` starts, or at once while it runs).
        self._members: dict[Endpoint, None] = {}
        self.index = index
        self.settings = settings
        self.addresses = addresses
        self.wall_clock = wall_clock
        self.streams: dict[Endpoint, list[tuple[KVEventStream, asyncio.Task[None]]]] = {}
        self._context: zmq.asyncio.Context | None = None
        self._running = False
        self._log_once = LogOnce(log)

    async def run(self) -> None:
        """Subscribe to every endpoint now in the pool and follow the pool's changes
        until cancelled."""
        self._context = zmq.asyncio.Context()
        self._running = True
        try:
            if self.follow_datastore:
                self._membership(list(self.datastore.all_endpoints()), [])
                self.datastore.add_listener(self._membership)
            else:
                self._membership(list(self._members), [])
            await asyncio.Event().wait()
        finally:
            self._running = False
            if self.follow_datastore:
                self.datastore.remove_listener(self._membership)
            tasks = [task for streams in self.streams.values() for _, task in streams]
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self.streams.clear()
            self._context.destroy(linger=0)
            self._context = None

    def endpoints_changed(self, added: Iterable[Endpoint], removed: Iterable[Endpoint]) -> None:
        """For a subscriber that does not follow the datastore: `added` joined the
        pool (or changed; an endpoint already reported is left as it is), `removed`
        left it. A removed endpoint's streams stop and its index entries go at once,
        running or not."""
        if self.follow_datastore:
            raise RuntimeError("this subscriber follows the datastore's endpoints itself")
        removed = [e for e in removed if e in self._members]
        for endpoint in removed:
            del self._members[endpoint]
        added = [e for e in added if e not in self._members]
        for endpoint in added:
            self._members[endpoint] = None
        if self._running:
            self._membership(added, removed)
            return
        for endpoint in removed:
            self.index.remove_endpoint(endpoint)

    def _membership(self, added: Iterable[Endpoint], removed: Iterable[Endpoint]) -> None:
        if not self._running:
            return
        for endpoint in removed:
            for _, task in self.streams.pop(endpoint, []):
                task.cancel()
            self.index.remove_endpoint(endpoint)
        for endpoint in added:
            self._subscribe(endpoint)

    def _subscribe(self, endpoint: Endpoint) -> None:
        assert self._context is not None
        pub, replay = self.addresses(endpoint, self.settings)
        if pub is None:
            return
        started = []
        for rank in range(self.settings.dp_size):
            try:
                address = offset_address(pub, rank)
                replay_address = None if replay is None else offset_address(replay, rank)
            except ValueError as exc:
                self._log_once(
                    (endpoint.name, "address"),
                    logging.ERROR,
                    "KV events of %s: %s; not subscribed",
                    endpoint.name,
                    exc,
                )
                break
            sink = self.index.add_stream(endpoint, rank)
            stream = KVEventStream(
                self._context,
                sink,
                address,
                replay_address,
                self.settings,
                self._log_once,
                self.wall_clock,
            )
            task = asyncio.get_running_loop().create_task(
                self._follow(stream), name=f"kv-events-{sink.label}"
            )
            started.append((stream, task))
        self.streams[endpoint] = started

    async def _follow(self, stream: KVEventStream) -> None:
        """Run a stream; a bug in it must not end the subscription for good."""
        delay = self.settings.reconnect_interval_s
        while True:
            try:
                await stream.run()
                return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("KV events from %s: the stream failed; restarting it", stream.label)
                await asyncio.sleep(delay)
                delay = min(delay * 2, self.settings.reconnect_interval_max_s)

    def describe(self, endpoint: Endpoint) -> dict[str, Any] | None:
        """The subscription part of the endpoint's /debug/endpoints `index` entry."""
        streams = self.streams.get(endpoint)
        if not streams:
            return None
        statuses = [s.status for s, _ in streams]
        first = statuses[0]
        info: dict[str, Any] = {
            "state": first.state.value,
            "lastSeq": first.last_seq,
            "gaps": sum(s.gaps for s in statuses),
            "replays": sum(s.replays for s in statuses),
            "replayFailures": sum(s.replay_failures for s in statuses),
            "partialReplays": sum(s.partial_replays for s in statuses),
            "tailChecks": sum(s.tail_checks for s in statuses),
            "tailLosses": sum(s.tail_losses for s in statuses),
            "restarts": sum(s.restarts for s in statuses),
            "disconnects": sum(s.disconnects for s in statuses),
            "address": streams[0][0].address,
        }
        if len(streams) > 1:
            info["ranks"] = [
                {"rank": i, "state": s.state.value, "lastSeq": s.last_seq, "gaps": s.gaps}
                for i, s in enumerate(statuses)
            ]
        return info
