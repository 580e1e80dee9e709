"""`prefix-based-pd-decider` and `always-disagg-pd-decider`: llm-d's rule (off at
`nonCachedTokens: 0`; otherwise prompt >= `promptTokens` and uncached tokens on
the decode endpoint >= `nonCachedTokens`), read-only, with clear errors."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import pytest
import yaml
from epp.plugins.always_disagg_pd_decider import AlwaysDisaggPdDecider
from epp.plugins.prefix_based_pd_decider import PrefixBasedPdDecider

from epp.config import InvalidConfig
from epp.scheduling import CycleState, DisaggregationDecider
from tests.plugins.helpers import context, make_endpoints
from tests.plugins.llmd_helpers import load, request, with_match


def decider_config(parameters: dict[str, Any]) -> str:
    """A config declaring the decider (named by a profile handler in real use, here
    only built)."""
    return yaml.safe_dump(
        {
            "apiVersion": "llm-d.ai/v1alpha1",
            "kind": "EndpointPickerConfig",
            "plugins": [{"type": "prefix-based-pd-decider", "parameters": parameters}],
            "schedulingProfiles": [{"name": "default", "plugins": []}],
        }
    )


def decider(**params: Any) -> PrefixBasedPdDecider:
    params.setdefault("charsPerToken", 1.0)  # one token per character
    return PrefixBasedPdDecider(
        msgspec.convert(params, PrefixBasedPdDecider.Parameters), context("prefix-based-pd-decider")
    )


def test_both_are_deciders() -> None:
    assert isinstance(decider(), DisaggregationDecider)
    assert isinstance(AlwaysDisaggPdDecider(None, context("a")), DisaggregationDecider)


def test_always_disaggregates() -> None:
    (d,) = make_endpoints(1)
    answer = AlwaysDisaggPdDecider(None, context("a")).disaggregate(request(""), CycleState(), d)
    assert answer.disaggregate is True


def test_off_by_default() -> None:
    (d,) = make_endpoints(1)
    cycle = with_match(CycleState(), {})
    answer = decider().disaggregate(request("x" * 10_000), cycle, d)
    assert answer.disaggregate is False
    assert "off" in answer.reason


@pytest.mark.parametrize(
    ("prompt", "held_blocks", "expected"),
    [
        (100, 0.0, True),  # 100 uncached >= 50
        (50, 0.0, True),  # exactly the threshold disaggregates
        (49, 0.0, False),  # below it does not
        (100, 6.0, False),  # 60 of 100 cached on the decode endpoint: 40 < 50
        (100, 5.0, True),  # 50 of 100 cached: 50 >= 50
        (100, 10.0, False),  # all cached
        (100, 4.5, True),  # a fractional match (a tier-weighted precise producer): 45
    ],
)
def test_uncached_tokens_on_the_decode_endpoint_decide(
    prompt: int, held_blocks: float, expected: bool
) -> None:
    d, other = make_endpoints(2)
    # Blocks of 10 tokens; another endpoint holding everything changes nothing.
    cycle = with_match(CycleState(), {d: held_blocks, other: 10.0}, total=10, block_size=10)
    answer = decider(nonCachedTokens=50).disaggregate(request("x" * prompt), cycle, d)
    assert answer.disaggregate is expected
    cached = min(prompt, round(held_blocks * 10))
    assert answer.facts == {
        "promptTokens": prompt,
        "cachedTokens": cached,
        "uncachedTokens": prompt - cached,
        "thresholds": {"nonCachedTokens": 50, "promptTokens": 0},
    }


def test_a_short_prompt_stays_whole_below_prompt_tokens() -> None:
    (d,) = make_endpoints(1)
    plugin = decider(nonCachedTokens=10, promptTokens=200)
    cycle = with_match(CycleState(), {})
    short = plugin.disaggregate(request("x" * 199), cycle, d)
    assert short.disaggregate is False
    assert "promptTokens 200" in short.reason
    assert plugin.disaggregate(request("x" * 200), cycle, d).disaggregate is True


def test_token_id_prompts_count_exactly_and_text_at_chars_per_token() -> None:
    (d,) = make_endpoints(1)
    cycle = with_match(CycleState(), {})
    assert decider(nonCachedTokens=30).disaggregate(request(list(range(30))), cycle, d).disaggregate
    text = PrefixBasedPdDecider(
        msgspec.convert({"nonCachedTokens": 30}, PrefixBasedPdDecider.Parameters), context("p")
    )
    # 116 characters at 4 per token: 29 tokens.
    assert not text.disaggregate(request("x" * 116), cycle, d).disaggregate
    assert text.disaggregate(request("x" * 117), cycle, d).disaggregate


def test_the_named_producer_is_read() -> None:
    (d,) = make_endpoints(1)
    plugin = decider(nonCachedTokens=50, prefixMatchInfoProducerName="precise")
    cycle = with_match(CycleState(), {d: 10.0}, producer="precise")
    with_match(cycle, {})  # the approximate producer's: ignored
    assert plugin.disaggregate(request("x" * 100), cycle, d).disaggregate is False


def test_without_match_info_nothing_is_disaggregated_and_a_warning_says_why(
    caplog: pytest.LogCaptureFixture,
) -> None:
    (d,) = make_endpoints(1)
    plugin = decider(nonCachedTokens=1)
    with caplog.at_level(logging.WARNING):
        first = plugin.disaggregate(request("x" * 1000), CycleState(), d)
        plugin.disaggregate(request("x" * 1000), CycleState(), d)
    assert first.disaggregate is False
    assert "no prefix match info" in first.reason
    assert caplog.text.count("no prefix match info") == 1


def test_deciding_changes_nothing_in_the_cycle() -> None:
    (d,) = make_endpoints(1)
    cycle = with_match(CycleState(), {d: 2.0})
    before = dict(cycle._data)
    decider(nonCachedTokens=5).disaggregate(request("x" * 100), cycle, d)
    assert cycle._data == before


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"nonCachedTokens": -1}, "nonCachedTokens"),
        ({"promptTokens": -5}, "promptTokens"),
        ({"charsPerToken": 0}, "charsPerToken"),
        ({"nonCachedTokens": "many"}, "nonCachedTokens"),
        ({"threshold": 3}, "threshold"),
    ],
)
def test_bad_parameters_are_config_errors(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(InvalidConfig, match=message):
        load(decider_config(parameters))


def test_llm_d_parameters_load() -> None:
    config = load(
        decider_config(
            {
                "nonCachedTokens": 512,
                "promptTokens": 1024,
                "prefixMatchInfoProducerName": "approx-prefix-cache-producer",
            }
        )
    )
    plugin = config.plugins["prefix-based-pd-decider"]
    assert isinstance(plugin, PrefixBasedPdDecider)
    assert (plugin.non_cached_tokens, plugin.prompt_tokens) == (512, 1024)
