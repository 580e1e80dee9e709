"""`no-hit-lru-scorer`: cold requests by least recent use of a cold request (never
used first, 1 - rank / (n - 1)); warm requests 0.5 everywhere; the LRU moves only
at a cold pick."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import pytest
from epp.plugins.no_hit_lru_scorer import NoHitLruScorer

from epp.config import InvalidConfig
from epp.datastore import Endpoint
from epp.scheduling import CycleState
from tests.plugins.helpers import context, make_endpoints
from tests.plugins.llmd_helpers import load, one_plugin_config, request, routed, with_match


def scorer(**params: object) -> NoHitLruScorer:
    return NoHitLruScorer(
        msgspec.convert(params, NoHitLruScorer.Parameters), context("no-hit-lru-scorer")
    )


def cold(plugin: NoHitLruScorer, endpoints: list[Endpoint]) -> list[float]:
    """Score a cold request (match info with no hit) and route it to the best."""
    cycle = with_match(CycleState(), {})
    scores = plugin.score(request(), cycle, endpoints)
    best = max(endpoints, key=lambda e: scores[e])
    plugin.pre_request(request(), cycle, routed(("default", best)))
    return [scores[e] for e in endpoints]


def test_cold_requests_go_round_the_endpoints_least_recently_used_first() -> None:
    a, b, c = make_endpoints(3)
    plugin = scorer()
    assert cold(plugin, [a, b, c]) == [1.0, 0.5, 0.0]  # none used: in candidate order
    # a got one: the never-used come first, then a (rank 2 of 0..2).
    assert cold(plugin, [a, b, c]) == [0.0, 1.0, 0.5]
    # b got one: c never used; a (LRU 0) rank 1, b (LRU 1) rank 2.
    assert cold(plugin, [a, b, c]) == [0.5, 0.0, 1.0]
    # c got one: a is the least recently used now.
    assert cold(plugin, [a, b, c]) == [1.0, 0.5, 0.0]


def test_a_warm_request_scores_neutral_and_moves_nothing() -> None:
    a, b, c = make_endpoints(3)
    plugin = scorer()
    warm = with_match(CycleState(), {b: 1.0})
    assert plugin.score(request(), warm, [a, b, c]) == {a: 0.5, b: 0.5, c: 0.5}
    plugin.pre_request(request(), warm, routed(("default", a)))
    assert cold(plugin, [a, b, c]) == [1.0, 0.5, 0.0]  # a was not recorded


def test_a_hit_outside_the_candidates_does_not_make_a_request_warm() -> None:
    a, b, c = make_endpoints(3)
    cycle = with_match(CycleState(), {c: 3.0})
    assert scorer().score(request(), cycle, [a, b]) == {a: 1.0, b: 0.0}


def test_scoring_alone_moves_nothing() -> None:
    a, b = make_endpoints(2)
    plugin = scorer()
    for _ in range(3):  # /debug/explain: no pre_request
        assert plugin.score(request(), with_match(CycleState(), {}), [a, b]) == {a: 1.0, b: 0.0}


def test_without_match_info_a_request_is_cold_and_it_says_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    a, b = make_endpoints(2)
    plugin = scorer()
    with caplog.at_level(logging.WARNING):
        assert plugin.score(request(), CycleState(), [a, b]) == {a: 1.0, b: 0.0}
    assert "'approx-prefix-cache-producer'" in caplog.text


def test_it_reads_the_named_producer() -> None:
    a, b = make_endpoints(2)
    plugin = scorer(prefixMatchInfoProducerName="precise")
    cycle = with_match(CycleState(), {a: 2.0}, producer="precise")
    assert plugin.score(request(), cycle, [a, b]) == {a: 0.5, b: 0.5}
    cycle = with_match(CycleState(), {a: 2.0})  # another producer's hit
    assert plugin.score(request(), cycle, [a, b]) == {a: 1.0, b: 0.0}


def test_one_candidate_scores_one() -> None:
    (a,) = make_endpoints(1)
    plugin = scorer()
    assert cold(plugin, [a]) == [1.0]
    assert cold(plugin, [a]) == [1.0]


@pytest.mark.parametrize("name", ["prefill", "p-stage"])
def test_the_prefill_target_is_recorded_too(name: str) -> None:
    """Whatever the prefill profile is called; an encode endpoint holds no KV."""
    prefill, decode, spare, encoder = make_endpoints(4)
    plugin = scorer()
    cycle = with_match(CycleState(), {})
    plugin.score(request(), cycle, [prefill, decode, spare, encoder])
    result = routed(("decode", decode), (name, prefill), ("encode", encoder), prefill=name)
    plugin.pre_request(request(), cycle, result)
    # spare and the encoder never used (ranks 0, 1); the primary (decode) was moved
    # first, then prefill: decode is LRU 0 (rank 2), prefill LRU 1 (rank 3).
    scores = cold(plugin, [prefill, decode, spare, encoder])
    assert scores == pytest.approx([0.0, 1 / 3, 1.0, 2 / 3])


def test_the_lru_is_bounded_by_lru_size() -> None:
    a, b, c = make_endpoints(3)
    plugin = scorer(lruSize=1)
    cold(plugin, [a, b, c])  # a
    cold(plugin, [a, b, c])  # b; a forgotten
    # a and c are never-used again; b rank 2.
    assert cold(plugin, [a, b, c]) == [1.0, 0.0, 0.5]


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"lruSize": -1}, "lruSize must be > 0"),
        ({"lruSize": "big"}, "lruSize"),
        ({"prefixPlugin": "x"}, "prefixPlugin"),
    ],
)
def test_bad_parameters_are_config_errors(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        load(one_plugin_config("no-hit-lru-scorer", parameters))


def test_llm_d_parameters_load_deprecated_ones_included() -> None:
    parameters = {
        "prefixPluginType": "prefix-cache-scorer",
        "prefixPluginName": "cache-scorer",
        "lruSize": 2048,
        "prefixMatchInfoProducerName": "precise-prefix-cache-producer",
    }
    config = load(one_plugin_config("no-hit-lru-scorer", parameters))
    assert "no-hit-lru-scorer" in config.plugins
