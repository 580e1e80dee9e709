"""`predicted-ttft-scorer`: prefers the pod with the lowest predicted time to first
token for the request, as `predicted-ttft-producer` (the producer named by
`predictedTtftProducerName`, default `predicted-ttft-producer`) predicts it.

Pods predicted within `tieTolerance` (0.25: 25%, plus 1 ms) of the best are a tie:
predictions err by about that much, and among near-equal pods what matters is
what the pick does to the requests that follow. Ties are ranked

1. by the share of the prompt the pod would have to prefill, in tenths: a pod
   holding the prompt's prefix adds less work to the fleet and keeps the prefix
   in one place (with the prefix producer's `cacheWindow`, the share the pod was
   ever sent, even where its cache may have evicted it: a prompt group stays on
   one pod). A pod with more than `balanceFactor` (1.5) times the fleet's
   mean uncached tokens in flight from this EPP counts as holding nothing: a hot
   prefix, or a prompt every conversation shares, then spreads to the pods that
   are less loaded instead of piling onto the pods that hold it. With
   `crowdedFromDemandPods` (none: off; the default profile sets 1) only for a
   prefix wanted by more than that many pods' worth of the recent requests (the
   prefix producer's `demand` times the candidates): a prefix one pod can carry
   (a prompt group of many, a conversation's history) stays on the pod holding
   it however loaded, since counting that pod as holding nothing copies the
   prefix to a second pod, a miss's prefill on a loaded fleet, and splits its
   requests between two pods (docs/routing-evidence.md, A prefix one pod can carry);
2. then by the prefill work queued ahead of it on the pod, in tenths of the
   request's own prefill: a tie can be a whole prefill wide (a new prompt's), and
   a pod with one queued would make the request wait for it;
3. then by those tokens in flight (llm-d's token load, mostly decoding
   requests): a prompt no pod holds goes where it adds the least.

With `tieDecodeFactor` (none: off; the default profile sets 2.5), a pod decoding
more than that many times the fleet's mean context (the producer's decoding
tokens: the prompts of the requests it decodes) ranks, after the share of the
prompt and the queue, below every pod that does not. A pod decoding long
conversations that were hits has few uncached tokens in flight and would
otherwise take new prompts while each of its decode steps reads several times a
typical pod's context (the whole Mooncake trace at 0.8: new prompts went to the
pod decoding several times the mean, whose answers then set the run's length;
docs/routing-evidence.md, The decode load in a tie). A hit there keeps its rank, and no
request joins a queue for it.

Equal ranks score equal, and the picker draws among them. The tied pods score in
(0.9, 1], the others 0.9 x best / predicted. For a prompt no pod holds half of,
the tie is `newPrefixTolerance` (1.0) wide: where a new prompt group lands, its
followers go, so balance is worth more than a few milliseconds now.

Sessions: where requests continue earlier prompts (the prefix producer's
`continues`; the producer's `continuing_share`, e.g. 5/6 for six-turn
conversations), a new session's later turns will follow it to the pod it gets
now. Its predictions are then charged share / (1 - share) turns to come, each
about its own prefill for every request the pod has in flight above the fleet's
mean (credited below it): the greedy choice, the holder of a system prompt every
conversation shares, would pile the conversations onto few pods for their whole
length. Where no request continues another, nothing changes. With
`sessionTieShare` (none by default: off), a request that continues none while
the share is at least that is a new session whose tie is as wide as a new
prompt's and ranked by tokens in flight alone: where it starts, it stays, so its
placement is about spreading sessions, not about this turn's hit. It helps
conversational traffic from a cold start and costs traffic of independent
prompts over shared prefixes (docs/routing.md, Sessions).

`queueWeight` (1.0: off; the default profile sets 2, with the fade) counts the
queue a request would join up to that many times when pods are compared (not in
the prediction itself): once for the request's own wait, the rest for what the
greedy pick leaves out, the wait its own work then adds to the requests that
queue behind it there when an idle pod could have taken them. The extra counts
in proportion to the share of candidates with no queue, so it fades as the
fleet saturates: in overload, spreading costs hits the fleet has no room for.
It spreads a hot prompt, or conversations over one system prompt, before the
pods holding them build a queue (docs/routing-evidence.md, The queue's weight). The tie
window stays as wide as the predictions' error; the explain note's `costMs` is
what is compared. With `queueWeightFade: true` (the default profile's) the
extra also fades as the fleet's mean queue grows toward this request's own
prefill (its work on the pod holding most of its prompt), and is gone at or
above it: a fleet whose pods idle between short queues has room for what
spreading costs, while one whose pods are idle only between long ones (long
prompts pinned to the pods holding their histories) does not, though as many of
its pods idle at an instant. A hit, with little to prefill, loses the extra
once the fleet's mean queue passes that little; in the lab the fade keeps the
conversations' gain but not the hot prompt's (docs/routing.md). With
`queueWeightFadeMissCapMs` (none: off) the fade's scale is the larger of the
request's own prefill and a miss's prefill capped at that many milliseconds: a
request whose miss is short keeps the extra until the mean queue reaches it,
and a long prompt's (a miss of seconds) until the mean queue reaches the cap,
not the seconds of its miss.

`hotPrefixQueueWeight` (none: off; the default profile sets 8): the queue
weight, not faded, for a request whose prompt is mostly a hot prefix: more of
the recent requests ended their longest match where this one's ends (the prefix
producer's `demand`, a share of its last few hundred picks) than its share of
the pods holding that prefix (at least half the prompt, on pods holding nine
tenths of the deepest match any pod has). A hot system prompt then spreads to
idle pods while some are idle, each paying one short miss, however long the
fleet's mean queue, where the fade would leave a hit's extra nothing once that
queue passed its small prefill. A prompt group that is one of many (shared
prefixes, four groups a pod) wants a fraction of a pod and keeps the faded
weight; so does a long prompt with a short shared start (the Mooncake trace's
system prompt): its prefix is not half of it. Only the approximate prefix
producer counts the demand; with another, no prompt is hot (docs/routing-evidence.md,
The queue's weight).

`workWeight` (1.0: off; the default profile sets 8, gated as below) counts the
request's own prefill up to that many times when pods are compared, the extra in
proportion to the share of candidates with prefill queued: on a busy fleet, a
prefill the pick adds (a miss where a pod holds the prefix) also delays every
request that queues behind it, so the work a hit saves is worth more than this
request's wait. A crowded pod (the tie rule's: more than `balanceFactor` times
the mean tokens in flight) is counted as if it held nothing: its hit earns no
extra, or a hot prompt's holders would win every comparison until their queues
outgrew several whole prefills elsewhere. On the whole Mooncake trace at 0.95 of
capacity it lowers the p90 by more than half (docs/routing-evidence.md, The work's weight).
With `workWeightBusyFrom` (0.0: the extra in proportion to the busy share, as
above; the default profile sets 0.8) the extra is nothing until that share of
the candidates have prefill queued and grows to all of it when every one has: a
fleet with pods idle has room for a miss's prefill, and only once every pod
queues does the work a miss adds fall behind what arrives. On the Mooncake trace
most pods but not all queue at 0.8 of capacity, and all of them once the fleet
falls behind at 0.95; through Envoy on 8 pods, shared prefixes queue every pod
in bursts, and the weight then costs them (docs/routing-evidence.md, The work's weight).
`workWeightBusyForS` (none: off; the default profile sets 5) tells a fleet that
has fallen behind from such a burst: the scorer keeps, on its clock, the share
of the last that many seconds (an exponential average with that time constant)
during which at least `workWeightBusyFrom` of the candidates (and at least one)
had prefill queued, and the extra is nothing until that share reaches one half
and all of it when the fleet has been busy throughout. Busy from a quiet start,
the fleet needs the time constant times ln 2 before the weight acts at all: a
burst shorter than that changes no pick; a fleet that stays behind for longer
does (the Mooncake trace at 0.95 of capacity). The clock is the EPP's: a benchmark whose pods run
slower than real time must scale it (`bench run` does).

`decodeBalanceFactor` (none: off; the default profile sets 3) counts a pod as
holding nothing of the prompt when the prompts it is decoding (the producer's
decoding tokens: every decode step reads their context) add up to more than that
many times the fleet's mean: its hit is charged the
work of a miss, in proportion to the share of candidates with no prefill queued
(as the queue weight fades: when every pod queues, the fleet has no room for the
prefill a miss adds), and the tie rule counts it as crowded. Chasing hits, the
greedy pick keeps sending a family of long conversations to the pod that holds
them, whose decode steps then slow down for every stream on it (the whole
Mooncake trace on 64 pods at 0.8: one pod decoding several times a typical
pod's context set the run's length; see docs/routing-evidence.md, The decode load).

`spreadFactor` (none: off; the default profile sets 2):
for a request that continues no earlier one (a new question over a shared prompt,
a conversation's first turn), a pod with more than that many times the fleet's
mean tokens in flight is charged the work of a miss for its hit, in proportion to
the share of candidates with no prefill queued, as a decode-heavy pod is. A hot
prompt's holders otherwise keep its requests while pods idle, and a cold start's
first turns gather where the system prompt is; the turns that follow stay where
their history is, charged nothing (docs/routing-evidence.md, Spreading what starts).
Such a pod also ranks in a tie as holding nothing, as a crowded one.

`spreadByPodRequests` (false; the default profile sets it): the spread compares
the requests each pod reports running and waiting (its latest fresh scrape, plus
what this EPP sent it since) instead of this EPP's own tokens in flight. Behind
several EPP replicas each sees only its share of the requests, a pod or two of
them more than the mean is already twice it, and new prompts leave the pods
holding them; the pods' own counts include every replica's (docs/routing-evidence.md,
Where precise must beat approximate). A pod whose scrape is stale counts this
EPP's own requests there, times the requests the fresh pods report for each of
this EPP's own on them (the other replicas' share).

`kvRoomForNew` (false; off in the default profile): for a request that continues
no earlier one, a pod whose KV cache has no room for the request's uncached
tokens (its latest fresh scrape: the cache usage times the blocks it reports, of
their size) is charged the request's own prefill once more, as the engine,
out of blocks, preempts a running request and computes a prompt again; unless
every candidate is such a pod. A request that continues one stays with its
history: moving it costs the whole history's prefill (on the whole Mooncake
trace a gate for every request raised the p90; docs/routing-evidence.md, Room
in the KV cache).

`tieMaxMs` (none: off; the default profile sets 250): no tie
is wider than that many milliseconds. A tie is a share of the best prediction, so
a long prompt's is wide in time (25% of a 2 s prefill is half a second, a new
prompt's 100% of it two seconds), and its rank may choose a pod that much slower
for the hit or the balance it offers. Capped, long prompts go where they start
sooner; short prompts' ties are unchanged. On the whole Mooncake trace at 0.8 it
lowers the p90 and raises the p99 (docs/routing-evidence.md, A tie's width).

`newPrefixTieMaxMs` (none: off): the same cap for the ties of prompts no pod holds
half of (`newPrefixTolerance` wide) alone; a prompt some pod holds keeps its
`tieTolerance` tie however long, and its rank keeps it with its prefix. On the
whole Mooncake trace it routes within the default's intervals at 0.8, with no
fewer preemptions: the longest new prompts' capped ties are what gather them
where a KV cache overflows (docs/routing-evidence.md, A tie's width).

Each candidate's prediction and its parts (queued, prefill, attention, decoding,
waiting, fixed) are left for /debug/explain under the scorer's name, and the
best is logged at debug level. Without the producer's data every endpoint
scores 1.0 and a warning is logged once.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated

import msgspec

from epp.datastore import CACHE_INFO, KV_CACHE_USAGE, RUNNING, WAITING, Endpoint
from epp.requests import InferenceRequest
from epp.scheduling import CycleState, PluginContext, explain_note, explaining

from .predicted_ttft_producer import (
    DEFAULT_PRODUCER,
    TtftPrediction,
    predicted_ttft_key,
)

log = logging.getLogger(__name__)

# Below this a prediction counts as this (a division guard: no TTFT is shorter).
_FLOOR_S = 1e-4
_TIE_FLOOR_S = 1e-3
# Turns to come are counted up to 19 (a share of 0.95): one stray estimate cannot
# make load all that matters.
_MAX_SHARE = 0.95
# The facts `spreadByPodRequests` counts a pod's requests from.
_POD_REQUEST_FACTS = (RUNNING, WAITING)
# The facts `kvRoomForNew` reads.
_KV_ROOM_FACTS = (KV_CACHE_USAGE, CACHE_INFO)


def _uncached_tenths(p: TtftPrediction) -> int:
    """The share of the prompt the pod would have to prefill, in tenths: the same
    for pods that hold the same prefix to within a block or two."""
    total = p.cached_tokens + p.uncached_tokens
    return round(10 * p.uncached_tokens / total) if total > 0 else 0


def _above(values: Mapping[Endpoint, int], factor: float) -> set[Endpoint]:
    """The endpoints whose value is more than `factor` times the mean of them all
    (a mean under 1 counts as 1: an idle fleet has no outliers)."""
    limit = factor * max(1.0, sum(values.values()) / len(values))
    return {e for e, v in values.items() if v > limit}


def _hot_prefix(predicted: Mapping[Endpoint, TtftPrediction], demand: float) -> bool:
    """Whether the request's prompt is mostly a prefix that more of the recent
    requests wanted (`demand`, their share) than its holders' share of the pods:
    the pods holding it carry more than a pod's worth of it each."""
    deepest = max(p.cached_tokens for p in predicted.values())
    anyone = next(iter(predicted.values()))
    if deepest <= 0 or 2 * deepest < anyone.cached_tokens + anyone.uncached_tokens:
        return False
    holders = sum(p.cached_tokens >= 0.9 * deepest for p in predicted.values())
    return demand * len(predicted) > holders


def _charged_a_miss(
    seconds: Mapping[Endpoint, float],
    pods: set[Endpoint],
    share: float,
    miss: float,
    predicted: Mapping[Endpoint, TtftPrediction],
) -> dict[Endpoint, float]:
    """`seconds` with each of `pods` charged `share` of what its hit saves: the work
    of a miss (the most any candidate would prefill) less its own."""
    return {
        e: s + share * (miss - predicted[e].own_work_s) if e in pods else s
        for e, s in seconds.items()
    }


def _without_kv_room(predicted: Mapping[Endpoint, TtftPrediction], now: float) -> set[Endpoint]:
    """The pods whose KV cache, at their latest fresh scrape, has no room left for
    the request's uncached tokens (a pod whose usage, blocks or block size is not
    known counts as having room)."""
    full = set()
    for e, p in predicted.items():
        m = e.metrics
        if m.num_gpu_blocks <= 0 or m.block_size <= 0 or not m.all_known(_KV_ROOM_FACTS, now):
            continue
        cache_tokens = m.num_gpu_blocks * m.block_size
        if m.kv_cache_usage * cache_tokens + p.uncached_tokens > cache_tokens:
            full.add(e)
    return full


@dataclass
class BusyTime:
    """The share of recent time the fleet was busy: an exponential average, on the
    clock, of whether it was at each pick, each state held until the next pick
    (time, not picks: a count of picks spans fewer seconds the more requests a
    second the fleet gets). Starts at nothing, as a fleet that has just started."""

    share: float = 0.0
    busy: bool = False
    at: float | None = None

    def update(self, busy: bool, now: float, time_constant_s: float) -> float:
        """Advance to `now` (the state since the last update held until then),
        record `busy` from now on, and return the share."""
        if self.at is not None:
            held = 1.0 if self.busy else 0.0
            decay = math.exp(-max(0.0, now - self.at) / time_constant_s)
            self.share = held + (self.share - held) * decay
        self.busy, self.at = busy, now
        return self.share


class PredictedTtftScorer:
    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        predicted_ttft_producer_name: str = ""
        tie_tolerance: Annotated[float, msgspec.Meta(ge=0.0)] = 0.25
        new_prefix_tolerance: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
        balance_factor: Annotated[float, msgspec.Meta(ge=0.0)] = 1.5
        crowded_from_demand_pods: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
        session_tie_share: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
        queue_weight: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
        queue_weight_fade: bool = False
        queue_weight_fade_miss_cap_ms: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
        hot_prefix_queue_weight: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
        work_weight: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
        work_weight_busy_from: Annotated[float, msgspec.Meta(ge=0.0, lt=1.0)] = 0.0
        work_weight_busy_for_s: Annotated[float, msgspec.Meta(gt=0.0)] | None = None
        decode_balance_factor: Annotated[float, msgspec.Meta(gt=1.0)] | None = None
        spread_factor: Annotated[float, msgspec.Meta(gt=1.0)] | None = None
        tie_max_ms: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
        new_prefix_tie_max_ms: Annotated[float, msgspec.Meta(ge=0.0)] | None = None
        spread_by_pod_requests: bool = False
        tie_decode_factor: Annotated[float, msgspec.Meta(gt=1.0)] | None = None
        kv_room_for_new: bool = False

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        self.name = context.name
        self.producer = params.predicted_ttft_producer_name or DEFAULT_PRODUCER
        self.key = predicted_ttft_key(self.producer)
        self.tie_tolerance = params.tie_tolerance
        self.new_prefix_tolerance = params.new_prefix_tolerance
        self.balance_factor = params.balance_factor
        self.crowded_from_demand_pods = params.crowded_from_demand_pods
        self.session_tie_share = params.session_tie_share
        self.queue_weight = params.queue_weight
        self.queue_weight_fade = params.queue_weight_fade
        self.fade_miss_cap_s = (
            None
            if params.queue_weight_fade_miss_cap_ms is None
            else params.queue_weight_fade_miss_cap_ms / 1000.0
        )
        self.hot_prefix_queue_weight = params.hot_prefix_queue_weight
        self.work_weight = params.work_weight
        self.work_weight_busy_from = params.work_weight_busy_from
        self.work_weight_busy_for_s = params.work_weight_busy_for_s
        self.busy_time = BusyTime()
        self.decode_balance_factor = params.decode_balance_factor
        self.spread_factor = params.spread_factor
        self.spread_by_pod_requests = params.spread_by_pod_requests
        self.tie_decode_factor = params.tie_decode_factor
        self.kv_room_for_new = params.kv_room_for_new
        self.clock = context.clock
        self.tie_max_s = None if params.tie_max_ms is None else params.tie_max_ms / 1e3
        self.new_prefix_tie_max_s = (
            None if params.new_prefix_tie_max_ms is None else params.new_prefix_tie_max_ms / 1e3
        )
        self._warned = False

    def _pod_requests(self, predicted: Mapping[Endpoint, TtftPrediction]) -> dict[Endpoint, int]:
        """Each pod's requests in flight from every client: what it reported running
        and waiting at its latest fresh scrape, plus what this EPP sent it since
        (`Endpoint.unseen_routed`). Where the scrape is stale, this EPP's own
        requests there times the fresh pods' count for each of this EPP's own:
        behind several replicas this EPP sends a share of every pod's requests, and
        its own count alone would make the stale pod read lighter than the rest."""
        now = self.clock()
        out: dict[Endpoint, int] = {}
        stale: list[tuple[Endpoint, TtftPrediction]] = []
        reported = own = 0
        for e, p in predicted.items():
            m = e.metrics
            if m.all_known(_POD_REQUEST_FACTS, now):
                count = m.running_requests + m.waiting_requests + e.unseen_routed
                out[e] = count
                reported += count
                own += p.requests_in_flight
            else:
                stale.append((e, p))
        ratio = max(1.0, reported / own) if own > 0 else 1.0
        for e, p in stale:
            # At a ratio of 1 (no fresh pod, or no more requests than this EPP's own)
            # the count is this EPP's own: `round(n * 1.0)` is n, without the call.
            own_requests = p.requests_in_flight
            out[e] = own_requests if ratio == 1.0 else round(own_requests * ratio)
        return out

    def score(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Mapping[Endpoint, float]:
        predictions = cycle.get(self.key)
        if predictions is None:
            if not self._warned:
                self._warned = True
                log.warning(
                    "%s: no predictions from producer %r: every endpoint scores 1.0"
                    " (declare a predicted-ttft-producer of that name)",
                    self.name,
                    self.producer,
                )
            return dict.fromkeys(endpoints, 1.0)
        predicted = predictions.predict_all(endpoints)
        if not predicted:
            return {}
        # One pass over the predictions gathers what the rules below compare, rather
        # than a comprehension for each: per pod, its prediction (floored), the
        # prefill queued ahead, its tokens in flight and the context it decodes;
        # and this request's own prefill where it is least (its work on the pod
        # holding most of it) and most (a miss's work).
        seconds: dict[Endpoint, float] = {}
        queued: dict[Endpoint, float] = {}
        tokens: dict[Endpoint, int] = {}
        # The prompt tokens each pod decodes (the context its decode steps read):
        # the decode balance and the decode tie both compare them to their mean.
        context: dict[Endpoint, int] = {}
        with_context = self.decode_balance_factor is not None or self.tie_decode_factor is not None
        idle_pods = busy_pods = requests = 0
        least_work = miss = next(iter(predicted.values())).own_work_s
        for e, p in predicted.items():
            # `x if x > floor else floor`, not `max(floor, x)`: the same value (NaN
            # included), without the builtin's call for each pod. The least and most
            # work likewise as `min` and `max` find them (the first of equals).
            s = p.seconds
            seconds[e] = s if s > _FLOOR_S else _FLOOR_S
            q = p.queue_s
            queued[e] = q
            if q <= 0.0:
                idle_pods += 1
            elif q > 0.0:
                busy_pods += 1
            own = p.own_work_s
            if own < least_work:
                least_work = own
            if own > miss:
                miss = own
            requests += p.requests_in_flight
            tokens[e] = p.tokens_in_flight
            if with_context:
                context[e] = p.decoding_tokens
        share = min(predictions.continuing_share, _MAX_SHARE)
        new_session = share > 0.0 and not predictions.continues
        # With `sessionTieShare`: a request that continues none while that share of
        # requests continue earlier ones starts a session, which stays where it
        # starts, so its pick is about spreading sessions, not about this turn's
        # hit: its tie is as wide as a new prompt's and goes to the pod with the
        # fewest tokens in flight, whoever holds the prompt's start.
        session_tie = (
            new_session and self.session_tie_share is not None and share >= self.session_tie_share
        )
        charges: dict[Endpoint, float] = {}
        if new_session:
            # A new session, where requests continue earlier ones: its later turns
            # will follow it to the pod it gets now (their history is there), each
            # waiting behind the turns of the sessions already on that pod. So the
            # pick is charged, per turn to come (share / (1 - share) of them,
            # geometrically), about this turn's own prefill for each request the pod
            # has in flight above the fleet's mean, and credited as much below it.
            turns = share / (1.0 - share)
            mean = requests / len(predicted)
            charged: dict[Endpoint, float] = {}
            for e, p in predicted.items():
                charge = turns * (p.requests_in_flight - mean) * least_work
                charges[e] = charge
                s = seconds[e] + charge
                charged[e] = s if s > _FLOOR_S else _FLOOR_S
            seconds = charged
        kv_full: set[Endpoint] = set()
        if self.kv_room_for_new and not predictions.continues:
            # Out of blocks, the engine preempts a running request and computes a
            # prompt again: about this request's own prefill once more. Where every
            # pod is out of room, the charge would move nothing.
            kv_full = _without_kv_room(predicted, self.clock())
            if kv_full and len(kv_full) < len(predicted):
                seconds = {
                    e: s + predicted[e].own_work_s if e in kv_full else s
                    for e, s in seconds.items()
                }
        best = min(seconds.values())
        # The share of candidates with no prefill queued.
        idle = idle_pods / len(queued)
        # Ties are as wide as the predictions' error, a share of the best prediction,
        # whatever the queue weight.
        tie_base = best
        # A hot prefix: more of the recent requests want it than pods hold it. At
        # least one pod holds any prefix matched, so a prefix wanted by a pod's
        # worth or less (a shared prefix's group) is never hot: no pass over the
        # candidates for it.
        demand = predictions.demand
        hot = (
            self.hot_prefix_queue_weight is not None
            and demand * len(predicted) > 1.0
            and _hot_prefix(predicted, demand)
        )
        if self.queue_weight != 1.0 or hot:
            # In proportion to the pods with no queue: while some are idle, joining a
            # queue delays the requests behind it that could have gone there; when
            # every pod queues, the queue is everywhere and what counts is the work
            # the pick adds (spreading then costs hits the fleet has no room for).
            extra = (self.queue_weight - 1.0) * idle
            if hot:
                # Each pod that takes a hot prompt pays one short miss and then
                # holds it for the requests that follow: spread while pods idle,
                # however long the mean queue is beside this hit's prefill.
                assert self.hot_prefix_queue_weight is not None
                extra = (self.hot_prefix_queue_weight - 1.0) * idle
            elif self.queue_weight_fade:
                # The fleet's mean queue in units of this request's own prefill:
                # a small fraction over conversations on one system prompt with
                # room to spare; on the Mooncake trace near saturation, where a
                # quarter of the pods idle at each instant, hundreds of ms against
                # a hit's few, and a request sent to an idle pod brings its whole
                # long prompt's prefill.
                mean_queue = sum(queued.values()) / len(queued)
                scale = least_work
                if self.fade_miss_cap_s is not None:
                    # Where a miss is short (a hot system prompt, not a long
                    # history), spreading costs the fleet little: the extra lasts
                    # until the mean queue reaches a miss's prefill, up to the cap.
                    capped = miss if miss < self.fade_miss_cap_s else self.fade_miss_cap_s
                    scale = capped if capped > scale else scale
                extra *= max(0.0, 1.0 - mean_queue / max(_FLOOR_S, scale))
            seconds = {e: s + extra * queued[e] for e, s in seconds.items()}
            best = min(seconds.values())
        # Crowded: more than `balanceFactor` times the fleet's mean tokens in flight.
        # Both the work weight and the tie rank count such a pod as holding nothing.
        crowded: set[Endpoint]
        if (
            self.crowded_from_demand_pods is not None
            and demand * len(predicted) <= self.crowded_from_demand_pods
        ):
            # A prefix the recent requests want no more of than one pod carries (a
            # prompt group of many, a conversation's history): counted as holding
            # nothing, its loaded holder would send it to a second pod, a miss's
            # whole prefill on a fleet already loaded, and its requests would then
            # split between two pods for good. Only a prefix wanted beyond one pod
            # spreads by crowding (the decode balance and the spread, below, still
            # charge their pods whatever the demand).
            crowded = set()
        else:
            crowded = _above(tokens, self.balance_factor)
        if self.decode_balance_factor is not None:
            # Decode-heavy: the contexts this pod decodes are far above the fleet's
            # mean, so every stream there steps slowly; a hit there is charged as a
            # miss, so requests that chase it go where decoding is lighter (some pod
            # always is: none is above k > 1 times the mean of them all).
            heavy = _above(context, self.decode_balance_factor)
            # In proportion to the pods with no prefill queued, as the queue weight:
            # when every pod queues, the fleet has no room for the prefill a miss adds.
            if heavy and idle > 0.0:
                seconds = _charged_a_miss(seconds, heavy, idle, miss, predicted)
                best = min(seconds.values())
                crowded |= heavy
        pod_requests: dict[Endpoint, int] | None = None
        if self.spread_factor is not None and not predictions.continues and idle > 0.0:
            # A request that starts something (a new question over a shared prompt, a
            # conversation's first turn): the requests like it that follow go where it
            # goes, so while pods idle, a pod far above the fleet's mean tokens in
            # flight is charged the work of a miss for its hit, as a decode-heavy pod
            # is. A request that continues one stays with its history.
            if self.spread_by_pod_requests:
                pod_requests = self._pod_requests(predicted)
            swamped = _above(tokens if pod_requests is None else pod_requests, self.spread_factor)
            if swamped:
                seconds = _charged_a_miss(seconds, swamped, idle, miss, predicted)
                best = min(seconds.values())
                # And the tie rule counts it as holding nothing, as a crowded pod
                # (with the tokens in flight and the default factors it is one already).
                crowded |= swamped
        work_share: float | None = None  # of the work weight's extra, when it is set
        if self.work_weight != 1.0:
            # In proportion to the pods with a queue: the prefill this pick adds
            # delays the requests that queue behind it there, so on a busy fleet
            # the work a hit saves counts for more than this request's own wait.
            # A crowded pod counts the work of a miss (the most any candidate
            # would prefill): the tie rule already treats it as holding nothing,
            # and a hot prompt's holders would otherwise keep every request
            # until their queues outweighed several whole prefills elsewhere.
            busy = busy_pods / len(queued)
            start = self.work_weight_busy_from
            if self.work_weight_busy_for_s is None:
                # With `workWeightBusyFrom`, nothing until that share of the pods
                # queue: while some idle, the fleet has room for a miss's prefill.
                share = max(0.0, (busy - start) / (1.0 - start))
            else:
                # Only once the fleet has stayed busy: a burst that queues every
                # pod for a moment passes before the work a miss adds matters.
                # (At least one pod: from a share of 0, busy means any pod queues.)
                held = self.busy_time.update(
                    busy >= start and busy > 0.0, self.clock(), self.work_weight_busy_for_s
                )
                share = min(1.0, max(0.0, 2.0 * held - 1.0))
            work_share = share
            extra = (self.work_weight - 1.0) * share
            if extra != 0.0:  # below the busy share (most picks), no pass over the pods
                seconds = {
                    e: s + extra * (miss if e in crowded else predicted[e].own_work_s)
                    for e, s in seconds.items()
                }
                best = min(seconds.values())
        if explaining(cycle):
            notes: dict[str, dict[str, object]] = {
                e.name: {
                    **predicted[e].describe(),
                    "continuingShare": round(predictions.continuing_share, 3),
                    "sessionChargeMs": round(charges.get(e, 0.0) * 1e3, 3),
                    "sessionTie": session_tie,
                    "decodingTokens": predicted[e].decoding_tokens,
                    "prefixDemand": round(demand, 4),
                    "hotPrefix": hot,
                    "crowded": e in crowded,
                    "kvFull": e in kv_full,
                    "costMs": round(seconds[e] * 1e3, 3),
                }
                for e in endpoints
            }
            if work_share is not None:
                for note in notes.values():
                    note["workWeightShare"] = round(work_share, 4)
            if self.spread_factor is not None and self.spread_by_pod_requests:
                # What the spread compares, whether or not it applied to this pick.
                if pod_requests is None:
                    pod_requests = self._pod_requests(predicted)
                for e, n in pod_requests.items():
                    notes[e.name]["podRequests"] = n
            explain_note(cycle, self.name, notes)
        if log.isEnabledFor(logging.DEBUG):
            log.debug(
                "%s: lowest cost (predicted TTFT) %.1f ms of %d candidates",
                self.name,
                best * 1e3,
                len(seconds),
            )
        # Predictions closer to the best than their error are a tie. Among those,
        # the pod this request adds the least prefill work to scores highest (a pod
        # holding its prefix: less work for the fleet, the prefix kept in one place),
        # then the one with the least prefill queued ahead, then the one with the
        # fewest tokens in flight from this EPP (a prompt no pod holds spreads the
        # load it will bring); they score in (0.9, 1], the others below 0.9 in order
        # of prediction. Equal keys score equal: the picker draws among them.
        wide = session_tie or all(_uncached_tenths(p) >= 5 for p in predicted.values())
        width = tie_base * (self.new_prefix_tolerance if wide else self.tie_tolerance)
        if self.tie_max_s is not None:
            # A long prompt's tie, a share of a second or more, would let its rank
            # pick a pod that much slower.
            width = min(width, self.tie_max_s)
        if wide and self.new_prefix_tie_max_s is not None:
            # A new prompt's tie, as wide as its prediction, would send it to a pod
            # up to twice as slow for the balance; a prompt some pod holds keeps its
            # tie, whose rank keeps it with its prefix.
            width = min(width, self.new_prefix_tie_max_s)
        near = best + width + _TIE_FLOOR_S

        def uncached_rank(e: Endpoint) -> int:
            if session_tie:
                return 0  # where the prompt's start is cached does not count
            if e in crowded:
                return 10
            # With a prefix index that tells them apart (`cacheWindow`), the pod the
            # prompt's group was sent to ranks first even where its cache may have
            # evicted it: the prediction already counts the miss, and a group kept
            # on one pod refills one cache instead of spreading over several.
            remembered = predictions.remembered_share(e)
            if remembered is not None:
                return round(10 * (1.0 - remembered))
            return _uncached_tenths(predicted[e])

        # The queue in tenths of this request's own prefill: a pod with half a prefill
        # queued delays this request by that much, whatever its tokens in flight
        # (mostly decoding requests) say about its load. Ranked by tokens alone, a
        # new prompt's wide tie sent requests behind queued prefills while other
        # pods had none (no-reuse, 64 pods, load 0.8: p90 9% above round-robin).
        work = max(_FLOOR_S, least_work)

        def queue_units(e: Endpoint) -> int:
            return round(10 * queued[e] / work)

        # With `tieDecodeFactor`: a pod decoding far more context than the fleet's
        # mean ranks after the pods with as much of the prompt and of a queue that
        # do not. Its requests were hits, so its tokens in flight read light, but
        # every decode step there reads that context, and a request placed there
        # decodes slowly. (Not before the queue: while the fleet's mean is a
        # request or two, any pod decoding one is far above it.)
        slow_decode: set[Endpoint] = set()
        if self.tie_decode_factor is not None:
            slow_decode = _above(context, self.tie_decode_factor)
        keys = {
            e: (uncached_rank(e), queue_units(e), e in slow_decode, tokens[e])
            for e in endpoints
            if seconds[e] <= near
        }
        ranks = {key: i for i, key in enumerate(sorted(set(keys.values())))}
        step = 0.1 / len(ranks)
        return {
            e: 1.0 - step * ranks[keys[e]] if e in keys else 0.9 * best / s
            for e, s in seconds.items()
        }
