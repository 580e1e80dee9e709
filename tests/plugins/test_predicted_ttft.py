"""`predicted-ttft-producer` and `predicted-ttft-scorer`: each pod's predicted time to
first token from its queue, the prefix it holds and a model fitted to observed
TTFTs; the scorer prefers the fastest, ties going to less work, then less load."""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import pytest
from epp.plugins.predicted_ttft_producer import (
    MAX_POD_FACTOR,
    PredictedTtftProducer,
    predicted_ttft_key,
)
from epp.plugins.predicted_ttft_scorer import BusyTime, PredictedTtftScorer
from epp.plugins.predicted_ttft_slo_filter import PredictedTtftSloFilter
from prometheus_client import CollectorRegistry

from epp.clock import VirtualClock
from epp.config import InvalidConfig
from epp.datastore import WAITING, Datastore, Endpoint, EndpointMetrics, EndpointSpec
from epp.errors import BadRequest, Shed
from epp.requests import InferenceRequest, parse_request
from epp.scheduling import (
    EXPLAIN_NOTES,
    PRIORITY,
    TTFT_OBSERVED,
    CycleState,
    PluginContext,
    PrefixMatchInfo,
    ResponseInfo,
    TtftObservation,
    prefix_match_key,
)
from epp.ttft.model import FEATURES
from tests.plugins.helpers import context, make_endpoints
from tests.plugins.llmd_helpers import load, one_plugin_config, request, routed, with_match

PROMPT = "x" * 4000  # the match below says: 4,000 tokens in 100 blocks of 40
DONE = ResponseInfo(completed=True)


class Fleet:
    """The two plugins on a virtual clock, driven as the director drives them."""

    def __init__(
        self,
        datastore: Datastore | None = None,
        scorer: PredictedTtftScorer.Parameters | None = None,
        **params: object,
    ) -> None:
        # The session rule is off unless a test asks for it (its own tests do): the
        # other tests are about predictions and ties.
        params.setdefault("initialContinuingShare", 0.0)
        self.clock = VirtualClock(100.0)
        self.metrics = CollectorRegistry()
        ctx = PluginContext(
            "predicted-ttft-producer",
            "predicted-ttft-producer",
            datastore or Datastore(),
            self.metrics,
            {},
            clock=self.clock,
        )
        self.producer = PredictedTtftProducer(
            msgspec.convert(params, PredictedTtftProducer.Parameters), ctx
        )
        self.scorer = PredictedTtftScorer(
            scorer or PredictedTtftScorer.Parameters(),
            PluginContext(
                "predicted-ttft-scorer",
                "predicted-ttft-scorer",
                Datastore(),
                CollectorRegistry(),
                {},
                clock=self.clock,
            ),
        )

    def cycle(
        self, matched: Mapping[Endpoint, float], demand: float = 0.0
    ) -> tuple[InferenceRequest, CycleState]:
        req = request(PROMPT)
        cycle = with_match(CycleState(), matched, total=100, block_size=40, demand=demand)
        asyncio.run(self.producer.prepare(req, cycle, []))
        return req, cycle

    def seconds(self, cycle: CycleState, endpoint: Endpoint) -> float:
        predictions = cycle.get(predicted_ttft_key("predicted-ttft-producer"))
        assert predictions is not None
        return predictions.predict(endpoint).seconds

    def route(
        self, endpoint: Endpoint, matched: Mapping[Endpoint, float] | None = None
    ) -> tuple[InferenceRequest, CycleState]:
        req, cycle = self.cycle(matched or {})
        self.producer.pre_request(req, cycle, routed(("default", endpoint)))
        return req, cycle


def _observe(fleet: Fleet, endpoint: Endpoint, elapsed: float, matched: float = 0.0) -> float:
    """Route one request to `endpoint`, its first token `elapsed` seconds later, then
    its end; returns what was predicted for it."""
    req, cycle = fleet.route(endpoint, {endpoint: matched})
    predicted = fleet.seconds(cycle, endpoint)
    result = routed(("default", endpoint))
    fleet.clock.advance(elapsed)
    fleet.producer.response_first_chunk(req, cycle, result, elapsed)
    fleet.producer.post_response(req, cycle, result, DONE)
    return predicted


def test_the_first_chunk_leaves_the_prediction_beside_the_observed_ttft() -> None:
    fleet = Fleet()
    (pod,) = make_endpoints(1)
    req, cycle = fleet.route(pod)
    assert cycle.get(TTFT_OBSERVED) is None  # nothing observed before the first chunk
    predicted = fleet.seconds(cycle, pod)
    fleet.clock.advance(0.04)
    fleet.producer.response_first_chunk(req, cycle, routed(("default", pod)), 0.04)
    assert cycle.get(TTFT_OBSERVED) == TtftObservation(pod.name, predicted, 0.04)


def test_a_pod_holding_the_prefix_is_predicted_faster_than_one_without() -> None:
    fleet = Fleet()
    warm, cold = make_endpoints(2)
    _, cycle = fleet.cycle({warm: 90.0})  # 90 of the 100 blocks
    assert fleet.seconds(cycle, warm) < fleet.seconds(cycle, cold)
    scores = fleet.scorer.score(request(PROMPT), cycle, [warm, cold])
    assert scores[warm] == 1.0
    assert scores[cold] < 0.9
    notes = cycle.get(EXPLAIN_NOTES)
    assert notes is not None
    explained = notes["predicted-ttft-scorer"]["ep-0"]
    assert explained["cachedTokens"] == 3600
    assert explained["uncachedTokens"] == 400
    assert explained["predictedTtftMs"] == pytest.approx(fleet.seconds(cycle, warm) * 1e3)
    assert {"queuedMs", "prefillMs", "attentionMs", "decodingMs", "fixedMs"} <= set(explained)


def test_work_sent_to_a_pod_queues_later_requests_until_it_is_done() -> None:
    fleet = Fleet()
    (pod,) = make_endpoints(1)
    _, alone = fleet.cycle({})
    idle = fleet.seconds(alone, pod)
    first, first_cycle = fleet.route(pod)
    _, behind = fleet.cycle({})
    queued = fleet.seconds(behind, pod) - idle
    assert queued > 0.05  # the first request's whole prefill of 4,000 tokens
    # Time drains the queue ...
    fleet.clock.advance(queued / 2)
    _, later = fleet.cycle({})
    assert fleet.seconds(later, pod) - idle == pytest.approx(queued / 2)
    # ... and the first token says it is over, whatever was predicted.
    fleet.producer.response_first_chunk(first, first_cycle, routed(("default", pod)), 0.01)
    _, after = fleet.cycle({})
    state = fleet.producer.describe_endpoint(pod)["predictedTtft"]
    assert isinstance(state, dict)
    assert (state["queuedRequests"], state["queuedMs"], state["decoding"]) == (0, 0.0, 1)
    assert state["observations"] == 1
    predictions = after.get(predicted_ttft_key("predicted-ttft-producer"))
    assert predictions is not None
    now = predictions.predict(pod)
    assert now.parts["queued"] == 0.0
    assert now.parts["decoding"] > 0.0  # one decoding request
    fleet.producer.post_response(first, first_cycle, routed(("default", pod)), DONE)
    fleet.producer.post_response(first, first_cycle, routed(("default", pod)), DONE)  # twice
    assert fleet.producer.describe_endpoint(pod)["predictedTtft"]["decoding"] == 0


def test_a_pick_predicts_every_candidate_in_one_pass_as_the_model_adds_up() -> None:
    """`predict_all` (what the scorer and the SLO filter read) gives each pod the
    prediction `predict` gives it alone, whose seconds are the model's terms on its
    feature vector, with the load this EPP has on the pod, in a fleet where pods
    differ in every input: queue, decoding batch, waiting requests, speed, prefix."""
    fleet = Fleet()
    queued, decoding, waiting, slow, fresh = pods = make_endpoints(5)
    for _ in range(40):  # a fitted model, not the prior, and one pod slower
        _observe(fleet, slow, 0.3, matched=50.0)
        _observe(fleet, queued, 0.1)
    first, first_cycle = fleet.route(decoding)
    fleet.producer.response_first_chunk(first, first_cycle, routed(("default", decoding)), 0.05)
    fleet.route(queued, {queued: 30.0})
    waiting.metrics = EndpointMetrics(waiting_requests=3, updated_at=fleet.clock())
    matched = {queued: 30.0, decoding: 80.0, slow: 50.0, fresh: 10.0}
    _, together = fleet.cycle(matched)
    _, alone = fleet.cycle(matched)
    key = predicted_ttft_key("predicted-ttft-producer")
    in_one_pass = together.get(key)
    one_by_one = alone.get(key)
    assert in_one_pass is not None
    assert one_by_one is not None
    predicted = in_one_pass.predict_all(pods)
    assert list(predicted) == list(pods)
    weights = fleet.producer.model.weights
    for pod in pods:
        batch, single = predicted[pod], one_by_one.predict(pod)
        assert batch.describe() == single.describe()
        assert batch.x == single.x
        assert batch.seconds == single.seconds
        # The model's terms on the feature vector, added one by one in its order:
        # the same float, not only a close one.
        added = 0.0
        for w, v in zip(weights, batch.x, strict=True):
            added += w * v
        assert batch.seconds == added
        assert batch.own_work_s == pytest.approx(batch.parts["prefill"] + batch.parts["attention"])
        assert batch.queue_s == batch.parts["queued"]
        assert batch.requests_in_flight == fleet.producer.requests_in_flight(pod)
        assert batch.tokens_in_flight == fleet.producer.tokens_in_flight(pod)
        assert batch.decoding_tokens == fleet.producer.decoding_tokens(pod)
        assert in_one_pass.predict(pod) is batch  # kept: a pick reads one instant
    # Each input shows where it should.
    assert predicted[queued].queue_s > 0.0
    assert predicted[fresh].queue_s == 0.0
    assert predicted[decoding].features.decoding == 1
    assert predicted[decoding].decoding_tokens > 0
    assert predicted[waiting].features.waiting == 3
    assert predicted[fresh].features.waiting == 0
    assert predicted[slow].factor > 1.0
    assert predicted[fresh].factor == 1.0
    assert predicted[decoding].cached_tokens == 3200
    assert predicted[waiting].cached_tokens == 0


def test_predict_all_keeps_what_was_predicted_in_the_endpoints_order() -> None:
    fleet = Fleet()
    a, b, c = pods = make_endpoints(3)
    key = predicted_ttft_key("predicted-ttft-producer")
    _, cycle = fleet.cycle({b: 50.0})
    predictions = cycle.get(key)
    assert predictions is not None
    first = predictions.predict(b)
    together = predictions.predict_all([c, b, a])
    assert list(together) == [c, b, a]
    assert together[b] is first
    again = predictions.predict_all(pods)
    assert list(again) == pods
    assert all(again[p] is together[p] for p in pods)
    # A pick's first ask answers with a dict of the caller's own: emptying it
    # forgets nothing.
    _, other = fleet.cycle({b: 50.0})
    fresh = other.get(key)
    assert fresh is not None
    answer = fresh.predict_all(pods)
    kept = dict(answer)
    answer.clear()
    assert all(fresh.predict(p) is kept[p] for p in pods)
    assert [p.seconds for p in kept.values()] == [together[p].seconds for p in pods]


def test_the_prefix_match_is_read_once_the_prefix_producer_has_left_it() -> None:
    fleet = Fleet()
    a, b = make_endpoints(2)
    cycle = CycleState()
    asyncio.run(fleet.producer.prepare(request(PROMPT), cycle, []))
    predictions = cycle.get(predicted_ttft_key("predicted-ttft-producer"))
    assert predictions is not None
    # Asked before the match is there: nothing is known yet, and nothing is kept.
    assert predictions.remembered_share(a) is None
    assert not predictions.continues
    assert predictions.demand == 0.0
    cycle.put(
        prefix_match_key("approx-prefix-cache-producer"),
        PrefixMatchInfo(100, 40, {}, continues=True, remembered={b: 40.0}, demand=0.25),
    )
    assert predictions.remembered_share(a) == 0.0
    assert predictions.remembered_share(b) == 0.4
    assert predictions.continues
    assert predictions.demand == 0.25


def test_predictions_learn_the_pods_speed_from_observed_first_tokens() -> None:
    fleet = Fleet()
    (pod,) = make_endpoints(1)
    # The truth: 12 ms + 25 us per uncached token, whatever the prior said.
    errors = []
    for i in range(120):
        matched = float(i % 5) * 20.0
        elapsed = 0.012 + 25e-6 * (4000 - matched * 40)
        predicted = _observe(fleet, pod, elapsed, matched)
        errors.append(abs(predicted - elapsed) / elapsed)
    assert errors[0] > 0.3  # the prior is far off ...
    assert statistics.median(errors[-40:]) < 0.05  # ... and learnt away
    page = fleet.metrics.get_sample_value(
        "epp_ttft_prediction_error_ratio_count", {"plugin": "predicted-ttft-producer"}
    )
    assert page == 120
    weight = fleet.metrics.get_sample_value(
        "epp_ttft_model_weight", {"plugin": "predicted-ttft-producer", "feature": "prefill"}
    )
    assert weight == pytest.approx(0.025, rel=0.2)  # seconds per 1,000 tokens
    resets = fleet.metrics.get_sample_value(
        "epp_ttft_model_covariance_resets_total", {"plugin": "predicted-ttft-producer"}
    )
    assert resets == 0  # exported, and a plain fit needs none


def test_a_prefill_floor_binds_only_below_what_the_fit_finds() -> None:
    """`minPrefillWeightMs` reaches the model as a bound on its prefill weight; a
    fleet whose prompts cost more than the floor is predicted exactly as without
    it, and one whose prompts the fit says cost nothing has its requests' own
    prefill charged to the ledger at the floor (tests/epp/ttft/test_model.py has
    the fit's side of it)."""
    floors = {}
    for observed in (0.1, 0.001):
        for floor in (0.0, 15.0):
            fleet = Fleet(minPrefillWeightMs=floor)
            assert fleet.producer.model.lower[FEATURES.index("prefill")] == floor / 1e3
            (a,) = make_endpoints(1)
            for _ in range(300):
                _observe(fleet, a, observed)
            fleet.route(a)  # charged to a's queue: its own prefill, as predicted
            _, cycle = fleet.cycle({})
            predictions = cycle.get(predicted_ttft_key("predicted-ttft-producer"))
            assert predictions is not None
            floors[observed, floor] = (
                fleet.producer.model.describe()["prefill"],
                predictions.predict(a).parts["queued"],
            )
    # 100 ms for 4,000 uncached tokens: the fit's prefill weight is above 15 ms per
    # 1,000 tokens, and the floor changes nothing.
    assert floors[0.1, 15.0] == floors[0.1, 0.0]
    assert floors[0.1, 0.0][0] > 0.015
    # 1 ms for 4,000 tokens: without a floor the fit says tokens cost nothing and
    # a pod with a request just sent shows no queue; with it, the request's
    # prefill at 15 ms per 1,000 tokens is queued there.
    assert floors[0.001, 0.0] == (0.0, 0.0)
    assert floors[0.001, 15.0][0] == pytest.approx(0.015)
    assert floors[0.001, 15.0][1] > 0.0


def test_revalue_queued_work_charged_under_the_prior_once_the_fit_has_moved() -> None:
    """From a cold start, a request sent to a pod is charged the prior's prefill;
    once first tokens elsewhere teach the model the pods are three times faster,
    `revalueQueued` re-values what is still queued (to within the share it allows
    to drift), where without it the pod reads busy for the prior's whole estimate."""
    queued = {}
    for revalue in (None, 0.2):
        fleet = Fleet(revalueQueued=revalue) if revalue is not None else Fleet()
        busy, other = make_endpoints(2)
        fleet.route(busy)  # charged under the prior
        _, cycle = fleet.cycle({})
        charged = fleet.seconds(cycle, busy) - fleet.seconds(cycle, other)
        before = cycle.get(predicted_ttft_key("predicted-ttft-producer"))
        assert before is not None
        truth = before.predict(other).own_work_s / 3 + 0.01
        for _ in range(200):
            # Observed on the other pod, the clock held: nothing drains meanwhile.
            req, observed = fleet.route(other)
            result = routed(("default", other))
            fleet.producer.response_first_chunk(req, observed, result, truth)
            fleet.producer.post_response(req, observed, result, DONE)
        _, cycle = fleet.cycle({})
        predictions = cycle.get(predicted_ttft_key("predicted-ttft-producer"))
        assert predictions is not None
        queued[revalue] = (charged, predictions.predict(busy), predictions.predict(other))
    charged, busy_now, other_now = queued[None]
    assert busy_now.parts["queued"] == pytest.approx(charged)  # the prior's, as charged
    charged, busy_now, other_now = queued[0.2]
    assert other_now.own_work_s < charged / 2  # the fit moved
    assert busy_now.parts["queued"] == pytest.approx(other_now.own_work_s, rel=0.2)


def test_relative_fit_reaches_the_model() -> None:
    """`relativeFit` makes the producer's model weigh observations by their
    prediction (tests/epp/ttft/test_model.py has what that does); off by default."""
    assert Fleet().producer.model.relative is False
    assert Fleet(relativeFit=True).producer.model.relative is True
    assert Fleet().producer.model.relative_floor_s == pytest.approx(0.01)
    floored = Fleet(relativeFit=True, relativeFitFloorMs=300).producer.model
    assert floored.relative_floor_s == pytest.approx(0.3)


def test_a_slow_pod_is_learnt_and_avoided() -> None:
    fleet = Fleet()
    fast, slow = make_endpoints(2)
    for _ in range(60):
        _observe(fleet, fast, 0.1)
        _observe(fleet, slow, 0.3)
    assert fleet.producer._pods[slow].factor > 1.5 * fleet.producer._pods[fast].factor
    assert fleet.producer._pods[slow].factor <= MAX_POD_FACTOR
    req, cycle = fleet.cycle({})
    scores = fleet.scorer.score(req, cycle, [fast, slow])
    assert scores[fast] > scores[slow]


def test_a_new_prompt_goes_to_the_pod_with_the_fewest_tokens_in_flight() -> None:
    fleet = Fleet()
    a, b, c = make_endpoints(3)
    # Nobody holds the prompt, nothing is queued: b has one request decoding, c two.
    for pod, count in ((b, 1), (c, 2)):
        for _ in range(count):
            req, cycle = fleet.route(pod)
            fleet.producer.response_first_chunk(req, cycle, routed(("default", pod)), 0.05)
    _, fresh = fleet.cycle({})
    scores = fleet.scorer.score(request(PROMPT), fresh, [a, b, c])
    # Within the wide tie of a new prompt (newPrefixTolerance): fewest tokens first.
    assert scores[a] == 1.0
    assert 0.9 < scores[c] < scores[b] < 1.0


@pytest.mark.parametrize(("factor", "a_first"), [(None, True), (2.5, False), (3.5, True)])
def test_tie_decode_factor_ranks_a_pod_decoding_far_more_context_after_the_others(
    factor: float | None, a_first: bool
) -> None:
    """a decodes six requests that were hits (95 of their 100 blocks cached: 200
    uncached tokens each, 4,000 of context each), b, c and d one miss each (4,000
    uncached, 4,000 of context), and e has a whole prefill queued, nothing decoding.
    a's context is 24,000, 3.33 times the mean of 7,200, but its tokens in flight
    are the fewest (1,200 against 4,000)."""
    fleet = Fleet(scorer=PredictedTtftScorer.Parameters(tie_decode_factor=factor))
    a, b, c, d, e = make_endpoints(5)
    for pod, count, matched in ((a, 6, 95.0), (b, 1, 0.0), (c, 1, 0.0), (d, 1, 0.0)):
        for _ in range(count):
            req, cycle = fleet.route(pod, {pod: matched})
            fleet.producer.response_first_chunk(req, cycle, routed(("default", pod)), 0.03)
    fleet.route(e)
    _, fresh = fleet.cycle({})
    pods = [a, b, c, d, e]
    assert max(fleet.seconds(fresh, p) for p in pods) <= 2 * min(
        fleet.seconds(fresh, p) for p in pods
    )  # all in a new prompt's tie
    scores = fleet.scorer.score(request(PROMPT), fresh, pods)
    if a_first:
        assert scores[a] == 1.0 > scores[b] == scores[c] == scores[d] > scores[e] > 0.9
    else:
        assert scores[b] == scores[c] == scores[d] == 1.0 > scores[a] > 0.9
    # A pod with a prefill queued ranks after it all the same: the decode load is
    # ranked after the queue, and e has no context decoding.
    assert scores[e] < scores[a]


def test_a_tie_decode_factor_of_one_or_less_is_refused() -> None:
    with pytest.raises(InvalidConfig, match="tieDecodeFactor"):
        load(one_plugin_config("predicted-ttft-scorer", {"tieDecodeFactor": 1.0}))


def test_within_a_tie_a_queued_prefill_counts_before_tokens_in_flight() -> None:
    fleet = Fleet()
    a, b = make_endpoints(2)
    # a: two requests decoding (8,000 tokens in flight), nothing queued; b: one
    # request's whole prefill queued (4,000 tokens in flight). Both are in the wide
    # tie of a new prompt, but on b it would wait for that prefill first.
    for _ in range(2):
        req, cycle = fleet.route(a)
        fleet.producer.response_first_chunk(req, cycle, routed(("default", a)), 0.05)
    fleet.route(b)
    _, fresh = fleet.cycle({})
    assert fleet.seconds(fresh, b) <= 2 * fleet.seconds(fresh, a)  # a tie
    scores = fleet.scorer.score(request(PROMPT), fresh, [a, b])
    assert scores[a] == 1.0
    assert 0.9 < scores[b] < 1.0
    # Half of b's prefill done, half of it still waits there: a still wins. Once it
    # is done, b has the fewer tokens in flight.
    predictions = fresh.get(predicted_ttft_key("predicted-ttft-producer"))
    assert predictions is not None
    queued = predictions.predict(b).parts["queued"]
    fleet.clock.advance(queued / 2)
    _, half = fleet.cycle({})
    assert fleet.scorer.score(request(PROMPT), half, [a, b])[a] == 1.0
    fleet.clock.advance(queued / 2)
    _, done = fleet.cycle({})
    assert fleet.scorer.score(request(PROMPT), done, [a, b])[b] == 1.0


def test_the_tie_is_no_wider_than_tie_max_ms() -> None:
    a, b = make_endpoints(2)
    scores = {}
    for cap in (None, 10_000.0, 1.0):
        fleet = Fleet(scorer=PredictedTtftScorer.Parameters(tie_max_ms=cap))
        fleet.route(b)  # a whole prefill queued on b
        _, fresh = fleet.cycle({})
        slower = fleet.seconds(fresh, b) - fleet.seconds(fresh, a)
        assert 0.001 < slower <= fleet.seconds(fresh, a)  # inside a new prompt's tie
        scores[cap] = fleet.scorer.score(request(PROMPT), fresh, [a, b])
    # Uncapped, or capped above the tie's width: b ties (ranked below a).
    assert scores[None] == scores[10_000.0]
    assert scores[None][a] == 1.0
    assert 0.9 < scores[None][b] < 1.0
    # Capped at 1 ms: b is out of the tie, scored by its prediction.
    assert scores[1.0][a] == 1.0
    assert scores[1.0][b] < 0.9


def test_new_prefix_tie_max_ms_caps_only_the_tie_of_a_prompt_no_pod_holds() -> None:
    a, b = make_endpoints(2)

    def scores_with(
        done: float, matched: Mapping[Endpoint, float], **params: float
    ) -> Mapping[Endpoint, float]:
        """b with a whole prefill queued of which `done` is done, a idle: the scores
        of a prompt each pod holds `matched` blocks of (of 100)."""
        fleet = Fleet(scorer=PredictedTtftScorer.Parameters(**params))  # type: ignore[arg-type]
        fleet.route(b)
        _, fresh = fleet.cycle({})
        predictions = fresh.get(predicted_ttft_key("predicted-ttft-producer"))
        assert predictions is not None
        fleet.clock.advance(done * predictions.predict(b).parts["queued"])
        _, cycle = fleet.cycle(matched)
        slower = fleet.seconds(cycle, b) / fleet.seconds(cycle, a) - 1.0
        assert 0.01 < slower < (0.25 if matched else 1.0)  # inside the uncapped tie
        return fleet.scorer.score(request(PROMPT), cycle, [a, b])

    # A new prompt, b twice as slow: in its uncapped tie, out of a 1 ms one.
    assert 0.9 < scores_with(0.0, {})[b] < 1.0
    assert scores_with(0.0, {}, new_prefix_tie_max_ms=1.0)[b] < 0.9
    assert scores_with(0.0, {}, tie_max_ms=1.0)[b] < 0.9
    # A prompt both pods hold most of, b a few percent slower: the 25% tie, which
    # tieMaxMs caps and newPrefixTieMaxMs leaves.
    held = {a: 80.0, b: 80.0}
    assert 0.9 < scores_with(0.97, held)[b] < 1.0
    assert 0.9 < scores_with(0.97, held, new_prefix_tie_max_ms=1.0)[b] < 1.0
    assert scores_with(0.97, held, tie_max_ms=1.0)[b] < 0.9


def test_near_ties_go_to_the_holder_of_the_prefix_unless_it_is_crowded() -> None:
    fleet = Fleet()
    a, b, c = make_endpoints(3)
    _, cycle = fleet.cycle({a: 100.0, b: 100.0})
    scores = fleet.scorer.score(request(PROMPT), cycle, [a, b, c])
    assert scores[a] == scores[b] == 1.0  # both hold it, both idle: a draw
    assert scores[c] < 0.9  # a whole prefill more: no tie
    # a gets two requests that it half holds; they start (no queue), and stay in
    # flight with 2,000 uncached tokens each: 4,000 on a, 1,333 on average.
    for _ in range(2):
        req, started = fleet.route(a, {a: 50.0})
        fleet.producer.response_first_chunk(req, started, routed(("default", a)), 0.05)
    _, cycle = fleet.cycle({a: 100.0, b: 100.0})
    scores = fleet.scorer.score(request(PROMPT), cycle, [a, b, c])
    assert scores[b] == 1.0
    assert scores[a] < scores[b]  # crowded: more than 1.5 x the mean in flight


@pytest.mark.parametrize(
    ("demand_pods", "demand", "winner"),
    [(None, 0.1, 1), (1.0, 0.1, 0), (1.0, 0.5, 1), (2.0, 0.5, 0)],
)
def test_a_prefix_one_pod_can_carry_stays_on_its_crowded_holder(
    demand_pods: float | None, demand: float, winner: int
) -> None:
    """a holds the whole prompt, b 92 of its 100 blocks; two requests decoding on a put
    it above 1.5 times the mean uncached tokens in flight. Crowded, a ranks as
    holding nothing and b wins the tie. With `crowdedFromDemandPods`, a prefix
    wanted by no more than that many pods' worth of the recent requests (demand
    0.1 of three pods: 0.3 of a pod) keeps its holder; one wanted by more (0.5:
    1.5 pods' worth) spreads as before, unless the bar is above it."""
    fleet = Fleet(scorer=PredictedTtftScorer.Parameters(crowded_from_demand_pods=demand_pods))
    a, b, c = make_endpoints(3)
    for _ in range(2):
        req, started = fleet.route(a, {a: 50.0})
        fleet.producer.response_first_chunk(req, started, routed(("default", a)), 0.05)
    _, cycle = fleet.cycle({a: 100.0, b: 92.0}, demand)
    scores = fleet.scorer.score(request(PROMPT), cycle, [a, b, c])
    assert scores[[a, b][winner]] == 1.0 > scores[[a, b][1 - winner]]
    assert scores[c] < 0.9  # a whole prefill more: no tie
    # The explain note says which pods the tie ranked as holding nothing.
    explained = _explained(cycle, (a, b, c))
    assert [explained[e]["crowded"] for e in (a, b, c)] == [winner == 1, False, False]


def _continuing(fleet: Fleet, endpoint: Endpoint, count: int) -> None:
    """`count` requests that each continue an earlier prompt, routed to `endpoint`
    and finished."""
    for _ in range(count):
        req = request(PROMPT)
        cycle = CycleState()
        info = PrefixMatchInfo(100, 40, {endpoint: 90.0}, continues=True)
        cycle.put(prefix_match_key("approx-prefix-cache-producer"), info)
        asyncio.run(fleet.producer.prepare(req, cycle, []))
        result = routed(("default", endpoint))
        fleet.producer.pre_request(req, cycle, result)
        fleet.producer.post_response(req, cycle, result, DONE)


def _busy_holder(fleet: Fleet) -> tuple[Endpoint, Endpoint]:
    """a holds the system prompt every conversation shares (80 of 100 blocks) and
    has three conversations in flight; b holds nothing and is idle."""
    a, b = make_endpoints(2)
    for _ in range(3):
        req, started = fleet.route(a, {a: 80.0})
        fleet.producer.response_first_chunk(req, started, routed(("default", a)), 0.05)
    return a, b


def _not_continuing(fleet: Fleet, endpoint: Endpoint, n: int) -> None:
    for _ in range(n):
        req, cycle = fleet.route(endpoint, {endpoint: 10.0})
        fleet.producer.post_response(req, cycle, routed(("default", endpoint)), DONE)


def test_a_cold_epp_assumes_sessions_until_the_traffic_says_otherwise() -> None:
    fleet = Fleet(initialContinuingShare=0.8)
    assert fleet.producer.continuing_share == 0.8
    a, b = _busy_holder(fleet)
    _, cycle = fleet.cycle({a: 80.0})
    scores = fleet.scorer.score(request(PROMPT), cycle, [a, b])
    # Each first turn might be a conversation's: it goes where its turns will wait
    # least, not to the busy holder of the shared prefix.
    assert scores[b] == 1.0 > 0.9 > scores[a]
    # Requests that continue nothing: the prior fades, and the pick is greedy again.
    _not_continuing(fleet, b, 100)
    assert fleet.producer.continuing_share < 0.1
    # a still has its three in flight; the hundred on b have ended.
    _, cycle = fleet.cycle({a: 80.0})
    scores = fleet.scorer.score(request(PROMPT), cycle, [a, b])
    assert scores[a] == 1.0 > 0.9 > scores[b]


def test_where_requests_continue_earlier_ones_a_new_session_spreads() -> None:
    fleet = Fleet()
    a, b = _busy_holder(fleet)
    _, cycle = fleet.cycle({a: 80.0})
    scores = fleet.scorer.score(request(PROMPT), cycle, [a, b])
    assert scores[a] == 1.0 > 0.9 > scores[b]  # no sessions assumed: the holder, greedily
    assert fleet.producer.continuing_share == 0.0
    # Then the traffic turns out to be conversations: most requests continue one.
    _continuing(fleet, b, 200)
    assert fleet.producer.continuing_share > 0.9
    _, cycle = fleet.cycle({a: 80.0})
    scores = fleet.scorer.score(request(PROMPT), cycle, [a, b])
    assert scores[b] == 1.0 > 0.9 > scores[a]  # a new one goes where its turns wait least
    notes = cycle.get(EXPLAIN_NOTES)
    assert notes is not None
    explained = notes["predicted-ttft-scorer"]
    assert explained["ep-0"]["continuingShare"] > 0.9
    # Three in flight on a, none on b: a is charged what b is credited.
    assert explained["ep-0"]["sessionChargeMs"] > 0
    assert explained["ep-0"]["sessionChargeMs"] == -explained["ep-1"]["sessionChargeMs"]
    # A conversation's next turn is not charged: it stays where its history is.
    cycle = CycleState()
    info = PrefixMatchInfo(100, 40, {a: 95.0}, continues=True)
    cycle.put(prefix_match_key("approx-prefix-cache-producer"), info)
    asyncio.run(fleet.producer.prepare(request(PROMPT), cycle, []))
    scores = fleet.scorer.score(request(PROMPT), cycle, [a, b])
    assert scores[a] == 1.0 > 0.9 > scores[b]


def _holder_and_idle_pod(fleet: Fleet) -> tuple[list[Endpoint], Mapping[Endpoint, float]]:
    """a holds 95 of the prompt's 100 blocks with one request decoding there, b
    holds nothing and is busy, c holds 85 blocks and is idle; a and c are predicted
    within each other's error."""
    a, b, c = make_endpoints(3)
    for endpoint, matched in ((a, 95.0), (b, 0.0), (b, 0.0)):
        req, started = fleet.route(endpoint, {endpoint: matched})
        fleet.producer.response_first_chunk(req, started, routed(("default", endpoint)), 0.05)
    return [a, b, c], {a: 95.0, c: 85.0}


@pytest.mark.parametrize(
    ("initial_share", "session_tie_share", "winner"),
    [
        (0.8, None, 0),  # off (the default): the tie goes to the pod holding more
        (0.8, 0.5, 2),  # a new session: to the idle pod, whoever holds more
        (0.0, 0.5, 0),  # no request continues another: no sessions
    ],
)
def test_session_ties_go_to_the_pod_with_the_fewest_tokens_in_flight(
    initial_share: float, session_tie_share: float | None, winner: int
) -> None:
    scorer = PredictedTtftScorer.Parameters(session_tie_share=session_tie_share)
    fleet = Fleet(scorer=scorer, initialContinuingShare=initial_share)
    endpoints, matched = _holder_and_idle_pod(fleet)
    a, b, c = endpoints
    assert (fleet.producer.continuing_share >= 0.5) == (initial_share > 0)
    _, cycle = fleet.cycle(matched)
    scores = fleet.scorer.score(request(PROMPT), cycle, endpoints)
    loser = c if endpoints[winner] is a else a
    assert scores[endpoints[winner]] == 1.0 > scores[loser] > 0.9
    assert scores[b] < 1.0
    # /debug/explain says whether the session tie applied.
    notes = cycle.get(EXPLAIN_NOTES)
    assert notes is not None
    assert notes["predicted-ttft-scorer"]["ep-0"]["sessionTie"] is (winner == 2)


@pytest.mark.parametrize(
    ("queue_weight", "b_queues", "winner"),
    [
        (1.0, False, 0),  # off: the greedy pick joins the holder's queue
        (3.0, False, 1),  # one pod of two idle: the queue counts twice, b wins
        (3.0, True, 0),  # every pod queues: the weight fades out, the holder wins
    ],
)
def test_the_queue_weight_counts_the_wait_a_request_adds_behind_it(
    queue_weight: float, b_queues: bool, winner: int
) -> None:
    """a holds 95 of the prompt's 100 blocks behind twelve queued prefills (about
    110 ms predicted), b holds nothing (about 150 ms idle)."""
    fleet = Fleet(scorer=PredictedTtftScorer.Parameters(queue_weight=queue_weight))
    a, b = make_endpoints(2)
    for _ in range(12):
        fleet.route(a, {a: 95.0})
    if b_queues:
        fleet.route(b, {b: 99.0})  # one short prefill: b is still predicted slower
    _, cycle = fleet.cycle({a: 95.0})
    assert fleet.seconds(cycle, a) < fleet.seconds(cycle, b) < 2 * fleet.seconds(cycle, a)
    scores = fleet.scorer.score(request(PROMPT), cycle, [a, b])
    assert scores[[a, b][winner]] == 1.0 > scores[[a, b][1 - winner]]
    # /debug/explain shows the prediction and, beside it, the cost compared.
    notes = cycle.get(EXPLAIN_NOTES)
    assert notes is not None
    explained = notes["predicted-ttft-scorer"]["ep-0"]
    assert explained["queuedMs"] > 0
    extra = 0.0 if b_queues else (queue_weight - 1.0) / 2
    assert explained["costMs"] == pytest.approx(
        explained["predictedTtftMs"] + extra * explained["queuedMs"], abs=0.01
    )


def _pick_after_queueing_on_a(
    parameters: PredictedTtftScorer.Parameters,
    queued_on_a: int,
    winner: int,
    demand: float = 0.0,
    held: float = 95.0,
) -> tuple[list[dict[str, Any]], list[float], list[float]]:
    """Two pods, `queued_on_a` requests holding `held` of 100 blocks queued on a,
    then a pick between them, its prefix wanted by `demand` of the recent requests,
    that `winner` (0: a, 1: b) must win. Returns each pod's explain note, its queued
    ms and the request's own prefill ms there."""
    fleet = Fleet(scorer=parameters)
    a, b = make_endpoints(2)
    for _ in range(queued_on_a):
        fleet.route(a, {a: held})
    _, cycle = fleet.cycle({a: held}, demand)
    scores = fleet.scorer.score(request(PROMPT), cycle, [a, b])
    assert scores[[a, b][winner]] == 1.0 > scores[[a, b][1 - winner]]
    explained = list(_explained(cycle, (a, b)).values())
    queued = [n["queuedMs"] for n in explained]
    own = [n["prefillMs"] + n["attentionMs"] for n in explained]
    return explained, queued, own


@pytest.mark.parametrize(("queued_on_a", "winner"), [(12, 0), (1, 0)])
def test_the_queue_weight_fades_as_the_mean_queue_reaches_the_requests_own_prefill(
    queued_on_a: int, winner: int
) -> None:
    """The pods of the test above, with `queueWeightFade`: twelve prefills queued on
    a put the fleet's mean queue far above the request's own prefill there (5 of
    100 blocks), the extra is gone and the holder wins, where without the fade b
    wins; one queued prefill leaves part of the extra, in the formula's share."""
    parameters = PredictedTtftScorer.Parameters(queue_weight=3.0, queue_weight_fade=True)
    explained, queued, own = _pick_after_queueing_on_a(parameters, queued_on_a, winner)
    fade = max(0.0, 1.0 - (sum(queued) / 2) / min(own))
    assert (fade == 0.0) == (queued_on_a == 12)
    assert 0.0 < fade < 1.0 or queued_on_a == 12
    extra = (3.0 - 1.0) * 0.5 * fade  # one pod of two idle
    assert explained[0]["costMs"] == pytest.approx(
        explained[0]["predictedTtftMs"] + extra * queued[0], abs=0.01
    )


@pytest.mark.parametrize(("cap_ms", "winner"), [(None, 0), (0.001, 0), (1e6, 1)])
def test_a_miss_cap_keeps_the_queue_weight_while_a_miss_is_short(
    cap_ms: float | None, winner: int
) -> None:
    """Twelve prefills queued on a, as above: the fade scaled by the request's own
    prefill leaves no extra and the holder wins. Scaled by a miss's prefill (a cap
    above it), the mean queue is short beside the miss, part of the extra stays and
    b wins; a cap below the request's own prefill changes nothing."""
    parameters = PredictedTtftScorer.Parameters(
        queue_weight=3.0, queue_weight_fade=True, queue_weight_fade_miss_cap_ms=cap_ms
    )
    explained, queued, own = _pick_after_queueing_on_a(parameters, 12, winner)
    scale = min(own) if cap_ms is None else max(min(own), min(max(own), cap_ms))
    fade = max(0.0, 1.0 - (sum(queued) / 2) / scale)
    extra = (3.0 - 1.0) * 0.5 * fade  # one pod of two idle
    assert explained[0]["costMs"] == pytest.approx(
        explained[0]["predictedTtftMs"] + extra * queued[0], abs=0.01
    )


@pytest.mark.parametrize(
    ("demand", "held", "hot", "winner"),
    [(0.6, 95.0, True, 1), (0.4, 95.0, False, 0), (0.0, 95.0, False, 0), (0.9, 40.0, False, 1)],
)
def test_a_hot_prefix_keeps_its_own_queue_weight_however_long_the_mean_queue(
    demand: float, held: float, hot: bool, winner: int
) -> None:
    """Twelve prefills queued on a, which holds the prompt's prefix: the fade leaves
    the default's weight nothing and a wins. With `hotPrefixQueueWeight`, a prefix
    wanted by more of the recent requests than a's share of the pods (over half of
    them, one pod of two) is hot: its weight counts unfaded and b, idle, wins. A
    prefix wanted by fewer is not, nor one that is not most of the prompt (40 of
    100 blocks: b wins on the prediction alone, a's queue of long prefills)."""
    parameters = PredictedTtftScorer.Parameters(
        queue_weight=2.0, queue_weight_fade=True, hot_prefix_queue_weight=8.0
    )
    explained, queued, _ = _pick_after_queueing_on_a(parameters, 12, winner, demand, held)
    assert [n["hotPrefix"] for n in explained] == [hot, hot]
    assert explained[0]["prefixDemand"] == demand
    extra = (8.0 - 1.0) * 0.5 if hot else 0.0  # one pod of two idle; faded to nothing
    assert explained[0]["costMs"] == pytest.approx(
        explained[0]["predictedTtftMs"] + extra * queued[0], abs=0.01
    )


def test_a_pod_that_leaves_takes_its_queue_and_speed_with_it() -> None:
    datastore = Datastore()
    datastore.replace_all([EndpointSpec("a", "10.0.0.1:8000")])
    fleet = Fleet(datastore)
    (old,) = datastore.ready_endpoints()
    req, cycle = fleet.route(old)
    datastore.replace_all([EndpointSpec("a", "10.0.0.9:8000")])  # same name, new pod
    (new,) = datastore.ready_endpoints()
    assert fleet.producer.describe_endpoint(new)["predictedTtft"]["queuedRequests"] == 0
    # The old request ends into the old pod's ledger, not the new one's.
    fleet.producer.post_response(req, cycle, routed(("default", old)), DONE)
    assert fleet.producer.describe_endpoint(new)["predictedTtft"]["queuedRequests"] == 0


def test_without_the_producer_every_pod_scores_one_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    scorer = Fleet().scorer
    a, b = make_endpoints(2)
    with caplog.at_level(logging.WARNING):
        assert scorer.score(request(), CycleState(), [a, b]) == {a: 1.0, b: 1.0}
        scorer.score(request(), CycleState(), [a, b])
    assert sum("no predictions from producer" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"forgetting": 2.0}, "forgetting"),
        ({"podAdaptRate": -0.5}, "podAdaptRate"),
        ({"noSuchParameter": 1}, "noSuchParameter"),
        ({"minPrefillWeightMs": -1.0}, "minPrefillWeightMs"),
        ({"minPrefillWeightMs": float("nan")}, "minPrefillWeightMs"),
        ({"minPrefillWeightMs": 1e9}, "minPrefillWeightMs"),
        ({"relativeFitFloorMs": 0}, "relativeFitFloorMs"),
        ({"relativeFitFloorMs": -5.0}, "relativeFitFloorMs"),
        ({"relativeFitFloorMs": 1e9}, "relativeFitFloorMs"),
        ({"revalueQueued": 0}, "revalueQueued"),
        ({"revalueQueued": -0.2}, "revalueQueued"),
    ],
)
def test_bad_parameters_are_refused(parameters: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        load(one_plugin_config("predicted-ttft-producer", parameters))
    with pytest.raises(InvalidConfig, match="tieTolerance"):
        load(one_plugin_config("predicted-ttft-scorer", {"tieTolerance": -0.1}))
    with pytest.raises(InvalidConfig, match="queueWeightFade"):
        load(one_plugin_config("predicted-ttft-scorer", {"queueWeightFade": "yes"}))
    with pytest.raises(InvalidConfig, match="hotPrefixQueueWeight"):
        load(one_plugin_config("predicted-ttft-scorer", {"hotPrefixQueueWeight": -2}))
    with pytest.raises(InvalidConfig, match="crowdedFromDemandPods"):
        load(one_plugin_config("predicted-ttft-scorer", {"crowdedFromDemandPods": -1}))
    with pytest.raises(InvalidConfig, match="queueWeightFadeMissCapMs"):
        load(one_plugin_config("predicted-ttft-scorer", {"queueWeightFadeMissCapMs": 0}))
    with pytest.raises(InvalidConfig, match="sessionTieShare"):
        load(one_plugin_config("predicted-ttft-scorer", {"sessionTieShare": 1.5}))
    with pytest.raises(InvalidConfig, match="queueWeight"):
        load(one_plugin_config("predicted-ttft-scorer", {"queueWeight": -1.0}))
    with pytest.raises(InvalidConfig, match="workWeight"):
        load(one_plugin_config("predicted-ttft-scorer", {"workWeight": -1.0}))
    for bad_share in (1.0, -0.1, "most"):
        with pytest.raises(InvalidConfig, match="workWeightBusyFrom"):
            load(one_plugin_config("predicted-ttft-scorer", {"workWeightBusyFrom": bad_share}))
    for bad_time in (0.0, -5.0, "long"):
        with pytest.raises(InvalidConfig, match="workWeightBusyForS"):
            load(one_plugin_config("predicted-ttft-scorer", {"workWeightBusyForS": bad_time}))
    with pytest.raises(InvalidConfig, match="tieMaxMs"):
        load(one_plugin_config("predicted-ttft-scorer", {"tieMaxMs": -1.0}))
    with pytest.raises(InvalidConfig, match="newPrefixTieMaxMs"):
        load(one_plugin_config("predicted-ttft-scorer", {"newPrefixTieMaxMs": -1.0}))
    with pytest.raises(InvalidConfig, match="kvRoomForNew"):
        load(one_plugin_config("predicted-ttft-scorer", {"kvRoomForNew": "yes"}))


def _slo_request(value: str | None, header: str = "x-slo-ttft-ms") -> InferenceRequest:
    return parse_request(
        request_id="r",
        method="POST",
        path="/v1/completions",
        headers={} if value is None else {header: value},
        body=msgspec.json.encode({"model": "m", "prompt": PROMPT}),
    )


def test_the_slo_filter_keeps_the_pods_predicted_to_meet_the_objective() -> None:
    fleet = Fleet()
    slo = PredictedTtftSloFilter(
        PredictedTtftSloFilter.Parameters(), context("predicted-ttft-slo-filter")
    )
    warm, cold = make_endpoints(2)
    _, cycle = fleet.cycle({warm: 100.0})
    fast, slow = fleet.seconds(cycle, warm), fleet.seconds(cycle, cold)
    between = f"{(fast + slow) / 2 * 1e3:.3f}"
    assert slo.filter(_slo_request(None), cycle, [warm, cold]) == [warm, cold]
    assert slo.filter(_slo_request(between), cycle, [warm, cold]) == [warm]
    assert slo.filter(_slo_request(between, "x-llm-d-slo-ttft-ms"), cycle, [warm, cold]) == [warm]
    # Nobody meets 0.001 ms: a request that must be served goes to every pod ...
    assert slo.filter(_slo_request("0.001"), cycle, [warm, cold]) == [warm, cold]
    notes = cycle.get(EXPLAIN_NOTES)
    assert notes is not None
    assert notes["predicted-ttft-slo-filter"]["met"] is False
    # ... a sheddable one is refused, saying why.
    cycle.put(PRIORITY, -1)
    with pytest.raises(Shed, match=r"objective of 0.001 ms \(the best is predicted at \d+ ms\)"):
        slo.filter(_slo_request("0.001"), cycle, [warm, cold])
    for bad in ("soon", "-5", "0", "nan"):
        with pytest.raises(BadRequest, match="x-slo-ttft-ms must be a positive number"):
            slo.filter(_slo_request(bad), cycle, [warm, cold])


@pytest.mark.parametrize(
    ("work_weight", "busy_from", "b_queues", "a_crowded", "winner"),
    [
        (1.0, 0.0, True, False, 1),  # off: the greedy pick takes b, predicted sooner
        (4.0, 0.0, True, False, 0),  # every pod queues: a's hit saves more than b's wait
        (4.0, 0.0, False, False, 0),  # b idle: the extra halves (one pod of two queues)
        (4.0, 0.0, True, True, 1),  # a crowded: its hit earns no extra, and b is sooner
        (4.0, 0.5, False, False, 1),  # b idle: half the pods queue, from which it counts
        (4.0, 0.5, True, False, 0),  # every pod queues: all of the extra
        (4.0, 0.25, False, False, 0),  # half the pods queue: a third of the extra
    ],
)
def test_the_work_weight_counts_the_prefill_a_miss_adds_on_a_busy_fleet(
    work_weight: float, busy_from: float, b_queues: bool, a_crowded: bool, winner: int
) -> None:
    """a holds 95 of the prompt's 100 blocks behind thirty queued prefills, b holds
    nothing (behind one short one, or idle): b is predicted sooner, by more than a
    tie, but would prefill all 4,000 tokens where a prefills 200. Unless a is
    crowded, b decodes a request that prefilled 2,200 tokens: a's 6,000 in flight
    are then below 1.5 times the mean. With `workWeightBusyFrom`, the extra grows
    from nothing at that share of the pods queued to all of it when every pod is."""
    fleet = Fleet(
        scorer=PredictedTtftScorer.Parameters(
            work_weight=work_weight, work_weight_busy_from=busy_from
        )
    )
    a, b = make_endpoints(2)
    for _ in range(30):
        fleet.route(a, {a: 95.0})
    if not a_crowded:
        decoding, cycle = fleet.route(b, {b: 45.0})
        fleet.producer.response_first_chunk(
            decoding, cycle, routed(("default", b)), fleet.seconds(cycle, b)
        )
    if b_queues:
        fleet.route(b, {b: 99.0})
    _, cycle = fleet.cycle({a: 95.0})
    predictions = cycle.get(predicted_ttft_key("predicted-ttft-producer"))
    assert predictions is not None
    mean = (fleet.producer.tokens_in_flight(a) + fleet.producer.tokens_in_flight(b)) / 2
    assert (fleet.producer.tokens_in_flight(a) > 1.5 * mean) is a_crowded
    assert fleet.seconds(cycle, b) * 1.25 + 0.001 < fleet.seconds(cycle, a)
    scores = fleet.scorer.score(request(PROMPT), cycle, [a, b])
    assert scores[[a, b][winner]] == 1.0 > scores[[a, b][1 - winner]]
    notes = cycle.get(EXPLAIN_NOTES)
    assert notes is not None
    explained = {e: notes["predicted-ttft-scorer"][e.name] for e in (a, b)}
    own = {e: n["prefillMs"] + n["attentionMs"] for e, n in explained.items()}
    busy = 1.0 if b_queues else 0.5
    share = (busy - busy_from) / (1.0 - busy_from)
    # A crowded pod is charged the work of a miss: the most any candidate prefills.
    counted = {a: max(own.values()) if a_crowded else own[a], b: own[b]}
    for e in (a, b):
        assert explained[e]["costMs"] == pytest.approx(
            explained[e]["predictedTtftMs"] + (work_weight - 1.0) * share * counted[e], abs=0.01
        )


def test_the_busy_time_is_the_share_of_recent_time_the_fleet_was_busy() -> None:
    """An exponential average on the clock, each pick's state held until the next."""
    busy = BusyTime()
    assert busy.update(True, 10.0, 5.0) == 0.0  # nothing before the first pick
    one = 1.0 - math.exp(-1.0)
    assert busy.update(True, 15.0, 5.0) == pytest.approx(one)  # busy one time constant
    # Idle from 15 on, but busy from 10 to 15 is what 15 to 20 saw before it.
    assert busy.update(False, 20.0, 5.0) == pytest.approx(1.0 - math.exp(-2.0))
    assert busy.update(False, 25.0, 5.0) == pytest.approx((1.0 - math.exp(-2.0)) / math.e)
    # A clock read out of order (an earlier time) changes nothing but the state.
    assert busy.update(True, 24.0, 5.0) == pytest.approx((1.0 - math.exp(-2.0)) / math.e)


def test_with_a_busy_time_the_work_weight_waits_until_the_fleet_has_stayed_busy() -> None:
    """The setup of the work weight's test (a holds 95 of 100 blocks behind thirty
    prefills, b nothing behind one short one), and c idle: the fleet counts as busy
    while at least three quarters of the candidates queue. The extra is nothing
    until the fleet has been busy half the recent time (a time constant of 1 ms,
    so that the queues barely drain while the test moves the clock) and all of it
    once busy throughout; one idle pick does not take it away, a while idle does."""
    fleet = Fleet(
        scorer=PredictedTtftScorer.Parameters(
            work_weight=4.0, work_weight_busy_from=0.75, work_weight_busy_for_s=0.001
        )
    )
    a, b, c = make_endpoints(3)
    for _ in range(30):
        fleet.route(a, {a: 95.0})
    decoding, cycle = fleet.route(b, {b: 45.0})
    fleet.producer.response_first_chunk(
        decoding, cycle, routed(("default", b)), fleet.seconds(cycle, b)
    )
    fleet.route(b, {b: 99.0})

    def pick(candidates: list[Endpoint]) -> tuple[Endpoint, float]:
        _, cycle = fleet.cycle({a: 95.0})
        assert fleet.seconds(cycle, b) * 1.25 + 0.001 < fleet.seconds(cycle, a)
        scores = fleet.scorer.score(request(PROMPT), cycle, candidates)
        notes = cycle.get(EXPLAIN_NOTES)
        assert notes is not None
        share = notes["predicted-ttft-scorer"][a.name]["workWeightShare"]
        (best,) = [e for e, v in scores.items() if v == 1.0]
        return best, share

    assert pick([a, b]) == (b, 0.0)  # every pod queues, but only since now: greedy
    fleet.clock.advance(0.01)  # ten time constants busy
    best, share = pick([a, b])
    assert best is a
    assert share == pytest.approx(1.0, abs=1e-3)
    # c idles: two of three queue, not busy; the fleet was busy until now. (c wins
    # either way: with three pods a's tokens in flight make it crowded.)
    assert pick([a, b, c])[1] == pytest.approx(1.0, abs=1e-3)
    fleet.clock.advance(0.01)  # ten time constants with c idle
    assert pick([a, b, c])[1] == pytest.approx(0.0, abs=1e-3)
    best, share = pick([a, b])  # every pod queues again, since now
    assert best is b
    assert share == pytest.approx(0.0, abs=1e-3)


def test_from_a_busy_share_of_nothing_the_busy_time_counts_a_pod_queued() -> None:
    """`workWeightBusyFrom: 0` with a busy time: an idle fleet is not busy, however
    long it idles."""
    fleet = Fleet(
        scorer=PredictedTtftScorer.Parameters(work_weight=4.0, work_weight_busy_for_s=0.001)
    )
    a, b = make_endpoints(2)

    def share_after_two_picks(apart_s: float) -> object:
        for _ in range(2):
            _, cycle = fleet.cycle({a: 95.0})
            fleet.scorer.score(request(PROMPT), cycle, [a, b])
            fleet.clock.advance(apart_s)
        notes = cycle.get(EXPLAIN_NOTES)
        assert notes is not None
        return notes["predicted-ttft-scorer"][a.name]["workWeightShare"]

    assert share_after_two_picks(0.01) == 0.0
    fleet.route(b)  # b queues: half the pods, at least the share of nothing
    # Busy one time constant: the average at 1 - 1/e, the extra's share twice that
    # less one (as the explain note rounds it).
    assert share_after_two_picks(0.001) == round(2.0 * (1.0 - math.exp(-1.0)) - 1.0, 4)


def test_the_prompt_tokens_decoding_on_a_pod_are_counted_from_first_token_to_end() -> None:
    fleet = Fleet()
    (pod,) = make_endpoints(1)
    result = routed(("default", pod))

    def decoding_tokens() -> object:
        return fleet.producer.describe_endpoint(pod)["predictedTtft"]["decodingTokens"]

    assert decoding_tokens() == 0
    first, first_cycle = fleet.route(pod, {pod: 90.0})
    aborted, aborted_cycle = fleet.route(pod)
    assert decoding_tokens() == 0  # queued for prefill: nothing decodes yet
    fleet.producer.response_first_chunk(first, first_cycle, result, 0.05)
    assert decoding_tokens() == 4000  # the whole prompt, cached part included
    # One that ends before its first token never decoded; a repeated end counts once.
    fleet.producer.post_response(aborted, aborted_cycle, result, ResponseInfo(completed=False))
    assert decoding_tokens() == 4000
    fleet.producer.post_response(first, first_cycle, result, DONE)
    fleet.producer.post_response(first, first_cycle, result, DONE)
    assert decoding_tokens() == 0


@pytest.mark.parametrize(
    ("factor", "c_queues", "winner"),
    [
        (None, False, 0),  # off: a's hit wins, however long the contexts it decodes
        (3.0, False, 0),  # a decodes 2.5 times the mean's 4,000-token contexts: not heavy
        (2.0, False, 1),  # heavy: a counts as holding nothing, and b decodes less
        (2.0, True, 0),  # c queues: two thirds of a miss is charged, and a's hit wins again
    ],
)
def test_the_decode_balance_factor_counts_a_heavy_pods_hit_as_a_miss(
    factor: float | None, c_queues: bool, winner: int
) -> None:
    """a holds 95 of the prompt's 100 blocks and decodes five 4,000-token prompts,
    b holds nothing and decodes none, c holds nothing and decodes one (and with
    `c_queues` has a prefill queued)."""
    fleet = Fleet(scorer=PredictedTtftScorer.Parameters(decode_balance_factor=factor))
    a, b, c = make_endpoints(3)
    for pod, count in ((a, 5), (c, 1)):
        for _ in range(count):
            req, cycle = fleet.route(pod, {pod: 95.0})
            fleet.producer.response_first_chunk(req, cycle, routed(("default", pod)), 0.03)
    if c_queues:
        fleet.route(c, {c: 99.0})
    _, cycle = fleet.cycle({a: 95.0})
    assert fleet.seconds(cycle, a) * 1.25 < fleet.seconds(cycle, b)  # a's hit: no tie
    scores = fleet.scorer.score(request(PROMPT), cycle, [a, b, c])
    assert scores[[a, b][winner]] == 1.0 == max(scores.values())
    explained = _explained(cycle, (a, b, c))
    assert [explained[e]["decodingTokens"] for e in (a, b, c)] == [20000, 0, 4000]
    # A heavy pod is charged the work of a miss (the most any candidate prefills),
    # in proportion to the pods with no prefill queued.
    idle = 2 / 3 if c_queues else 1.0
    _assert_charged_a_miss(explained, a, idle if factor == 2.0 else 0.0)
    _assert_charged_a_miss(explained, b, 0.0)


def _explained(cycle: CycleState, pods: Sequence[Endpoint]) -> dict[Endpoint, dict[str, Any]]:
    notes = cycle.get(EXPLAIN_NOTES)
    assert notes is not None
    return {e: notes["predicted-ttft-scorer"][e.name] for e in pods}


def _assert_charged_a_miss(
    explained: Mapping[Endpoint, Mapping[str, Any]], pod: Endpoint, share: float
) -> None:
    """`pod`'s cost is its prediction plus `share` of the work a miss (the most any
    candidate prefills) adds over its own."""
    own = {e: n["prefillMs"] + n["attentionMs"] for e, n in explained.items()}
    assert explained[pod]["costMs"] == pytest.approx(
        explained[pod]["predictedTtftMs"] + share * (max(own.values()) - own[pod]), abs=0.01
    )


def test_a_decode_balance_factor_of_one_or_less_is_refused() -> None:
    with pytest.raises(InvalidConfig, match="decodeBalanceFactor"):
        load(one_plugin_config("predicted-ttft-scorer", {"decodeBalanceFactor": 1.0}))


@pytest.mark.parametrize(
    ("factor", "continues", "c_queues", "winner"),
    [
        (None, False, False, 0),  # off: a's hit wins, however crowded a is
        (4.0, False, False, 0),  # a has under four times the mean tokens in flight
        (2.0, False, False, 1),  # crowded: a's hit is charged as a miss, b is idle
        (2.0, True, False, 0),  # a turn that continues one stays with its history
        (2.0, False, True, 0),  # c queues: two thirds of a miss, and a's hit wins again
    ],
)
def test_the_spread_factor_charges_a_crowded_pods_hit_to_a_request_that_starts_something(
    factor: float | None, continues: bool, c_queues: bool, winner: int
) -> None:
    """a holds 95 of the prompt's 100 blocks and has eight requests in flight, b
    holds nothing and has none, c holds nothing and has one (and with `c_queues`
    it is queued for prefill; otherwise it decodes)."""
    fleet = Fleet(scorer=PredictedTtftScorer.Parameters(spread_factor=factor))
    a, b, c = make_endpoints(3)
    for pod, count in ((a, 8), (c, 1)):
        for _ in range(count):
            req, cycle = fleet.route(pod, {pod: 95.0})
            if pod is a or not c_queues:
                fleet.producer.response_first_chunk(req, cycle, routed(("default", pod)), 0.03)
    cycle = CycleState()
    info = PrefixMatchInfo(100, 40, {a: 95.0}, continues=continues)
    cycle.put(prefix_match_key("approx-prefix-cache-producer"), info)
    asyncio.run(fleet.producer.prepare(request(PROMPT), cycle, []))
    predictions = cycle.get(predicted_ttft_key("predicted-ttft-producer"))
    assert predictions is not None
    mean = sum(fleet.producer.tokens_in_flight(e) for e in (a, b, c)) / 3
    assert 2.0 * mean < fleet.producer.tokens_in_flight(a) < 4.0 * mean
    assert fleet.seconds(cycle, a) * 1.25 < fleet.seconds(cycle, b)  # a's hit: no tie
    scores = fleet.scorer.score(request(PROMPT), cycle, [a, b, c])
    assert scores[[a, b][winner]] == 1.0 == max(scores.values())
    explained = _explained(cycle, (a, b, c))
    idle = 2 / 3 if c_queues else 1.0
    _assert_charged_a_miss(explained, a, idle if factor == 2.0 and not continues else 0.0)
    _assert_charged_a_miss(explained, b, 0.0)


@pytest.mark.parametrize(
    ("by_pod", "fresh", "a_running", "a_unseen", "winner"),
    [
        # this EPP's own tokens: none in flight anywhere, a's hit wins
        (False, True, 8, 0, 0),
        # a reports eight requests (another replica's): crowded
        (True, True, 8, 0, 1),
        # a reports two, and this EPP has sent it six since that scrape: crowded
        (True, True, 2, 6, 1),
        # a reports two and nothing was sent since: not above twice the mean
        (True, True, 2, 0, 0),
        # a stale scrape counts this EPP's own requests: none
        (True, False, 8, 0, 0),
    ],
)
def test_spread_by_pod_requests_counts_what_every_replica_sent(
    by_pod: bool, fresh: bool, a_running: int, a_unseen: int, winner: int
) -> None:
    """a holds 95 of the prompt's 100 blocks and reports `a_running` requests
    running (with `a_unseen` more sent by this EPP since that scrape), b and c hold
    nothing and report none and one; this EPP has none of them in flight. With
    `spreadByPodRequests` the spread reads the pods' own counts (every client's
    requests), so a prompt starting over a shared prefix leaves a pod that other
    replicas crowd, which this EPP's tokens in flight cannot see."""
    fleet = Fleet(
        scorer=PredictedTtftScorer.Parameters(spread_factor=2.0, spread_by_pod_requests=by_pod)
    )
    a, b, c = make_endpoints(3)
    for pod, running in ((a, a_running), (b, 0), (c, 1)):
        pod.metrics = EndpointMetrics(running_requests=running, updated_at=fleet.clock())
    a.routed = a_unseen  # the scrape saw routed_seen = 0
    if not fresh:
        fleet.clock.advance(a.metrics.staleness_s + 1.0)
    cycle = CycleState()
    info = PrefixMatchInfo(100, 40, {a: 95.0}, continues=False)
    cycle.put(prefix_match_key("approx-prefix-cache-producer"), info)
    asyncio.run(fleet.producer.prepare(request(PROMPT), cycle, []))
    scores = fleet.scorer.score(request(PROMPT), cycle, [a, b, c])
    assert scores[[a, b][winner]] == 1.0 == max(scores.values())
    explained = _explained(cycle, (a, b, c))
    _assert_charged_a_miss(explained, a, 1.0 if winner == 1 else 0.0)
    # /debug/explain shows what the spread compared.
    counts = [explained[e].get("podRequests") for e in (a, b, c)]
    if not by_pod:
        assert counts == [None, None, None]
    elif fresh:
        assert counts == [a_running + a_unseen, 0, 1]
    else:
        assert counts == [0, 0, 0]  # stale, and this EPP has nothing in flight there


@pytest.mark.parametrize("a_scrape", ["stale", "no waiting count", "fresh"])
def test_spread_by_pod_requests_scales_a_stale_pods_own_requests_by_the_fleets_ratio(
    a_scrape: str,
) -> None:
    """This EPP has four requests on a and one decoding on b; b reports two running
    (another replica sent the other), c none. a's scrape is stale: the fresh pods
    report two requests for each of this EPP's, so a counts eight, more than twice
    the mean ((8 + 2 + 0) / 3), and its hit is charged a miss in proportion to the
    pods with no queue (b and c). Counted as this EPP's own four, a would sit at
    exactly twice the mean, not above it, as it does when a's fresh scrape says
    four: then no other replica has sent it anything. A fresh page without the
    waiting count is no count either, as a stale one."""
    fleet = Fleet(
        scorer=PredictedTtftScorer.Parameters(spread_factor=2.0, spread_by_pod_requests=True),
        initialContinuingShare=0.0,
    )
    a, b, c = make_endpoints(3)
    missing = {WAITING: "absent"} if a_scrape == "no waiting count" else {}
    a.metrics = EndpointMetrics(running_requests=4, updated_at=fleet.clock(), missing=missing)
    if a_scrape == "stale":
        fleet.clock.advance(a.metrics.staleness_s + 1.0)
    for _ in range(4):
        fleet.route(a)
    req, started = fleet.route(b)
    fleet.producer.response_first_chunk(req, started, routed(("default", b)), 0.01)
    b.metrics = EndpointMetrics(running_requests=2, updated_at=fleet.clock())
    c.metrics = EndpointMetrics(updated_at=fleet.clock())
    cycle = CycleState()
    info = PrefixMatchInfo(100, 40, {a: 95.0}, continues=False)
    cycle.put(prefix_match_key("approx-prefix-cache-producer"), info)
    asyncio.run(fleet.producer.prepare(request(PROMPT), cycle, []))
    fleet.scorer.score(request(PROMPT), cycle, [a, b, c])
    explained = _explained(cycle, (a, b, c))
    fresh = a_scrape == "fresh"
    _assert_charged_a_miss(explained, a, 0.0 if fresh else 2 / 3)
    assert [explained[e]["podRequests"] for e in (a, b, c)] == [4 if fresh else 8, 2, 0]


def test_spread_by_pod_requests_counts_this_epps_own_where_no_scrape_is_fresh() -> None:
    """No pod has a fresh scrape (none ever reported): there is no other replica's
    share to scale by, and each pod counts the requests this EPP has on it."""
    fleet = Fleet(
        scorer=PredictedTtftScorer.Parameters(spread_factor=2.0, spread_by_pod_requests=True),
        initialContinuingShare=0.0,
    )
    a, b, c = make_endpoints(3)
    for _ in range(3):
        fleet.route(a)
    fleet.route(b)
    cycle = CycleState()
    info = PrefixMatchInfo(100, 40, {a: 95.0}, continues=False)
    cycle.put(prefix_match_key("approx-prefix-cache-producer"), info)
    asyncio.run(fleet.producer.prepare(request(PROMPT), cycle, []))
    fleet.scorer.score(request(PROMPT), cycle, [a, b, c])
    explained = _explained(cycle, (a, b, c))
    assert [explained[e]["podRequests"] for e in (a, b, c)] == [3, 1, 0]
    assert all(type(explained[e]["podRequests"]) is int for e in (a, b, c))


def test_a_spread_factor_of_one_or_less_is_refused() -> None:
    with pytest.raises(InvalidConfig, match="spreadFactor"):
        load(one_plugin_config("predicted-ttft-scorer", {"spreadFactor": 1.0}))


def test_within_a_tie_the_pod_a_prompt_was_sent_to_ranks_first() -> None:
    # Neither pod is predicted to hold the prompt (its cache window says b's copy is
    # gone), so both tie as for a new prompt; b, where the prompt's group was sent,
    # ranks first, and without the remembered match the pods draw.
    fleet = Fleet()
    a, b = make_endpoints(2)
    req = request(PROMPT)
    cycle = CycleState()
    cycle.put(
        prefix_match_key("approx-prefix-cache-producer"),
        PrefixMatchInfo(100, 40, {}, remembered={b: 100.0}),
    )
    asyncio.run(fleet.producer.prepare(req, cycle, []))
    scores = fleet.scorer.score(req, cycle, [a, b])
    assert fleet.seconds(cycle, a) == fleet.seconds(cycle, b)
    assert scores[b] == 1.0 > scores[a] >= 0.9
    _, plain = fleet.cycle({})
    scores = fleet.scorer.score(request(PROMPT), plain, [a, b])
    assert scores[a] == scores[b] == 1.0


@pytest.mark.parametrize("beyond_own", [True, False])
def test_with_waiting_beyond_own_a_pods_waiting_requests_count_beyond_this_epps_own(
    beyond_own: bool,
) -> None:
    fleet = Fleet(waitingBeyondOwn=beyond_own)
    mine, shared, other = make_endpoints(3)
    req, cycle = fleet.route(mine)
    _, shared_cycle = fleet.route(shared)
    start = fleet.clock()
    # Scrapes 5 ms later: each pod reports a request waiting; `shared` one more
    # (another replica's), `other` one this EPP never sent.
    fleet.clock.advance(0.005)
    scrape = fleet.clock()
    mine.metrics = EndpointMetrics(waiting_requests=1, updated_at=scrape)
    shared.metrics = EndpointMetrics(waiting_requests=2, updated_at=scrape)
    other.metrics = EndpointMetrics(waiting_requests=1, updated_at=scrape)
    # Read 20 ms later, after `mine`'s request started: that snapshot's waiting
    # request was this EPP's own, whose prefill its queue already counted.
    fleet.clock.advance(0.02)
    fleet.producer.response_first_chunk(
        req, cycle, routed(("default", mine)), fleet.clock() - start
    )
    _, now = fleet.cycle({})
    predictions = now.get(predicted_ttft_key("predicted-ttft-producer"))
    assert predictions is not None
    waiting = {e: predictions.predict(e).features.waiting for e in (mine, shared, other)}
    if not beyond_own:  # every request the pods report
        assert waiting == {mine: 1, shared: 2, other: 1}
        return
    assert waiting == {mine: 0, shared: 1, other: 1}
    per_request = predictions.predict(other).parts["waiting"]
    assert per_request > 0.0
    assert predictions.predict(mine).parts["waiting"] == 0.0
    # `shared`'s request still waiting after its predicted first token: the pod is
    # behind what this EPP predicted (a full KV cache, a full batch), and its
    # waiting request says so.
    fleet.clock.advance(fleet.seconds(shared_cycle, shared))
    shared.metrics = EndpointMetrics(waiting_requests=1, updated_at=fleet.clock())
    _, overdue = fleet.cycle({})
    behind = overdue.get(predicted_ttft_key("predicted-ttft-producer"))
    assert behind is not None
    assert behind.predict(shared).features.waiting == 1
    # A snapshot older than its staleness threshold counts none.
    fleet.clock.advance(mine.metrics.staleness_s)
    _, later = fleet.cycle({})
    stale = later.get(predicted_ttft_key("predicted-ttft-producer"))
    assert stale is not None
    assert stale.predict(other).features.waiting == 0


def test_count_overdue_adds_the_requests_a_pod_is_late_with() -> None:
    """With `countOverdue`, a pod holding a request whose first token is overdue is
    predicted slower than its drained queue says; without it, the feature is 0."""
    predicted = {}
    for count in (False, True):
        fleet = Fleet(countOverdue=count)
        late, idle = make_endpoints(2)
        fleet.route(late)  # 4,000 tokens: a first token predicted within a second
        fleet.clock.advance(5.0)  # ... and still none: the queue has drained in the ledger
        _, cycle = fleet.cycle({})
        predictions = cycle.get(predicted_ttft_key("predicted-ttft-producer"))
        assert predictions is not None
        both = predictions.predict_all([late, idle])
        assert both[late].queue_s == 0.0
        predicted[count] = (both[late].features.overdue, both[late].seconds - both[idle].seconds)
    assert predicted[False] == (0, 0.0)
    overdue, slower = predicted[True]
    assert overdue == 1
    assert slower == pytest.approx(fleet.producer.model.describe()["overdue"])
    assert slower > 0.0


def _kv_scrape(pod: Endpoint, usage: float, now: float) -> None:
    """A fresh scrape of `pod`: its KV cache 1,000 blocks of 16 tokens, `usage` used."""
    pod.metrics = EndpointMetrics(
        kv_cache_usage=usage, num_gpu_blocks=1000, block_size=16, updated_at=now
    )


@pytest.mark.parametrize(
    ("setting", "continues", "others_full", "a_fresh", "a_charged"),
    [
        (False, False, False, True, False),  # off: a's full cache counts for nothing
        (True, False, False, True, True),  # a has no room for the 4,000 tokens: charged
        (True, True, False, True, False),  # a request that continues one stays put
        (True, False, True, True, False),  # no pod has room: the charge moves nothing
        (True, False, False, False, False),  # a stale scrape says nothing of a's room
    ],
)
def test_kv_room_for_new_charges_a_pod_without_room_the_prefill_again(
    setting: bool, continues: bool, others_full: bool, a_fresh: bool, a_charged: bool
) -> None:
    """No pod holds the prompt (4,000 tokens); a's KV cache is 99% used (160 tokens
    of room), b's and c's 10% (or 99% with `others_full`). b has a request in
    flight, so without a charge the pick goes to a or c (fewest tokens in flight).
    The tie is capped at 1 ms (`tieMaxMs`): a new prompt's tie, as wide as its
    prediction, would otherwise hold a pod charged its prefill once more."""
    fleet = Fleet(scorer=PredictedTtftScorer.Parameters(kv_room_for_new=setting, tie_max_ms=1.0))
    a, b, c = make_endpoints(3)
    req, cycle = fleet.route(b)
    fleet.producer.response_first_chunk(req, cycle, routed(("default", b)), 0.03)
    _kv_scrape(a, 0.99, fleet.clock())
    if not a_fresh:
        fleet.clock.advance(a.metrics.staleness_s + 1.0)
    for pod in (b, c):
        _kv_scrape(pod, 0.99 if others_full else 0.1, fleet.clock())
    cycle = CycleState()
    info = PrefixMatchInfo(100, 40, {}, continues=continues)
    cycle.put(prefix_match_key("approx-prefix-cache-producer"), info)
    asyncio.run(fleet.producer.prepare(request(PROMPT), cycle, []))
    scores = fleet.scorer.score(request(PROMPT), cycle, [a, b, c])
    explained = _explained(cycle, (a, b, c))
    own = explained[a]["prefillMs"] + explained[a]["attentionMs"]
    charge = own if a_charged else 0.0
    assert explained[a]["costMs"] == pytest.approx(
        explained[a]["predictedTtftMs"] + charge, abs=0.01
    )
    assert explained[a]["kvFull"] is (setting and a_fresh and not continues)
    assert explained[c]["costMs"] == pytest.approx(explained[c]["predictedTtftMs"], abs=0.01)
    if a_charged:
        assert scores[a] < 0.9 < scores[c] == max(scores.values())
    else:
        assert scores[a] == max(scores.values())


def test_kv_room_for_new_reads_a_pod_without_a_block_size_as_having_room() -> None:
    """a reports its cache 99% used and its blocks but not their size: how many
    tokens it holds is not known, so it is not charged."""
    fleet = Fleet(scorer=PredictedTtftScorer.Parameters(kv_room_for_new=True, tie_max_ms=1.0))
    a, b = make_endpoints(2)
    a.metrics = EndpointMetrics(kv_cache_usage=0.99, num_gpu_blocks=1000, updated_at=fleet.clock())
    _kv_scrape(b, 0.1, fleet.clock())
    cycle = CycleState()
    cycle.put(prefix_match_key("approx-prefix-cache-producer"), PrefixMatchInfo(100, 40, {}))
    asyncio.run(fleet.producer.prepare(request(PROMPT), cycle, []))
    fleet.scorer.score(request(PROMPT), cycle, [a, b])
    explained = _explained(cycle, (a, b))
    assert explained[a]["kvFull"] is False
    assert explained[a]["costMs"] == pytest.approx(explained[a]["predictedTtftMs"], abs=0.01)
