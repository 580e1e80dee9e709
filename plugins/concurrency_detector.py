"""`concurrency-detector`: GIE's saturation detector by in-flight work; also a filter.

Per endpoint, the work this EPP has in flight there: requests
(`concurrencyMode: requests`, the default; the director's count of every request
it routed there until its end), or tokens (`concurrencyMode: tokens`: the
`inflight-load-producer` named by `inFlightLoadProducerName`, declared before
this plugin). Each endpoint's capacity is `maxConcurrency` requests (100) or
`maxTokenConcurrency` tokens (1,000,000).

- As the saturation detector: pool saturation = total in flight / total capacity
  over the request's candidates (none: 1.0). At 1.0 or more, requests of negative
  priority are shed with a 429 (flow control off); with flow control on it is the
  dispatch gate, with lower bands held by the usage-limit policy's ceilings.
- As a filter: keeps the endpoints with less than capacity x (1 + `headroom`)
  in flight; if that would drop every endpoint, all are kept (fail open, as this
  EPP's utilization detector does) and the scorers choose.

It reacts at once (no scrape in the way) and never goes stale, since it reads only
this EPP's own accounting; but it is open loop: it sees neither the engines' KV
cache nor traffic from other EPP replicas. What it bounds is the engines' batch:
with `maxConcurrency` near the batch a pod serves within its latency target, the
requests beyond it wait here, in priority order, instead of slowing every stream
of a larger batch (docs/flow-control.md measures it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

import msgspec

from epp.datastore import Endpoint
from epp.requests import InferenceRequest
from epp.scheduling import CycleState, PluginContext

from .inflight_load_producer import InFlightLoadProducer

DEFAULT_LOAD_PRODUCER = "inflight-load-producer"


class ConcurrencyDetector:
    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        concurrency_mode: Literal["requests", "tokens"] = "requests"
        max_concurrency: Annotated[int, msgspec.Meta(gt=0)] = 100
        max_token_concurrency: Annotated[int, msgspec.Meta(gt=0)] = 1_000_000
        headroom: Annotated[float, msgspec.Meta(ge=0.0)] = 0.0
        # Tokens mode only: the producer whose token counts it reads.
        in_flight_load_producer_name: str = ""

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        self.tokens = params.concurrency_mode == "tokens"
        self.capacity = params.max_token_concurrency if self.tokens else params.max_concurrency
        self.limit = self.capacity * (1.0 + params.headroom)
        self.producer: InFlightLoadProducer | None = None
        if self.tokens:
            # concurrencyMode tokens reads that producer's token counts.
            self.producer = context.declared(
                params.in_flight_load_producer_name or DEFAULT_LOAD_PRODUCER,
                InFlightLoadProducer,
                "inFlightLoadProducerName",
                "inflight-load-producer",
            )
        elif params.in_flight_load_producer_name:
            raise ValueError(
                "inFlightLoadProducerName is read in concurrencyMode tokens only; requests"
                " mode counts the requests this EPP routed"
            )

    def in_flight(self, endpoint: Endpoint) -> int:
        """The endpoint's work in flight, in the mode's unit."""
        if self.producer is not None:
            return self.producer.load(endpoint).tokens
        return endpoint.in_flight

    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        if not endpoints:
            return 1.0
        return sum(self.in_flight(e) for e in endpoints) / (self.capacity * len(endpoints))

    def filter(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Sequence[Endpoint]:
        kept = [e for e in endpoints if self.in_flight(e) < self.limit]
        return kept or endpoints
