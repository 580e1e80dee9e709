"""KV-event batches into the prefix index: the write side of the precise index.

`PreciseIndex` owns the shared pieces (the block map, the hasher, the alignment
checker, the speculative entries) and one `StreamIndex` per KV-event stream, i.e.
per endpoint and data-parallel rank (each DP rank has its own KV cache and its own
event stream, so each gets its own slot in the index; an endpoint holds a block if
any of its ranks does).

A stream's batch is applied event by event, in order:

- BlockStored: the blocks go into the tier of the event's medium (idempotent: a
  block stored again only refreshes its age); events of other KV-cache groups than
  the first (hybrid models), remote blocks (vLLM >= 0.26 `locality`) and media
  with no configured weight are counted and skipped. Sampled events are
  re-hashed by the alignment check;
- BlockRemoved: the blocks leave that tier;
- AllBlocksCleared: the stream's slot is retired (O(1)) and it starts a new one.

The subscriber calls `clear` on an engine restart or an unrecoverable gap, and
`PreciseIndex.remove_endpoint` when an endpoint leaves the pool.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from epp.datastore import Endpoint
from epp.kvindex.alignment import AlignmentChecker, AlignmentState
from epp.kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from epp.kvindex.hashing import EngineHasher
from epp.kvindex.index import PrefixIndex
from epp.kvindex.speculative import SpeculativeIndex
from epp.logs import LogOnce

log = logging.getLogger(__name__)

# Sweep this many keys between two yields to the event loop (~2-5 ms of work).
SWEEP_SLICE = 20_000


@dataclass
class StreamCounters:
    batches: int = 0
    events_applied: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    # reason -> count: "all_blocks_cleared", "restart", "gap", "resync", ...
    clears: Counter[str] = field(default_factory=Counter)
    # reason -> events skipped on purpose: "other_group", "remote", "unknown_medium"
    ignored: Counter[str] = field(default_factory=Counter)
    # reason -> events or messages rejected as malformed
    rejected: Counter[str] = field(default_factory=Counter)


class StreamIndex:
    """One KV-event stream's view of the index."""

    def __init__(self, owner: PreciseIndex, endpoint: Endpoint, rank: int) -> None:
        self.owner = owner
        self.endpoint = endpoint
        self.rank = rank
        self.slot = owner.index.new_slot()
        self.alignment = AlignmentState()
        self.counters = StreamCounters()
        self.closed = False

    @property
    def label(self) -> str:
        return self.endpoint.name if self.rank == 0 else f"{self.endpoint.name}/dp{self.rank}"

    def reject(self, reason: str, detail: str) -> None:
        """A message or event that could not be used: counted, logged once per cause."""
        self.counters.rejected[reason] += 1
        self.owner.log_once(
            (self.endpoint.name, "reject", reason),
            logging.WARNING,
            "KV events from %s: %s (%s); further ones are only counted",
            self.label,
            reason.replace("_", " "),
            detail,
        )

    def apply(self, batch: EventBatch) -> None:
        if self.closed:
            # The endpoint left the pool while this batch was in flight: nothing of
            # it may come back into the index.
            self.owner.late_batches += 1
            return
        counters = self.counters
        counters.batches += 1
        for reason, detail in batch.rejected:
            self.reject(reason, detail)
        if batch.data_parallel_rank is not None and batch.data_parallel_rank != self.rank:
            self.owner.log_once(
                (self.endpoint.name, "dp-rank", self.rank, batch.data_parallel_rank),
                logging.WARNING,
                "KV events from %s (subscribed as data-parallel rank %d) say rank %d: is"
                " kvEventsConfig.dpSize right? Applied to the stream they came on.",
                self.label,
                self.rank,
                batch.data_parallel_rank,
            )
        index = self.owner.index
        for event in batch.events:
            kind = type(event)
            if kind is BlockStored:
                assert isinstance(event, BlockStored)
                if not self._wanted(event.group_idx, event.locality):
                    continue
                tier = index.tier(event.medium)
                if tier is None:
                    self._unknown_medium(event.medium)
                    continue
                checker = self.owner.checker
                if (
                    checker is not None
                    and self.alignment.aligned is not False
                    and self._check(checker, event) is False
                ):
                    self.owner.misaligned(self)
                index.store(self.slot, tier, event.block_hashes)
                counters.blocks_stored += len(event.block_hashes)
            elif kind is BlockRemoved:
                assert isinstance(event, BlockRemoved)
                if not self._wanted(event.group_idx, event.locality):
                    continue
                tier = index.tier(event.medium)
                if tier is None:
                    self._unknown_medium(event.medium)
                    continue
                index.remove(self.slot, tier, event.block_hashes)
                counters.blocks_removed += len(event.block_hashes)
            else:
                assert isinstance(event, AllBlocksCleared)
                self.clear("all_blocks_cleared")
            counters.events_applied += 1

    def _check(self, checker: AlignmentChecker, event: BlockStored) -> bool | None:
        """The alignment check of one event. It is a safeguard, not part of the
        ingestion: should it fail on some unforeseen input, the event is still
        applied (the rest of the batch too) and the failure logged once."""
        try:
            return checker.check(self.alignment, event)
        except Exception as exc:
            self.alignment.unverifiable += 1
            self.owner.log_once(
                (self.endpoint.name, "alignment-error", type(exc).__name__),
                logging.ERROR,
                "KV events from %s: the alignment check failed on an event (%s: %s);"
                " the event is applied unchecked",
                self.label,
                type(exc).__name__,
                exc,
            )
            return None

    def _wanted(self, group: int | None, locality: str | None) -> bool:
        if group:
            # Hybrid models publish one stream of blocks per KV-cache group; the
            # first (full attention) decides prefix hits here.
            self.counters.ignored["other_group"] += 1
            return False
        if locality is not None and locality.upper() == "REMOTE":
            self.counters.ignored["remote"] += 1
            return False
        return True

    def _unknown_medium(self, medium: str) -> None:
        self.counters.ignored["unknown_medium"] += 1
        self.owner.log_once(
            ("medium", medium),
            logging.WARNING,
            "KV events name the medium %r, which has no weight in mediumWeights: its blocks"
            " are not indexed",
            medium,
        )

    def clear(self, reason: str) -> None:
        """Forget everything this stream held (O(1); the sweeper tidies up)."""
        if self.closed:
            return
        index = self.owner.index
        index.retire_slot(self.slot)
        self.slot = index.new_slot()
        self.alignment.reset()
        self.owner.forget_misalignment(self)
        self.counters.clears[reason] += 1
        self.owner.wake_sweeper()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.owner.index.retire_slot(self.slot)
        self.owner.wake_sweeper()

    @property
    def blocks(self) -> int:
        return sum(self.owner.index.slot_blocks(self.slot).values())


class PreciseIndex:
    def __init__(
        self,
        index: PrefixIndex,
        hasher: EngineHasher,
        checker: AlignmentChecker | None,
        speculative: SpeculativeIndex | None,
    ) -> None:
        self.index = index
        self.hasher = hasher
        self.checker = checker
        self.speculative = speculative
        self.log_once = LogOnce(log)
        self._streams: dict[Endpoint, list[StreamIndex]] = {}
        self._sweep_wanted = asyncio.Event()
        self.alignment_failures = 0
        self.late_batches = 0  # batches for endpoints already removed

    # -- streams -------------------------------------------------------------------

    def add_stream(self, endpoint: Endpoint, rank: int) -> StreamIndex:
        stream = StreamIndex(self, endpoint, rank)
        self._streams.setdefault(endpoint, []).append(stream)
        return stream

    def remove_endpoint(self, endpoint: Endpoint) -> None:
        """The endpoint left the pool: its entries go (O(1) per stream)."""
        for stream in self._streams.pop(endpoint, []):
            stream.close()

    def streams(self, endpoint: Endpoint) -> Sequence[StreamIndex]:
        return self._streams.get(endpoint, ())

    def all_streams(self) -> list[StreamIndex]:
        return [s for streams in self._streams.values() for s in streams]

    def trusted(self, endpoint: Endpoint) -> bool:
        """False once a stream of `endpoint` failed the alignment check."""
        return all(s.alignment.aligned is not False for s in self._streams.get(endpoint, ()))

    # -- alignment -------------------------------------------------------------------

    def misaligned(self, stream: StreamIndex) -> None:
        self.alignment_failures += 1
        self.log_once(
            (stream.endpoint.name, "misaligned"),
            logging.ERROR,
            "KV-event block hashes from %s disagree with the scorer's own: its precise"
            " prefix score is no longer trusted (scored 0). Likely cause: %s",
            stream.label,
            stream.alignment.cause,
        )

    def forget_misalignment(self, stream: StreamIndex) -> None:
        self.log_once.forget((stream.endpoint.name, "misaligned"))

    # -- the sweeper -----------------------------------------------------------------

    def wake_sweeper(self) -> None:
        self._sweep_wanted.set()

    async def run_sweeper(self) -> None:
        """Remove retired slots from the maps, a slice at a time, whenever a stream
        was cleared or an endpoint removed."""
        while True:
            await self._sweep_wanted.wait()
            self._sweep_wanted.clear()
            for _ in self.index.sweep(SWEEP_SLICE):
                await asyncio.sleep(0)

    def describe(self, endpoint: Endpoint) -> dict[str, Any]:
        """The index part of the endpoint's /debug/endpoints entry."""
        streams = self._streams.get(endpoint, [])
        by_medium: Counter[str] = Counter()
        digests: dict[str, int] = {}
        for stream in streams:
            by_medium.update(self.index.slot_blocks(stream.slot))
            for medium, digest in self.index.slot_digest(stream.slot).items():
                digests[medium] = digests.get(medium, 0) ^ digest
        aligned = [s.alignment.aligned for s in streams]
        return {
            "blocks": sum(by_medium.values()),
            "blocksByMedium": {k: v for k, v in by_medium.items() if v},
            # XOR of the block hashes held, per medium (16 hex digits): the engine's
            # cached blocks XORed the same way give the same value when the index is
            # in step with it, and so do two replicas that agree.
            "digest": {k: f"{digests.get(k, 0):016x}" for k, v in by_medium.items() if v},
            "eventsApplied": sum(s.counters.events_applied for s in streams),
            "aligned": None
            if all(a is None for a in aligned)
            else all(a is not False for a in aligned),
            "trusted": self.trusted(endpoint),
            "alignmentCause": next(
                (s.alignment.cause for s in streams if s.alignment.aligned is False), None
            ),
        }
