"""The precise prefix service's Prometheus metrics as a scrape sees them, and the
plain-number histogram behind the lag and scrape-duration histograms."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry, Histogram

from epp.clock import VirtualClock
from epp.datastore import Datastore, EndpointSpec
from epp.kvindex.service import KVEventsConfig, PrecisePrefixConfig, PrecisePrefixService
from epp.promutil import LATENCY_BUCKETS, BucketCounts
from tests.epp.kvindex.kv_support import RawPublisher, batch, stored, wait_for


def test_buckets_are_less_than_or_equal_as_prometheus_counts_them() -> None:
    """The same observations give the same exposition as prometheus_client's own
    Histogram, bound values and beyond-the-last included."""
    values = [0.0, 0.0001, 0.00011, 0.25, 0.2500001, 3.0, 10.0, 11.0, 1e9]
    ours = BucketCounts(LATENCY_BUCKETS)
    registry = CollectorRegistry()
    theirs = Histogram("h", "h", buckets=LATENCY_BUCKETS, registry=registry)
    for value in values:
        ours.observe(value)
        theirs.observe(value)
    for le, count in ours.cumulative():
        assert registry.get_sample_value("h_bucket", {"le": le}) == count, le
    assert (ours.count, ours.sum) == (len(values), sum(values))
    assert ours.cumulative()[-1] == ("+Inf", float(len(values)))


def test_merging_adds_up_and_refuses_other_bounds() -> None:
    a, b = BucketCounts((0.1, 1.0)), BucketCounts((0.1, 1.0))
    a.observe(0.05)
    b.observe(0.5)
    b.observe(5.0)
    merged = BucketCounts.merged([a, b], (0.1, 1.0))
    assert merged.cumulative() == [("0.1", 1.0), ("1.0", 2.0), ("+Inf", 3.0)]
    assert (merged.count, merged.sum) == (3, 5.55)
    with pytest.raises(ValueError, match="other bucket bounds"):
        BucketCounts.merged([a, BucketCounts((0.1,))], (0.1, 1.0))
    with pytest.raises(ValueError, match="increasing"):
        BucketCounts((1.0, 0.1))


@pytest.fixture
async def publisher() -> AsyncIterator[RawPublisher]:
    made = RawPublisher()
    yield made
    await made.close()


async def test_the_lag_histogram_and_the_skew_counters_on_the_service_metrics(
    publisher: RawPublisher,
) -> None:
    """Through the service as the server builds it (real ZMQ, the real subscriber),
    with its wall clock injected: one batch 0.25 s old, one unstamped, one from a
    clock 0.5 s ahead."""
    wall = VirtualClock(1_700_000_000.0)
    datastore = Datastore()
    datastore.replace_all([EndpointSpec("pod", "127.0.0.1:1", kv_events=publisher.address)])
    config = PrecisePrefixConfig(
        alignment_check=False, kv_events_config=KVEventsConfig(replay=False)
    )
    service = PrecisePrefixService(config, datastore, wall_clock=wall)
    registry = CollectorRegistry()
    registry.register(service.collector())
    task = asyncio.create_task(service.run())
    try:
        await publisher.wait_subscribed()
        await publisher.send(0, batch(stored([1]), ts=wall() - 0.25))
        await publisher.send(1, batch(stored([2]), ts=0.0))
        await publisher.send(2, batch(stored([3]), ts=wall() + 0.5))

        def sample(name: str, **labels: str) -> float | None:
            return registry.get_sample_value(name, {"endpoint": "pod", **labels})

        await wait_for(lambda: sample("epp_kv_event_batches_total") == 3, what="3 batches")
        assert sample("epp_kv_event_lag_seconds_count") == 2
        assert sample("epp_kv_event_lag_seconds_sum") == 0.25
        assert sample("epp_kv_event_lag_seconds_bucket", le="0.0001") == 1  # the skewed one
        assert sample("epp_kv_event_lag_seconds_bucket", le="0.1") == 1
        assert sample("epp_kv_event_lag_seconds_bucket", le="0.25") == 2
        assert sample("epp_kv_event_lag_seconds_bucket", le="+Inf") == 2
        assert sample("epp_kv_event_lag_negative_total") == 1
        assert sample("epp_kv_event_lag_negative_seconds_total") == 0.5
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
