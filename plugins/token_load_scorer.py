"""`token-load-scorer`: prefers endpoints with fewer tokens in flight (llm-d's scorer
of the same name).

It reads what `inflight-load-producer` left for the request (the producer named by
`inFlightLoadProducerName`, default `inflight-load-producer`): the tokens in flight
on each endpoint, plus the tokens this request would add there (its prompt less
the prefix the endpoint already holds). With t that sum and T =
`queueThresholdTokens` (default 4194304, i.e. 128 requests of 32K tokens):

    score = 1 - min(1, t / T)        (t <= 0 -> 1.0)

so an idle endpoint scores 1 and one with T or more tokens in flight 0, linear in
between. Counting tokens rather than requests tells a 50-token request from a
30K-token one, which is what prefill time follows.

`queueThresholdTokens: 0` means the default, as in llm-d; a negative value is
refused (llm-d silently takes the default for it too). Without the producer's data
(it is not in the config) every endpoint scores 1.0 and a warning is logged once:
llm-d creates the producer by itself, this EPP does not.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Final

import msgspec

from epp.datastore import Endpoint
from epp.requests import InferenceRequest
from epp.scheduling import CycleState, PluginContext

from .inflight_load_producer import DEFAULT_PRODUCER, in_flight_load_key

log = logging.getLogger(__name__)

DEFAULT_QUEUE_THRESHOLD_TOKENS: Final = 4194304


class TokenLoadScorer:
    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        queue_threshold_tokens: int = DEFAULT_QUEUE_THRESHOLD_TOKENS
        in_flight_load_producer_name: str = ""

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        threshold = params.queue_threshold_tokens
        if threshold < 0:
            raise ValueError(
                f"queueThresholdTokens must be > 0 (0: the default"
                f" {DEFAULT_QUEUE_THRESHOLD_TOKENS}), got {threshold}"
            )
        self.name = context.name
        self.threshold = float(threshold or DEFAULT_QUEUE_THRESHOLD_TOKENS)
        self.producer = params.in_flight_load_producer_name or DEFAULT_PRODUCER
        self.key = in_flight_load_key(self.producer)
        self._warned = False

    def score(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Mapping[Endpoint, float]:
        info = cycle.get(self.key)
        if info is None:
            if not self._warned:
                self._warned = True
                log.warning(
                    "%s: no in-flight load from producer %r: every endpoint scores 1.0"
                    " (declare an inflight-load-producer of that name)",
                    self.name,
                    self.producer,
                )
            return dict.fromkeys(endpoints, 1.0)
        scores: dict[Endpoint, float] = {}
        for e in endpoints:
            tokens = info.load(e).tokens + info.request_tokens(e)
            scores[e] = 1.0 if tokens <= 0 else 1.0 - min(1.0, tokens / self.threshold)
        return scores
