"""The load scorers' formulas on hand-built endpoints, stale and missing metrics
included."""

from __future__ import annotations

import time

import pytest
from epp.plugins.active_request_scorer import ActiveRequestScorer
from epp.plugins.kv_cache_utilization_scorer import KvCacheUtilizationScorer
from epp.plugins.load_aware_scorer import LoadAwareScorer
from epp.plugins.queue_scorer import QueueScorer
from epp.plugins.running_requests_size_scorer import RunningRequestsSizeScorer

from epp.datastore import KV_CACHE_USAGE, RUNNING, WAITING, Endpoint, EndpointMetrics
from epp.scheduling import CycleState
from tests.plugins.helpers import context, make_endpoints, make_request


def fresh(**values: object) -> EndpointMetrics:
    return EndpointMetrics(updated_at=time.monotonic(), **values)  # type: ignore[arg-type]


def stale(**values: object) -> EndpointMetrics:
    return EndpointMetrics(updated_at=time.monotonic() - 10.0, **values)  # type: ignore[arg-type]


def with_metrics(*snapshots: EndpointMetrics) -> list[Endpoint]:
    endpoints = make_endpoints(len(snapshots))
    for endpoint, snapshot in zip(endpoints, snapshots, strict=True):
        endpoint.metrics = snapshot
    return endpoints


def scores(plugin: object, endpoints: list[Endpoint]) -> list[float]:
    result = plugin.score(make_request(), CycleState(), endpoints)  # type: ignore[attr-defined]
    return [result[e] for e in endpoints]


def test_queue_scorer_is_min_max_normalised() -> None:
    plugin = QueueScorer(None, context("queue-scorer"))
    endpoints = with_metrics(
        fresh(waiting_requests=0), fresh(waiting_requests=5), fresh(waiting_requests=10)
    )
    assert scores(plugin, endpoints) == [1.0, 0.5, 0.0]


def test_queue_scorer_all_equal_is_one() -> None:
    plugin = QueueScorer(None, context("queue-scorer"))
    assert scores(plugin, with_metrics(fresh(waiting_requests=7), fresh(waiting_requests=7))) == [
        1.0,
        1.0,
    ]


def test_queue_scorer_unknown_queues_are_neutral_and_do_not_skew_the_scale() -> None:
    plugin = QueueScorer(None, context("queue-scorer"))
    endpoints = with_metrics(
        fresh(waiting_requests=2),
        fresh(waiting_requests=4),
        stale(waiting_requests=100),
        fresh(waiting_requests=0, missing={WAITING: "vllm:num_requests_waiting is NaN"}),
    )
    assert scores(plugin, endpoints) == [1.0, 0.0, 0.5, 0.5]
    assert scores(plugin, with_metrics(stale(), stale())) == [0.5, 0.5]


def test_running_requests_size_scorer() -> None:
    plugin = RunningRequestsSizeScorer(None, context("running-requests-size-scorer"))
    endpoints = with_metrics(
        fresh(running_requests=10),
        fresh(running_requests=30),
        fresh(missing={RUNNING: "not on the page"}),
    )
    assert scores(plugin, endpoints) == [1.0, 0.0, 0.5]


def test_kv_cache_utilization_scorer_is_one_minus_usage() -> None:
    plugin = KvCacheUtilizationScorer(None, context("kv-cache-utilization-scorer"))
    endpoints = with_metrics(
        fresh(kv_cache_usage=0.0),
        fresh(kv_cache_usage=0.25),
        fresh(kv_cache_usage=1.0),
        stale(kv_cache_usage=0.0),
        fresh(missing={KV_CACHE_USAGE: "above 1"}),
    )
    assert scores(plugin, endpoints) == [1.0, 0.75, 0.0, 0.5, 0.5]


@pytest.mark.parametrize(
    ("queue", "expected"), [(0, 0.5), (1, 0.5 * (1 - 1 / 128)), (64, 0.25), (128, 0.0), (500, 0.0)]
)
def test_load_aware_scorer_formula(queue: int, expected: float) -> None:
    plugin = LoadAwareScorer(LoadAwareScorer.Parameters(), context("load-aware-scorer"))
    assert scores(plugin, with_metrics(fresh(waiting_requests=queue))) == [pytest.approx(expected)]


def test_load_aware_scorer_threshold_and_neutral() -> None:
    plugin = LoadAwareScorer(LoadAwareScorer.Parameters(threshold=10), context("load-aware-scorer"))
    assert scores(plugin, with_metrics(fresh(waiting_requests=5), stale(waiting_requests=0))) == [
        0.25,
        0.25,
    ]


def test_active_request_scorer_uses_the_epps_own_in_flight_counts() -> None:
    plugin = ActiveRequestScorer(ActiveRequestScorer.Parameters(), context("active-request-scorer"))
    endpoints = make_endpoints(4)  # never scraped: in-flight counts need no metrics
    for endpoint, count in zip(endpoints, [0, 2, 4, 8], strict=True):
        endpoint.in_flight = count
    assert scores(plugin, endpoints) == [1.0, 0.75, 0.5, 0.0]


def test_active_request_scorer_idle_threshold_and_busy_cap() -> None:
    params = ActiveRequestScorer.Parameters(idle_threshold=2, max_busy_score=0.5)
    plugin = ActiveRequestScorer(params, context("active-request-scorer"))
    endpoints = make_endpoints(3)
    for endpoint, count in zip(endpoints, [2, 3, 6], strict=True):
        endpoint.in_flight = count
    assert scores(plugin, endpoints) == [1.0, 0.25, 0.0]


def test_active_request_scorer_spreads_a_burst_between_scrapes() -> None:
    """Each pick of a burst sees the in-flight counts of the picks before it."""
    plugin = ActiveRequestScorer(ActiveRequestScorer.Parameters(), context("active-request-scorer"))
    endpoints = make_endpoints(4)
    for _ in range(8):
        result = plugin.score(make_request(), CycleState(), endpoints)
        best = max(endpoints, key=lambda e: (result[e], -endpoints.index(e)))
        best.in_flight += 1  # what the director does at pick time
    assert [e.in_flight for e in endpoints] == [2, 2, 2, 2]
