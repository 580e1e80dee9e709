"""`stale-metrics-filter` and `utilization-detector` (saturation and filter)."""

from __future__ import annotations

import time

import msgspec
import pytest
from epp.plugins.stale_metrics_filter import StaleMetricsFilter
from epp.plugins.utilization_detector import UtilizationDetector

from epp.datastore import KV_CACHE_USAGE, WAITING, Endpoint, EndpointMetrics
from epp.scheduling import CycleState
from tests.plugins.helpers import context, make_endpoints, make_request


def pool(*snapshots: EndpointMetrics) -> list[Endpoint]:
    endpoints = make_endpoints(len(snapshots))
    for endpoint, snapshot in zip(endpoints, snapshots, strict=True):
        endpoint.metrics = snapshot
    return endpoints


def aged(age: float, **values: object) -> EndpointMetrics:
    return EndpointMetrics(updated_at=time.monotonic() - age, **values)  # type: ignore[arg-type]


def stale_filter(**params: object) -> StaleMetricsFilter:
    return StaleMetricsFilter(msgspec.convert(params, StaleMetricsFilter.Parameters), context("f"))


def detector(**params: object) -> UtilizationDetector:
    return UtilizationDetector(
        msgspec.convert(params, UtilizationDetector.Parameters), context("d")
    )


def test_stale_filter_drops_stale_and_unready_endpoints() -> None:
    fresh, old, never, unready = pool(aged(0.1), aged(5.0), EndpointMetrics(), aged(0.1))
    unready.ready = False
    kept = stale_filter().filter(make_request(), CycleState(), [fresh, old, never, unready])
    assert list(kept) == [fresh]


def test_stale_filter_threshold_parameter() -> None:
    a, b = pool(aged(0.1), aged(0.6))
    assert list(
        stale_filter(metricsStalenessThreshold="500ms").filter(make_request(), CycleState(), [a, b])
    ) == [a]


def test_stale_filter_drops_an_unreachable_endpoint_whatever_the_age() -> None:
    # Scraped a moment ago, then refused: the server is gone.
    up, gone = pool(aged(0.1), aged(0.1, unreachable=True, error="refused"))
    for plugin in (stale_filter(), stale_filter(metricsStalenessThreshold="1h")):
        assert list(plugin.filter(make_request(), CycleState(), [up, gone])) == [up]
    assert detector().load(gone, time.monotonic()) == 1.0
    assert list(detector().filter(make_request(), CycleState(), [up, gone])) == [up]


def test_stale_filter_fails_open_unless_told_not_to() -> None:
    endpoints = pool(aged(10.0), EndpointMetrics())
    assert list(stale_filter().filter(make_request(), CycleState(), endpoints)) == endpoints
    assert list(stale_filter(failOpen=False).filter(make_request(), CycleState(), endpoints)) == []


def test_saturation_is_the_mean_of_the_most_loaded_resource() -> None:
    endpoints = pool(
        aged(0.0, waiting_requests=5, kv_cache_usage=0.2),  # queue-bound: 1.0
        aged(0.0, waiting_requests=0, kv_cache_usage=0.4),  # KV-bound: 0.5
        aged(0.0, waiting_requests=1, kv_cache_usage=0.0),  # 0.2
    )
    assert detector().saturation(endpoints) == pytest.approx((1.0 + 0.5 + 0.2) / 3)


def test_stale_or_unknown_endpoints_count_as_saturated() -> None:
    d = detector()
    assert d.saturation(pool(aged(1.0))) == 1.0  # older than 200ms
    assert d.saturation(pool(EndpointMetrics())) == 1.0  # never scraped
    assert d.saturation([]) == 1.0
    both_missing = aged(0.0, missing={WAITING: "NaN", KV_CACHE_USAGE: "NaN"})
    assert d.saturation(pool(both_missing)) == 1.0
    # A fact the engine does not report is left out, the other one still counts.
    queue_only = aged(0.0, waiting_requests=1, missing={KV_CACHE_USAGE: "no metric"})
    assert d.saturation(pool(queue_only)) == pytest.approx(0.2)


def test_requests_routed_after_the_scrape_count_as_waiting() -> None:
    # The scrape saw 1 waiting when 4 requests had been routed here; 3 more went
    # since, so the queue is read as 4 (of a threshold of 5) until the next scrape.
    d = detector()
    (endpoint,) = pool(aged(0.0, waiting_requests=1, routed_seen=4))
    endpoint.routed = 7
    assert endpoint.unseen_routed == 3
    assert d.saturation([endpoint]) == pytest.approx(4 / 5)
    assert d.dispatch_saturation([endpoint]) == pytest.approx(4 / 5)
    assert list(d.filter(make_request(), CycleState(), [endpoint])) == [endpoint]
    endpoint.routed = 8  # a fifth: at the threshold, filtered out (fail open aside)
    (other,) = pool(aged(0.0))
    assert list(d.filter(make_request(), CycleState(), [endpoint, other])) == [other]
    # The next scrape, sent after all 8, takes them over: its own count is the truth.
    endpoint.metrics = aged(0.0, waiting_requests=2, routed_seen=8)
    assert endpoint.unseen_routed == 0
    assert d.saturation([endpoint]) == pytest.approx(2 / 5)


def test_detector_filter_keeps_endpoints_under_their_limits() -> None:
    ok, long_queue, full_kv, old = pool(
        aged(0.0, waiting_requests=4, kv_cache_usage=0.79),
        aged(0.0, waiting_requests=5),
        aged(0.0, kv_cache_usage=0.8),
        aged(1.0),
    )
    kept = detector().filter(make_request(), CycleState(), [ok, long_queue, full_kv, old])
    assert list(kept) == [ok]
    roomy = detector(headroom=0.2).filter(make_request(), CycleState(), [ok, long_queue, full_kv])
    assert list(roomy) == [ok, long_queue, full_kv]  # limits 6 and 0.96
    assert list(detector().filter(make_request(), CycleState(), [long_queue, old])) == [
        long_queue,
        old,
    ]


@pytest.mark.parametrize(
    "bad",
    [
        {"queueDepthThreshold": 0},
        {"kvCacheUtilThreshold": 1.5},
        {"headroom": -0.1},
        {"metricsStalenessThreshold": "soon"},
    ],
)
def test_detector_parameters_are_validated(bad: dict[str, object]) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert(bad, UtilizationDetector.Parameters)
