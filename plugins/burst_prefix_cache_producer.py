"""`burst-prefix-cache-producer`: co-locates a burst of requests that share a prompt
onto the same endpoint, so the shared prefix is prefilled once (llm-d's data
producer of the same name).

The problem it solves: when many requests with one prompt arrive at once (the n
samples of an RL rollout group, a fan-out of one system prompt), every cache is
still cold, so every prefix scorer scores them all 0 and the load scorers spread
them: the prompt is prefilled on several endpoints and the prefix cache is wasted.

What it does: a request waits until its batch window closes; the window opens with
the first request of a batch and closes `windowDurationMs` (100, in 1..10000)
later. Then the batch is placed as a whole:

1. each prompt is cut into blocks of `blockSizeTokens` (64) tokens, estimated from
   the text at `charsPerToken` (this EPP's, 4.0) as the approximate prefix index
   does, and hashed as a chain; at most `maxPrefixTokensToMatch / blockSizeTokens`
   blocks (0: 2048 blocks; otherwise at least `blockSizeTokens`);
2. requests whose block chains are identical form a group. A group of two or more
   is always placed together. A lone request is placed only if
   `minColocateBlocks` > 0 and its first `minColocateBlocks` blocks equal those of
   another request in the batch; other lone requests (and prompt-less ones) get no
   affinity and are left to the other scorers;
3. groups are placed before lone requests, each tier longest prompt first. A unit
   goes to one endpoint, at most `maxPerReplica` (-1: no limit) of a group's
   requests per endpoint, the rest spilling to the next least-loaded endpoints.
   With `minColocateBlocks` > 0, a unit's first endpoint is the one already given
   the longest shared prefix (at least `minColocateBlocks` blocks) in this batch,
   unless that endpoint already has its fair share of the batch
   (ceil(total / endpoints)); otherwise the least-loaded endpoint in this batch.
   Load is counted in requests, or with `balanceBy: tokens` in prefix blocks, a
   unit charging an endpoint once, less the leading blocks it already got in this
   batch. Ties go to fewer running requests (fresh model-server metrics; 0
   without them), then to the name;
4. each request leaves a `PrefixMatchInfo` under this producer's name: all its
   blocks matched on its endpoint, none elsewhere. `prefix-cache-scorer` with
   `prefixMatchInfoProducerName: <this plugin's name>` turns that into 1.0 there.

A batch holds at most `maxBatchSize` (1000; -1: no limit) requests; a request
beyond it fails in this producer (logged) and is scheduled without its affinity.
Placement only sees one window: cache reuse across windows is the approximate or
precise prefix producer's job, which can run beside this one.

Waiting uses `PluginContext.sleep` and the time waited `PluginContext.clock`, so
a simulation on virtual time drives the window. Every request with a prompt waits
for its window, /debug/explain's too (which then joins the batch it explains).

Differences from llm-d: tokens are estimated from the text (llm-d hashes the ids
of its token-producer, which it creates when none is configured); a request
without a prompt does not wait for a window (llm-d's waits, then gets no
affinity); a completion batch of several prompts is placed by its first prompt.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Final, Literal

import msgspec

from epp.approxindex import DEFAULT_CHARS_PER_TOKEN, prompt_blocks
from epp.datastore import RUNNING, Endpoint
from epp.requests import InferenceRequest
from epp.scheduling import (
    CycleState,
    PluginContext,
    PrefixMatchInfo,
    explain_note,
    prefix_match_key,
)

UNLIMITED: Final = -1
DEFAULT_MAX_PREFIX_BLOCKS: Final = 2048
MAX_WINDOW_MS: Final = 10000


class BatchFull(Exception):
    """The current window already holds `maxBatchSize` requests."""


@dataclass(eq=False, slots=True)
class _Entry:
    hashes: tuple[int, ...]
    endpoints: Sequence[Endpoint]
    assigned: Endpoint | None = None


@dataclass(eq=False, slots=True)
class _Batch:
    entries: list[_Entry] = field(default_factory=list)
    sealed: asyncio.Event = field(default_factory=asyncio.Event)
    timer: asyncio.Task[None] | None = None


class BurstPrefixCacheProducer:
    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        window_duration_ms: int = 100
        max_per_replica: int = UNLIMITED
        block_size_tokens: int = 64
        max_prefix_tokens_to_match: int = 0
        min_colocate_blocks: int = 0
        max_batch_size: int = 1000
        # "" is llm-d's unset value: requests.
        balance_by: Literal["requests", "tokens", ""] = "requests"
        # This EPP's: characters per token when a prompt is text.
        chars_per_token: Annotated[float, msgspec.Meta(gt=0.0)] = DEFAULT_CHARS_PER_TOKEN

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        _check(params)
        self.name = context.name
        self.key = prefix_match_key(context.name)
        self.clock = context.clock
        self.sleep = context.sleep
        self.window_s = params.window_duration_ms / 1000.0
        self.max_per_replica = params.max_per_replica
        self.block_size = params.block_size_tokens
        self.max_blocks = (
            params.max_prefix_tokens_to_match // params.block_size_tokens
            if params.max_prefix_tokens_to_match > 0
            else DEFAULT_MAX_PREFIX_BLOCKS
        )
        self.min_colocate = params.min_colocate_blocks
        self.max_batch = params.max_batch_size
        self.by_tokens = params.balance_by == "tokens"
        self.chars_per_token = params.chars_per_token
        self._batch: _Batch | None = None

    async def prepare(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> None:
        blocks = prompt_blocks(request, self.block_size, self.chars_per_token, self.max_blocks)
        hashes = tuple(blocks.all()) if blocks is not None else ()
        if not hashes:
            cycle.put(self.key, PrefixMatchInfo(0, self.block_size, {}))
            return
        batch = self._batch
        if batch is None:
            batch = self._batch = _Batch()
            batch.timer = asyncio.get_running_loop().create_task(self._close_after(batch))
        if self.max_batch != UNLIMITED and len(batch.entries) >= self.max_batch:
            raise BatchFull(
                f"{self.name}: the batch window already holds maxBatchSize={self.max_batch}"
                " requests; this one is scheduled without burst affinity"
            )
        entry = _Entry(hashes, endpoints)
        batch.entries.append(entry)
        queued_at = self.clock()
        await batch.sealed.wait()
        matched: dict[Endpoint, float] = {}
        assigned = entry.assigned
        if assigned is not None:
            # By name: the batch was placed over its first request's candidates, which
            # may be other objects (the pool changed meanwhile) or not this request's.
            for e in endpoints:
                if e.name == assigned.name:
                    matched[e] = float(len(hashes))
        cycle.put(self.key, PrefixMatchInfo(len(hashes), self.block_size, matched))
        explain_note(
            cycle,
            self.name,
            {
                "waitedMs": (self.clock() - queued_at) * 1000.0,
                "batchSize": len(batch.entries),
                "assigned": assigned.name if assigned is not None else None,
            },
        )

    async def _close_after(self, batch: _Batch) -> None:
        try:
            await self.sleep(self.window_s)
        finally:
            # Even when cancelled (shutdown): nobody may wait for a window forever.
            self._seal(batch)

    def _seal(self, batch: _Batch) -> None:
        if batch.sealed.is_set():
            return
        if self._batch is batch:
            self._batch = None
        _Placement(self, batch.entries).run()
        batch.sealed.set()


def _check(params: BurstPrefixCacheProducer.Parameters) -> None:
    """llm-d's rules for the parameters, with what is wrong and what is allowed."""
    if not 1 <= params.window_duration_ms <= MAX_WINDOW_MS:
        raise ValueError(
            f"windowDurationMs must be in 1..{MAX_WINDOW_MS} (every request waits that"
            f" long), got {params.window_duration_ms}"
        )
    if params.max_per_replica != UNLIMITED and params.max_per_replica < 1:
        raise ValueError(
            f"maxPerReplica must be -1 (no limit) or >= 1, got {params.max_per_replica}"
        )
    if params.block_size_tokens < 1:
        raise ValueError(f"blockSizeTokens must be > 0, got {params.block_size_tokens}")
    if params.max_prefix_tokens_to_match < 0:
        raise ValueError(
            f"maxPrefixTokensToMatch must be >= 0, got {params.max_prefix_tokens_to_match}"
        )
    if 0 < params.max_prefix_tokens_to_match < params.block_size_tokens:
        raise ValueError(
            f"maxPrefixTokensToMatch ({params.max_prefix_tokens_to_match}) must be 0 or at"
            f" least blockSizeTokens ({params.block_size_tokens}): a smaller value matches"
            " no block"
        )
    if params.min_colocate_blocks < 0:
        raise ValueError(f"minColocateBlocks must be >= 0, got {params.min_colocate_blocks}")
    if params.max_batch_size != UNLIMITED and params.max_batch_size < 1:
        raise ValueError(f"maxBatchSize must be -1 (no limit) or >= 1, got {params.max_batch_size}")
    if not math.isfinite(params.chars_per_token):
        raise ValueError(f"charsPerToken must be a finite number > 0, got {params.chars_per_token}")


class _Placement:
    """One sealed batch's placement (steps 2 and 3 of the module docstring)."""

    def __init__(self, producer: BurstPrefixCacheProducer, entries: list[_Entry]) -> None:
        self.k = producer.max_per_replica
        self.min_colocate = producer.min_colocate
        self.by_tokens = producer.by_tokens
        self.now = producer.clock()
        self.entries = entries
        self.load: dict[str, int] = {}  # per endpoint, in requests or blocks
        self.holders: dict[int, set[str]] = {}  # block hash -> endpoints given it
        self.max_share = 0

    def run(self) -> None:
        groups: dict[tuple[int, ...], list[_Entry]] = {}
        replicas: Sequence[Endpoint] | None = None
        for entry in self.entries:
            groups.setdefault(entry.hashes, []).append(entry)
            if replicas is None:
                replicas = entry.endpoints
        if not replicas:
            return
        shared = self._sharing_prefix(groups)
        whole = [key for key, members in groups.items() if len(members) >= 2]
        lone = [key for key, members in groups.items() if len(members) == 1 and key in shared]
        if not whole and not lone:
            return
        # Longest prompt first: it leaves the most blocks for shorter ones to match.
        whole.sort(key=len, reverse=True)
        lone.sort(key=len, reverse=True)
        units = whole + lone
        total = sum(len(key) if self.by_tokens else len(groups[key]) for key in units)
        self.max_share = -(-total // len(replicas))
        for key in units:
            self._place(groups[key], replicas)

    def _sharing_prefix(self, groups: dict[tuple[int, ...], list[_Entry]]) -> set[tuple[int, ...]]:
        """The prompts whose first `minColocateBlocks` blocks another request shares."""
        n = self.min_colocate
        if n <= 0:
            return set()
        requests: dict[tuple[int, ...], int] = {}
        for key, members in groups.items():
            if len(key) >= n:
                requests[key[:n]] = requests.get(key[:n], 0) + len(members)
        return {key for key in groups if len(key) >= n and requests[key[:n]] >= 2}

    def _place(self, members: list[_Entry], replicas: Sequence[Endpoint]) -> None:
        hashes = members[0].hashes
        prefer = self.min_colocate > 0
        matches = self._shared_blocks(hashes) if prefer or self.by_tokens else {}
        here: dict[str, int] = {}  # this unit's requests per endpoint
        i = 0
        while i < len(members):
            target = self._choose(replicas, here, matches, prefer)
            name = target.name
            run = len(members) - i
            if self.k != UNLIMITED:
                # More members than k x endpoints: one more each, rebalancing.
                run = min(run, max(1, self.k - here.get(name, 0)))
            for member in members[i : i + run]:
                member.assigned = target
            first = here.get(name, 0) == 0
            here[name] = here.get(name, 0) + run
            if not self.by_tokens:
                self.load[name] = self.load.get(name, 0) + run
            elif first:
                charge = max(0, len(hashes) - matches.get(name, 0))
                self.load[name] = self.load.get(name, 0) + charge
            i += run
            prefer = False  # only the unit's first endpoint follows the shared prefix
        for name in here:
            for h in hashes:
                self.holders.setdefault(h, set()).add(name)

    def _shared_blocks(self, hashes: tuple[int, ...]) -> dict[str, int]:
        """Per endpoint, how many of the prompt's leading blocks this batch gave it."""
        found: dict[str, int] = {}
        for h in hashes:
            holders = self.holders.get(h)
            if not holders:
                break
            for name in holders:
                found[name] = found.get(name, 0) + 1
        return found

    def _choose(
        self,
        replicas: Sequence[Endpoint],
        here: dict[str, int],
        matches: dict[str, int],
        prefer: bool,
    ) -> Endpoint:
        open_ = [e for e in replicas if self.k == UNLIMITED or here.get(e.name, 0) < self.k]
        if prefer:
            sharing = [
                e
                for e in open_
                if self.load.get(e.name, 0) < self.max_share
                and matches.get(e.name, 0) >= self.min_colocate
            ]
            if sharing:
                return min(sharing, key=lambda e: (-matches.get(e.name, 0), *self._rank(e)))
        return min(open_ or replicas, key=self._rank)

    def _rank(self, endpoint: Endpoint) -> tuple[int, int, str]:
        """Less is preferred: batch load, then running requests, then name."""
        metrics = endpoint.metrics
        running = metrics.running_requests if metrics.known(RUNNING, self.now) else 0
        return (self.load.get(endpoint.name, 0), running, endpoint.name)
