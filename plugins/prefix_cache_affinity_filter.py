"""`prefix-cache-affinity-filter`: keeps only the "sticky" endpoints, those that
already hold most of the prompt (llm-d's filter of the same name).

Why a filter and not a higher prefix weight: with the max-score picker a prefix
scorer sends every request of a popular prefix to the one endpoint that holds it
(a hot spot); with the weighted-random picker it often sends them to endpoints
that hold nothing. Narrowing the candidates to the sticky set first, then letting
a load scorer choose among them, keeps the cache hits and spreads the load.

For each request, with s(e) = the share of the prompt's blocks endpoint e holds
(matched / total blocks in the `PrefixMatchInfo` of `prefixMatchInfoProducerName`,
default `approx-prefix-cache-producer`; 0 without it):

1. one candidate, or `affinityThreshold` <= 0: keep all;
2. with probability `explorationProbability` (0, in [0, 1]): keep all, so other
   endpoints get to warm their caches over time (drawn from a seeded generator:
   `seed`, this EPP's; none: the run's seed if it has one, else afresh at every
   start);
3. sticky = endpoints with s(e) >= `affinityThreshold` (0.80, <= 1); none: keep all;
4. TTFT load gate, when `maxTTFTPenaltyMs` (18000, >= 0; 0: always stick) > 0 and
   some endpoint is not sticky: each endpoint's TTFT is estimated as

       ttft_ms(e) = tokens in flight on e / peakPrefillThroughput * 1000

   (`peakPrefillThroughput` 15928 tokens/s, llm-d's figure for Qwen3-32B on two
   H100s at TP=2; in-flight tokens from `inFlightLoadProducerName`, default
   `inflight-load-producer`, 0 without it). If the best sticky endpoint's TTFT
   exceeds the best non-sticky one's by more than `maxTTFTPenaltyMs`, keep all:
   the cache hit is not worth the queue;
5. otherwise keep the sticky endpoints.

It can be declared twice with different thresholds (0.99 as a global gate, 0.80
within a tier). `ttftSource` is `prefillThroughput` (the default);
`latencyPredictor` needs llm-d's predicted-latency producer, which this EPP does
not have, so it is refused unless the gate is off (`maxTTFTPenaltyMs: 0`);
`latencyPredictionInfoProducerName` is accepted for llm-d configs and unused.
/debug/explain shows what the filter saw under `notes.<name>`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Annotated, Final, Literal

import msgspec

from epp.datastore import Endpoint
from epp.requests import InferenceRequest
from epp.scheduling import CycleState, PluginContext, explain_note, prefix_match_key

from .inflight_load_producer import DEFAULT_PREFIX_PRODUCER, DEFAULT_PRODUCER, in_flight_load_key

log = logging.getLogger(__name__)

DEFAULT_PEAK_PREFILL_THROUGHPUT: Final = 15928.0


class PrefixCacheAffinityFilter:
    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        affinity_threshold: Annotated[float, msgspec.Meta(le=1.0)] = 0.80
        exploration_probability: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
        max_ttft_penalty_ms: Annotated[float, msgspec.Meta(ge=0.0)] = msgspec.field(
            default=18000.0, name="maxTTFTPenaltyMs"
        )
        ttft_source: Literal["prefillThroughput", "latencyPredictor"] = "prefillThroughput"
        peak_prefill_throughput: Annotated[float, msgspec.Meta(ge=0.0)] = (
            DEFAULT_PEAK_PREFILL_THROUGHPUT
        )
        prefix_match_info_producer_name: str = ""
        latency_prediction_info_producer_name: str = ""
        in_flight_load_producer_name: str = ""
        # This EPP's: seed the exploration draw (none: afresh at every start).
        seed: int | None = None

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        gate = params.max_ttft_penalty_ms > 0
        if gate and params.ttft_source == "latencyPredictor":
            raise ValueError(
                "ttftSource latencyPredictor reads llm-d's predicted-latency producer, which"
                " this EPP does not have: use prefillThroughput, or maxTTFTPenaltyMs: 0"
            )
        if gate and params.peak_prefill_throughput == 0:
            raise ValueError(
                "peakPrefillThroughput must be > 0 when the TTFT load gate is on"
                " (maxTTFTPenaltyMs > 0)"
            )
        self.name = context.name
        self.threshold = params.affinity_threshold
        self.exploration = params.exploration_probability
        self.max_penalty_ms = params.max_ttft_penalty_ms
        self.peak_throughput = params.peak_prefill_throughput
        self.prefix_key = prefix_match_key(
            params.prefix_match_info_producer_name or DEFAULT_PREFIX_PRODUCER
        )
        self.load_producer = params.in_flight_load_producer_name or DEFAULT_PRODUCER
        self.load_key = in_flight_load_key(self.load_producer)
        self._rng = context.rng(params.seed)
        self._warned = False

    def filter(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Sequence[Endpoint]:
        if len(endpoints) <= 1 or self.threshold <= 0:
            return endpoints
        if self.exploration > 0 and self._rng.random() < self.exploration:
            explain_note(cycle, self.name, {"explored": True})
            return endpoints
        info = cycle.get(self.prefix_key)
        sticky: list[Endpoint] = []
        others: list[Endpoint] = []
        for e in endpoints:
            share = info.ratio(e) if info is not None else 0.0
            (sticky if share >= self.threshold else others).append(e)
        if not sticky:
            explain_note(cycle, self.name, {"sticky": 0})
            return endpoints
        if self.max_penalty_ms > 0 and others:
            penalty = self._best_ttft_ms(cycle, sticky) - self._best_ttft_ms(cycle, others)
            if penalty > self.max_penalty_ms:
                explain_note(cycle, self.name, {"sticky": len(sticky), "ttftPenaltyMs": penalty})
                return endpoints
        explain_note(cycle, self.name, {"sticky": len(sticky)})
        return sticky

    def _best_ttft_ms(self, cycle: CycleState, endpoints: Sequence[Endpoint]) -> float:
        """The lowest estimated TTFT among `endpoints`, from their in-flight tokens."""
        loads = cycle.get(self.load_key)
        if loads is None:
            if not self._warned:
                self._warned = True
                log.warning(
                    "%s: no in-flight load from producer %r: the TTFT load gate sees no"
                    " load (declare an inflight-load-producer of that name)",
                    self.name,
                    self.load_producer,
                )
            return 0.0
        tokens = min(loads.load(e).tokens for e in endpoints)
        return tokens / self.peak_throughput * 1000.0
