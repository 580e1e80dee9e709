"""`precise-prefix-cache-scorer`: route to the pod that really holds the longest
cached prefix of the prompt, as the engines report it in their KV events.

One plugin, three extension points (llm-d's precise prefix-cache scorer):

- **DataProducer** (`prepare`, async): tokenize the prompt as the engine will
  (chat template, tokenizer; off the event loop when long), then walk its blocks
  over the index, hashing each block with the engine's own algorithm only as far
  as some candidate still holds the prefix;
- **Scorer**: matched consecutive prefix blocks / the prompt's full blocks (at
  most `maxPrefixBlocksToMatch`: only a long prompt's first blocks count, as
  /debug/explain's `notes` say), weighted by medium (GPU 1.0, CPU 0.8 by
  default), in [0, 1]. A pod whose KV
  events failed the alignment self-check scores 0 (not trusted), as do pods
  without KV events, and every pod when the prompt cannot be hashed (no tokenizer,
  images, a LoRA adapter whose path is unknown under vLLM >= 0.31);
- **PreRequest** (`speculativeIndexing`): the chosen pod is recorded as holding
  the prompt's blocks for `speculativeTTL`, so a burst of siblings sticks together
  before the engine's events arrive.

Beside the request path it runs the KV-event subscriber (one ZMQ SUB per endpoint
and DP rank, with replay), the tokenizer loading, and the index sweeper. See
docs/precise-prefix.md for the parameters and what is and is not possible.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from epp.datastore import Endpoint
from epp.durations import Duration, parse_duration
from epp.kvindex.alignment import AlignmentChecker
from epp.kvindex.hashing import (
    DEFAULT_HASH_SEED,
    DEFAULT_MEMO_BLOCKS,
    EngineHasher,
    HashContext,
    PromptBlocks,
)
from epp.kvindex.index import PrefixIndex
from epp.kvindex.ingest import PreciseIndex
from epp.kvindex.lookup import PrefixMatch, longest_prefix
from epp.kvindex.speculative import SpeculativeIndex
from epp.logs import LogOnce
from epp.scheduling import (
    CycleState,
    InferenceRequest,
    PluginContext,
    SchedulingResult,
    StateKey,
    explain_note,
)
from epp.sources.kv_events import KVEventSubscriber, SubscriberSettings
from epp.tokenization.models import LoraAdapter, TokenizerRegistry, TokenizerSource
from epp.tokenization.prompts import Unsupported, prompt_tokens, token_id_prompt

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
    reconnect_interval: Duration = "100ms"
    reconnect_interval_max: Duration = "5s"


class TokenizerConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    model: str = "*"  # the request's model this tokenizer is for; "*" = any other
    path: str | None = None  # a directory with tokenizer.json (+ tokenizer_config.json)
    hugging_face: str | None = None  # or a Hub model id, fetched at start-up
    revision: str | None = None


class LoraAdapterConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    name: str
    base_model: str
    path: str | None = None  # the adapter's path as the engine loaded it


class PrecisePrefixParameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    # The engine's --block-size (the hash block size).
    block_size: _Positive = 16
    # The engine's NONE_HASH seed: its PYTHONHASHSEED, or vLLM's default.
    hash_seed: str = DEFAULT_HASH_SEED
    # The engine's --prefix-caching-hash-algo.
    hash_algo: Literal["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"] = "sha256"
    # cache_salt / LoRA in the hashes: "tagged" = vLLM >= 0.31, "plain" = 0.12 - 0.30.
    extra_keys_format: Literal["tagged", "plain"] = "tagged"
    kv_events_config: KVEventsConfig = msgspec.field(default_factory=KVEventsConfig)
    speculative_indexing: bool = False
    speculative_ttl: Duration = msgspec.field(default="2s", name="speculativeTTL")
    tokenizers: list[TokenizerConfig] = []
    tokenizers_cache_dir: str | None = None
    hugging_face_offline: bool = False
    lora_adapters: list[LoraAdapterConfig] = []
    # "error": a configured tokenizer directory that does not exist stops the start;
    # "fallback": its model gets no precise score (logged, and in /debug/endpoints).
    on_missing_tokenizer: Literal["error", "fallback"] = "error"
    # Bound of the index in (block, endpoint) entries; about 100 bytes each.
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
    # Recent blocks whose hash is remembered (a repeated prefix costs a lookup).
    hash_cache_blocks: _Positive = DEFAULT_MEMO_BLOCKS
    # Only a prompt's first blocks are hashed and matched (GIE's names): bounds the
    # work a very long prompt costs at pick time. 8192 blocks of 16 tokens are
    # 131,072 tokens. maxPrefixTokensToMatch, when set, wins (as tokens // blockSize
    # blocks, at least one). 0: no cap.
    max_prefix_blocks_to_match: Annotated[int, msgspec.Meta(ge=0)] = 8192
    max_prefix_tokens_to_match: Annotated[int, msgspec.Meta(ge=0)] = 0


_PREPARED: StateKey[_Prepared] = StateKey("precise-prefix-cache-scorer")
_SKIP_REASONS = {
    "no-tokenizer": "no_tokenizer",
    "loading": "tokenizer_loading",
    "failed": "tokenizer_failed",
}


@dataclass(slots=True)
class _Prepared:
    match: PrefixMatch
    blocks: PromptBlocks
    # endpoint -> the slots its score is read from (as at the walk)
    slots: dict[Endpoint, tuple[int, ...]]


@dataclass
class LookupStats:
    lookups: int = 0
    hits: int = 0  # some candidate held at least the first block
    request_blocks: int = 0
    matched_blocks: int = 0  # of the best candidate
    speculative_extensions: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> lookups not done


class PrecisePrefixCacheScorer:
    Parameters = PrecisePrefixParameters

    def __init__(self, params: PrecisePrefixParameters, context: PluginContext) -> None:
        self.name = context.name
        self.params = params
        weights = {k.lower(): v for k, v in params.medium_weights.items()}
        if not weights or any(not 0 < w <= 1 for w in weights.values()):
            raise ValueError("mediumWeights: every weight must be in (0, 1]")
        for tokenizer in params.tokenizers:
            if (tokenizer.path is None) == (tokenizer.hugging_face is None):
                raise ValueError(
                    f"tokenizers: model {tokenizer.model!r} needs exactly one of path and"
                    " huggingFace"
                )
        events = params.kv_events_config
        self.hasher = EngineHasher(
            params.hash_algo,
            params.hash_seed,
            params.block_size,
            params.extra_keys_format,
            memo_blocks=params.hash_cache_blocks,
        )
        lora_paths = {a.name: a.path for a in params.lora_adapters if a.path is not None}
        self.speculative = (
            SpeculativeIndex(parse_duration(params.speculative_ttl))
            if params.speculative_indexing
            else None
        )
        self.precise = PreciseIndex(
            PrefixIndex(params.max_index_entries, weights),
            self.hasher,
            AlignmentChecker(self.hasher, lora_paths, sample_every=params.alignment_sample_every)
            if params.alignment_check
            else None,
            self.speculative,
        )
        self.subscriber = KVEventSubscriber(
            context.datastore,
            self.precise,
            SubscriberSettings(
                topic=events.topic_filter,
                replay=events.replay,
                dp_size=events.dp_size,
                port=events.socket_port,
                replay_port=events.replay_port,
                replay_timeout_s=parse_duration(events.replay_timeout),
                reconnect_interval_s=parse_duration(events.reconnect_interval),
                reconnect_interval_max_s=parse_duration(events.reconnect_interval_max),
            ),
        )
        self.tokenizers = TokenizerRegistry(
            [
                TokenizerSource(t.model, t.path, t.hugging_face, t.revision)
                for t in params.tokenizers
            ],
            [LoraAdapter(a.name, a.base_model, a.path) for a in params.lora_adapters],
            cache_dir=params.tokenizers_cache_dir,
            offline=params.hugging_face_offline,
            workers=params.tokenizer_workers,
            tokenizer_options={
                "cache_bytes": params.tokenizer_cache_bytes,
                "inline_chars": params.inline_tokenize_chars,
            },
        )
        missing = self.tokenizers.missing_directories()
        if missing and params.on_missing_tokenizer == "error":
            raise ValueError(
                "tokenizers: " + "; ".join(missing) + " (onMissingTokenizer: fallback routes"
                " those models without a precise score instead)"
            )
        for problem in missing:
            log.warning("%s: %s; its requests get no precise prefix score", self.name, problem)
        if not params.tokenizers:
            log.warning(
                "%s: no tokenizers configured: only prompts sent as token ids get a precise"
                " prefix score",
                self.name,
            )
        if params.max_prefix_tokens_to_match > 0:
            self.max_blocks = max(1, params.max_prefix_tokens_to_match // params.block_size)
        else:
            self.max_blocks = params.max_prefix_blocks_to_match
        self.stats = LookupStats()
        self._log_once = LogOnce(log)
        # Started by the server once the whole configuration is valid; never here.
        context.background.run(f"{self.name}: kv-events", self.subscriber.run)
        context.background.run(f"{self.name}: tokenizers", self._load_tokenizers)
        context.background.describe_endpoints(self.describe_endpoint)
        context.metrics.register(_Metrics(self))

    async def _load_tokenizers(self) -> None:
        try:
            await self.tokenizers.load()
            # Stay until shutdown, which closes the tokenizer threads.
            await asyncio.Event().wait()
        finally:
            self.tokenizers.close()

    # -- DataProducer ------------------------------------------------------------------

    def _skip(self, reason: str, model: str, detail: str = "") -> None:
        skipped = self.stats.skipped
        skipped[reason] = skipped.get(reason, 0) + 1
        self._log_once(
            (reason, model),
            logging.WARNING,
            "%s: requests for model %r get no precise prefix score: %s",
            self.name,
            model,
            detail or reason.replace("_", " "),
        )

    async def prepare(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> None:
        if request.prompt is None:
            return
        model = request.target_model or request.model
        resolution = self.tokenizers.resolve(model)
        adapter = resolution.adapter
        context = HashContext(
            cache_salt=request.cache_salt,
            lora_name=adapter.name if adapter is not None else None,
            lora_path=adapter.path if adapter is not None else None,
        )
        if not context.hashable(self.hasher.extra_keys_format):
            self._skip(
                "lora_path_unknown",
                model,
                "vLLM >= 0.31 hashes a LoRA adapter's path, which KV events do not carry:"
                " give its path in loraAdapters",
            )
            return
        try:
            data = token_id_prompt(request)
            if data is None:
                tokenizer = resolution.tokenizer
                if tokenizer is None:
                    reason = resolution.reason or "no-tokenizer"
                    self._skip(
                        _SKIP_REASONS.get(reason, "no_tokenizer"),
                        model,
                        "no tokenizer is configured for it (add it to tokenizers, or a '*' entry)"
                        if reason == "no-tokenizer"
                        else f"its tokenizer is {reason} (see the tokenizers in /debug/endpoints)",
                    )
                    return
                data = await prompt_tokens(request, tokenizer, self.tokenizers.executor)
        except Unsupported as exc:
            self._skip(exc.reason, model, str(exc))
            return
        self.lookup(data, context, endpoints, cycle)

    def lookup(
        self,
        data: bytes,
        context: HashContext,
        endpoints: Sequence[Endpoint],
        cycle: CycleState,
    ) -> PrefixMatch:
        """Walk the prompt's blocks over the index for `endpoints` (synchronous:
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
        block_bytes = self.hasher.block_bytes
        prompt_blocks = len(data) // block_bytes
        considered = prompt_blocks
        if self.max_blocks and prompt_blocks > self.max_blocks:
            # Only the first blocks count, for the match and for the score's
            # denominator alike: a pod holding all of them scores 1.
            considered = self.max_blocks
            data = data[: considered * block_bytes]
        explain_note(
            cycle,
            self.name,
            {
                "promptBlocks": prompt_blocks,
                "consideredBlocks": considered,
                "truncated": considered < prompt_blocks,
                "maxPrefixBlocksToMatch": self.max_blocks,
            },
        )
        blocks = self.hasher.prompt(data, context)
        match = longest_prefix(precise.index, blocks, candidates, self.speculative)
        stats = self.stats
        stats.lookups += 1
        stats.request_blocks += match.n_blocks
        best = max(match.blocks.values(), default=0)
        stats.matched_blocks += best
        stats.speculative_extensions += match.speculative_hits
        if best:
            stats.hits += 1
        cycle.put(_PREPARED, _Prepared(match, blocks, slots))
        return match

    # -- Scorer ---------------------------------------------------------------------------

    def score(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Mapping[Endpoint, float]:
        prepared = cycle.get(_PREPARED)
        if prepared is None:
            return dict.fromkeys(endpoints, 0.0)
        match = prepared.match
        scores = {}
        for endpoint in endpoints:
            owned = prepared.slots.get(endpoint)
            scores[endpoint] = max((match.score(s) for s in owned), default=0.0) if owned else 0.0
        return scores

    # -- PreRequest -----------------------------------------------------------------------

    def pre_request(
        self, request: InferenceRequest, cycle: CycleState, result: SchedulingResult
    ) -> None:
        speculative = self.speculative
        prepared = cycle.get(_PREPARED)
        if speculative is None or prepared is None or not result.targets:
            return
        match = prepared.match
        if not match.n_blocks:
            return
        streams = self.precise.streams(result.targets[0])
        if not streams:
            return
        stop = match.stop
        keys = match.keys
        anchor = keys[stop] if stop < match.n_blocks and stop < len(keys) else None
        bb = prepared.blocks.block_bytes
        speculative.record(
            [s.slot for s in streams],
            keys[:stop],
            anchor,
            prepared.blocks.data,
            stop * bb,
            match.n_blocks * bb,
        )

    # -- observability --------------------------------------------------------------------

    def describe_endpoint(self, endpoint: Endpoint) -> dict[str, Any]:
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
        info["tokenizers"] = self.tokenizers.describe()
        return {"index": info}


class _Metrics(Collector):
    """The plugin's Prometheus metrics, read from its plain counters at scrape
    time: nothing on the ingestion or pick path touches a Prometheus object."""

    def __init__(self, plugin: PrecisePrefixCacheScorer) -> None:
        self.plugin = plugin

    def collect(self) -> Iterator[Metric]:
        plugin = self.plugin
        precise = plugin.precise
        index = precise.index
        yield _gauge(
            "epp_kv_index_entries",
            "Live (block, endpoint) entries in the prefix index.",
            index.stats.entries,
        )
        yield _gauge(
            "epp_kv_index_max_entries",
            "The prefix index's bound (maxIndexEntries).",
            index.max_entries,
        )
        yield _counter(
            "epp_kv_index_evicted_entries",
            "Entries evicted to stay within maxIndexEntries (events lost, or a bound too small).",
            index.stats.evicted_entries,
        )
        blocks = GaugeMetricFamily(
            "epp_kv_index_blocks", "Blocks each endpoint holds per medium, as its KV events say.",
            labels=["endpoint", "medium"],
        )  # fmt: skip
        families: dict[str, CounterMetricFamily] = {
            "events": CounterMetricFamily(
                "epp_kv_events_applied", "KV events applied to the index.", labels=["endpoint"]
            ),
            "batches": CounterMetricFamily(
                "epp_kv_event_batches", "KV-event batches received.", labels=["endpoint"]
            ),
            "blocks": CounterMetricFamily(
                "epp_kv_blocks_applied",
                "Blocks stored or removed by applied KV events.",
                labels=["endpoint", "op"],
            ),
            "gaps": CounterMetricFamily(
                "epp_kv_event_gaps", "Sequence gaps in a KV-event stream.", labels=["endpoint"]
            ),
            "replays": CounterMetricFamily(
                "epp_kv_event_replays",
                "Replay requests by outcome (requested, failed, partial: the buffer no longer"
                " reached back far enough).",
                labels=["endpoint", "result"],
            ),
            "resets": CounterMetricFamily(
                "epp_kv_index_resets",
                "Times an endpoint's entries were cleared, by reason (restart, gap,"
                " all_blocks_cleared).",
                labels=["endpoint", "reason"],
            ),
            "rejected": CounterMetricFamily(
                "epp_kv_events_rejected",
                "KV-event messages or events rejected as malformed, by reason.",
                labels=["endpoint", "reason"],
            ),
            "ignored": CounterMetricFamily(
                "epp_kv_events_ignored",
                "Well-formed KV events skipped on purpose, by reason.",
                labels=["endpoint", "reason"],
            ),
            "alignment": CounterMetricFamily(
                "epp_kv_alignment_failures",
                "KV events whose block hashes disagreed with the scorer's own computation.",
                labels=["endpoint"],
            ),
            "checked": CounterMetricFamily(
                "epp_kv_alignment_checked_blocks",
                "Blocks re-hashed by the alignment self-check.",
                labels=["endpoint"],
            ),
        }
        trusted = GaugeMetricFamily(
            "epp_kv_index_trusted",
            "1 if the endpoint's precise prefix score is trusted (alignment check passed or"
            " not yet possible), 0 if its hashes disagree.",
            labels=["endpoint"],
        )
        connected = GaugeMetricFamily(
            "epp_kv_event_stream_live",
            "1 if the endpoint's KV-event stream is connected (live or replaying).",
            labels=["endpoint"],
        )
        for endpoint, streams in plugin.subscriber.streams.items():
            name = endpoint.name
            by_medium: dict[str, int] = {}
            sinks = precise.streams(endpoint)
            for sink in sinks:
                for medium, count in index.slot_blocks(sink.slot).items():
                    by_medium[medium] = by_medium.get(medium, 0) + count
            for medium, count in by_medium.items():
                blocks.add_metric([name, medium], count)
            families["events"].add_metric([name], sum(s.counters.events_applied for s in sinks))
            families["batches"].add_metric([name], sum(s.counters.batches for s in sinks))
            families["blocks"].add_metric(
                [name, "stored"], sum(s.counters.blocks_stored for s in sinks)
            )
            families["blocks"].add_metric(
                [name, "removed"], sum(s.counters.blocks_removed for s in sinks)
            )
            statuses = [stream.status for stream, _ in streams]
            families["gaps"].add_metric([name], sum(s.gaps for s in statuses))
            families["replays"].add_metric([name, "requested"], sum(s.replays for s in statuses))
            families["replays"].add_metric(
                [name, "failed"], sum(s.replay_failures for s in statuses)
            )
            families["replays"].add_metric(
                [name, "partial"], sum(s.partial_replays for s in statuses)
            )
            for label, key in (
                ("resets", "clears"),
                ("rejected", "rejected"),
                ("ignored", "ignored"),
            ):
                merged: dict[str, int] = {}
                for sink in sinks:
                    for reason, count in getattr(sink.counters, key).items():
                        merged[reason] = merged.get(reason, 0) + count
                for reason, count in merged.items():
                    families[label].add_metric([name, reason], count)
            families["alignment"].add_metric([name], sum(s.alignment.mismatches for s in sinks))
            families["checked"].add_metric([name], sum(s.alignment.checked_blocks for s in sinks))
            trusted.add_metric([name], 1.0 if precise.trusted(endpoint) else 0.0)
            connected.add_metric(
                [name],
                1.0 if all(s.state.value in ("live", "replaying") for s in statuses) else 0.0,
            )
        yield blocks
        yield from families.values()
        yield trusted
        yield connected
        stats = plugin.stats
        lookups = CounterMetricFamily(
            "epp_precise_prefix_lookups",
            "Prompts looked up in the index: hit (some candidate holds at least its first"
            " block) or miss.",
            labels=["result"],
        )
        lookups.add_metric(["hit"], stats.hits)
        lookups.add_metric(["miss"], stats.lookups - stats.hits)
        yield lookups
        skipped = CounterMetricFamily(
            "epp_precise_prefix_skipped",
            "Requests scored without the index, by reason (no tokenizer, multimodal, ...).",
            labels=["reason"],
        )
        for reason, count in stats.skipped.items():
            skipped.add_metric([reason], count)
        yield skipped
        yield _counter(
            "epp_precise_prefix_request_blocks",
            "Full blocks of the prompts looked up.",
            stats.request_blocks,
        )
        yield _counter(
            "epp_precise_prefix_matched_blocks",
            "Prefix blocks the best candidate held, summed over lookups.",
            stats.matched_blocks,
        )
        yield _counter(
            "epp_precise_prefix_hashed_blocks",
            "Blocks hashed for lookups (the rest came from the hash cache).",
            plugin.hasher.computed,
        )
        if plugin.speculative is not None:
            yield _counter(
                "epp_precise_prefix_speculative_extensions",
                "Lookups where a speculative anchor extended a pod's match.",
                stats.speculative_extensions,
            )
            yield _counter(
                "epp_precise_prefix_speculative_records",
                "Picks recorded as speculative index entries.",
                plugin.speculative.stats.recorded,
            )
            yield _gauge(
                "epp_precise_prefix_speculative_entries",
                "Live speculative entries (block keys and anchors).",
                plugin.speculative.stats.entries,
            )


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation)
    family.add_metric([], value)
    return family


def _counter(name: str, documentation: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation)
    family.add_metric([], value)
    return family
