"""`predicted-ttft-producer`: each candidate pod's predicted time to first token for
the request, in seconds, from a model this EPP fits online to the TTFTs it
observes; `predicted-ttft-scorer` picks on it.

The prediction for pod p (epp/ttft/model.py, docs/routing.md explains it):

    ttft(p) = fixed + queued(p) + f(p) * (prefill(U) + attention(U, C))
              + decoding(p) + waiting(p)

- `queued(p)`: the predicted prefill work this EPP has sent to p that has not
  produced its first token yet, drained at one second per second and re-anchored
  at every first token (epp/ttft/ledger.py);
- U = the prompt's tokens minus the C tokens of its prefix that p holds, from the
  prefix producer named `prefixMatchInfoProducerName` (default
  `approx-prefix-cache-producer`; a precise producer's match works the same);
  attention grows with U x (C + U / 2);
- `decoding(p)`: requests this EPP has on p past their first token;
- `waiting(p)`: requests p reports waiting in its metrics (a full batch; other
  replicas' traffic). With `waitingBeyondOwn`, only those beyond this EPP's own
  that it expected queued there at the scrape (sent, first token not yet due:
  those are in `queued(p)` already);
- f(p): the pod's own speed relative to the fleet, learnt from its observations
  (1 for a new pod, kept in [0.25, 4]).

A disaggregated request (prefill on pod P, decode on pod D: a P/D profile
handler's pick) is predicted as P's queue and P's own prefill (U and C are P's),
plus the KV transfer of the prompt tokens D does not hold (the model's
`transfer` term), plus D's decoding batch the first decode step joins, and the
requests waiting on either pod. It is charged to P's queue until its first token
and decodes on D from then on; its observed TTFT fits the same model (the
transfer weight is learnt from these alone). `predicted-ttft-pd-decider` compares
this prediction with D doing the prefill itself.

The weights are shared by the fleet and fitted by recursive least squares from
every observation: the time from the pick to the first chunk of the response
(`ResponseFirstChunk`), with the features the prediction was made from. So the
model needs no configuration of hardware or model size, follows a fleet whose
speed changes, and learns a pod that is slower than the others through f(p).
A pod without observations is predicted with the fleet's weights, so nothing has
to be explored to route well from the first request.

Lifecycle of a request on its pod: the pick charges the pod's ledger with the
request's predicted prefill (`pre_request`); its first response chunk moves it to
decoding and is one observation (`response_first_chunk`); its end takes it off
(`post_response`). Without response bodies reaching the EPP (an Envoy config that
does not stream them), nothing is observed: predictions keep the prior weights
and a request counts as queued until its end.

Parameters: `prefixMatchInfoProducerName`; `forgetting` (0.995: the weight of an
observation decays by this per later one, a memory of about 200 observations);
`podAdaptRate` (0.05: how fast f(p) follows a pod's observed/predicted ratio);
`initialContinuingShare` (0.8: the share of requests assumed to continue an
earlier one before any has been seen; 0 for traffic known to have no sessions).
`waitingBeyondOwn` (false; the lab profile predicted-ttft-waiting sets it): count
a pod's scraped waiting requests only beyond this EPP's own that it expected
there when the scrape was taken (docs/routing-evidence.md, What a pod says is waiting).
`minPrefillWeightMs` (0; the lab profile predicted-ttft-prefill-floor sets 15):
the least the model's prefill weight may be, in milliseconds per 1,000 uncached
tokens; on prompts all of one length the fit cannot tell that weight from the
fixed cost and may take it to 0, after which the ledger charges no prefill and
every queue reads empty (docs/routing-evidence.md, The prefill weight's floor).
`countOverdue` (false; the lab profile predicted-ttft-overdue sets it): add to
the prediction, at a weight the model fits, the requests this EPP has queued on
the pod whose first token was due and has not come: a pod fallen behind (a full
KV cache) reads an empty queue otherwise (docs/routing-evidence.md, Predictions in
overload).
`relativeFit` (false; the default profile sets it): fit
the model by weighted least squares, each observation weighted by the inverse
of its predicted TTFT, so that the seconds-long waits of a fleet in overload,
whose noise is seconds too, do not pull the weights the short TTFTs are
predicted with (epp/ttft/model.py; docs/routing-evidence.md, Predictions in overload).
`relativeFitFloorMs` (10): with `relativeFit`, predictions under that many
milliseconds weigh as one of that many (the default profile sets 300: every
TTFT under it weighs alike, and only longer ones less; docs/routing-evidence.md,
Predictions in overload).
`revalueQueued` (none: off): when the model's prediction of a request's own
prefill moves by more than that share (0.2: 20%) from what it was when the work
now queued on the pods was charged, every pod's queued work is re-valued by the
ratio (`PodLedger.rescale`), measured on each observed request's own prefill. From a
cold start, the pods' first requests are charged at the prior's prefill rate
and read as queued for as long as the prior says until their first tokens come,
while the requests after them are charged at the fitted rate: the pods picked
first look busiest and the next requests gather on the pods picked since
(docs/routing-evidence.md, Queued work from a cold start).

Metrics: `epp_ttft_prediction_error_ratio{plugin}` (|predicted - observed| /
observed per observed request), `epp_ttft_observed_seconds{plugin}`,
`epp_ttft_model_weight{plugin,feature}`,
`epp_ttft_model_covariance_resets_total{plugin}`. /debug/explain shows each
candidate's prediction and its parts; /debug/endpoints each pod's queue,
decoding requests, the prompt tokens they decode (`decodingTokens`, the
scorer's `decodeBalanceFactor` reads them) and speed factor.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Final

import msgspec
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from epp.datastore import WAITING, Endpoint
from epp.promutil import shared
from epp.requests import InferenceRequest
from epp.scheduling import (
    METRICS,
    TTFT_OBSERVED,
    CycleState,
    PluginContext,
    PrefixMatchInfo,
    ResponseInfo,
    SchedulingResult,
    StateKey,
    TtftObservation,
    prefix_match_key,
)
from epp.ttft.ledger import DEPARTURE_HORIZON_S, PodLedger
from epp.ttft.model import (
    FEATURES,
    RELATIVE_FLOOR_S,
    OnlineTtftModel,
    TtftFeatures,
    attention_pairs,
)

log = logging.getLogger(__name__)

# Where `predicted_wait`'s terms, and the prefill weight's floor, sit in the model's weights.
_QUEUED, _PREFILL, _ATTENTION, _DECODING, _WAITING = (
    FEATURES.index(n) for n in ("queued", "prefill", "attention", "decoding", "waiting")
)

CONTINUING_RATE: Final = 1 / 64
# Before any evidence, four requests in five are assumed to continue earlier ones
# (a new session brings four more turns; `initialContinuingShare`), with the
# weight of SHARE_PRIOR_REQUESTS requests. A cold EPP cannot tell a
# conversation's first turn from an independent prompt, and the two mistakes
# cost differently: assuming sessions where there are none spreads the first few
# dozen requests a little more than needed (the share falls to 0.1 within 93
# requests that continue nothing); assuming none where every request is a
# conversation pins the first conversations, all their turns, to the few pods
# that hold the system prompt (docs/routing.md, Sessions).
SHARE_PRIOR: Final = 0.8
SHARE_PRIOR_REQUESTS: Final = 16

DEFAULT_PRODUCER: Final = "predicted-ttft-producer"
DEFAULT_PREFIX_PRODUCER: Final = "approx-prefix-cache-producer"
MIN_POD_FACTOR: Final = 0.25
MAX_POD_FACTOR: Final = 4.0
_ERROR_BUCKETS: Final = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0)
_TTFT_BUCKETS: Final = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class TtftPrediction(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """One pod's predicted TTFT for one request (seconds), what it is made of, and
    the load this EPP had on that pod when it was made (for a disaggregated
    prediction, the prefill pod's).

    A msgspec struct rather than a dataclass: a pick makes one per candidate (64
    on a 64-pod fleet), and a struct is built in C, several times faster than a
    Python `__init__` with these keywords. Its fields are numbers and a tuple of
    numbers, so it never holds a cycle (`gc=False`). The feature vector, the parts
    and the features, which only the chosen pod's charge and /debug/explain read,
    are derived when asked."""

    seconds: float
    # The request's own prefill on the pod (the model's prefill and attention
    # terms): what later requests would wait for.
    own_work_s: float
    # The model's queued term: the wait for the prefill queued ahead.
    queue_s: float
    weights: tuple[float, ...]  # the model's weights when predicted
    factor: float  # the pod's speed factor f(p) the own prefill was scaled by
    queued_s: float  # the ledger's backlog: the queued feature
    cached_tokens: int
    uncached_tokens: int
    decoding: int  # requests decoding in the batch the first step joins
    waiting: int  # requests the pod(s) report waiting, as counted
    transfer_tokens: int = 0  # KV cache the decode pod pulls
    # This EPP's load on the pod: requests queued or decoding, their uncached
    # prompt tokens, and the prompt tokens of those decoding.
    requests_in_flight: int = 0
    tokens_in_flight: int = 0
    decoding_tokens: int = 0
    overdue: int = 0  # requests queued here whose first token was due (`countOverdue`)

    @property
    def features(self) -> TtftFeatures:
        return TtftFeatures(
            self.queued_s,
            self.uncached_tokens,
            attention_pairs(self.uncached_tokens, self.cached_tokens),
            self.decoding,
            self.waiting,
            self.transfer_tokens,
            self.overdue,
        )

    @property
    def x(self) -> tuple[float, ...]:
        """The model's feature vector, the pod's speed scaling its own prefill (the
        queue is already in its seconds)."""
        raw = self.features.vector()
        factor = self.factor
        return (raw[0], raw[1], raw[2] * factor, raw[3] * factor, raw[4], raw[5], raw[6], raw[7])

    @property
    def parts(self) -> dict[str, float]:
        """Seconds per model term."""
        return {name: w * v for name, w, v in zip(FEATURES, self.weights, self.x, strict=True)}

    def describe(self) -> dict[str, float | int]:
        out: dict[str, float | int] = {"predictedTtftMs": round(self.seconds * 1e3, 3)}
        out.update({f"{k}Ms": round(v * 1e3, 3) for k, v in self.parts.items()})
        if self.transfer_tokens <= 0:
            del out["transferMs"]  # served whole: nothing moves between pods
        out["cachedTokens"] = self.cached_tokens
        out["uncachedTokens"] = self.uncached_tokens
        if self.transfer_tokens > 0:
            out["transferTokens"] = self.transfer_tokens
        out["podFactor"] = round(self.factor, 4)
        return out


def predicted_ttft_key(producer: str) -> StateKey[TtftPredictions]:
    """Where the producer named `producer` leaves a request's `TtftPredictions`."""
    return StateKey(f"PredictedTtft/{producer}")


class _Pod:
    __slots__ = ("decoding_tokens", "factor", "ledger", "observations", "tokens_in_flight")

    def __init__(self, ledger: PodLedger) -> None:
        self.ledger = ledger
        self.factor = 1.0
        self.observations = 0
        # Uncached prompt tokens of the requests in flight here, from pick to end
        # (llm-d's in-flight token load): the scorer's tie-break.
        self.tokens_in_flight = 0
        # Prompt tokens of the requests decoding here (their context, which every
        # decode step reads): the pod's decode load, as Dynamo's decode blocks.
        self.decoding_tokens = 0


@dataclass(slots=True)
class _Charge:
    """What a routed request charged, kept in its cycle until its end."""

    pod: _Pod  # where it decodes (and, served whole, prefills)
    prediction: TtftPrediction
    key: object
    # A disaggregated request's prefill pod: its queue holds the request until
    # the first token, its in-flight tokens until the end.
    prefill_pod: _Pod | None = None
    decoding: bool = False
    released: bool = False

    @property
    def prompt_tokens(self) -> int:
        return self.prediction.cached_tokens + self.prediction.uncached_tokens

    @property
    def computing(self) -> _Pod:
        """The pod that computes the prompt, whose queue the request joined."""
        return self.prefill_pod if self.prefill_pod is not None else self.pod


class TtftPredictions:
    """What the producer leaves for one request: each pod's prediction, computed
    when first asked and then kept (so a pick reads every pod at one instant)."""

    __slots__ = ("_cache", "_cycle", "_pairs", "_prefix", "_producer", "_request", "candidates")

    def __init__(
        self,
        producer: PredictedTtftProducer,
        request: InferenceRequest,
        cycle: CycleState,
        candidates: Sequence[Endpoint] = (),
    ) -> None:
        self._producer = producer
        self._request = request
        self._cycle = cycle
        # The endpoints the request could go to, before any profile's filters.
        self.candidates = tuple(candidates)
        self._cache: dict[Endpoint, TtftPrediction] = {}
        self._pairs: dict[tuple[Endpoint, Endpoint], TtftPrediction] = {}
        self._prefix: PrefixMatchInfo | None = None

    def _prefix_info(self) -> PrefixMatchInfo | None:
        """The prefix producer's match for the request, read from the cycle once
        it is there (a scorer asks `remembered_share` of every pod in a tie)."""
        info = self._prefix
        if info is None:
            info = self._prefix = self._cycle.get(self._producer.prefix_key)
        return info

    def decoding(self, endpoint: Endpoint) -> int:
        """Requests this EPP has on `endpoint` past their first token."""
        return self._producer.decoding(endpoint)

    def remembered_share(self, endpoint: Endpoint) -> float | None:
        """The share of the prompt's blocks `endpoint` was ever sent and its prefix
        index still remembers, where the index tells that apart from what the pod
        still holds (`PrefixMatchInfo.remembered`); None where it does not."""
        info = self._prefix_info()
        if info is None or info.remembered is None or info.total_blocks <= 0:
            return None
        return min(1.0, info.remembered.get(endpoint, 0.0) / info.total_blocks)

    @property
    def continues(self) -> bool:
        """The prompt continues an earlier one (its prefix producer says so)."""
        info = self._prefix_info()
        return info is not None and info.continues

    @property
    def demand(self) -> float:
        """The share of recent requests whose longest held prefix is this one's."""
        info = self._prefix_info()
        return 0.0 if info is None else info.demand

    @property
    def continuing_share(self) -> float:
        """The share of this EPP's recent requests that continued an earlier prompt."""
        return self._producer.continuing_share

    def predict(self, endpoint: Endpoint) -> TtftPrediction:
        found = self._cache.get(endpoint)
        if found is None:
            found = self._producer.predict(self._cycle, endpoint)
            self._cache[endpoint] = found
        return found

    def predict_all(self, endpoints: Sequence[Endpoint]) -> dict[Endpoint, TtftPrediction]:
        """`predict` for each of `endpoints` (those not predicted yet in one pass)."""
        cache = self._cache
        if not cache:
            # The usual case, a pick's first ask: the pass's own dict, in the order of
            # `endpoints`, is the answer.
            fresh = self._producer.predict_many(self._cycle, endpoints)
            cache.update(fresh)
            return fresh
        missing = [e for e in endpoints if e not in cache]
        if missing:
            cache.update(self._producer.predict_many(self._cycle, missing))
        return {e: cache[e] for e in endpoints}

    def predict_disaggregated(self, prefill: Endpoint, decode: Endpoint) -> TtftPrediction:
        """The request's TTFT if `prefill` computes its prompt and `decode` decodes."""
        found = self._pairs.get((prefill, decode))
        if found is None:
            found = self._producer.predict(self._cycle, prefill, decode)
            self._pairs[(prefill, decode)] = found
        return found


class PredictedTtftProducer:
    consumes = frozenset({METRICS})  # the pods' waiting requests

    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        prefix_match_info_producer_name: str = ""
        forgetting: Annotated[float, msgspec.Meta(gt=0.5, le=1.0)] = 0.995
        pod_adapt_rate: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.05
        initial_continuing_share: Annotated[float, msgspec.Meta(ge=0.0, le=0.95)] = SHARE_PRIOR
        waiting_beyond_own: bool = False
        min_prefill_weight_ms: Annotated[float, msgspec.Meta(ge=0.0, le=1000.0)] = 0.0
        count_overdue: bool = False
        relative_fit: bool = False
        relative_fit_floor_ms: Annotated[float, msgspec.Meta(gt=0.0, le=60000.0)] = (
            RELATIVE_FLOOR_S * 1e3
        )
        revalue_queued: Annotated[float, msgspec.Meta(gt=0.0)] | None = None

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        self.name = context.name
        self.key = predicted_ttft_key(context.name)
        self.prefix_key = prefix_match_key(
            params.prefix_match_info_producer_name or DEFAULT_PREFIX_PRODUCER
        )
        self.clock = context.clock
        lower = [0.0] * len(FEATURES)
        # The prefill feature is in thousands of tokens, its weight in seconds.
        lower[_PREFILL] = params.min_prefill_weight_ms / 1e3
        self.model = OnlineTtftModel(
            forgetting=params.forgetting,
            lower=lower,
            relative=params.relative_fit,
            relative_floor_s=params.relative_fit_floor_ms / 1e3,
        )
        self.waiting_beyond_own = params.waiting_beyond_own
        self.count_overdue = params.count_overdue
        self.adapt = params.pod_adapt_rate
        self.revalue_queued = params.revalue_queued
        # The weights the work queued on the pods was charged under, as far as
        # re-valuing it goes (`revalueQueued`).
        self._charged_weights = tuple(self.model.weights)
        self._pods: dict[Endpoint, _Pod] = {}
        self._charge: StateKey[_Charge] = StateKey(f"predicted-ttft-charge/{context.name}")
        self._warned_no_prefix = False
        # Moving average (over about 64 requests) of requests continuing an earlier
        # prompt: near 0 for independent prompts over shared prefixes, near
        # (turns - 1) / turns for conversations. Until 64 requests have been seen
        # it is the plain mean of the prior's pseudo-requests and the requests,
        # so the prior fades as evidence comes, neither lingering nor lagging.
        self.continuing_share = params.initial_continuing_share
        self._share_samples = SHARE_PRIOR_REQUESTS
        context.datastore.add_listener(self._membership)
        registry = context.metrics
        self._error = shared(
            registry,
            "epp_ttft_prediction_error_ratio",
            lambda: Histogram(
                "epp_ttft_prediction_error_ratio",
                "|predicted - observed| / observed time to first token, per request whose"
                " first response chunk the EPP saw (predicted at its pick).",
                ["plugin"],
                buckets=_ERROR_BUCKETS,
                registry=registry,
            ),
        ).labels(self.name)
        self._observed = shared(
            registry,
            "epp_ttft_observed_seconds",
            lambda: Histogram(
                "epp_ttft_observed_seconds",
                "Time from the pick to the first response chunk, as the EPP saw it.",
                ["plugin"],
                buckets=_TTFT_BUCKETS,
                registry=registry,
            ),
        ).labels(self.name)
        shared(registry, "epp_ttft_model_weight", lambda: _WeightsCollector(registry)).add(
            self.name, self.model
        )

    def _membership(self, added: list[Endpoint], removed: list[Endpoint]) -> None:
        # A pod that leaves takes its queue and speed with it; requests still
        # running there release into the old ledger, never a new pod's.
        for endpoint in removed:
            self._pods.pop(endpoint, None)

    def _pod(self, endpoint: Endpoint) -> _Pod:
        pod = self._pods.get(endpoint)
        if pod is None:
            # Departures are remembered only for `waitingBeyondOwn`, which reads them.
            horizon = DEPARTURE_HORIZON_S if self.waiting_beyond_own else 0.0
            pod = self._pods[endpoint] = _Pod(PodLedger(horizon_s=horizon))
        return pod

    def requests_in_flight(self, endpoint: Endpoint) -> int:
        pod = self._pods.get(endpoint)
        return 0 if pod is None else pod.ledger.queued + pod.ledger.decoding

    def tokens_in_flight(self, endpoint: Endpoint) -> int:
        pod = self._pods.get(endpoint)
        return 0 if pod is None else pod.tokens_in_flight

    def decoding(self, endpoint: Endpoint) -> int:
        pod = self._pods.get(endpoint)
        return 0 if pod is None else pod.ledger.decoding

    def decoding_tokens(self, endpoint: Endpoint) -> int:
        pod = self._pods.get(endpoint)
        return 0 if pod is None else pod.decoding_tokens

    def predicted_wait(self, endpoint: Endpoint) -> float:
        """Seconds the model predicts any new request waits on `endpoint` before its
        own prefill starts: the prefill queued ahead, the decoding batch it joins and
        the requests the pod reports waiting (a prediction for a request with nothing
        to prefill, less the fixed cost every request pays). Fresh whatever the
        scrapes do: the queue and the batch are this EPP's own accounting, and
        waiting requests whose metrics are stale count as none."""
        pod = self._pods.get(endpoint)
        now = self.clock()
        weights = self.model.weights
        queued = pod.ledger.backlog(now) if pod is not None else 0.0
        decoding = pod.ledger.decoding if pod is not None else 0
        return (
            weights[_QUEUED] * queued
            + weights[_DECODING] * decoding
            + weights[_WAITING] * self._waiting(endpoint, now)
        )

    def _waiting(self, endpoint: Endpoint, now: float) -> int:
        """The requests `endpoint` reported waiting in its latest fresh scrape.

        With `waitingBeyondOwn`, only those this EPP's ledger does not account for:
        the scrape's count less this EPP's requests it expected to be queued there
        at the scrape's instant (sent, and their first token not yet due: their
        prefill is the ledger's queue already; counted again, a request that had
        just arrived at an engine, long running when a snapshot up to a scrape
        interval old is read, makes the pod look 50 ms slower at the prior's
        weight). What is left is traffic this EPP does not see (other replicas),
        requests the engine sent back to waiting (preempted), and this EPP's own
        that are overdue (the pod is behind what was predicted)."""
        metrics = endpoint.metrics
        if metrics.waiting_requests <= 0 or not metrics.known(WAITING, now):
            return 0
        if not self.waiting_beyond_own:
            return metrics.waiting_requests
        pod = self._pods.get(endpoint)
        own = 0 if pod is None else pod.ledger.expected_at(metrics.updated_at)
        return max(0, metrics.waiting_requests - own)

    # -- predicting -----------------------------------------------------------------

    def predict(
        self, cycle: CycleState, endpoint: Endpoint, decode: Endpoint | None = None
    ) -> TtftPrediction:
        """The request's predicted TTFT on `endpoint`; with `decode`, if `endpoint`
        computes the prompt and `decode` (another pod) then decodes."""
        return self.predict_many(cycle, (endpoint,), decode)[endpoint]

    def predict_many(
        self, cycle: CycleState, endpoints: Sequence[Endpoint], decode: Endpoint | None = None
    ) -> dict[Endpoint, TtftPrediction]:
        """`predict` for each of `endpoints`, at one instant and with the model's
        weights of that instant. One pass, the per-pick work read once: a pick
        predicts every candidate, and on a large fleet that is most of its cost."""
        info = cycle.get(self.prefix_key)
        if info is None:
            if not self._warned_no_prefix:
                self._warned_no_prefix = True
                log.warning(
                    "%s: no prefix match from %s for a request: predicting as if no pod"
                    " held any of its prompt (is the producer in the config?)",
                    self.name,
                    self.prefix_key.name,
                )
            prompt, block = 0, 0
            matched: Mapping[Endpoint, float] = {}
        else:
            prompt, block, matched = info.prompt_tokens(), info.block_size_tokens, info.matched
        now = self.clock()
        w0, w1, w2, w3, w4, w5, w6, w7 = weights = tuple(self.model.weights)
        pods = self._pods
        transfer = 0
        decode_pod = None
        decode_waiting = 0
        if decode is not None:
            # The decode pod pulls what it does not hold already, and the first token
            # comes from its first step, in its batch.
            transfer = prompt - min(prompt, round(matched.get(decode, 0.0) * block))
            decode_pod = pods.get(decode)
            decode_waiting = self._waiting(decode, now)
        transfer_part = w6 * (transfer / 1e3)
        fixed = w0 * 1.0  # the fixed term (its feature is 1), the same for every pod
        out: dict[Endpoint, TtftPrediction] = {}
        count_overdue = self.count_overdue
        for endpoint in endpoints:
            # Spelled out rather than `min(prompt, round(share * block))`: the same
            # value for any share a prefix index gives (0 to 1), without two builtin
            # calls for each of the (mostly unmatched) candidates.
            share = matched.get(endpoint, 0.0)
            if share > 0.0:
                cached = round(share * block)
                if cached > prompt:
                    cached = prompt
            else:
                cached = 0
            uncached = prompt - cached
            pod = pods.get(endpoint)
            overdue = 0
            if pod is None:
                queued, factor, in_flight, tokens, decoding_tokens = 0.0, 1.0, 0, 0, 0
                decoding = 0
            else:
                ledger = pod.ledger
                queued = ledger.backlog(now)
                factor = pod.factor
                decoding = ledger.decoding
                in_flight = ledger.queued + decoding
                tokens = pod.tokens_in_flight
                decoding_tokens = pod.decoding_tokens
                if count_overdue:
                    overdue = ledger.overdue(now)
            if decode is not None:
                decoding = 0 if decode_pod is None else decode_pod.ledger.decoding
            # Most pods report nothing waiting: no call for them.
            waiting = decode_waiting
            if endpoint.metrics.waiting_requests > 0:
                waiting += self._waiting(endpoint, now)
            # The terms in the model's order (FEATURES), summed in that order: the
            # same seconds as `TtftPrediction.parts` adds up. The pod's speed
            # scales its own prefill; the queue is already in its seconds.
            # `attention_pairs` and the int-to-float conversions are spelled out: the
            # same floats (a float times an int converts the int as `float` does),
            # without four calls for each candidate.
            queue = w1 * queued
            prefill = w2 * (uncached / 1e3 * factor)
            attention = w3 * (uncached * (cached + uncached / 2.0) / 1e6 * factor)
            seconds = (
                fixed
                + queue
                + prefill
                + attention
                + w4 * decoding
                + w5 * waiting
                + transfer_part
                + w7 * overdue
            )
            out[endpoint] = TtftPrediction(
                seconds=seconds,
                own_work_s=prefill + attention,
                queue_s=queue,
                weights=weights,
                factor=factor,
                queued_s=queued,
                cached_tokens=cached,
                uncached_tokens=uncached,
                decoding=decoding,
                waiting=waiting,
                transfer_tokens=transfer,
                requests_in_flight=in_flight,
                tokens_in_flight=tokens,
                decoding_tokens=decoding_tokens,
                overdue=overdue,
            )
        return out

    # -- extension points --------------------------------------------------------------

    async def prepare(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> None:
        cycle.put(self.key, TtftPredictions(self, request, cycle, endpoints))

    def pre_request(
        self, request: InferenceRequest, cycle: CycleState, result: SchedulingResult
    ) -> None:
        predictions = cycle.get(self.key)
        if predictions is None or not result.targets:
            return
        endpoint = result.targets[0]
        info = cycle.get(self.prefix_key)
        if info is not None and info.total_blocks > 0:
            self._share_samples += 1
            rate = max(CONTINUING_RATE, 1.0 / self._share_samples)
            self.continuing_share += rate * (float(info.continues) - self.continuing_share)
        prefill = _prefill_target(result)
        pod = self._pod(endpoint)
        prefill_pod = None
        if prefill is None:
            prediction = predictions.predict(endpoint)
        else:
            prediction = predictions.predict_disaggregated(prefill, endpoint)
            prefill_pod = self._pod(prefill)
        charge = _Charge(pod, prediction, object(), prefill_pod)
        # The request's own prefill joins the computing pod's queue: what later
        # requests wait for.
        now = self.clock()
        charge.computing.ledger.charge(
            charge.key, prediction.own_work_s, now, due=now + prediction.seconds
        )
        charge.computing.tokens_in_flight += prediction.uncached_tokens
        cycle.put(self._charge, charge)

    def response_first_chunk(
        self,
        request: InferenceRequest,
        cycle: CycleState,
        result: SchedulingResult,
        elapsed_s: float,
    ) -> None:
        charge = cycle.get(self._charge)
        if charge is None or charge.decoding or charge.released:
            return
        charge.decoding = True
        charge.pod.decoding_tokens += charge.prompt_tokens
        if charge.prefill_pod is None:
            charge.pod.ledger.started(charge.key, self.clock())
        else:
            charge.prefill_pod.ledger.started(charge.key, self.clock(), decodes=False)
            charge.pod.ledger.decoding_started()
        # The speed factor that scaled the prediction's prefill learns from it.
        pod = charge.computing
        predicted = charge.prediction.seconds
        if not (elapsed_s > 0 and math.isfinite(elapsed_s)):
            return
        self._observed.observe(elapsed_s)
        cycle.put(TTFT_OBSERVED, TtftObservation(result.targets[0].name, predicted, elapsed_s))
        if predicted > 0:
            self._error.observe(abs(predicted - elapsed_s) / elapsed_s)
        self.model.observe(charge.prediction.x, elapsed_s)
        pod.observations += 1
        if self.revalue_queued is not None:
            self._revalue(charge.prediction.x)
        if predicted > 0 and self.adapt > 0:
            # Follow the pod's observed / predicted ratio in log space, a step of
            # `adapt` per observation, one observation moving it by at most 2x.
            step = max(-math.log(2.0), min(math.log(2.0), math.log(elapsed_s / predicted)))
            factor = pod.factor * math.exp(self.adapt * step)
            pod.factor = max(MIN_POD_FACTOR, min(MAX_POD_FACTOR, factor))

    def _revalue(self, x: tuple[float, ...]) -> None:
        """Re-value every pod's queued work when the model's prediction of `x`'s own
        prefill has moved by more than `revalueQueued` since it was charged."""
        assert self.revalue_queued is not None
        weights = self.model.weights
        charged = self._charged_weights
        before = charged[_PREFILL] * x[_PREFILL] + charged[_ATTENTION] * x[_ATTENTION]
        now_s = weights[_PREFILL] * x[_PREFILL] + weights[_ATTENTION] * x[_ATTENTION]
        if before <= 0.0 or now_s <= 0.0:
            return
        ratio = now_s / before
        if abs(ratio - 1.0) <= self.revalue_queued:
            return
        self._charged_weights = tuple(weights)
        now = self.clock()
        for pod in self._pods.values():
            pod.ledger.rescale(ratio, now)

    def post_response(
        self,
        request: InferenceRequest,
        cycle: CycleState,
        result: SchedulingResult,
        response: ResponseInfo,
    ) -> None:
        charge = cycle.get(self._charge)
        if charge is None or charge.released:
            return  # released once, however often the end is reported
        charge.released = True
        computing = charge.computing
        computing.tokens_in_flight = max(
            0, computing.tokens_in_flight - charge.prediction.uncached_tokens
        )
        if charge.decoding:
            charge.pod.decoding_tokens = max(0, charge.pod.decoding_tokens - charge.prompt_tokens)
        now = self.clock()
        if charge.prefill_pod is not None:
            charge.prefill_pod.ledger.release(charge.key, False, now)
        charge.pod.ledger.release(charge.key, charge.decoding, now)

    def describe_endpoint(self, endpoint: Endpoint) -> Mapping[str, object]:
        pod = self._pods.get(endpoint)
        if pod is None:
            return {
                "predictedTtft": {
                    "queuedRequests": 0,
                    "queuedMs": 0.0,
                    "decoding": 0,
                    "decodingTokens": 0,
                }
            }
        return {
            "predictedTtft": {
                "queuedRequests": pod.ledger.queued,
                "queuedMs": round(pod.ledger.backlog(self.clock()) * 1e3, 3),
                "decoding": pod.ledger.decoding,
                "decodingTokens": pod.decoding_tokens,
                "podFactor": round(pod.factor, 4),
                "observations": pod.observations,
            }
        }


def _prefill_target(result: SchedulingResult) -> Endpoint | None:
    """A disaggregated pick's prefill endpoint: the first target of the profile
    other than the primary one, if the request uses one (the P/D handlers keep
    the prefill profile in the result only when the request goes to it)."""
    for name, profile in result.profiles.items():
        if (
            name != result.primary_profile
            and profile.targets
            and profile.targets[0] is not result.targets[0]
        ):
            return profile.targets[0]
    return None


class _WeightsCollector(Collector):
    """`epp_ttft_model_weight{plugin,feature}`, read from the models at exposition."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._models: dict[str, OnlineTtftModel] = {}
        registry.register(self)

    def add(self, plugin: str, model: OnlineTtftModel) -> None:
        self._models[plugin] = model

    def describe(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("epp_ttft_model_weight", "", labels=["plugin", "feature"])
        yield CounterMetricFamily("epp_ttft_model_covariance_resets", "", labels=["plugin"])

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            "epp_ttft_model_weight",
            "The predicted-TTFT model's fitted weights (seconds per unit of each feature:"
            " fixed, queued seconds, thousands of uncached tokens, millions of attention"
            " pairs, decoding requests, waiting requests, thousands of tokens of KV cache"
            " transferred, overdue requests).",
            labels=["plugin", "feature"],
        )
        resets = CounterMetricFamily(
            "epp_ttft_model_covariance_resets",
            "Times the predicted-TTFT model's fit found its covariance no longer positive"
            " definite (rounding over a long run) and started it again from the prior.",
            labels=["plugin"],
        )
        for plugin, model in self._models.items():
            for feature, weight in model.describe().items():
                family.add_metric([plugin, feature], weight)
            resets.add_metric([plugin], model.covariance_resets)
        yield family
        yield resets
