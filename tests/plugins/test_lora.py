"""LoRA affinity: GIE's scorer tiers and filter groups, from vLLM's LoRA info."""

from __future__ import annotations

import time

import pytest
from epp.plugins.lora_affinity_filter import LoraAffinityFilter
from epp.plugins.lora_affinity_scorer import LoraAffinityScorer

from epp.datastore import LORA, Endpoint, EndpointMetrics
from epp.requests import Api, InferenceRequest
from epp.scheduling import CycleState
from tests.plugins.helpers import context, make_endpoints


def request(model: str = "sql-lora", rewrite: str | None = None) -> InferenceRequest:
    return InferenceRequest(
        request_id="r",
        path="/v1/completions",
        method="POST",
        api=Api.COMPLETIONS,
        model=model,
        target_model=rewrite or model,
    )


def lora(
    running: set[str], waiting: set[str], max_adapters: int, age: float = 0.0
) -> EndpointMetrics:
    return EndpointMetrics(
        running_adapters=frozenset(running),
        waiting_adapters=frozenset(waiting),
        max_adapters=max_adapters,
        updated_at=time.monotonic() - age,
    )


def pool(*snapshots: EndpointMetrics) -> list[Endpoint]:
    endpoints = make_endpoints(len(snapshots))
    for endpoint, snapshot in zip(endpoints, snapshots, strict=True):
        endpoint.metrics = snapshot
    return endpoints


def test_scorer_tiers() -> None:
    endpoints = pool(
        lora({"sql-lora"}, set(), 2),  # running: 1.0
        lora({"other"}, set(), 4),  # room for another: 0.8
        lora({"a", "b"}, {"sql-lora"}, 3),  # waiting, no room: 0.6
        lora({"a", "b"}, set(), 2),  # full: 0.0
        lora({"a"}, set(), 2, age=60.0),  # stale: neutral
        EndpointMetrics(updated_at=time.monotonic(), missing={LORA: "not on the page"}),
    )
    scorer = LoraAffinityScorer(None, context("lora-affinity-scorer"))
    scores = scorer.score(request(), CycleState(), endpoints)
    assert [scores[e] for e in endpoints] == [1.0, 0.8, 0.6, 0.0, 0.5, 0.5]


def test_scorer_uses_the_target_model_after_a_rewrite() -> None:
    endpoints = pool(lora({"adapter-v2"}, set(), 1), lora({"adapter-v1"}, set(), 1))
    scorer = LoraAffinityScorer(None, context("lora-affinity-scorer"))
    scores = scorer.score(request("adapter", rewrite="adapter-v2"), CycleState(), endpoints)
    assert [scores[e] for e in endpoints] == [1.0, 0.0]


def test_filter_keeps_affinity_then_available_then_all() -> None:
    hot, loading, room, full = pool(
        lora({"sql-lora"}, set(), 2),
        lora(set(), {"sql-lora"}, 2),
        lora({"x"}, set(), 4),
        lora({"x", "y"}, set(), 2),
    )
    always = LoraAffinityFilter(LoraAffinityFilter.Parameters(threshold=1.0), context("f"))
    assert list(always.filter(request(), CycleState(), [hot, loading, room, full])) == [
        hot,
        loading,
    ]
    never = LoraAffinityFilter(LoraAffinityFilter.Parameters(threshold=0.0), context("f"))
    assert list(never.filter(request(), CycleState(), [hot, loading, room, full])) == [room]
    assert list(always.filter(request(), CycleState(), [room, full])) == [room]
    # Nowhere to load it (or a base model): everything stays, the scorers decide.
    assert list(always.filter(request(), CycleState(), [full])) == [full]


def test_filter_without_lora_state_keeps_everyone() -> None:
    endpoints = pool(lora({"sql-lora"}, set(), 2, age=60.0), EndpointMetrics())
    flt = LoraAffinityFilter(LoraAffinityFilter.Parameters(), context("f"))
    assert list(flt.filter(request(), CycleState(), endpoints)) == endpoints


def test_filter_threshold_sends_a_share_to_new_endpoints() -> None:
    hot, room = pool(lora({"sql-lora"}, set(), 2), lora(set(), set(), 2))
    flt = LoraAffinityFilter(LoraAffinityFilter.Parameters(threshold=0.5), context("f"))
    picks = [tuple(flt.filter(request(), CycleState(), [hot, room])) for _ in range(400)]
    assert 100 < picks.count((hot,)) < 300
    assert picks.count((hot,)) + picks.count((room,)) == 400


def test_filter_threshold_is_bounded() -> None:
    import msgspec

    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"threshold": 1.5}, LoraAffinityFilter.Parameters)
