"""`no-hit-lru-scorer`: spreads cold requests over the endpoints, least recently
used first (llm-d's scorer of the same name).

A cold request (no endpoint holds any block of its prompt) fills a KV cache from
scratch wherever it goes; sending cold requests to the endpoint that got one
longest ago spreads that cache growth evenly, instead of piling new prefixes onto
whichever endpoint wins a tie.

For each request it reads the `PrefixMatchInfo` of `prefixMatchInfoProducerName`
(default `approx-prefix-cache-producer`):

- warm (some candidate holds at least one block): 0.5 for every endpoint, leaving
  the choice to the prefix scorer;
- cold (none does, or there is no match info): with n candidates, the endpoints
  that never got a cold request first, in candidate order, score
  `1 - i / (n - 1)` for i = 0, 1, ...; then those that did, from the least
  recently used, score `1 - (never_used + position) / (n - 1)`, floored at 0, where
  `position` is the endpoint's rank in the LRU (oldest 0). A single candidate
  scores 1.0.

At the pick (pre_request, so /debug/explain changes nothing), a cold request moves
the endpoints that now hold its prompt's KV (the primary target, and a
disaggregated pick's prefill endpoint: `SchedulingResult.kv_holders`) to the most
recently used end; llm-d finds the prefill endpoint by the profile name `prefill`,
this one by what the profile handler reports, whatever the profile's name. The LRU
remembers at most `lruSize` endpoints (1024; 0: the default, as in llm-d; negative
values are refused).
`prefixPluginType` and `prefixPluginName` are llm-d's deprecated, never-used
parameters: accepted and ignored.

llm-d creates `approx-prefix-cache-producer` by itself when this scorer needs it;
this EPP does not: without a producer of that name in the config every request is
cold (a warning says so once).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Final

import msgspec

from epp.datastore import Endpoint
from epp.requests import InferenceRequest
from epp.scheduling import (
    NEUTRAL_SCORE,
    CycleState,
    PluginContext,
    SchedulingResult,
    StateKey,
    prefix_match_key,
)

from .inflight_load_producer import DEFAULT_PREFIX_PRODUCER

log = logging.getLogger(__name__)

DEFAULT_LRU_SIZE: Final = 1024


class NoHitLruScorer:
    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        lru_size: int = DEFAULT_LRU_SIZE
        prefix_match_info_producer_name: str = ""
        # llm-d's, deprecated there and never used.
        prefix_plugin_type: str = ""
        prefix_plugin_name: str = ""

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        if params.lru_size < 0:
            raise ValueError(
                f"lruSize must be > 0 (0: the default {DEFAULT_LRU_SIZE}), got {params.lru_size}"
            )
        self.name = context.name
        self.size = params.lru_size or DEFAULT_LRU_SIZE
        self.producer = params.prefix_match_info_producer_name or DEFAULT_PREFIX_PRODUCER
        self.key = prefix_match_key(self.producer)
        # Endpoint names, least recently used first.
        self._lru: OrderedDict[str, None] = OrderedDict()
        self._cold: StateKey[bool] = StateKey(f"no-hit-lru-cold/{context.name}")
        self._warned = False

    def score(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Mapping[Endpoint, float]:
        cold = self._is_cold(cycle, endpoints)
        cycle.put(self._cold, cold)
        if not cold:
            return dict.fromkeys(endpoints, NEUTRAL_SCORE)
        n = len(endpoints)
        if n == 1:
            return {endpoints[0]: 1.0}
        position = {name: i for i, name in enumerate(self._lru)}
        never_used = [e for e in endpoints if e.name not in position]
        scores = {e: 1.0 - i / (n - 1) for i, e in enumerate(never_used)}
        for e in endpoints:
            if e.name in position:
                rank = len(never_used) + position[e.name]
                scores[e] = max(0.0, 1.0 - rank / (n - 1))
        return scores

    def _is_cold(self, cycle: CycleState, endpoints: Sequence[Endpoint]) -> bool:
        info = cycle.get(self.key)
        if info is None:
            if not self._warned:
                self._warned = True
                log.warning(
                    "%s: no prefix match info from producer %r: every request counts as"
                    " cold (declare that producer, or name another with"
                    " prefixMatchInfoProducerName)",
                    self.name,
                    self.producer,
                )
            return True
        return not any(info.matched.get(e, 0.0) > 0 for e in endpoints)

    def pre_request(
        self, request: InferenceRequest, cycle: CycleState, result: SchedulingResult
    ) -> None:
        if not cycle.get(self._cold):
            return
        for holder in result.kv_holders:
            self._use(holder.name)

    def _use(self, name: str) -> None:
        self._lru[name] = None
        self._lru.move_to_end(name)
        while len(self._lru) > self.size:
            self._lru.popitem(last=False)
