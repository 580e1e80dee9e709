"""`precise-prefix-cache-scorer`: route to the pod that really holds the longest
cached prefix of the prompt, as the engines report it in their KV events.

One plugin, three extension points (llm-d's precise prefix-cache scorer):

- **DataProducer** (`prepare`, async): tokenize the prompt as the engine will
  (chat template, tokenizer; off the event loop when long), then walk its blocks
  over the index, keying each block as the index keys the engines' events (its
  token ids, chained; no engine hash settings) only as far as some candidate
  still holds the prefix;
- **Scorer**: matched consecutive prefix blocks / the prompt's full blocks (at
  most `maxPrefixBlocksToMatch`: only a long prompt's first blocks count, as
  /debug/explain's `notes` say), weighted by medium (GPU 1.0, CPU 0.8 by
  default), in [0, 1]. A pod whose KV
  events are cut in blocks of another size than `blockSize` scores 0 (not
  trusted), as do pods without KV events, and every pod when the prompt cannot be
  keyed (no tokenizer, images);
- **PreRequest**: with `speculativeIndexing`, the chosen pod is recorded as holding
  the prompt's blocks for `speculativeTTL`, so a burst of siblings sticks together
  before the engine's events arrive; one pick in `alignmentSampleEvery` is a
  tokenization probe (the pod's events should bring the blocks predicted).

The plugin only reads: the index, the KV-event subscriber (one ZMQ SUB per endpoint
and DP rank, with replay), the tokenizers and the block keys belong to the precise
prefix service (epp/kvindex/service.py), which the server builds from this
plugin's parameters, starts and stops. See docs/precise-prefix.md for the
parameters and what is and is not possible.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from epp.datastore import Endpoint
from epp.kvindex.service import PrecisePrefixConfig, PrecisePrefixService, PromptMatch
from epp.scheduling import (
    CycleState,
    InferenceRequest,
    PluginContext,
    PrefixMatchInfo,
    SchedulingResult,
    ServiceContext,
    StateKey,
    explain_note,
    prefix_match_key,
)


def match_info(found: PromptMatch, service: PrecisePrefixService) -> PrefixMatchInfo:
    """A precise match as llm-d's PrefixCacheMatchInfo, for `prefix-cache-scorer`
    (and whatever else reads a prefix producer's match)."""
    return PrefixMatchInfo(
        found.considered_blocks,
        service.config.block_size,
        {e: found.score(e) * found.considered_blocks for e in found.slots},
        found.prompt_blocks,
        continues=service.continues(found),
    )


def precise_prefix_service(
    params: PrecisePrefixConfig, context: ServiceContext
) -> PrecisePrefixService:
    return PrecisePrefixService(
        params,
        context.datastore,
        name=context.name,
        clock=context.clock,
        local_tokenizers=context.settings.tokenizer_dirs,
    )


class PrecisePrefixCacheScorer:
    Parameters = PrecisePrefixConfig
    # Built by the framework from the parameters, run by the server.
    Service = staticmethod(precise_prefix_service)

    def __init__(self, params: PrecisePrefixConfig, context: PluginContext) -> None:
        self.name = context.name
        assert isinstance(context.service, PrecisePrefixService)
        self.service: PrecisePrefixService = context.service
        self._match: StateKey[PromptMatch] = StateKey(f"precise-prefix-match:{context.name}")

    # -- DataProducer ------------------------------------------------------------------

    async def prepare(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> None:
        found = await self.service.lookup_request(request, endpoints)
        if not isinstance(found, PromptMatch):
            return
        explain_note(
            cycle,
            self.name,
            {
                "promptBlocks": found.prompt_blocks,
                "consideredBlocks": found.considered_blocks,
                "truncated": found.considered_blocks < found.prompt_blocks,
                "maxPrefixBlocksToMatch": self.service.max_blocks,
            },
        )
        cycle.put(self._match, found)
        # The same match as llm-d's PrefixCacheMatchInfo, for `prefix-cache-scorer`
        # with `prefixMatchInfoProducerName: <this plugin's name>`.
        cycle.put(prefix_match_key(self.name), match_info(found, self.service))

    # -- Scorer ---------------------------------------------------------------------------

    def score(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Mapping[Endpoint, float]:
        found = cycle.get(self._match)
        if found is None:
            return dict.fromkeys(endpoints, 0.0)
        return {endpoint: found.score(endpoint) for endpoint in endpoints}

    # -- PreRequest -----------------------------------------------------------------------

    def pre_request(
        self, request: InferenceRequest, cycle: CycleState, result: SchedulingResult
    ) -> None:
        found = cycle.get(self._match)
        if found is not None:
            self.service.record_pick(found, result.kv_holders)
