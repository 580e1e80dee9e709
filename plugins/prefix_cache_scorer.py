"""`prefix-cache-scorer`: prefers the endpoints this EPP recently sent the longest
prefix of the prompt to (GIE's approximate prefix-cache scorer, for pools whose
engines publish no KV events; with KV events use `precise-prefix-cache-scorer`).

The index (epp/approxindex.py) learns from this EPP's own decisions: in
`pre_request`, the chosen endpoint is recorded as holding every block of the
prompt. /debug/explain runs only the scoring, so it changes nothing; a replica only
knows its own traffic.

Formula, with n the prompt's blocks (at most the match cap) and m the number of
leading blocks the endpoint holds in the index:

    score = m / n        (0 for a request without a prompt)

Never stale (it needs no metrics), except that `autoTune` reads the pool's KV
configuration.

Parameters (GIE's names and defaults):
- `blockSizeTokens` (16): tokens per block; text is cut every
  `blockSizeTokens * charsPerToken` characters (`charsPerToken`, this EPP's, 4.0:
  the usual average for English text), token-id prompts every `blockSizeTokens` ids.
- `maxPrefixBlocksToMatch` (256; 0: no cap) and `maxPrefixTokensToMatch` (0: unused;
  when set it wins, as `tokens // blockSizeTokens` blocks): how much of a prompt is
  hashed and matched. /debug/explain's `notes.<plugin>` says how many blocks a
  prompt had and how many were considered.
- `lruCapacityPerServer` (31250): blocks remembered per endpoint, the least recently
  used forgotten first. The index's memory bound: one entry per (endpoint, block).
- `autoTune` (true): use the pool's own KV block size (`vllm:cache_config_info`,
  when every candidate reporting it agrees) instead of `blockSizeTokens`, and an
  endpoint's `num_gpu_blocks` as its capacity instead of `lruCapacityPerServer`.
- `blockSize` (GIE's old block size in characters) is refused with a pointer to
  `blockSizeTokens`.

Metrics: `epp_approx_prefix_index_blocks{plugin}` (entries in the index),
`epp_approx_prefix_index_evictions_total{plugin}`, `epp_approx_prefix_match_ratio{plugin}`
(the chosen endpoint's score, per routed request). /debug/endpoints shows each
endpoint's `approxPrefixIndex.blocks`.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated

import msgspec
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from epp.approxindex import DEFAULT_CHARS_PER_TOKEN, ApproxPrefixIndex, PromptBlocks, prompt_blocks
from epp.datastore import CACHE_INFO, Endpoint
from epp.promutil import shared
from epp.requests import InferenceRequest
from epp.scheduling import (
    METRICS,
    CycleState,
    PluginContext,
    SchedulingResult,
    StateKey,
    explain_note,
)

_RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0)


@dataclass
class _Lookup:
    blocks: PromptBlocks | None
    matched: dict[Endpoint, int]


class PrefixCacheScorer:
    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        auto_tune: bool = True
        block_size_tokens: Annotated[int, msgspec.Meta(ge=1)] = 16
        max_prefix_blocks_to_match: Annotated[int, msgspec.Meta(ge=0)] = 256
        max_prefix_tokens_to_match: Annotated[int, msgspec.Meta(ge=0)] = 0
        lru_capacity_per_server: Annotated[int, msgspec.Meta(ge=1)] = 31250
        chars_per_token: Annotated[float, msgspec.Meta(gt=0)] = DEFAULT_CHARS_PER_TOKEN
        block_size: int | None = None

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        if params.block_size is not None:
            raise ValueError(
                "blockSize (characters per block) is GIE's old parameter: give"
                " blockSizeTokens instead (characters = tokens x charsPerToken)"
            )
        self.name = context.name
        self.auto_tune = params.auto_tune
        # Auto-tuning reads the pool's KV configuration from the model-server metrics.
        self.consumes = frozenset({METRICS}) if params.auto_tune else frozenset()
        self.block_size_tokens = params.block_size_tokens
        self.max_blocks = params.max_prefix_blocks_to_match
        self.max_tokens = params.max_prefix_tokens_to_match
        self.capacity = params.lru_capacity_per_server
        self.chars_per_token = params.chars_per_token
        self.index = ApproxPrefixIndex()
        self._state: StateKey[_Lookup] = StateKey(f"prefix-cache-scorer:{context.name}")
        # Building a plugin starts no I/O; listening to the datastore is not I/O
        # (during `epp validate` it is a throwaway datastore).
        context.datastore.add_listener(self._membership)
        self.clock = context.clock
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

    def describe_endpoint(self, endpoint: Endpoint) -> Mapping[str, object]:
        return {"approxPrefixIndex": {"blocks": self.index.blocks_of(endpoint)}}

    def _membership(self, added: list[Endpoint], removed: list[Endpoint]) -> None:
        for endpoint in removed:
            self.index.remove(endpoint)

    def block_size(self, endpoints: Sequence[Endpoint], now: float) -> int:
        if self.auto_tune:
            sizes = {e.metrics.block_size for e in endpoints if e.metrics.known(CACHE_INFO, now)}
            if len(sizes) == 1:
                return sizes.pop()
        return self.block_size_tokens

    def _lookup(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> _Lookup:
        found = cycle.get(self._state)
        if found is not None:
            return found
        block_size = self.block_size(endpoints, self.clock())
        max_blocks = self.max_tokens // block_size if self.max_tokens > 0 else self.max_blocks
        if self.max_tokens > 0 and max_blocks == 0:
            max_blocks = 1  # a cap below one block still hashes the first one
        blocks = prompt_blocks(request, block_size, self.chars_per_token, max_blocks)
        matched = self.index.match(blocks, endpoints) if blocks is not None else {}
        if blocks is not None:
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
        lookup = _Lookup(blocks, matched)
        cycle.put(self._state, lookup)
        return lookup

    def score(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Mapping[Endpoint, float]:
        lookup = self._lookup(request, cycle, endpoints)
        total = lookup.blocks.total if lookup.blocks is not None else 0
        if total == 0:
            return dict.fromkeys(endpoints, 0.0)
        return {e: lookup.matched.get(e, 0) / total for e in endpoints}

    def pre_request(
        self, request: InferenceRequest, cycle: CycleState, result: SchedulingResult
    ) -> None:
        targets = result.targets
        if not targets:
            return
        chosen = targets[0]
        lookup = self._lookup(request, cycle, targets)
        blocks = lookup.blocks
        if blocks is None or blocks.total == 0:
            return
        capacity = self.capacity
        if self.auto_tune and chosen.metrics.known(CACHE_INFO, self.clock()):
            capacity = chosen.metrics.num_gpu_blocks
        before = self.index.evictions
        self.index.add(chosen, blocks.all(), capacity)
        if self.index.evictions > before:
            self._evictions.inc(self.index.evictions - before)
        self._ratio.observe(lookup.matched.get(chosen, 0) / blocks.total)


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
