"""`token-load-scorer`: 1 - min(1, (tokens in flight + this request's uncached
tokens) / queueThresholdTokens), read from the in-flight load producer."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import pytest
from epp.plugins.token_load_scorer import DEFAULT_QUEUE_THRESHOLD_TOKENS, TokenLoadScorer

from epp.config import InvalidConfig
from epp.scheduling import CycleState
from tests.plugins.helpers import context, make_endpoints
from tests.plugins.llmd_helpers import (
    charge,
    load,
    one_plugin_config,
    prepared,
    producer,
    request,
    with_match,
)


def scorer(**params: object) -> TokenLoadScorer:
    return TokenLoadScorer(
        msgspec.convert(params, TokenLoadScorer.Parameters), context("token-load-scorer")
    )


def test_score_is_one_minus_the_share_of_the_threshold() -> None:
    loads = producer()
    a, b, c = make_endpoints(3)
    charge(loads, a, 300)
    charge(loads, c, 5000)
    req = request("x" * 100)
    cycle = prepared(loads, req, CycleState())
    scores = scorer(queueThresholdTokens=1000).score(req, cycle, [a, b, c])
    # a: (300 + 100) / 1000; b: 100 / 1000; c: over the threshold.
    assert scores == {a: pytest.approx(0.6), b: pytest.approx(0.9), c: 0.0}


def test_the_request_counts_only_what_the_endpoint_does_not_hold() -> None:
    loads = producer()
    a, b = make_endpoints(2)
    req = request("x" * 100)
    # 10 blocks of 10 tokens: b holds 5.
    cycle = prepared(loads, req, with_match(CycleState(), {b: 5.0}))
    scores = scorer(queueThresholdTokens=1000).score(req, cycle, [a, b])
    assert scores == {a: pytest.approx(0.9), b: pytest.approx(0.95)}


def test_the_default_threshold_is_llm_ds() -> None:
    loads = producer()
    (a,) = make_endpoints(1)
    charge(loads, a, DEFAULT_QUEUE_THRESHOLD_TOKENS // 4 - 5)
    req = request("x" * 5)
    cycle = prepared(loads, req, CycleState())
    assert scorer().score(req, cycle, [a])[a] == pytest.approx(0.75)
    assert DEFAULT_QUEUE_THRESHOLD_TOKENS == 4194304
    # 0 is llm-d's "unset".
    assert scorer(queueThresholdTokens=0).score(req, cycle, [a])[a] == pytest.approx(0.75)


def test_an_idle_endpoint_and_an_empty_request_score_one() -> None:
    loads = producer()
    (a,) = make_endpoints(1)
    req = request("x" * 100)
    cycle = prepared(loads, req, with_match(CycleState(), {a: 10.0}))
    assert scorer(queueThresholdTokens=10).score(req, cycle, [a]) == {a: 1.0}


def test_it_reads_the_named_producer() -> None:
    named = producer()
    (a,) = make_endpoints(1)
    charge(named, a, 500)
    req = request("x" * 10)
    cycle = CycleState()
    # The producer leaves its data under its own name: another name sees nothing.
    prepared(named, req, cycle)
    other = scorer(queueThresholdTokens=1000, inFlightLoadProducerName="elsewhere")
    assert other.score(req, cycle, [a]) == {a: 1.0}
    own = scorer(queueThresholdTokens=1000, inFlightLoadProducerName="inflight-load-producer")
    assert own.score(req, cycle, [a])[a] == pytest.approx(0.49)


def test_without_the_producer_every_endpoint_scores_one_and_it_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    a, b = make_endpoints(2)
    plugin = scorer()
    with caplog.at_level(logging.WARNING):
        assert plugin.score(request(), CycleState(), [a, b]) == {a: 1.0, b: 1.0}
        plugin.score(request(), CycleState(), [a, b])
    warned = [r for r in caplog.records if "no in-flight load from producer" in r.message]
    assert len(warned) == 1  # once, not per request
    assert "'inflight-load-producer'" in warned[0].message


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"queueThresholdTokens": -1}, "queueThresholdTokens must be > 0"),
        ({"queueThresholdTokens": "many"}, "queueThresholdTokens"),
        ({"queueThresholdTokens": 1.5}, "queueThresholdTokens"),
        ({"threshold": 10}, "threshold"),
    ],
)
def test_bad_parameters_are_config_errors(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        load(one_plugin_config("token-load-scorer", parameters))
