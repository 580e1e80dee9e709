"""The precise prefix service: one owner for the index of what every engine caches,
the KV-event feed that keeps it, and the tokenizers and block hashing that read it.

Built once per configured precise prefix producer (by the config's build step, not
by a plugin), started and stopped by the server, read by plugins:

    KV events (ZMQ, per endpoint and DP rank) --> KVEventSubscriber --> PreciseIndex
                                                          (or `feed`, for tests and the lab)
    request --> lookup_request: tokenize as the engine will, key the blocks, walk the index
            --> PromptMatch: per candidate endpoint, the share of the prompt it holds
    the pick --> record_pick: speculative entries until the engine's events arrive,
                 and where the routed prompt ended (`continues`)

Who may mutate what: the subscriber (or `feed`) writes the index; `record_pick`
writes speculative entries; lookups only read. Everything runs on one event loop;
tokenizing a long prompt goes to the tokenizers' worker threads.

Time comes from the `clock` it is given (speculative entries' TTL), so the same
service runs on the wall clock and in a simulation's virtual time. The KV-event lag
(`epp_kv_event_lag_seconds`) is read on `wall_clock` instead: the engines stamp
their batches with their host's time.time(), which only a wall clock compares with.
It is observed by the subscriber only, for batches that came over ZMQ; `feed` does
not observe it (a simulation's batches carry its virtual time).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Final, Literal

import msgspec
from prometheus_client.registry import Collector
from xxhash import xxh3_64_intdigest

from epp.clock import SYSTEM_CLOCK, Clock
from epp.datastore import Datastore, Endpoint
from epp.durations import Duration, parse_duration
from epp.kvindex.alignment import PROBE_BLOCKS, AlignmentChecker
from epp.kvindex.blockkeys import BlockKeys, HashContext, PromptBlocks
from epp.kvindex.events import EventBatch
from epp.kvindex.index import UNBOUNDED, PrefixIndex
from epp.kvindex.ingest import PreciseIndex, StreamIndex
from epp.kvindex.lookup import PrefixMatch, longest_prefix
from epp.kvindex.speculative import SpeculativeIndex
from epp.kvindex.subscriber import KVEventSubscriber, SubscriberSettings
from epp.kvindex.telemetry import PrecisePrefixCollector
from epp.logs import LogOnce
from epp.lru import LRU, pop_least_recent
from epp.requests import InferenceRequest
from epp.tokenization.models import (
    ANY_MODEL,
    SAME_AS_MODEL,
    LoraAdapter,
    TokenizerRegistry,
    TokenizerSource,
)
from epp.tokenization.prompts import Unsupported, prompt_tokens, token_id_prompt

# Routed prompts whose end is remembered for `continues`: the most recent ones (a
# digest and a dict slot each, about 100 bytes), as the approximate index keeps them.
MAX_PROMPT_ENDS: Final = 65_536
# First turns over one system prompt share the anchor at its end: this many of
# their lengths (in blocks) are kept per anchor, the most recent; a conversation
# whose first question's length has dropped out is not told apart (a few
# microseconds per lookup: one digest of a short tail per length).
MAX_TAILS_PER_ANCHOR: Final = 32

log = logging.getLogger(__name__)

_Port = Annotated[int, msgspec.Meta(ge=1, le=65535)]
_Positive = Annotated[int, msgspec.Meta(ge=1)]


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    # SUB topic prefix; vLLM publishes with an empty topic unless told otherwise.
    topic_filter: str = ""
    # Accepted for llm-d compatibility and not needed: each stream is its own task
    # on the event loop, applied in order.
    concurrency: _Positive = 4
    # Recover lost batches (and an engine's state when joining late) through the
    # engine's replay socket (`kvEventsReplay`, or `replayPort`).
    replay: bool = True
    # Data-parallel ranks per endpoint: rank r publishes on port + r.
    dp_size: _Positive = 1
    # For endpoints without `kvEvents` (Kubernetes pods): the engine's ports.
    socket_port: _Port | None = None
    replay_port: _Port | None = None
    replay_timeout: Duration = "2s"
    # After live batches, this long without another: ask the replay socket whether
    # the last ones were dropped (a PUB socket at its high-water mark drops the
    # newest without a trace). "0s": never ask.
    tail_check: Duration = "1s"
    reconnect_interval: Duration = "100ms"
    reconnect_interval_max: Duration = "5s"


class TokenizerConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    model: str = "*"  # the request's model this tokenizer is for; "*" = any other
    path: str | None = None  # a directory with tokenizer.json (+ tokenizer_config.json)
    # Or a Hub model id, fetched at start-up; "*" (on the "*" entry): each request's
    # model name is its Hub id, fetched when a request first names it.
    hugging_face: str | None = None
    revision: str | None = None


class LoraAdapterConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    name: str
    base_model: str
    path: str | None = None  # accepted, not needed: blocks are keyed by the name


class PrecisePrefixConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    """The service's settings: `precise-prefix-cache-scorer`'s parameters
    (docs/precise-prefix.md has them all)."""

    # The engine's --block-size: events are cut in blocks of this many tokens.
    block_size: _Positive = 16
    # Accepted and ignored (llm-d's configs and ours before the index had its own
    # keys set them): the index hashes the events' token ids itself, so the
    # engine's seed, algorithm and extra-key layout do not matter.
    hash_seed: str = "vllm-none-hash"
    hash_algo: Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"] = "sha256"
    extra_keys_format: Literal["tagged", "plain"] = "tagged"
    kv_events_config: KVEventsConfig = msgspec.field(default_factory=KVEventsConfig)
    speculative_indexing: bool = False
    speculative_ttl: Duration = msgspec.field(default="2s", name="speculativeTTL")
    tokenizers: list[TokenizerConfig] = []
    # The Hub cache (its own layout; default: HF_HUB_CACHE, else HF_HOME/hub).
    tokenizers_cache_dir: str | None = None
    # The cache only, never the network (as HF_HUB_OFFLINE=1, which also works).
    hugging_face_offline: bool = False
    # With `huggingFace: "*"`: the most models whose tokenizer is fetched (the first
    # ones requests name); others get no precise score. Bounds downloads and memory
    # (each tokenizer: its vocabulary plus up to tokenizerCacheBytes of cache).
    max_tokenizer_models: _Positive = 8
    lora_adapters: list[LoraAdapterConfig] = []
    # "error": a configured tokenizer directory that does not exist stops the start;
    # "fallback": its model gets no precise score (logged, and in /debug/endpoints).
    on_missing_tokenizer: Literal["error", "fallback"] = "error"
    # Bound of the index in (block, endpoint) entries; about 150 bytes each with the
    # engine-hash map.
    max_index_entries: _Positive = 2_000_000
    medium_weights: dict[str, float] = msgspec.field(
        default_factory=lambda: {"gpu": 1.0, "cpu": 0.8}
    )
    alignment_check: bool = True
    alignment_sample_every: _Positive = 32
    tokenizer_cache_bytes: _Positive = 64 * 1024 * 1024
    # Uncached text longer than this is tokenized in a worker thread.
    inline_tokenize_chars: Annotated[int, msgspec.Meta(ge=0)] = 2_000
    tokenizer_workers: _Positive = 2
    # Accepted and ignored: block keys cost a fraction of a microsecond, a cache of
    # them would cost as much to look up.
    hash_cache_blocks: _Positive = 16_384
    # Only a prompt's first blocks are hashed and matched (GIE's names): bounds the
    # work a very long prompt costs at pick time. 8192 blocks of 16 tokens are
    # 131,072 tokens. maxPrefixTokensToMatch, when set, wins (as tokens // blockSize
    # blocks, at least one). 0: no cap.
    max_prefix_blocks_to_match: Annotated[int, msgspec.Meta(ge=0)] = 8192
    max_prefix_tokens_to_match: Annotated[int, msgspec.Meta(ge=0)] = 0


_NO_TOKENIZER = {
    "no-tokenizer": "no tokenizer is configured for it (add it to tokenizers, or a '*' entry)",
    "model-limit": "maxTokenizerModels other models already have their Hub tokenizer (raise"
    " it, or give this model an entry of its own in tokenizers)",
}


def _check_tokenizer(tokenizer: TokenizerConfig) -> None:
    if (tokenizer.path is None) == (tokenizer.hugging_face is None):
        raise ValueError(
            f"tokenizers: model {tokenizer.model!r} needs exactly one of path and huggingFace"
        )
    if tokenizer.hugging_face == SAME_AS_MODEL:
        if tokenizer.model != ANY_MODEL:
            raise ValueError(
                f"tokenizers: model {tokenizer.model!r}: huggingFace '*' (each model's own Hub"
                " tokenizer) is for the model '*' entry; name the Hub model id here"
            )
        if tokenizer.revision is not None:
            raise ValueError(
                "tokenizers: model '*': a revision names one repository's; with huggingFace"
                " '*' give the models that need one an entry of their own"
            )


def _tokenizer_sources(
    configured: Sequence[TokenizerConfig], local: Sequence[tuple[str, str]]
) -> list[TokenizerSource]:
    """The config's tokenizers, with the local directories given on the command line
    in place of the entries of the same models (put first: they load first)."""
    overridden = {model for model, _ in local}
    return [TokenizerSource(model, path=directory) for model, directory in local] + [
        TokenizerSource(t.model, t.path, t.hugging_face, t.revision)
        for t in configured
        if t.model not in overridden
    ]


@dataclass(slots=True)
class PromptMatch:
    """One prompt looked up: how much of it each candidate endpoint holds."""

    match: PrefixMatch
    blocks: PromptBlocks
    # endpoint -> the index slots (one per DP rank) its score is read from
    slots: dict[Endpoint, tuple[int, ...]]
    prompt_blocks: int  # the prompt's full blocks
    considered_blocks: int  # of which the first this many were matched (the cap)

    def score(self, endpoint: Endpoint) -> float:
        """The share of the considered blocks `endpoint` holds from the first one,
        weighted by medium, in [0, 1]; 0 for an endpoint without (trusted) events."""
        owned = self.slots.get(endpoint)
        if not owned:
            return 0.0
        match = self.match
        return max(match.score(slot) for slot in owned)

    def matched_blocks(self, endpoint: Endpoint) -> int:
        """Consecutive blocks from the first that `endpoint` holds (unweighted)."""
        owned = self.slots.get(endpoint, ())
        return max((self.match.blocks.get(slot, 0) for slot in owned), default=0)


@dataclass(frozen=True, slots=True)
class NoLookup:
    """The prompt could not be looked up: every endpoint scores 0 for it."""

    reason: str  # a metric label: no_tokenizer, tokenizer_loading, multimodal, ...
    detail: str


@dataclass
class LookupStats:
    lookups: int = 0
    hits: int = 0  # some candidate held at least the first block
    request_blocks: int = 0
    matched_blocks: int = 0  # of the best candidate
    speculative_extensions: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> lookups not done


_TOKENIZER_REASONS = {
    "no-tokenizer": "no_tokenizer",
    "loading": "tokenizer_loading",
    "failed": "tokenizer_failed",
    "model-limit": "tokenizer_model_limit",
}


class PrecisePrefixService:
    def __init__(
        self,
        config: PrecisePrefixConfig,
        datastore: Datastore,
        *,
        name: str = "precise-prefix",
        clock: Clock = SYSTEM_CLOCK,
        wall_clock: Clock = time.time,
        local_tokenizers: Sequence[tuple[str, str]] = (),
        follow_datastore: bool = True,
        external_tokens: bool = False,
    ) -> None:
        """Checks `config` and builds everything; starts nothing (`run` does).
        `local_tokenizers`: (model, directory) pairs that win over the config's
        entries for those models (`epp serve --tokenizer-dir`).
        `follow_datastore`: False when the owner reports the endpoints to follow
        itself (`endpoints_changed`: llm-d's endpoint notifications) instead of the
        subscriber following the datastore.
        `external_tokens`: the prompts' token ids come from elsewhere (llm-d's
        token producer) and are looked up with `lookup`; the service loads no
        tokenizer of its own and does not warn that it has none.
        Raises ValueError for a config that cannot work."""
        self.name = name
        self.config = config
        weights = {k.lower(): v for k, v in config.medium_weights.items()}
        if not weights or any(not 0 < w <= 1 for w in weights.values()):
            raise ValueError("mediumWeights: every weight must be in (0, 1]")
        for tokenizer in config.tokenizers:
            _check_tokenizer(tokenizer)
        self.keys = BlockKeys(config.block_size)
        self.speculative = (
            SpeculativeIndex(parse_duration(config.speculative_ttl), clock=clock)
            if config.speculative_indexing
            else None
        )
        self.precise = PreciseIndex(
            PrefixIndex(config.max_index_entries, weights),
            config.block_size,
            AlignmentChecker(config.block_size, config.alignment_sample_every, clock=clock)
            if config.alignment_check
            else None,
            self.speculative,
        )
        events = config.kv_events_config
        self.subscriber = KVEventSubscriber(
            datastore,
            self.precise,
            SubscriberSettings(
                topic=events.topic_filter,
                replay=events.replay,
                dp_size=events.dp_size,
                port=events.socket_port,
                replay_port=events.replay_port,
                replay_timeout_s=parse_duration(events.replay_timeout),
                tail_check_s=parse_duration(events.tail_check),
                reconnect_interval_s=parse_duration(events.reconnect_interval),
                reconnect_interval_max_s=parse_duration(events.reconnect_interval_max),
            ),
            wall_clock=wall_clock,
            follow_datastore=follow_datastore,
        )
        self.tokenizers = TokenizerRegistry(
            _tokenizer_sources(config.tokenizers, local_tokenizers),
            [LoraAdapter(a.name, a.base_model, a.path) for a in config.lora_adapters],
            cache_dir=config.tokenizers_cache_dir,
            offline=config.hugging_face_offline,
            workers=config.tokenizer_workers,
            tokenizer_options={
                "cache_bytes": config.tokenizer_cache_bytes,
                "inline_chars": config.inline_tokenize_chars,
            },
            max_models=config.max_tokenizer_models,
        )
        missing = self.tokenizers.missing_directories()
        if missing and config.on_missing_tokenizer == "error":
            raise ValueError(
                "tokenizers: " + "; ".join(missing) + " (onMissingTokenizer: fallback routes"
                " those models without a precise score instead)"
            )
        for problem in missing:
            log.warning("%s: %s; its requests get no precise prefix score", name, problem)
        if not self.tokenizers.sources and not external_tokens:
            log.warning(
                "%s: no tokenizers configured: only prompts sent as token ids get a precise"
                " prefix score",
                name,
            )
        if config.max_prefix_tokens_to_match > 0:
            self.max_blocks = max(1, config.max_prefix_tokens_to_match // config.block_size)
        else:
            self.max_blocks = config.max_prefix_blocks_to_match
        self.external_tokens = external_tokens
        self.stats = LookupStats()
        # Where each routed prompt ended (record_pick, `_mark_end`): a digest of its
        # last blocks, seeded with the last key its lookup computed.
        self._prompt_ends: LRU[int, None] = LRU(MAX_PROMPT_ENDS)
        # anchor key -> the tail lengths (blocks) of the prompts anchored there
        self._end_anchors: dict[int, tuple[int, ...]] = {}
        # The anchors, least recently marked first (a dict deleted from its front
        # costs each later `next(iter())` a scan over the deleted slots).
        self._anchor_order: LRU[int, None] = LRU(UNBOUNDED)
        self._log_once = LogOnce(log)

    # -- lifecycle -------------------------------------------------------------------

    async def run(self) -> None:
        """Follow every endpoint's KV events, load the tokenizers (the configured
        ones now, per-model Hub ones when first asked for) and keep the index swept,
        until cancelled."""
        tokenizers = self.tokenizers
        tasks = [
            asyncio.create_task(self.subscriber.run(), name=f"{self.name}: kv-events"),
            asyncio.create_task(self.precise.run_sweeper(), name=f"{self.name}: sweeper"),
            asyncio.create_task(tokenizers.load(), name=f"{self.name}: tokenizers"),
            asyncio.create_task(
                tokenizers.fetch_on_demand(), name=f"{self.name}: per-model tokenizers"
            ),
        ]
        try:
            # The tokenizer loaders end once all are loaded (the per-model one at
            # once without `huggingFace: "*"`); the others run on.
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            self.tokenizers.close()

    def endpoints_changed(self, added: Sequence[Endpoint], removed: Sequence[Endpoint]) -> None:
        """Endpoints to follow joined (or changed) and left the pool, for a service
        built with `follow_datastore=False`: a removed endpoint's KV-event streams
        stop and its index entries go at once."""
        self.subscriber.endpoints_changed(added, removed)

    # -- the write side, for tests and simulations -------------------------------------

    def feed(self, endpoint: Endpoint, batch: EventBatch, rank: int = 0) -> StreamIndex:
        """Apply a decoded KV-event batch of `endpoint` (DP rank `rank`) as the
        subscriber would, without a socket: the ingestion is the real one."""
        for stream in self.precise.streams(endpoint):
            if stream.rank == rank:
                break
        else:
            stream = self.precise.add_stream(endpoint, rank)
        stream.apply(batch)
        return stream

    # -- the read side -------------------------------------------------------------------

    async def lookup_request(
        self, request: InferenceRequest, endpoints: Sequence[Endpoint]
    ) -> PromptMatch | NoLookup | None:
        """Tokenize the request's prompt as the engine will and look it up for
        `endpoints`; None for a request without a prompt."""
        if request.prompt is None:
            return None
        model = request.target_model or request.model
        adapter = self.tokenizers.adapter(model)
        context = HashContext(
            cache_salt=request.cache_salt,
            lora_name=adapter.name if adapter is not None else None,
        )
        try:
            data = token_id_prompt(request)
            if data is None:
                # Only now: resolving may queue a per-model Hub fetch, which a prompt
                # of token ids does not need.
                resolution = self.tokenizers.resolve(model)
                tokenizer = resolution.tokenizer
                if tokenizer is None:
                    reason = resolution.reason or "no-tokenizer"
                    return self._skip(
                        _TOKENIZER_REASONS.get(reason, "no_tokenizer"),
                        model,
                        _NO_TOKENIZER.get(
                            reason,
                            f"its tokenizer is {reason} (see the tokenizers in /debug/endpoints)",
                        ),
                    )
                data = await prompt_tokens(request, tokenizer, self.tokenizers.executor)
        except Unsupported as exc:
            return self._skip(exc.reason, model, str(exc))
        return self.lookup(data, context, endpoints)

    def lookup(
        self, data: bytes, context: HashContext, endpoints: Sequence[Endpoint]
    ) -> PromptMatch:
        """Walk the prompt's token bytes over the index for `endpoints` (synchronous:
        the index cannot change during the walk)."""
        precise = self.precise
        slots: dict[Endpoint, tuple[int, ...]] = {}
        candidates = 0
        for endpoint in endpoints:
            streams = precise.streams(endpoint)
            if streams and precise.trusted(endpoint):
                owned = tuple(s.slot for s in streams)
                slots[endpoint] = owned
                for slot in owned:
                    candidates |= 1 << slot
        block_bytes = self.keys.block_bytes
        prompt_blocks = len(data) // block_bytes
        considered = prompt_blocks
        if self.max_blocks and prompt_blocks > self.max_blocks:
            # Only the first blocks count, for the match and for the score's
            # denominator alike: a pod holding all of them scores 1.
            considered = self.max_blocks
            data = data[: considered * block_bytes]
        blocks = self.keys.prompt(data, context)
        match = longest_prefix(precise.index, blocks, candidates, self.speculative)
        stats = self.stats
        stats.lookups += 1
        stats.request_blocks += match.n_blocks
        best = max(match.blocks.values(), default=0)
        stats.matched_blocks += best
        stats.speculative_extensions += match.speculative_hits
        if best:
            stats.hits += 1
        return PromptMatch(match, blocks, slots, prompt_blocks, considered)

    def record_pick(self, found: PromptMatch, holders: Sequence[Endpoint]) -> None:
        """The request went to `holders[0]` (and its prompt's KV was computed on the
        others: a disaggregated pick's prefill endpoint; `SchedulingResult.kv_holders`):
        with speculative indexing, its prompt's blocks count as held on each until the
        engines' own events arrive; one pick in `alignmentSampleEvery` is a
        tokenization probe (`alignment`) of the primary."""
        if not holders:
            return
        speculative = self.speculative
        match = found.match
        checker = self.precise.checker
        if checker is not None and match.n_blocks and checker.wants_probe():
            self._probe(found, holders[0])
        self._mark_end(found)
        if speculative is None or not match.n_blocks:
            return
        streams = [s for holder in holders for s in self.precise.streams(holder)]
        if not streams:
            return
        stop = match.stop
        keys = match.keys
        anchor = keys[stop] if stop < match.n_blocks and stop < len(keys) else None
        bb = found.blocks.block_bytes
        speculative.record(
            [s.slot for s in streams],
            keys[:stop],
            anchor,
            found.blocks.data,
            stop * bb,
            match.n_blocks * bb,
        )

    def continues(self, found: PromptMatch) -> bool:
        """Whether the prompt is an earlier routed prompt plus more (a conversation's
        next turn, an agent's next step), held by some candidate through that
        prompt's end. The engines cache the answers too, so the match runs on past
        where the earlier prompt ended; another conversation over the same system
        prompt shares only blocks that end no routed prompt."""
        ends = self._prompt_ends
        deepest = max(found.match.blocks.values(), default=0)
        if not ends or not deepest:
            return False
        anchors = self._end_anchors
        data = found.blocks.data
        bb = found.blocks.block_bytes
        for i, key in enumerate(found.match.keys[:deepest]):
            tails = anchors.get(key)
            if not tails:
                continue
            start = (i + 1) * bb
            for tail in tails:
                if i + 1 + tail <= deepest and (
                    xxh3_64_intdigest(data[start : start + tail * bb], seed=key) in ends
                ):
                    return True
        return False

    def _mark_end(self, found: PromptMatch) -> None:
        """Remember where the routed prompt ended, without hashing its blocks: the
        last key the lookup computed (the anchor) and a digest of the prompt's
        full blocks after it. A later prompt that passes through the anchor and
        has the same bytes after it continues this one. Not when the cap cut the
        prompt (its end is not known here)."""
        keys = found.match.keys
        if not keys or found.considered_blocks < found.prompt_blocks:
            return
        anchor = min(found.match.stop, len(keys) - 1)  # where a later walk computes keys
        tail = found.considered_blocks - 1 - anchor
        bb = found.blocks.block_bytes
        start = (anchor + 1) * bb
        end = xxh3_64_intdigest(found.blocks.data[start : start + tail * bb], seed=keys[anchor])
        self._prompt_ends[end] = None  # the oldest goes past MAX_PROMPT_ENDS
        # Conversations over one system prompt share its anchor: a few tail lengths
        # are kept per anchor, the most recent.
        anchors = self._end_anchors
        tails = anchors.get(keys[anchor], ())
        anchors[keys[anchor]] = (tail, *(t for t in tails if t != tail))[:MAX_TAILS_PER_ANCHOR]
        order = self._anchor_order
        order[keys[anchor]] = None
        if len(order) > MAX_PROMPT_ENDS:
            del anchors[pop_least_recent(order)]

    def _probe(self, found: PromptMatch, endpoint: Endpoint) -> None:
        """Expect the key of the prompt's probe block in `endpoint`'s events."""
        probe = min(found.match.n_blocks, PROBE_BLOCKS) - 1
        blocks = found.blocks
        while len(blocks.keys) <= probe:
            blocks.next_key()  # at most PROBE_BLOCKS keys, usually none
        held = found.matched_blocks(endpoint) > probe
        self.precise.expect(endpoint, blocks.keys[probe], held)

    def _skip(self, reason: str, model: str, detail: str) -> NoLookup:
        skipped = self.stats.skipped
        skipped[reason] = skipped.get(reason, 0) + 1
        self._log_once(
            (reason, model),
            logging.WARNING,
            "%s: requests for model %r get no precise prefix score: %s",
            self.name,
            model,
            detail,
        )
        return NoLookup(reason, detail)

    # -- observability --------------------------------------------------------------------

    def collector(self) -> Collector:
        return PrecisePrefixCollector(self)

    def describe_endpoint(self, endpoint: Endpoint) -> dict[str, Any]:
        """The endpoint's `index` entry in /debug/endpoints (empty without events)."""
        subscription = self.subscriber.describe(endpoint)
        if subscription is None:
            return {}
        index = self.precise.describe(endpoint)
        info: dict[str, Any] = {
            "blocks": index.pop("blocks"),
            "lastSeq": subscription.pop("lastSeq"),
            "eventsApplied": index.pop("eventsApplied"),
            "gaps": subscription.pop("gaps"),
            "replays": subscription.pop("replays"),
        }
        info.update(index)
        info.update(subscription)
        if not self.external_tokens:  # else the token producer says how its tokenizer is
            info["tokenizers"] = self.tokenizers.describe()
        return {"index": info}
