"""Predicted TTFT with prefill/decode disaggregation: the producer predicts and
charges a disaggregated request on both pods and learns the KV transfer from its
observations; `predicted-ttft-pd-decider` disaggregates when that is predicted to
cost less than the decode pod alone."""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import pytest
import yaml
from epp.plugins.predicted_ttft_pd_decider import PredictedTtftPdDecider
from epp.plugins.predicted_ttft_producer import (
    TtftPredictions,
    predicted_ttft_key,
)

from epp.config import InvalidConfig
from epp.datastore import Datastore, Endpoint, EndpointSpec
from epp.director import Director
from epp.requests import InferenceRequest
from epp.scheduling import (
    EXPLAIN_NOTES,
    CycleState,
    DisaggregationDecider,
    ResponseInfo,
)
from epp.scheduling.types import SchedulingResult
from epp.telemetry import Telemetry
from tests.plugins.helpers import context
from tests.plugins.llmd_helpers import load, request, routed, with_match
from tests.plugins.test_predicted_ttft import Fleet as TtftFleet

PROMPT = "x" * 4000  # the match below says: 4,000 tokens in 100 blocks of 40
DONE = ResponseInfo(completed=True)
ROLE = "llm-d.ai/role"


def pod(name: str, role: str | None) -> Endpoint:
    labels = {ROLE: role} if role else {}
    return Endpoint(EndpointSpec(name, f"10.0.0.{len(name)}:8000", labels=labels))


class Fleet(TtftFleet):
    """The producer and the decider on a virtual clock, driven as the director does."""

    def __init__(self, pods: Sequence[Endpoint], **decider: Any) -> None:
        super().__init__()
        self.pods = list(pods)
        self.decider = PredictedTtftPdDecider(
            msgspec.convert(decider, PredictedTtftPdDecider.Parameters),
            context("predicted-ttft-pd-decider", self.clock),
        )

    def cycle(self, matched: Mapping[Endpoint, float]) -> tuple[InferenceRequest, CycleState]:
        req = request(PROMPT)
        cycle = with_match(CycleState(), matched, total=100, block_size=40)
        asyncio.run(self.producer.prepare(req, cycle, self.pods))
        return req, cycle

    def predictions(self, cycle: CycleState) -> TtftPredictions:
        found = cycle.get(predicted_ttft_key("predicted-ttft-producer"))
        assert found is not None
        return found

    def send(
        self, result: SchedulingResult, matched: Mapping[Endpoint, float] | None = None
    ) -> tuple[InferenceRequest, CycleState]:
        req, cycle = self.cycle(matched or {})
        self.producer.pre_request(req, cycle, result)
        return req, cycle


def split(decode: Endpoint, prefill: Endpoint) -> SchedulingResult:
    return routed(("decode", decode), ("prefill", prefill))


def test_a_disaggregated_request_queues_on_the_prefill_pod_and_decodes_on_the_other() -> None:
    d, p = pod("d", "decode"), pod("pp", "prefill")
    fleet = Fleet([d, p])
    result = split(d, p)
    req, cycle = fleet.send(result)
    producer = fleet.producer
    # Its prefill is queued on P, in work and tokens; D holds nothing of it yet.
    assert producer.requests_in_flight(p) == 1
    assert producer.tokens_in_flight(p) == 4000
    assert producer.requests_in_flight(d) == 0
    assert producer.tokens_in_flight(d) == 0
    _, later = fleet.cycle({})
    assert fleet.predictions(later).predict(p).parts["queued"] > 0
    assert fleet.predictions(later).predict(d).parts["queued"] == 0
    # The first token: P's part is over, D decodes it.
    fleet.clock.advance(0.2)
    producer.response_first_chunk(req, cycle, result, 0.2)
    assert producer.requests_in_flight(p) == 0
    assert producer.decoding(d) == 1
    assert producer.decoding(p) == 0
    producer.post_response(req, cycle, result, DONE)
    producer.post_response(req, cycle, result, DONE)  # reported twice: released once
    assert [producer.requests_in_flight(e) for e in (d, p)] == [0, 0]
    assert [producer.tokens_in_flight(e) for e in (d, p)] == [0, 0]


def test_an_aborted_disaggregated_request_leaves_both_pods_clean() -> None:
    d, p = pod("d", "decode"), pod("pp", "prefill")
    fleet = Fleet([d, p])
    result = split(d, p)
    req, cycle = fleet.send(result)
    fleet.producer.post_response(req, cycle, result, ResponseInfo(completed=False))
    assert [fleet.producer.requests_in_flight(e) for e in (d, p)] == [0, 0]
    _, fresh = fleet.cycle({})
    assert fleet.predictions(fresh).predict(p).parts["queued"] == 0


def test_the_transfer_is_the_prompt_the_decode_pod_does_not_hold() -> None:
    d, p = pod("d", "decode"), pod("pp", "prefill")
    fleet = Fleet([d, p])
    # D holds 60 of the 100 blocks, P 20: P computes 3,200 tokens, 1,600 move.
    _, cycle = fleet.cycle({d: 60.0, p: 20.0})
    pair = fleet.predictions(cycle).predict_disaggregated(p, d)
    assert (pair.cached_tokens, pair.uncached_tokens, pair.transfer_tokens) == (800, 3200, 1600)
    assert pair.parts["transfer"] > 0
    assert pair.describe()["transferTokens"] == 1600
    whole = fleet.predictions(cycle).predict(d)
    assert "transferMs" not in whole.describe()
    assert whole.features.transfer_tokens == 0
    # D holding everything: nothing moves.
    _, held = fleet.cycle({d: 100.0})
    assert fleet.predictions(held).predict_disaggregated(p, d).parts["transfer"] == 0


def test_the_transfer_rate_is_learnt_from_disaggregated_first_tokens() -> None:
    d, p = pod("d", "decode"), pod("pp", "prefill")
    fleet = Fleet([d, p])
    rng = random.Random(5)
    truth_per_ktoken = 0.040  # 40 ms per 1,000 tokens moved: 8x the prior
    for _ in range(300):
        held = rng.choice((0.0, 25.0, 50.0, 75.0))
        result = split(d, p)
        req, cycle = fleet.send(result, {d: held})
        moved = 4000 - held * 40
        ttft = 0.01 + 0.030 * 4.0 + truth_per_ktoken * moved / 1e3
        fleet.clock.advance(ttft)
        fleet.producer.response_first_chunk(req, cycle, result, ttft)
        fleet.producer.post_response(req, cycle, result, DONE)
    learnt = fleet.producer.model.describe()["transfer"]
    assert learnt == pytest.approx(truth_per_ktoken, rel=0.25)


def test_whole_requests_leave_the_transfer_weight_at_its_prior() -> None:
    (d,) = [pod("d", None)]
    fleet = Fleet([d])
    prior = fleet.producer.model.describe()["transfer"]
    for i in range(50):
        result = routed(("default", d))
        req, cycle = fleet.send(result)
        fleet.clock.advance(0.1 + i * 1e-3)
        fleet.producer.response_first_chunk(req, cycle, result, 0.1 + i * 1e-3)
        fleet.producer.post_response(req, cycle, result, DONE)
    assert fleet.producer.model.describe()["transfer"] == prior


# -- the decider -----------------------------------------------------------------------


def _load_decode_pod(fleet: Fleet, d: Endpoint, streams: int) -> None:
    """`streams` requests decoding on `d` (their first tokens seen)."""
    for _ in range(streams):
        result = routed(("decode", d))
        req, cycle = fleet.send(result, {d: 100.0})
        fleet.producer.response_first_chunk(req, cycle, result, 0.05)


def test_a_long_uncached_prompt_beside_many_streams_is_disaggregated() -> None:
    d, p = pod("d", "decode"), pod("pp", "prefill")
    fleet = Fleet([d, p])
    _load_decode_pod(fleet, d, 20)
    req, cycle = fleet.cycle({})
    answer = fleet.decider.disaggregate(req, cycle, d)
    assert answer.disaggregate is True
    assert "pp" in answer.reason
    facts: Any = answer.facts
    assert facts["split"]["prefill"] == "pp"
    assert facts["whole"]["decodingBeside"] == 20
    assert facts["split"]["costMs"] < facts["whole"]["costMs"]


def test_a_prompt_the_decode_pod_holds_stays_whole() -> None:
    d, p = pod("d", "decode"), pod("pp", "prefill")
    fleet = Fleet([d, p])
    _load_decode_pod(fleet, d, 20)
    req, cycle = fleet.cycle({d: 100.0})
    answer = fleet.decider.disaggregate(req, cycle, d)
    assert answer.disaggregate is False
    assert "decode endpoint alone" in answer.reason


def test_a_backed_up_prefill_pod_is_not_worth_it() -> None:
    d, p = pod("d", "decode"), pod("pp", "prefill")
    fleet = Fleet([d, p])
    for _ in range(30):  # 30 long prefills queued on P
        fleet.send(split(d, p))
    req, cycle = fleet.cycle({})
    assert fleet.decider.disaggregate(req, cycle, d).disaggregate is False


def test_the_best_prefill_pod_is_named_and_decode_pods_are_not_prefill_candidates() -> None:
    d, d2 = pod("d", "decode"), pod("d2", "decode")
    busy, idle, both = pod("busy", "prefill"), pod("idle", "prefill"), pod("both", "both")
    fleet = Fleet([d, d2, busy, idle, both], streamDelayWeight=5.0)
    _load_decode_pod(fleet, d, 10)
    _load_decode_pod(fleet, both, 10)  # decodes too: its prefill stalls its streams
    for _ in range(5):
        fleet.send(split(d2, busy))
    req, cycle = fleet.cycle({})
    answer = fleet.decider.disaggregate(req, cycle, d)
    facts: Any = answer.facts
    assert answer.disaggregate is True
    assert facts["split"]["prefill"] == "idle"


def test_without_prefill_pods_or_predictions_it_says_why(caplog: pytest.LogCaptureFixture) -> None:
    d, other = pod("d", "decode"), pod("plain", None)
    fleet = Fleet([d, other])
    _load_decode_pod(fleet, d, 20)
    req, cycle = fleet.cycle({})
    answer = fleet.decider.disaggregate(req, cycle, d)
    assert (answer.disaggregate, answer.reason) == (
        False,
        "no prefill endpoint among the candidates",
    )
    with caplog.at_level(logging.WARNING):
        first = fleet.decider.disaggregate(req, CycleState(), d)
        fleet.decider.disaggregate(req, CycleState(), d)
    assert first.disaggregate is False
    assert "no predictions" in first.reason
    assert caplog.text.count("no predictions") == 1


def test_min_gain_holds_back_a_small_saving() -> None:
    d, p = pod("d", "decode"), pod("pp", "prefill")
    fleet = Fleet([d, p], minGainMs=10_000)
    _load_decode_pod(fleet, d, 20)
    req, cycle = fleet.cycle({})
    answer = fleet.decider.disaggregate(req, cycle, d)
    assert answer.disaggregate is False
    assert "minGainMs" in answer.reason


def test_a_gain_inside_the_predictions_error_is_no_gain() -> None:
    d, p = pod("d", "decode"), pod("pp", "prefill")
    loose = Fleet([d, p], minGainFraction=0.0)
    _load_decode_pod(loose, d, 20)
    req, cycle = loose.cycle({})
    answer = loose.decider.disaggregate(req, cycle, d)
    facts: Any = answer.facts
    saving = 1 - facts["split"]["costMs"] / facts["whole"]["costMs"]
    assert answer.disaggregate is True
    assert saving > 0
    # The same pods and load, a margin just above the predicted saving: no.
    strict = Fleet([d, p], minGainFraction=min(0.99, saving + 0.01))
    _load_decode_pod(strict, d, 20)
    req, cycle = strict.cycle({})
    held = strict.decider.disaggregate(req, cycle, d)
    assert held.disaggregate is False
    assert "minGainFraction" in held.reason


def test_deciding_changes_no_pod_state() -> None:
    d, p = pod("d", "decode"), pod("pp", "prefill")
    fleet = Fleet([d, p])
    req, cycle = fleet.cycle({})
    fleet.decider.disaggregate(req, cycle, d)
    assert [fleet.producer.requests_in_flight(e) for e in (d, p)] == [0, 0]
    assert isinstance(fleet.decider, DisaggregationDecider)


PD_CONFIG = {
    "apiVersion": "llm-d.ai/v1alpha1",
    "kind": "EndpointPickerConfig",
    "plugins": [
        {"type": "approx-prefix-cache-producer"},
        {"type": "predicted-ttft-producer"},
        {"type": "predicted-ttft-scorer"},
        {"type": "decode-filter"},
        {"type": "prefill-filter"},
        {"type": "max-score-picker"},
        {"type": "predicted-ttft-pd-decider", "parameters": {}},
        {
            "type": "disagg-profile-handler",
            "parameters": {"deciders": {"prefill": "predicted-ttft-pd-decider"}},
        },
    ],
    "schedulingProfiles": [
        {
            "name": name,
            "plugins": [
                {"pluginRef": f"{name}-filter"},
                {"pluginRef": "predicted-ttft-scorer"},
                {"pluginRef": "max-score-picker"},
            ],
        }
        for name in ("decode", "prefill")
    ],
}


def _config(**decider: Any) -> str:
    data: Any = yaml.safe_load(yaml.safe_dump(PD_CONFIG))
    data["plugins"][6]["parameters"] = decider
    return yaml.safe_dump(data)


def test_a_pd_config_with_it_routes_and_explains_the_decision() -> None:
    datastore = Datastore()
    datastore.replace_all(
        [
            EndpointSpec("decode-0", "10.0.0.1:8000", labels={ROLE: "decode"}),
            EndpointSpec("prefill-0", "10.0.0.2:8000", labels={ROLE: "prefill"}),
        ]
    )
    config = load(_config(streamDelayWeight=2.0))
    director = Director(datastore, config, Telemetry(datastore))
    # A cold EPP, an empty fleet, a long prompt: predicted cheaper whole on decode-0
    # (no stream there to delay; the transfer costs something).
    # /debug/explain's pick, which changes nothing, shows the decision's facts.
    explained = asyncio.run(director.explain(request("word " * 3000)))
    assert explained["picked"][0] == "10.0.0.1:8000"  # decode-0
    handler = explained["notes"]["disagg-profile-handler"]
    assert handler["decider"] == "predicted-ttft-pd-decider"
    assert set(handler["facts"]) >= {"whole", "split", "streamDelayWeight"}
    # Nothing decodes on decode-0, so moving the prefill saves nothing and the
    # transfer costs: served whole, and the facts say so.
    facts = handler["facts"]
    assert facts["split"]["prefill"] == "prefill-0"
    assert facts["split"]["transferMs"] > 0
    assert facts["split"]["costMs"] > facts["whole"]["costMs"]
    assert handler["decision"] is False
    assert handler["disaggregated"] is False
    # The routed pick decides the same, and keeps no notes (nobody reads them).
    decision = asyncio.run(director.pick_endpoint(request("word " * 3000)))
    assert decision.endpoint.name == "decode-0"
    assert decision.result.request_headers == {}
    assert decision.cycle.get(EXPLAIN_NOTES) is None
    director.finish(decision, DONE)


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"streamDelayWeight": -1}, "streamDelayWeight"),
        ({"minGainMs": -0.5}, "minGainMs"),
        ({"minGainMs": "soon"}, "minGainMs"),
        ({"minGainFraction": 1.0}, "minGainFraction"),
        ({"minGainFraction": -0.1}, "minGainFraction"),
        ({"streamDelayWeight": float("inf")}, "streamDelayWeight"),
        ({"nonCachedTokens": 3}, "nonCachedTokens"),
    ],
)
def test_bad_parameters_are_config_errors(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        load(_config(**parameters))
