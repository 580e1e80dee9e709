"""`approx-prefix-cache-producer`: which endpoint this EPP recently sent the longest
prefix of the prompt to (llm-d's approximate prefix-cache producer), for pools
whose engines publish no KV events.

A DataProducer and a PreRequest hook. For each request it leaves a
`PrefixMatchInfo` under its name (`prefix_match_key`): the prompt's blocks and how
many leading ones each candidate holds in its index. `prefix-cache-scorer` reads it
with `prefixMatchInfoProducerName: <this plugin's name>`. At the pick, the chosen
endpoint is recorded as holding every block of the prompt: the index learns from
this EPP's own decisions (epp/approxindex.py), and a replica knows its own traffic
only.

Parameters (llm-d's names and defaults):
- `blockSizeTokens` (16): tokens per block; text is cut every
  `blockSizeTokens * charsPerToken` characters (`charsPerToken`, this EPP's, 4.0),
  token-id prompts every `blockSizeTokens` ids. As in llm-d, a block is never
  smaller than 64 tokens when the request is looked up (a smaller value is raised,
  with a warning at start).
- `maxPrefixTokensToMatch` (131072; 0: use `maxPrefixBlocksToMatch`): how much of
  a prompt is hashed and matched, as `tokens // blockSize` blocks;
  `maxPrefixBlocksToMatch` (2048, deprecated in llm-d; both 0: no cap).
- `lruCapacityPerServer` (31250): blocks remembered per endpoint.
- `autoTune` (true): the pool's own KV block size (`vllm:cache_config_info`), and
  as an endpoint's capacity its `num_gpu_blocks` (llm-d's count), where the
  metrics report them, but never less than the endpoint's KV cache counted in
  this index's blocks: the tokens the cache holds over the tokens of one block,
  for text the tokens a block's characters really are, as the engines' own prompt
  token counts (`usage.prompt_tokens` of completed responses) show against the
  prompts' characters. `num_gpu_blocks` of a block of 16 text tokens at
  `charsPerToken` 4 is less than the cache where the text has more characters
  per token (the lab's: about 7): that index forgot prompts its pods still held,
  a prefix group lost its pod, and with small caches the pods thrashed
  (docs/routing-evidence.md, The index's capacity). Counting the cache exactly, without
  llm-d's count as the floor, was measured and not kept: it forgets a group's
  pod as soon as the pod may have evicted it, which cost hits on small caches.
- `blockSize` (deprecated in llm-d): taken as `blockSizeTokens` when that is left at
  its default.
- `cacheWindow` (false; this EPP's; the default profile sets it): the match it leaves counts on
  each endpoint only the blocks recorded there within its KV cache's worth of the
  latest (with autoTune; else `lruCapacityPerServer`), what the pod can still
  hold, so a prediction is not made for a hit the engine has evicted; the whole
  remembered match, the pod a prompt group was sent to, is left beside it
  (`PrefixMatchInfo.remembered`), which `predicted-ttft-scorer`'s tie rank reads
  (docs/routing-evidence.md, The index's capacity).

The match also says how many of the recent requests wanted the prefix it ends on
(`PrefixMatchInfo.demand`: the share of the last few hundred picks whose longest
match ended on the same block), which `predicted-ttft-scorer`'s
`hotPrefixQueueWeight` reads.

`prefix-cache-scorer` without a producer name keeps an index of its own, with
GIE's parameters (plugins/prefix_cache_scorer.py); both use `ApproxPrefixMatcher`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Annotated, Final

import msgspec
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from epp.approxindex import (
    DEFAULT_CHARS_PER_TOKEN,
    ApproxPrefixIndex,
    PrefixDemand,
    PromptBlocks,
    prompt_blocks,
)
from epp.datastore import CACHE_INFO, Endpoint
from epp.promutil import shared
from epp.requests import InferenceRequest
from epp.scheduling import (
    METRICS,
    CycleState,
    PluginContext,
    PrefixMatchInfo,
    ResponseInfo,
    SchedulingResult,
    StateKey,
    explain_note,
    prefix_match_key,
)

log = logging.getLogger(__name__)

_RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)
# llm-d raises a smaller block size to this at lookup time (short blocks made hot
# spots of short prompts).
LLMD_MIN_BLOCK_SIZE_TOKENS: Final = 64
LLMD_DEFAULT_BLOCK_SIZE_TOKENS: Final = 16
# The weight of a prompt's characters-to-tokens observation decays by this per
# later one (a memory of about 200 responses): a pool's prompts change language or
# template slowly, if at all.
TEXT_MEMORY: Final = 0.995


class ApproxPrefixMatcher:
    """An approximate prefix index and how it is read and taught: the machinery of
    `approx-prefix-cache-producer` and of `prefix-cache-scorer`'s own index."""

    def __init__(
        self,
        context: PluginContext,
        *,
        auto_tune: bool,
        block_size_tokens: int,
        max_blocks: int,
        max_tokens: int,
        capacity: int,
        chars_per_token: float,
        min_block_size_tokens: int = 1,
        cache_window: bool = False,
    ) -> None:
        self.name = context.name
        self.clock = context.clock
        self.auto_tune = auto_tune
        self.block_size_tokens = block_size_tokens
        self.min_block_size_tokens = min_block_size_tokens
        self.max_blocks = max_blocks
        self.max_tokens = max_tokens
        self.capacity = capacity
        self.chars_per_token = chars_per_token
        self.cache_window = cache_window
        self.index = ApproxPrefixIndex()
        self.demand = PrefixDemand()
        # The block the request's longest match ends on: counted at the pick.
        self._demand_key: StateKey[int] = StateKey(f"approx-prefix-demand/{context.name}")
        # Prompt characters and the tokens the engines counted for them, each
        # observation's weight decaying by TEXT_MEMORY per later one: what a block of
        # text really holds in tokens (`tokens_per_char`).
        self._text_chars = 0.0
        self._text_tokens = 0.0
        self.key = prefix_match_key(context.name)
        # The prompt's blocks, hashed as far as the match went: the pick records
        # them without hashing again.
        self._blocks: StateKey[PromptBlocks] = StateKey(f"approx-prefix-blocks/{context.name}")
        # Building a plugin starts no I/O; listening to the datastore is not I/O
        # (during `epp validate` it is a throwaway datastore).
        context.datastore.add_listener(self._membership)
        registry = context.metrics
        label = context.name
        shared(registry, "epp_approx_prefix_index_blocks", lambda: _IndexCollector(registry)).add(
            label, self.index
        )
        self._evictions = shared(
            registry,
            "epp_approx_prefix_index_evictions",
            lambda: Counter(
                "epp_approx_prefix_index_evictions",
                "Blocks the approximate prefix index forgot to stay within an endpoint's"
                " capacity (lruCapacityPerServer, or num_gpu_blocks with autoTune).",
                ["plugin"],
                registry=registry,
            ),
        ).labels(label)
        self._ratio = shared(
            registry,
            "epp_approx_prefix_match_ratio",
            lambda: Histogram(
                "epp_approx_prefix_match_ratio",
                "Share of the prompt's blocks the chosen endpoint held in the approximate"
                " prefix index, per routed request.",
                ["plugin"],
                buckets=_RATIO_BUCKETS,
                registry=registry,
            ),
        ).labels(label)

    def _membership(self, added: list[Endpoint], removed: list[Endpoint]) -> None:
        for endpoint in removed:
            self.index.remove(endpoint)

    def describe_endpoint(self, endpoint: Endpoint) -> Mapping[str, object]:
        return {
            "approxPrefixIndex": {
                "blocks": self.index.blocks_of(endpoint),
                "tokensPerChar": round(self.tokens_per_char(), 4),
            }
        }

    def tokens_per_char(self) -> float:
        """Prompt tokens per character of prompt text: as observed (`observe`),
        or `1 / charsPerToken` before any observation."""
        if self._text_chars > 0.0 and self._text_tokens > 0.0:
            return self._text_tokens / self._text_chars
        return 1.0 / self.chars_per_token

    def observe(self, cycle: CycleState, response: ResponseInfo) -> None:
        """A completed response's prompt tokens, as its engine counted them (template
        tokens included), against the characters of the prompt text this request's
        match cut into blocks (kept in `cycle`: the text is not rebuilt)."""
        blocks = cycle.get(self._blocks)
        usage = response.usage
        if not response.completed or usage is None or usage.prompt_tokens <= 0:
            return
        if blocks is None or not blocks.is_text or blocks.units == 0:
            return  # token ids are exact; nothing to learn
        self._text_chars = self._text_chars * TEXT_MEMORY + blocks.units
        self._text_tokens = self._text_tokens * TEXT_MEMORY + usage.prompt_tokens

    def cache_blocks_of(self, endpoint: Endpoint, blocks: PromptBlocks, now: float) -> int | None:
        """How many of this index's blocks `endpoint`'s KV cache holds (its tokens
        over a block's), or None with autoTune off or before it reports its cache."""
        metrics = endpoint.metrics
        if not (self.auto_tune and metrics.known(CACHE_INFO, now) and metrics.num_gpu_blocks):
            return None
        cache_tokens = metrics.num_gpu_blocks * (metrics.block_size or self.block_size_tokens)
        block_tokens = blocks.step * self.tokens_per_char() if blocks.is_text else blocks.step
        return max(1, int(cache_tokens / block_tokens))

    def block_size(self, endpoints: Sequence[Endpoint], now: float) -> int:
        size = self.block_size_tokens
        if self.auto_tune:
            sizes = {e.metrics.block_size for e in endpoints if e.metrics.known(CACHE_INFO, now)}
            if len(sizes) == 1:
                size = sizes.pop()
        return max(size, self.min_block_size_tokens)

    def match(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> PrefixMatchInfo:
        """The request's match for `endpoints`, left in `cycle` for the pick (computed
        once per request)."""
        found = cycle.get(self.key)
        if found is not None:
            return found
        block_size = self.block_size(endpoints, self.clock())
        max_blocks = self.max_tokens // block_size if self.max_tokens > 0 else self.max_blocks
        if self.max_tokens > 0 and max_blocks == 0:
            max_blocks = 1  # a cap below one block still hashes the first one
        blocks = prompt_blocks(request, block_size, self.chars_per_token, max_blocks)
        if blocks is None:
            info = PrefixMatchInfo(0, block_size, {})
        else:
            explain_note(
                cycle,
                self.name,
                {
                    "promptBlocks": blocks.uncapped,
                    "consideredBlocks": blocks.total,
                    "truncated": blocks.total < blocks.uncapped,
                    "maxPrefixBlocksToMatch": max_blocks,
                    "blockSizeTokens": block_size,
                },
            )
            remembered = self.index.match(blocks, endpoints)
            matched = remembered
            if self.cache_window:
                # What each pod can still hold: the blocks recorded on it within its
                # cache's worth of the latest.
                held = {e: self.index.recent_run(blocks, e, run) for e, run in remembered.items()}
                matched = {e: run for e, run in held.items() if run > 0}
            deepest = max(remembered.values(), default=0)
            key: int | None = None
            if deepest > 0:
                key = blocks.hash(deepest - 1)  # hashed already by the match
                cycle.put(self._demand_key, key)
            info = PrefixMatchInfo(
                blocks.total,
                block_size,
                matched,
                blocks.uncapped,
                continues=self.index.continues(blocks, remembered),
                remembered=remembered if self.cache_window else None,
                demand=self.demand.share(key),
            )
            cycle.put(self._blocks, blocks)
        cycle.put(self.key, info)
        return info

    def record(
        self, request: InferenceRequest, cycle: CycleState, result: SchedulingResult
    ) -> None:
        """The request went to its primary target: its blocks are held there now, and
        on a disaggregated pick's prefill endpoint, which computed them and keeps
        them in its cache (`SchedulingResult.kv_holders`; llm-d's producer records
        the prefill endpoint too)."""
        holders = result.kv_holders
        if not holders:
            return
        chosen = holders[0]
        info = self.match(request, cycle, result.targets)
        blocks = cycle.get(self._blocks)
        if blocks is None or blocks.total == 0:
            return
        now = self.clock()
        before = self.index.evictions
        for holder in holders:
            # llm-d's count (num_gpu_blocks), but never less than the cache itself;
            # the window is the cache (without cache info, the configured capacity).
            cache = self.cache_blocks_of(holder, blocks, now)
            if cache is None:
                capacity = held = self.capacity
            else:
                capacity, held = max(holder.metrics.num_gpu_blocks, cache), cache
            self.index.add(holder, blocks.all(), capacity, held if self.cache_window else None)
        self.index.mark_end(blocks)
        self.demand.add(cycle.get(self._demand_key))
        if self.index.evictions > before:
            self._evictions.inc(self.index.evictions - before)
        self._ratio.observe(info.ratio(chosen))


class ApproxPrefixCacheProducer:
    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        auto_tune: bool = True
        block_size_tokens: Annotated[int, msgspec.Meta(ge=1)] = LLMD_DEFAULT_BLOCK_SIZE_TOKENS
        max_prefix_tokens_to_match: Annotated[int, msgspec.Meta(ge=0)] = 131072
        max_prefix_blocks_to_match: Annotated[int, msgspec.Meta(ge=0)] = 2048
        lru_capacity_per_server: Annotated[int, msgspec.Meta(ge=1)] = 31250
        block_size: Annotated[int, msgspec.Meta(ge=0)] = 0  # deprecated in llm-d
        chars_per_token: Annotated[float, msgspec.Meta(gt=0)] = DEFAULT_CHARS_PER_TOKEN
        cache_window: bool = False

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        block_size = params.block_size_tokens
        if params.block_size > 0 and block_size == LLMD_DEFAULT_BLOCK_SIZE_TOKENS:
            log.warning("%s: blockSize is deprecated: read as blockSizeTokens", context.name)
            block_size = params.block_size
        # llm-d's own default (16) is raised too, as its README says: no warning for
        # a value the user did not choose.
        if block_size < LLMD_MIN_BLOCK_SIZE_TOKENS and block_size != LLMD_DEFAULT_BLOCK_SIZE_TOKENS:
            log.warning(
                "%s: blockSizeTokens %d is raised to %d when requests are looked up (as llm-d"
                " does)",
                context.name,
                block_size,
                LLMD_MIN_BLOCK_SIZE_TOKENS,
            )
        # Auto-tuning reads the pool's KV configuration from the model-server metrics.
        self.consumes = frozenset({METRICS}) if params.auto_tune else frozenset()
        self.matcher = ApproxPrefixMatcher(
            context,
            auto_tune=params.auto_tune,
            block_size_tokens=block_size,
            max_blocks=params.max_prefix_blocks_to_match,
            max_tokens=params.max_prefix_tokens_to_match,
            capacity=params.lru_capacity_per_server,
            chars_per_token=params.chars_per_token,
            min_block_size_tokens=LLMD_MIN_BLOCK_SIZE_TOKENS,
            cache_window=params.cache_window,
        )

    async def prepare(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> None:
        self.matcher.match(request, cycle, endpoints)

    def pre_request(
        self, request: InferenceRequest, cycle: CycleState, result: SchedulingResult
    ) -> None:
        self.matcher.record(request, cycle, result)

    def post_response(
        self,
        request: InferenceRequest,
        cycle: CycleState,
        result: SchedulingResult,
        response: ResponseInfo,
    ) -> None:
        self.matcher.observe(cycle, response)

    def describe_endpoint(self, endpoint: Endpoint) -> Mapping[str, object]:
        return self.matcher.describe_endpoint(endpoint)


class _IndexCollector(Collector):
    """`epp_approx_prefix_index_blocks{plugin}`, read from the indexes at exposition."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._indexes: dict[str, ApproxPrefixIndex] = {}
        registry.register(self)

    def add(self, plugin: str, index: ApproxPrefixIndex) -> None:
        self._indexes[plugin] = index

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("epp_approx_prefix_index_blocks", "", labels=["plugin"])

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "epp_approx_prefix_index_blocks",
            "Entries (endpoint, block) in the approximate prefix index; bounded by the sum"
            " of the endpoints' capacities.",
            labels=["plugin"],
        )
        for plugin, index in self._indexes.items():
            family.add_metric([plugin], index.size)
        yield family
