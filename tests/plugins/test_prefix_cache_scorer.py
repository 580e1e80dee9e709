"""`prefix-cache-scorer`: learns in pre_request, scores matched / total blocks; a
real EPP's /debug/explain leaves its index untouched."""

from __future__ import annotations

import time

import msgspec
import pytest
from prometheus_client import CollectorRegistry

from epp.datastore import Datastore, EndpointMetrics, EndpointSpec
from epp.requests import InferenceRequest, parse_request
from epp.scheduling import CycleState, PluginContext, SchedulingResult
from epp.scheduling.types import ProfileResult, ScoredEndpoint
from plugins.prefix_cache_scorer import PrefixCacheScorer
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
    assert plugin.index.size == 0


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
    assert plugin.index.blocks_of(a) == 10
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
    assert plugin.block_size([a, b], now) == 8
    pick(plugin, request("z" * 32 * 10), [a, b], a)  # 32 characters per block
    assert plugin.index.blocks_of(a) == 3  # num_gpu_blocks
    b.metrics = EndpointMetrics(block_size=16, num_gpu_blocks=3, updated_at=now)
    assert plugin.block_size([a, b], now) == 4  # disagreement: the configured size


def test_removed_endpoints_leave_the_index() -> None:
    plugin, _, datastore = build(autoTune=False)
    datastore.replace_all([EndpointSpec("a", "10.0.0.1:8000")])
    a = datastore.get("a")
    assert a is not None
    pick(plugin, request("r" * 200), [a], a)
    assert plugin.index.size > 0
    datastore.replace_all([])
    assert plugin.index.size == 0


def test_old_character_block_size_is_refused() -> None:
    with pytest.raises(ValueError, match="blockSizeTokens"):
        build(blockSize=64)
