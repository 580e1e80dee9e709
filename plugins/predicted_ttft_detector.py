"""`predicted-ttft-detector`: a saturation detector that reads the predicted-TTFT
model instead of queue lengths; flow control's dispatch gate in seconds.

An endpoint's load is the wait the model predicts for any new request there
before its own prefill starts (the prefill queued ahead of it, the decoding batch
it joins, the requests the pod reports waiting: `PredictedTtftProducer.
predicted_wait`), divided by `waitThreshold` (default 150ms), capped at 1.0. The
pool's saturation is the mean over the request's candidates (none: 1.0).

Why seconds rather than requests: `utilization-detector` counts waiting requests,
and a queue of three 12,000-token prompts holds the next request a hundred times
longer than three 100-token ones; here the threshold is the queueing delay a
dispatched request may meet, whatever the prompts' lengths and whatever each pod
already holds of them, learnt from the first tokens this EPP observes.

Why each pod is capped at 1.0: a pod that is full counts as full, not more; one
stuck or slow pod with a long queue would otherwise hold back the whole pool
while the others have room (the pick avoids that pod anyway).

Stale metrics never freeze it: the queue and the decoding batch are this EPP's
own accounting, always current; only the engines' waiting counts come from the
scrapes, and a pod whose metrics are stale or missing is judged without them. So
one reading, `saturation`, serves admission (requests of negative priority are
shed at 1.0 with flow control off) and flow control's dispatch gate, which asks
`saturation` of a detector that has no separate dispatch reading.

It needs a `predicted-ttft-producer` declared before it in the config (named by
`predictedTtftProducerName`, default `predicted-ttft-producer`): the producer
keeps the per-pod queues and fits the model whether or not a profile scores with
it.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from epp.datastore import Endpoint
from epp.durations import Duration, parse_duration
from epp.scheduling import METRICS, PluginContext

from .predicted_ttft_producer import DEFAULT_PRODUCER, PredictedTtftProducer


class PredictedTtftDetector:
    consumes = frozenset({METRICS})  # the pods' waiting requests, through the producer

    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        predicted_ttft_producer_name: str = DEFAULT_PRODUCER
        # The predicted wait at which a pod counts as full (load 1.0).
        wait_threshold: Duration = "150ms"

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        self.threshold_s = parse_duration(params.wait_threshold)
        if self.threshold_s <= 0:
            raise ValueError("waitThreshold must be positive")
        self.producer = context.declared(
            params.predicted_ttft_producer_name,
            PredictedTtftProducer,
            "predictedTtftProducerName",
            "predicted-ttft-producer",
        )

    def load(self, endpoint: Endpoint) -> float:
        """The endpoint's predicted wait over the threshold, at most 1.0."""
        return min(1.0, self.producer.predicted_wait(endpoint) / self.threshold_s)

    def saturation(self, endpoints: Sequence[Endpoint]) -> float:
        if not endpoints:
            return 1.0
        return sum(self.load(e) for e in endpoints) / len(endpoints)
