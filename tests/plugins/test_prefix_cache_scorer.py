"""`prefix-cache-scorer`: learns in pre_request, scores matched / total blocks; a
real EPP's /debug/explain leaves its index untouched."""

from __future__ import annotations

import time

import msgspec
import pytest
from epp.plugins.approx_prefix_cache_producer import ApproxPrefixCacheProducer
from epp.plugins.prefix_cache_scorer import PrefixCacheScorer
from prometheus_client import CollectorRegistry

from epp.datastore import Datastore, EndpointMetrics, EndpointSpec
from epp.requests import InferenceRequest, parse_request
from epp.scheduling import CycleState, PluginContext, SchedulingResult, prefix_match_key
from epp.scheduling.types import ProfileResult, ResponseInfo, ScoredEndpoint, Usage
from tests.plugins.helpers import make_endpoints


def build(**params: object) -> tuple[PrefixCacheScorer, CollectorRegistry, Datastore]:
    registry = CollectorRegistry()
    datastore = Datastore()
    plugin = PrefixCacheScorer(
        msgspec.convert(params, PrefixCacheScorer.Parameters),
        PluginContext("prefix", "prefix-cache-scorer", datastore, registry, {}),
    )
    return plugin, registry, datastore


def request(prompt: str, salt: str | None = None) -> InferenceRequest:
    body: dict[str, object] = {"model": "m", "prompt": prompt}
    if salt is not None:
        body["cache_salt"] = salt
    return parse_request(
        request_id="r",
        method="POST",
        path="/v1/completions",
        headers={},
        body=msgspec.json.encode(body),
    )


def routed(endpoint) -> SchedulingResult:  # type: ignore[no-untyped-def]
    return SchedulingResult(
        "default",
        {"default": ProfileResult("default", (endpoint,), (ScoredEndpoint(endpoint, 1.0),))},
    )


def pick(plugin: PrefixCacheScorer, req: InferenceRequest, endpoints, chosen) -> dict:  # type: ignore[no-untyped-def]
    cycle = CycleState()
    scores = plugin.score(req, cycle, endpoints)
    plugin.pre_request(req, cycle, routed(chosen))
    return scores  # type: ignore[return-value]


def test_score_is_matched_over_total_blocks_and_learns_in_pre_request() -> None:
    plugin, registry, _ = build(autoTune=False, blockSizeTokens=4)  # 16 characters per block
    a, b = make_endpoints(2)
    system = "S" * 48  # 3 blocks
    first = pick(plugin, request(system + "first question"), [a, b], a)
    assert set(first.values()) == {0.0}
    scores = plugin.score(request(system + "a different one"), CycleState(), [a, b])
    # 3 shared blocks of 48 + 15 characters = 4 blocks.
    assert scores[a] == pytest.approx(3 / 4)
    assert scores[b] == 0.0
    assert registry.get_sample_value("epp_approx_prefix_index_blocks", {"plugin": "prefix"}) == 4
    assert (
        registry.get_sample_value("epp_approx_prefix_match_ratio_count", {"plugin": "prefix"}) == 1
    )


def test_scoring_alone_changes_nothing() -> None:
    plugin, _, _ = build(autoTune=False)
    (a,) = make_endpoints(1)
    for _ in range(3):
        plugin.score(request("hello " * 50), CycleState(), [a])
    assert plugin.own.index.size == 0


def test_salts_do_not_share_affinity() -> None:
    plugin, _, _ = build(autoTune=False, blockSizeTokens=4)
    a, b = make_endpoints(2)
    pick(plugin, request("T" * 64, salt="tenant-a"), [a, b], a)
    assert plugin.score(request("T" * 64, salt="tenant-a"), CycleState(), [a, b])[a] == 1.0
    assert plugin.score(request("T" * 64, salt="tenant-b"), CycleState(), [a, b])[a] == 0.0


def test_capacity_bounds_the_index_and_evictions_are_counted() -> None:
    plugin, registry, _ = build(autoTune=False, blockSizeTokens=1, lruCapacityPerServer=10)
    (a,) = make_endpoints(1)
    for i in range(5):
        pick(plugin, request(f"{i}" * 40), [a], a)  # 10 blocks each
    assert plugin.own.index.blocks_of(a) == 10
    assert (
        registry.get_sample_value("epp_approx_prefix_index_evictions_total", {"plugin": "prefix"})
        == 40
    )


def test_auto_tune_reads_block_size_and_capacity_from_cache_info() -> None:
    plugin, _, _ = build(blockSizeTokens=4)
    a, b = make_endpoints(2)
    now = time.monotonic()
    for e in (a, b):
        e.metrics = EndpointMetrics(block_size=8, num_gpu_blocks=3, updated_at=now)
    assert plugin.own.block_size([a, b], now) == 8
    pick(plugin, request("z" * 32 * 10), [a, b], a)  # 32 characters per block
    assert plugin.own.index.blocks_of(a) == 3  # num_gpu_blocks
    b.metrics = EndpointMetrics(block_size=16, num_gpu_blocks=3, updated_at=now)
    assert plugin.own.block_size([a, b], now) == 4  # disagreement: the configured size


def test_removed_endpoints_leave_the_index() -> None:
    plugin, _, datastore = build(autoTune=False)
    datastore.replace_all([EndpointSpec("a", "10.0.0.1:8000")])
    a = datastore.get("a")
    assert a is not None
    pick(plugin, request("r" * 200), [a], a)
    assert plugin.own.index.size > 0
    datastore.replace_all([])
    assert plugin.own.index.size == 0


def test_old_character_block_size_is_refused() -> None:
    with pytest.raises(ValueError, match="blockSizeTokens"):
        build(blockSize=64)


# -- reading a producer (llm-d's shape) --------------------------------------------------


def producer(**params: object) -> ApproxPrefixCacheProducer:
    return ApproxPrefixCacheProducer(
        msgspec.convert(params, ApproxPrefixCacheProducer.Parameters),
        PluginContext(
            "approx", "approx-prefix-cache-producer", Datastore(), CollectorRegistry(), {}
        ),
    )


async def test_the_scorer_reads_the_named_producers_match() -> None:
    source = producer(autoTune=False)  # blocks of 64 tokens: 256 characters
    scorer, _, _ = build(prefixMatchInfoProducerName="approx")
    a, b = make_endpoints(2)
    prompt = "x" * (256 * 4)  # 4 blocks
    cycle = CycleState()
    await source.prepare(request(prompt), cycle, [a, b])
    source.pre_request(request(prompt), cycle, routed(a))  # a now holds all 4
    assert source.matcher.index.blocks_of(a) == 4
    half = prompt[: 256 * 2] + "y" * (256 * 2)  # shares 2 leading blocks with a
    cycle = CycleState()
    await source.prepare(request(half), cycle, [a, b])
    assert scorer.score(request(half), cycle, [a, b]) == {a: 0.5, b: 0.0}
    # The scorer keeps no index and learns nothing.
    scorer.pre_request(request(half), cycle, routed(b))
    assert source.matcher.index.blocks_of(b) == 0


@pytest.mark.parametrize("disaggregated", [True, False])
async def test_a_disaggregated_pick_is_recorded_on_its_prefill_endpoint_too(
    disaggregated: bool,
) -> None:
    """The prefill endpoint computed the prompt's blocks and keeps them; the decode
    endpoint got them over the KV transfer. An encode endpoint holds none, nor does
    a prefill pick the handler did not use."""
    source = producer(autoTune=False)  # blocks of 64 tokens: 256 characters
    decode, prefill, encoder = make_endpoints(3)
    prompt = "x" * (256 * 3)
    cycle = CycleState()
    await source.prepare(request(prompt), cycle, [decode, prefill, encoder])
    result = SchedulingResult(
        "decode",
        {
            name: ProfileResult(name, (e,), (ScoredEndpoint(e, 1.0),))
            for name, e in (("decode", decode), ("p", prefill), ("encode", encoder))
        },
        prefill_profile="p" if disaggregated else None,
    )
    source.pre_request(request(prompt), cycle, result)
    index = source.matcher.index
    held = (index.blocks_of(decode), index.blocks_of(prefill), index.blocks_of(encoder))
    assert held == ((3, 3, 0) if disaggregated else (3, 0, 0))


async def test_the_producer_tells_a_prompt_that_continues_an_earlier_one() -> None:
    source = producer(autoTune=False)  # blocks of 256 characters
    key = prefix_match_key("approx")
    a, b = make_endpoints(2)
    first = "s" * 600 + "q" * 300  # a shared part, then this session's own
    cycle = CycleState()
    await source.prepare(request(first), cycle, [a, b])
    info = cycle.get(key)
    assert info is not None
    assert not info.continues  # nothing before it
    source.pre_request(request(first), cycle, routed(a))
    # The next turn: the whole first prompt and more.
    cycle = CycleState()
    await source.prepare(request(first + "a" * 300 + "w" * 100), cycle, [a, b])
    info = cycle.get(key)
    assert info is not None
    assert info.continues
    assert info.matched == {a: 3}
    # Another session over the same shared part only shares a prefix.
    cycle = CycleState()
    await source.prepare(request("s" * 600 + "z" * 300), cycle, [a, b])
    info = cycle.get(key)
    assert info is not None
    assert not info.continues
    assert info.matched == {a: 2}


async def test_the_producer_counts_how_many_recent_requests_wanted_a_prefix() -> None:
    """`demand`: the share of the recent picks whose longest match ended on the same
    block. Requests over one system prompt, each with its own question, make it
    the share of them; a request no pod holds anything of has none, and the others'
    share fades as other prompts come."""
    source = producer(autoTune=False)  # blocks of 256 characters
    key = prefix_match_key("approx")
    a, b = make_endpoints(2)
    system = "s" * 512  # two whole blocks

    async def demand(prompt: str) -> float:
        cycle = CycleState()
        await source.prepare(request(prompt), cycle, [a, b])
        info = cycle.get(key)
        assert info is not None
        source.pre_request(request(prompt), cycle, routed(a))
        return info.demand

    assert await demand(system + "q0" * 100) == 0.0  # nothing held yet
    # The later ones match the system prompt's two blocks on a.
    shares = [await demand(system + f"q{i}" * 100) for i in range(1, 9)]
    assert shares[0] == 0.0  # the first request held none: no match recorded
    assert 0.0 < shares[1] < shares[-1] < 1.0
    assert shares[-1] == pytest.approx(7 / 8, abs=0.02)  # 7 of the 8 picks before it
    for i in range(300):  # unrelated prompts, one block each
        await demand(f"{i:04d}" * 64)
    assert await demand(system + "q9" * 100) < 0.1 * shares[-1]


async def test_the_match_length_weight_rewards_long_matches() -> None:
    source = producer(autoTune=False)
    scorer, _, _ = build(
        prefixMatchInfoProducerName="approx", matchLengthWeight=0.5, matchLengthScaleTokens=512
    )
    (a,) = make_endpoints(1)
    prompt = "x" * (256 * 4)
    cycle = CycleState()
    await source.prepare(request(prompt), cycle, [a])
    source.pre_request(request(prompt), cycle, routed(a))
    cycle = CycleState()
    await source.prepare(request(prompt[: 256 * 2]), cycle, [a])  # 2 blocks, both held
    # ratio 2/2 = 1; length min(1, 2 x 64 / 512)^2 = 1/16
    assert scorer.score(request(prompt[: 256 * 2]), cycle, [a]) == {a: 0.5 / 16 + 0.5}


def test_without_the_producers_match_every_endpoint_scores_zero() -> None:
    scorer, _, _ = build(prefixMatchInfoProducerName="nobody")
    a, b = make_endpoints(2)
    assert scorer.score(request("hello"), CycleState(), [a, b]) == {a: 0.0, b: 0.0}


def test_own_index_parameters_with_a_producer_name_are_refused() -> None:
    with pytest.raises(ValueError, match="blockSizeTokens, lruCapacityPerServer: these set this"):
        build(prefixMatchInfoProducerName="approx", blockSizeTokens=8, lruCapacityPerServer=9)


def test_the_llm_d_producer_raises_short_blocks_to_64_tokens() -> None:
    source = producer(autoTune=False, blockSizeTokens=16)
    assert source.matcher.block_size([], 0.0) == 64
    assert producer(autoTune=False, blockSize=128).matcher.block_size([], 0.0) == 128


# -- the index's capacity, with autoTune -------------------------------------------------


def _learn(source: ApproxPrefixCacheProducer, endpoint, req: InferenceRequest) -> CycleState:  # type: ignore[no-untyped-def]
    """Route `req` to `endpoint` through the producer; the request's cycle."""
    cycle = CycleState()
    source.matcher.match(req, cycle, [endpoint])
    source.pre_request(req, cycle, routed(endpoint))
    return cycle


def _answered(prompt_tokens: int | None, *, completed: bool = True) -> ResponseInfo:
    usage = None if prompt_tokens is None else Usage(prompt_tokens=prompt_tokens)
    return ResponseInfo(completed=completed, status=200, usage=usage)


def _served(plugin: PrefixCacheScorer, req: InferenceRequest, endpoint, prompt_tokens: int) -> None:  # type: ignore[no-untyped-def]
    """`req` picked for `endpoint` by the scorer, then answered with `prompt_tokens`."""
    cycle = CycleState()
    plugin.score(req, cycle, [endpoint])
    plugin.pre_request(req, cycle, routed(endpoint))
    plugin.post_response(req, cycle, routed(endpoint), _answered(prompt_tokens))


def test_auto_tuned_capacity_is_num_gpu_blocks_where_that_covers_the_cache() -> None:
    # The engine's blocks are 16 tokens, the producer's 64 (256 characters): 64 of
    # them hold four times the cache (1,024 tokens), which llm-d's count allows.
    source = producer()
    (a,) = make_endpoints(1)
    a.metrics = EndpointMetrics(block_size=16, num_gpu_blocks=64, updated_at=time.monotonic())
    _learn(source, a, request("a" * 256 * 80))
    assert source.matcher.index.blocks_of(a) == 64
    assert source.describe_endpoint(a) == {
        "approxPrefixIndex": {"blocks": 64, "tokensPerChar": 0.25}
    }


def test_the_capacity_is_never_less_than_the_cache_in_the_texts_own_tokens() -> None:
    # GIE's index: blocks of 16 tokens, 64 characters. Text of 8 characters per
    # token makes a block 8 tokens, so a cache of 64 engine blocks (1,024 tokens)
    # holds 128 of them, once the responses' prompt token counts say so.
    scorer, _, _ = build(blockSizeTokens=16)
    assert scorer.own is not None
    (a,) = make_endpoints(1)
    a.metrics = EndpointMetrics(block_size=16, num_gpu_blocks=64, updated_at=time.monotonic())
    pick(scorer, request("b" * 64 * 200), [a], a)
    assert scorer.own.index.blocks_of(a) == 64  # before any count: 16 tokens a block
    _served(scorer, request("c" * 64 * 200), a, 64 * 200 // 8)
    pick(scorer, request("d" * 64 * 200), [a], a)
    assert scorer.own.index.blocks_of(a) == 128
    assert scorer.own.tokens_per_char() == pytest.approx(1 / 8)


def test_aborted_or_usage_less_responses_and_token_prompts_teach_nothing() -> None:
    source = producer()
    (a,) = make_endpoints(1)
    text = request("d" * 1000)
    for response in (_answered(10, completed=False), _answered(None), _answered(0)):
        source.post_response(text, _learn(source, a, text), routed(a), response)
    ids = parse_request(
        request_id="r",
        method="POST",
        path="/v1/completions",
        headers={},
        body=msgspec.json.encode({"model": "m", "prompt": list(range(1000))}),
    )
    source.post_response(ids, _learn(source, a, ids), routed(a), _answered(10))
    assert source.matcher.tokens_per_char() == 0.25  # still 1 / charsPerToken
    source.post_response(text, _learn(source, a, text), routed(a), _answered(100))
    assert source.matcher.tokens_per_char() == pytest.approx(0.1)  # a text answer teaches


def test_token_id_prompts_count_a_block_as_its_ids() -> None:
    # GIE's index on a pool of 16-token blocks: a block of ids is an engine block,
    # whatever the text's characters per token, so the cache holds num_gpu_blocks.
    scorer, _, _ = build(maxPrefixBlocksToMatch=0)
    assert scorer.own is not None
    (a,) = make_endpoints(1)
    a.metrics = EndpointMetrics(block_size=16, num_gpu_blocks=64, updated_at=time.monotonic())
    _served(scorer, request("e" * 800), a, 100)  # text of 8 characters a token
    assert scorer.own.tokens_per_char() == pytest.approx(1 / 8)
    ids = parse_request(
        request_id="r",
        method="POST",
        path="/v1/completions",
        headers={},
        body=msgspec.json.encode({"model": "m", "prompt": list(range(16 * 200))}),
    )
    pick(scorer, ids, [a], a)
    # Counted as text, a block of 16 ids would be 2 tokens and the cache 512 blocks.
    assert scorer.own.index.blocks_of(a) == 64


def test_without_cache_info_the_configured_capacity_holds() -> None:
    source = producer(lruCapacityPerServer=5)
    (a,) = make_endpoints(1)
    _learn(source, a, request("f" * 256 * 40))
    assert source.matcher.index.blocks_of(a) == 5


def test_the_cache_window_matches_what_the_pod_can_still_hold() -> None:
    # A cache of 64 engine blocks of 16 tokens holds 16 of the producer's 64-token
    # blocks; the index remembers 64 (num_gpu_blocks).
    source = producer(cacheWindow=True)
    (a,) = make_endpoints(1)
    a.metrics = EndpointMetrics(block_size=16, num_gpu_blocks=64, updated_at=time.monotonic())
    first = request("g" * 256 * 40)
    _learn(source, a, first)
    info = source.matcher.match(first, CycleState(), [a])
    # A prompt is recorded deepest block first, so its first blocks are the latest.
    assert info.matched == {a: 16}
    assert info.remembered == {a: 40}
    _learn(source, a, request("h" * 256 * 20))  # another prompt fills the window
    info = source.matcher.match(first, CycleState(), [a])
    assert info.matched == {}
    assert info.remembered == {a: 40}
    # Without the window the match is all the index remembers (64 blocks of
    # num_gpu_blocks hold the prompt's 40), and nothing is left beside it.
    plain = producer()
    _learn(plain, a, first)
    info = plain.matcher.match(first, CycleState(), [a])
    assert info.matched == {a: 40}
    assert info.remembered is None
