"""Prometheus helpers for plugins.

Two instances of one plugin type in a config (two prefix indexes, say) register the
same metric names in the application's registry; prometheus_client refuses a name
twice. `shared` hands the second instance the collector the first one registered,
so both report through one family, told apart by a `plugin` label.

`BucketCounts` is a histogram kept as plain numbers, for values observed where a
prometheus_client Histogram would cost too much (the KV-event lag, the metrics
scraper's scrape durations), exposed by a collector with `add_histogram`.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Final, TypeVar, cast

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

C = TypeVar("C", bound=Collector)


def shared(registry: CollectorRegistry, name: str, build: Callable[[], C]) -> C:
    """The collector registered in `registry` under the metric name `name`, or the
    one `build()` makes (which must register itself there under that name)."""
    # prometheus_client has no public lookup by name; this mapping is what it checks
    # duplicates against (the library's version is pinned).
    existing = registry._names_to_collectors.get(name)
    if existing is not None:
        return cast("C", existing)
    return build()


# Seconds, for delays between processes: from a tenth of a millisecond (two
# processes on one idle host) to ten seconds (a stalled event loop, or the clock
# skew of two hosts); beyond is the +Inf bucket. Finer from 0.5 to 10 ms, where
# these delays usually are, so quantiles interpolated from the buckets are close.
LATENCY_BUCKETS: Final = (
    0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075,
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


class BucketCounts:
    """A histogram as plain numbers, observed where a prometheus_client Histogram
    (a lock per bucket and sum) would cost too much per event, and exposed by a
    collector at scrape time (`add_histogram`). Not thread-safe: it lives on the
    event loop, as everything that observes it does."""

    __slots__ = ("bounds", "count", "counts", "sum")

    def __init__(self, bounds: Sequence[float] = LATENCY_BUCKETS) -> None:
        self.bounds = tuple(bounds)
        if list(self.bounds) != sorted(set(self.bounds)):
            raise ValueError("bucket bounds must be increasing")
        # counts[i]: observations in (bounds[i-1], bounds[i]]; the last one is +Inf.
        self.counts = [0] * (len(self.bounds) + 1)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bound's bucket
        # (Prometheus buckets are "less than or equal").
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, float]]:
        """(le, observations <= le) per bucket, +Inf last: Prometheus' shape."""
        # As prometheus_client's own Histogram writes them ("0.0001", "1.0"), so a
        # bucket keeps its `le` label if it moves to one or from one.
        les = [repr(float(b)) for b in self.bounds] + ["+Inf"]
        return list(zip(les, map(float, itertools.accumulate(self.counts)), strict=True))

    @classmethod
    def merged(cls, parts: Iterable[BucketCounts], bounds: Sequence[float]) -> BucketCounts:
        """One histogram of several with the same `bounds` (an endpoint's DP ranks)."""
        total = cls(bounds)
        for part in parts:
            if part.bounds != total.bounds:
                raise ValueError("histograms with other bucket bounds cannot be merged")
            total.counts = [a + b for a, b in zip(total.counts, part.counts, strict=True)]
            total.count += part.count
            total.sum += part.sum
        return total


def add_histogram(
    family: HistogramMetricFamily, labels: Sequence[str], histogram: BucketCounts
) -> None:
    family.add_metric(list(labels), histogram.cumulative(), histogram.sum)
