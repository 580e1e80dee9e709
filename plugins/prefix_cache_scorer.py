"""`prefix-cache-scorer`: prefers the endpoints that hold the longest prefix of the
prompt, as a prefix-cache producer found it (llm-d's scorer of the same name).

Two ways to use it:

- **With a producer** (`prefixMatchInfoProducerName: <a producer's name>`), as in
  llm-d: it reads the `PrefixMatchInfo` that `approx-prefix-cache-producer`,
  `precise-prefix-cache-producer` or `precise-prefix-cache-scorer` left for the
  request under that name, and scores it:

      score = w * min(1, m * blockSizeTokens / matchLengthScaleTokens)^2 + (1 - w) * m / n

  with n the prompt's blocks, m the leading blocks the endpoint holds,
  `matchLengthWeight` w (0.0, in [0, 1]) and `matchLengthScaleTokens` (8192). With
  the default w it is the share of the prompt's blocks held, `m / n`. An endpoint
  the producer did not report, or a request without a prompt, scores 0.
- **On its own** (no producer name), as GIE's approximate scorer and this EPP's
  default profile use it: it keeps an approximate index of its own, learnt from
  this EPP's own picks (the machinery of `approx-prefix-cache-producer`, see
  plugins/approx_prefix_cache_producer.py, with its capacity counted as there:
  with autoTune, an endpoint's `num_gpu_blocks`, but never less than its KV cache
  in the tokens a block of text really holds, learnt from the responses' prompt
  token counts), with GIE's parameters and defaults:
  `blockSizeTokens` (16) and `charsPerToken` (4.0); `maxPrefixBlocksToMatch` (256;
  0: no cap) and `maxPrefixTokensToMatch` (0: unused; when set it wins);
  `lruCapacityPerServer` (31250); `autoTune` (true). `blockSize` (GIE's old block
  size in characters) is refused with a pointer to `blockSizeTokens`. It leaves its
  `PrefixMatchInfo` under its own name, for other plugins to read.

These index parameters belong to a producer: given together with a producer name
they are refused.

Metrics of its own index: `epp_approx_prefix_index_blocks{plugin}`,
`epp_approx_prefix_index_evictions_total{plugin}`,
`epp_approx_prefix_match_ratio{plugin}`; /debug/endpoints shows each endpoint's
`approxPrefixIndex.blocks` and the tokens per character of text it counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated

import msgspec

from epp.approxindex import DEFAULT_CHARS_PER_TOKEN
from epp.datastore import Endpoint
from epp.requests import InferenceRequest
from epp.scheduling import (
    METRICS,
    CycleState,
    PluginContext,
    PrefixMatchInfo,
    ResponseInfo,
    SchedulingResult,
    prefix_match_key,
)

from .approx_prefix_cache_producer import ApproxPrefixMatcher

_Blocks = Annotated[int, msgspec.Meta(ge=0)]


class PrefixCacheScorerParameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    # llm-d's: read a producer's match.
    prefix_match_info_producer_name: str | None = None
    match_length_weight: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    match_length_scale_tokens: Annotated[int, msgspec.Meta(gt=0)] = 8192
    # GIE's: an index of its own (no producer name). None: the default below.
    auto_tune: bool | None = None
    block_size_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    max_prefix_blocks_to_match: _Blocks | None = None
    max_prefix_tokens_to_match: _Blocks | None = None
    lru_capacity_per_server: Annotated[int, msgspec.Meta(ge=1)] | None = None
    chars_per_token: Annotated[float, msgspec.Meta(gt=0)] | None = None
    block_size: int | None = None


_OWN_INDEX_PARAMETERS = {
    "auto_tune": "autoTune",
    "block_size_tokens": "blockSizeTokens",
    "max_prefix_blocks_to_match": "maxPrefixBlocksToMatch",
    "max_prefix_tokens_to_match": "maxPrefixTokensToMatch",
    "lru_capacity_per_server": "lruCapacityPerServer",
    "chars_per_token": "charsPerToken",
    "block_size": "blockSize",
}


def _or(value: int | None, default: int) -> int:
    return default if value is None else value


class PrefixCacheScorer:
    Parameters = PrefixCacheScorerParameters

    def __init__(self, params: PrefixCacheScorerParameters, context: PluginContext) -> None:
        if params.block_size is not None:
            raise ValueError(
                "blockSize (characters per block) is GIE's old parameter: give"
                " blockSizeTokens instead (characters = tokens x charsPerToken)"
            )
        self.name = context.name
        self.weight = params.match_length_weight
        self.scale_tokens = params.match_length_scale_tokens
        producer = params.prefix_match_info_producer_name
        self.own: ApproxPrefixMatcher | None = None
        if producer is not None:
            given = [camel for field, camel in _OWN_INDEX_PARAMETERS.items()
                     if getattr(params, field) is not None]  # fmt: skip
            if given:
                raise ValueError(
                    f"{', '.join(given)}: these set this scorer's own index, which it does not"
                    f" keep when it reads producer {producer!r}: give them to the producer"
                )
            self.key = prefix_match_key(producer)
            self.consumes: frozenset[str] = frozenset()
            return
        auto_tune = True if params.auto_tune is None else params.auto_tune
        # Auto-tuning reads the pool's KV configuration from the model-server metrics.
        self.consumes = frozenset({METRICS}) if auto_tune else frozenset()
        self.own = ApproxPrefixMatcher(
            context,
            auto_tune=auto_tune,
            block_size_tokens=_or(params.block_size_tokens, 16),
            max_blocks=_or(params.max_prefix_blocks_to_match, 256),
            max_tokens=_or(params.max_prefix_tokens_to_match, 0),
            capacity=_or(params.lru_capacity_per_server, 31250),
            chars_per_token=params.chars_per_token or DEFAULT_CHARS_PER_TOKEN,
        )
        self.key = self.own.key

    def score(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Mapping[Endpoint, float]:
        if self.own is not None:
            info: PrefixMatchInfo | None = self.own.match(request, cycle, endpoints)
        else:
            info = cycle.get(self.key)
        if info is None or info.total_blocks <= 0:
            return dict.fromkeys(endpoints, 0.0)
        w = self.weight
        if w == 0.0:
            return {e: info.ratio(e) for e in endpoints}
        scale = self.scale_tokens / info.block_size_tokens
        return {
            e: w * min(1.0, info.matched.get(e, 0.0) / scale) ** 2 + (1.0 - w) * info.ratio(e)
            for e in endpoints
        }

    def pre_request(
        self, request: InferenceRequest, cycle: CycleState, result: SchedulingResult
    ) -> None:
        if self.own is not None:
            self.own.record(request, cycle, result)

    def post_response(
        self,
        request: InferenceRequest,
        cycle: CycleState,
        result: SchedulingResult,
        response: ResponseInfo,
    ) -> None:
        # Its own index's capacity is at least the cache, a text block counted in
        # the tokens the engines report for its characters.
        if self.own is not None:
            self.own.observe(cycle, response)

    def describe_endpoint(self, endpoint: Endpoint) -> Mapping[str, object]:
        return self.own.describe_endpoint(endpoint) if self.own is not None else {}
