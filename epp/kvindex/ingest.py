"""KV-event batches into the prefix index: the write side of the precise index.

`PreciseIndex` owns the shared pieces (the block map, the alignment checker, the
speculative entries) and one `StreamIndex` per KV-event stream, i.e. per endpoint
and data-parallel rank (each DP rank has its own KV cache and its own event
stream, so each gets its own slot in the index; an endpoint holds a block if any of
its ranks does).

The index is keyed by the EPP's own block keys (`blockkeys`), computed from the
token ids each BlockStored event carries. A stream keeps a map from the engine's
block hash (the uint64 on the wire) to that key, which is all the engine's hash is
still needed for: to chain an event's first block to its parent, to apply
removals, and to resolve the token-less events of CPU-offload connectors.

A stream's batch is applied event by event, in order:

- BlockStored with tokens: the keys are computed from `token_ids`, cut in blocks of
  the configured size and chained from the parent's key (the root for no parent;
  else the map's entry for `parent_block_hash`), with the event's extras (LoRA
  name, salt, other extra keys); they go into the tier of the event's medium and
  the map learns engine hash -> key for each block. Rejected, counted and logged
  once, with nothing indexed: a block size other than ours (`block_size_mismatch`:
  the alignment check marks the stream), `token_ids` that are not
  len(block_hashes) x block size (`bad_token_count`) or not uint32
  (`bad_token_ids`); ignored likewise: a parent never seen (`unknown_parent`: lost
  or trimmed events; the engine's later blocks of that request cannot be placed);
- BlockStored without tokens (offload connectors: CPU or storage copies of blocks
  the GPU stored before): the keys come from the map (a hash it does not know is
  counted in `unknown_hashes` as `unknown_block` and skipped);
- storing is idempotent: a block stored again (a replay, vLLM's
  `kv_cache_report_mode=full`) only refreshes its age;
- events of other KV-cache groups than the first (hybrid models), remote blocks
  (vLLM >= 0.26 `locality`) and media with no configured weight are counted and
  skipped;
- BlockRemoved: the keys come from the map and leave that tier; an engine hash the
  map does not know is counted in `unknown_hashes` as `unknown_removal` (logged
  once; nothing removed). The map forgets a hash once the stream holds its key in
  no tier;
- AllBlocksCleared: the stream's slot is retired (O(1)) and it starts a new one,
  with an empty map.

Every decoded event is counted once: applied, ignored or rejected.

The map is per stream: an entry costs what an index entry costs (about 75 bytes: a
dict slot and a 60-bit int; the key object is shared with the index).
It holds what the engine holds, as reported: one entry per engine hash the stream
holds in some tier. What lost removals or the index's own bound leave behind is
trimmed: when the map outgrows twice the stream's live index entries (plus
`MAP_SLACK`), its oldest entries whose key the stream no longer holds go, and it
never exceeds the index's bound. A map shared by the pods that use the same seed
would save nothing where it matters: the worst case (every block on one pod) has
one entry per block either way, the engine hashes differ between pods with
different seeds, and a shared map would need counts per entry to know when a
hash may go (docs/precise-prefix.md has the measurement).

The subscriber calls `clear` on an engine restart or an unrecoverable gap, and
`PreciseIndex.remove_endpoint` when an endpoint leaves the pool.
"""

from __future__ import annotations

import asyncio
import logging
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final, cast

from epp.datastore import Endpoint
from epp.kvindex.alignment import TOKENIZATION_CAUSE, AlignmentChecker, AlignmentState
from epp.kvindex.blockkeys import ROOT_KEY, chain_keys, event_extras
from epp.kvindex.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from epp.kvindex.index import PrefixIndex, Tier
from epp.kvindex.speculative import SpeculativeIndex
from epp.logs import LogOnce
from epp.tokenization.tokens import TOKEN_BYTES, TOKEN_TYPECODE

log = logging.getLogger(__name__)

# Sweep this many keys between two yields to the event loop (~2-5 ms of work).
SWEEP_SLICE = 20_000
# A stream's engine-hash map may exceed twice its live index entries by this much
# before it is trimmed (a small stream's map is never trimmed for nothing).
MAP_SLACK: Final = 4096


@dataclass
class StreamCounters:
    batches: int = 0
    events_applied: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    # reason -> count: "all_blocks_cleared", "restart", "gap", "resync", ...
    clears: Counter[str] = field(default_factory=Counter)
    # Every decoded event is applied, ignored or rejected, counted once.
    # reason -> events skipped: "other_group", "remote", "unknown_medium",
    # "unknown_parent" (a BlockStored whose parent the stream never stored)
    ignored: Counter[str] = field(default_factory=Counter)
    # reason -> events or messages rejected as malformed: "block_size_mismatch",
    # "bad_token_count", "bad_token_ids", and the wire decoder's reasons
    rejected: Counter[str] = field(default_factory=Counter)
    # reason -> block hashes of applied events that the stream's map did not know:
    # "unknown_removal" (BlockRemoved), "unknown_block" (BlockStored without tokens)
    unknown_hashes: Counter[str] = field(default_factory=Counter)
    map_trimmed: int = 0  # engine-hash map entries dropped by the trim


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
        # The engine's block hash (its low 60 bits: `events`) -> the EPP's key.
        self.engine_keys: dict[int, int] = {}
        # Keys the map reaches from more than one engine hash, and how many more
        # (an engine before vLLM 0.17 caching the same tokens under two salts): a
        # removal of one of the hashes leaves the key held.
        self._shared_keys: Counter[int] = Counter()
        self._trim_at = MAP_SLACK
        # BlockStored events with tokens applied (the alignment probes' clock).
        self.token_events = 0

    @property
    def label(self) -> str:
        return self.endpoint.name if self.rank == 0 else f"{self.endpoint.name}/dp{self.rank}"

    def reject(self, reason: str, detail: str) -> None:
        """A message or event that could not be used: counted, logged once per cause."""
        self._note(self.counters.rejected, "reject", reason, detail)

    def ignore(self, reason: str, detail: str) -> None:
        """An event skipped for a reason worth a line: counted, logged once."""
        self._note(self.counters.ignored, "ignore", reason, detail)

    def unknown(self, reason: str, count: int, detail: str) -> None:
        """Block hashes the map does not know: counted, logged once."""
        self._note(self.counters.unknown_hashes, "ignore", reason, detail, count)

    def _note(
        self, counter: Counter[str], kind: str, reason: str, detail: str, count: int = 1
    ) -> None:
        counter[reason] += count
        self.owner.log_once(
            (self.endpoint.name, kind, reason),
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
                if event.token_ids:
                    if not self._store(tier, event):
                        continue
                else:
                    self._store_known(tier, event.block_hashes)
            elif kind is BlockRemoved:
                assert isinstance(event, BlockRemoved)
                if not self._wanted(event.group_idx, event.locality):
                    continue
                tier = index.tier(event.medium)
                if tier is None:
                    self._unknown_medium(event.medium)
                    continue
                self._remove(tier, event.block_hashes)
            else:
                assert isinstance(event, AllBlocksCleared)
                self.clear("all_blocks_cleared")
            counters.events_applied += 1
        checker = self.owner.checker
        if checker is not None and self.alignment.pending:
            checker.expire(self.alignment, self.token_events)
            if self.alignment.tokenization is False:
                self.owner.tokenization_flagged(self)

    def _store(self, tier: Tier, event: BlockStored) -> bool:
        """A BlockStored with its tokens: our keys, chained from the parent's. False
        when the event was rejected or ignored (counted)."""
        hashes = event.block_hashes
        n = len(hashes)
        size = self.owner.block_size
        checker = self.owner.checker
        if event.block_size != size:
            self.reject(
                "block_size_mismatch",
                f"the engine's blocks are {event.block_size} tokens, blockSize is {size}:"
                " set blockSize to the engine's --block-size; such events are not indexed",
            )
            if checker is not None and self.alignment.aligned is not False:
                checker.block_size_agrees(self.alignment, event.block_size)
                self.owner.misaligned(self)
            return False
        tokens = event.token_ids
        if len(tokens) != n * size:
            self.reject(
                "bad_token_count",
                f"{len(tokens)} token ids for {n} blocks of {size}; such events are not indexed",
            )
            return False
        parent_hash = event.parent_block_hash
        engine_keys = self.engine_keys
        if parent_hash is None:
            parent = ROOT_KEY
        else:
            known = engine_keys.get(parent_hash)
            if known is None:
                self.ignore(
                    "unknown_parent",
                    "a BlockStored whose parent block was never stored (events lost or"
                    " trimmed); its blocks are not indexed",
                )
                return False
            parent = known
        try:
            data = array(TOKEN_TYPECODE, tokens).tobytes()  # token_bytes, inlined
        except (OverflowError, TypeError):
            self.reject("bad_token_ids", "token ids must be ints in 0 .. 2**32 - 1")
            return False
        extra_keys = event.extra_keys
        if (
            event.lora_name is None
            and event.lora_id is None
            and not event.cache_salt
            and (not extra_keys or extra_keys.count(None) == len(extra_keys))
        ):
            extras = None  # the common case: plain text, no adapter, no salt
        else:
            extras = event_extras(
                n,
                parent_hash is None,
                event.lora_name,
                event.lora_id,
                event.extra_keys,
                event.cache_salt,
            )
        keys = chain_keys(parent, data, size * TOKEN_BYTES, extras)
        if checker is not None:
            alignment = self.alignment
            if alignment.aligned is None:
                alignment.aligned = True
            alignment.events_seen += 1
            alignment.checked_blocks += n
            if alignment.pending:
                checker.on_stored(alignment, keys)
        self.token_events += 1
        held: list[int] = []
        self.owner.index.store(self.slot, tier, keys, hashes, held)
        if held:
            self._share(held, keys, hashes)
        engine_keys.update(zip(hashes, keys, strict=True))
        self.counters.blocks_stored += n
        if len(engine_keys) > self._trim_at:
            self._trim()
        return True

    def _store_known(self, tier: Tier, hashes: list[int]) -> None:
        """A BlockStored without tokens (an offload connector's copy): the keys of
        blocks the stream stored before."""
        engine_keys = self.engine_keys
        keys: list[int] = []
        marks: list[int] = []
        for engine_hash in hashes:
            key = engine_keys.get(engine_hash)
            if key is not None:
                keys.append(key)
                marks.append(engine_hash)
        if len(keys) < len(hashes):
            self.unknown(
                "unknown_block",
                len(hashes) - len(keys),
                "a BlockStored without token ids names a block never stored with them;"
                " it is not indexed",
            )
        if keys:
            self._put(tier, keys, marks)

    def _put(self, tier: Tier, keys: list[int], hashes: list[int]) -> None:
        held: list[int] = []
        self.owner.index.store(self.slot, tier, keys, hashes, held)
        if held:
            self._share(held, keys, hashes)
        engine_keys = self.engine_keys
        engine_keys.update(zip(hashes, keys, strict=True))
        self.counters.blocks_stored += len(keys)
        if len(engine_keys) > self._trim_at:
            self._trim()

    def _share(self, held: list[int], keys: list[int], hashes: list[int]) -> None:
        """Keys the stream held already (before the map is updated): under a hash
        the map does not know yet, a second engine hash now reaches the same key."""
        held_set = set(held)
        engine_keys = self.engine_keys
        for key, engine_hash in zip(keys, hashes, strict=True):
            if key in held_set and engine_hash not in engine_keys:
                self._shared_keys[key] += 1

    def _remove(self, tier: Tier, hashes: list[int]) -> None:
        engine_keys = self.engine_keys
        index = self.owner.index
        bit = 1 << self.slot
        # Tiers other than this one that may hold the stream's blocks (usually none):
        # while one does, the map keeps the hash (an offloaded copy's removal comes
        # later); otherwise the hash goes with the block.
        others = [t.blocks for t in index.tiers if t is not tier and t.blocks]
        direct = not others and not self._shared_keys
        look_up = engine_keys.pop if direct else engine_keys.get
        found = [look_up(engine_hash, None) for engine_hash in hashes]
        if None in found:
            keys = [key for key in found if key is not None]
            marks = [h for h, key in zip(hashes, found, strict=True) if key is not None]
            self.unknown(
                "unknown_removal",
                len(found) - len(keys),
                "a BlockRemoved names a block never stored (events lost, or stored before"
                " the EPP subscribed); nothing removed",
            )
            if not keys:
                return
        else:
            keys = cast(list[int], found)
            marks = hashes
        if self._shared_keys:
            keys, marks = self._unshare(keys, marks)
        index.remove(self.slot, tier, keys, marks)
        self.counters.blocks_removed += len(keys)
        if direct:
            return
        for key, engine_hash in zip(keys, marks, strict=True):
            for blocks in others:
                if blocks.get(key, 0) & bit:
                    break
            else:
                engine_keys.pop(engine_hash, None)

    def _unshare(self, keys: list[int], marks: list[int]) -> tuple[list[int], list[int]]:
        """Removals of keys another engine hash still reaches: only the hash goes."""
        shared = self._shared_keys
        kept_keys: list[int] = []
        kept_marks: list[int] = []
        for key, engine_hash in zip(keys, marks, strict=True):
            if key in shared:
                shared[key] -= 1
                if not shared[key]:
                    del shared[key]
                del self.engine_keys[engine_hash]
            else:
                kept_keys.append(key)
                kept_marks.append(engine_hash)
        return kept_keys, kept_marks

    def _trim(self) -> None:
        """Drop the oldest map entries whose key the stream holds no more (left by
        lost removals or by the index's bound), to twice its live entries; never
        past the index's bound."""
        index = self.owner.index
        engine_keys = self.engine_keys
        live = sum(index.slot_blocks(self.slot).values())
        target = 2 * live + MAP_SLACK // 2
        excess = len(engine_keys) - target
        if excess > 0:
            slot = self.slot
            stale = []
            for engine_hash, key in engine_keys.items():
                if not index.holds(slot, key):
                    stale.append(engine_hash)
                    if len(stale) >= excess:
                        break
            for engine_hash in stale:
                del engine_keys[engine_hash]
            self.counters.map_trimmed += len(stale)
        hard = index.max_entries
        if len(engine_keys) > hard:
            # Only an engine holding more blocks than the whole index may: the
            # oldest go, held or not (their removals will count as unknown).
            for engine_hash in list(engine_keys)[: len(engine_keys) - hard]:
                del engine_keys[engine_hash]
                self.counters.map_trimmed += 1
        self._trim_at = max(2 * len(engine_keys), 2 * live + MAP_SLACK)

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
        self.engine_keys = {}
        self._shared_keys = Counter()
        self._trim_at = MAP_SLACK
        self.alignment.reset()
        self.owner.forget_misalignment(self)
        self.counters.clears[reason] += 1
        self.owner.wake_sweeper()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.owner.index.retire_slot(self.slot)
        self.engine_keys = {}
        self._shared_keys = Counter()
        self.alignment.pending.clear()
        self.owner.wake_sweeper()

    @property
    def blocks(self) -> int:
        return sum(self.owner.index.slot_blocks(self.slot).values())


class PreciseIndex:
    def __init__(
        self,
        index: PrefixIndex,
        block_size: int,
        checker: AlignmentChecker | None,
        speculative: SpeculativeIndex | None,
    ) -> None:
        if block_size < 1:
            raise ValueError("the block size must be >= 1")
        self.index = index
        self.block_size = block_size
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
        """False once a stream of `endpoint` published blocks of another size."""
        return all(s.alignment.aligned is not False for s in self._streams.get(endpoint, ()))

    # -- alignment -------------------------------------------------------------------

    def misaligned(self, stream: StreamIndex) -> None:
        self.alignment_failures += 1
        self.log_once(
            (stream.endpoint.name, "misaligned"),
            logging.ERROR,
            "KV events from %s cannot be indexed: %s. Its precise prefix score is not"
            " trusted (scored 0).",
            stream.label,
            stream.alignment.cause,
        )

    def tokenization_flagged(self, stream: StreamIndex) -> None:
        self.log_once(
            (stream.endpoint.name, "tokenization"),
            logging.ERROR,
            "KV events from %s: %s",
            stream.label,
            TOKENIZATION_CAUSE.format(missed=stream.alignment.consecutive_misses),
        )

    def forget_misalignment(self, stream: StreamIndex) -> None:
        self.log_once.forget((stream.endpoint.name, "misaligned"))
        self.log_once.forget((stream.endpoint.name, "tokenization"))

    def expect(self, endpoint: Endpoint, key: int, held: bool) -> None:
        """The alignment probe of a pick (`alignment`): `endpoint` should come to
        hold `key` (or holds it already: `held`)."""
        checker = self.checker
        streams = self._streams.get(endpoint)
        if checker is None or not streams:
            return
        checker.expect([(s.alignment, s.token_events) for s in streams], key, held)
        for stream in streams:
            if stream.alignment.tokenization is False:
                self.tokenization_flagged(stream)

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
        agreement = [s.alignment.tokenization for s in streams]
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
            # Whether the blocks predicted for the prompts sent here showed up in its
            # events (None: not known yet; false: the tokenizations likely differ).
            "tokenizationAgreement": None
            if all(a is None for a in agreement)
            else all(a is not False for a in agreement),
            "tokenizationProbes": {
                "confirmed": sum(s.alignment.confirmed for s in streams),
                "missed": sum(s.alignment.missed for s in streams),
                "inconclusive": sum(s.alignment.inconclusive for s in streams),
                "pending": sum(len(s.alignment.pending) for s in streams),
            },
            "engineHashes": sum(len(s.engine_keys) for s in streams),
        }
