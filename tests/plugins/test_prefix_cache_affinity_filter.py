"""`prefix-cache-affinity-filter`: sticky endpoints (prefix share >= threshold)
only, unless none is sticky, the draw explores, or the TTFT load gate opens."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from epp.plugins.inflight_load_producer import InFlightLoadProducer
from epp.plugins.prefix_cache_affinity_filter import PrefixCacheAffinityFilter

from epp.config import InvalidConfig
from epp.datastore import Endpoint
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


def affinity(**params: object) -> PrefixCacheAffinityFilter:
    return PrefixCacheAffinityFilter(
        msgspec.convert(params, PrefixCacheAffinityFilter.Parameters),
        context("prefix-cache-affinity-filter"),
    )


def run(
    plugin: PrefixCacheAffinityFilter,
    endpoints: list[Endpoint],
    matched: dict[Endpoint, float],
    loads: InFlightLoadProducer | None = None,
) -> list[Endpoint]:
    req = request("x" * 100)
    cycle = with_match(CycleState(), matched, total=10)
    if loads is not None:
        prepared(loads, req, cycle)
    return list(plugin.filter(req, cycle, endpoints))


def test_keeps_the_endpoints_at_or_above_the_threshold() -> None:
    a, b, c, d = make_endpoints(4)
    # Shares 0.8, 0.79, 1.0, 0.
    kept = run(affinity(), [a, b, c, d], {a: 8.0, b: 7.9, c: 10.0})
    assert kept == [a, c]
    assert run(affinity(affinityThreshold=0.5), [a, b, c, d], {a: 5.0, b: 4.0}) == [a]


def test_no_sticky_endpoint_keeps_all() -> None:
    endpoints = make_endpoints(3)
    a = endpoints[0]
    assert run(affinity(), endpoints, {a: 7.0}) == endpoints
    # No match info at all (no producer): nothing is sticky.
    assert affinity().filter(request(), CycleState(), endpoints) == endpoints


def test_one_candidate_or_a_threshold_of_zero_keeps_all() -> None:
    a, b = make_endpoints(2)
    assert run(affinity(), [b], {a: 10.0}) == [b]
    assert run(affinity(affinityThreshold=0.0), [a, b], {a: 10.0}) == [a, b]
    assert run(affinity(affinityThreshold=-1.0), [a, b], {a: 10.0}) == [a, b]


def test_it_reads_the_named_prefix_producer() -> None:
    a, b = make_endpoints(2)
    plugin = affinity(prefixMatchInfoProducerName="precise")
    cycle = with_match(CycleState(), {a: 10.0})  # the approximate producer's: ignored
    assert plugin.filter(request(), cycle, [a, b]) == [a, b]
    with_match(cycle, {b: 9.0}, producer="precise")
    assert plugin.filter(request(), cycle, [a, b]) == [b]


def test_the_ttft_gate_opens_when_the_sticky_queue_costs_more_than_the_penalty() -> None:
    sticky, other = make_endpoints(2)
    loads = producer()
    # 1000 tokens/s: 1 ms per token in flight. Penalty 1000 ms.
    plugin = affinity(peakPrefillThroughput=1000, maxTTFTPenaltyMs=1000)
    charge(loads, other, 1000)
    charge(loads, sticky, 2000)
    # 2000 ms - 1000 ms = 1000 ms: not more than the penalty, stick.
    assert run(plugin, [sticky, other], {sticky: 10.0}, loads) == [sticky]
    charge(loads, sticky, 1)
    # 2001 ms - 1000 ms > 1000 ms: keep all.
    assert run(plugin, [sticky, other], {sticky: 10.0}, loads) == [sticky, other]


def test_the_ttft_gate_compares_the_best_of_each_side() -> None:
    busy, idle_sticky, other = make_endpoints(3)
    loads = producer()
    plugin = affinity(peakPrefillThroughput=1000, maxTTFTPenaltyMs=100)
    charge(loads, busy, 100_000)
    charge(loads, idle_sticky, 150)
    charge(loads, other, 100)
    # Best sticky 150 ms vs best other 100 ms: within the penalty.
    kept = run(plugin, [busy, idle_sticky, other], {busy: 10.0, idle_sticky: 9.0}, loads)
    assert kept == [busy, idle_sticky]


def test_the_default_gate_is_llm_ds_18_seconds_at_15928_tokens_per_second() -> None:
    sticky, other = make_endpoints(2)
    loads = producer()
    plugin = affinity()
    # 18 s at 15928 tokens/s.
    charge(loads, sticky, 18 * 15928)
    assert run(plugin, [sticky, other], {sticky: 10.0}, loads) == [sticky]
    charge(loads, sticky, 16)  # just over 18000 ms ahead
    assert run(plugin, [sticky, other], {sticky: 10.0}, loads) == [sticky, other]


def test_a_zero_penalty_always_sticks() -> None:
    sticky, other = make_endpoints(2)
    loads = producer()
    charge(loads, sticky, 10**6)  # a minute of prefill at llm-d's rate
    plugin = affinity(maxTTFTPenaltyMs=0, peakPrefillThroughput=0)
    assert run(plugin, [sticky, other], {sticky: 10.0}, loads) == [sticky]


def test_exploration_skips_the_gate_at_its_probability_with_a_seed() -> None:
    a, b = make_endpoints(2)
    always = affinity(explorationProbability=1.0)
    assert run(always, [a, b], {a: 10.0}) == [a, b]
    first = affinity(explorationProbability=0.25, seed=3)
    second = affinity(explorationProbability=0.25, seed=3)
    draws = [len(run(first, [a, b], {a: 10.0})) == 2 for _ in range(4000)]
    assert 0.22 < sum(draws) / len(draws) < 0.28
    assert [len(run(second, [a, b], {a: 10.0})) == 2 for _ in range(4000)] == draws
    never = affinity(seed=3)  # the default: 0
    assert all(run(never, [a, b], {a: 10.0}) == [a] for _ in range(200))


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"affinityThreshold": 1.5}, "affinityThreshold"),
        ({"explorationProbability": 1.1}, "explorationProbability"),
        ({"explorationProbability": -0.1}, "explorationProbability"),
        ({"maxTTFTPenaltyMs": -1}, "maxTTFTPenaltyMs"),
        ({"peakPrefillThroughput": -5}, "peakPrefillThroughput"),
        ({"peakPrefillThroughput": 0}, "peakPrefillThroughput must be > 0"),
        ({"ttftSource": "latencyPredictor"}, "predicted-latency producer"),
        ({"ttftSource": "guess"}, "ttftSource"),
        ({"maxTtftPenaltyMs": 100}, "maxTtftPenaltyMs"),
        ({"maxTokensInFlightPenalty": 1000}, "maxTokensInFlightPenalty"),
        ({"seed": "lucky"}, "seed"),
    ],
)
def test_bad_parameters_are_config_errors(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        load(one_plugin_config("prefix-cache-affinity-filter", parameters))


def test_llm_d_parameters_load() -> None:
    for parameters in (
        {
            "affinityThreshold": 0.99,
            "explorationProbability": 0.01,
            "maxTTFTPenaltyMs": 5000,
            "ttftSource": "prefillThroughput",
            "peakPrefillThroughput": 33821,
            "prefixMatchInfoProducerName": "approx-prefix-cache-producer",
            "inFlightLoadProducerName": "inflight-load-producer",
            "latencyPredictionInfoProducerName": "predicted-latency-producer",
        },
        {"ttftSource": "latencyPredictor", "maxTTFTPenaltyMs": 0},
    ):
        config = load(one_plugin_config("prefix-cache-affinity-filter", parameters))
        assert "prefix-cache-affinity-filter" in config.plugins
