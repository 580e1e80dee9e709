"""The benchmark's statistics: one percentile for every result file.

Each measurement used to carry its own percentile (nearest rank rounded, nearest
rank rounded up, the sample at floor(q·n), linear interpolation), so the same
samples gave a different p99 in each report. The one kept is numpy's default
(`numpy.percentile(values, 100 * q)`, method "linear", Hyndman and Fan's type 7):
linear interpolation between the two closest ranks. A figure in a result file can
then be recomputed from its raw samples with numpy, and tests/bench/test_stats.py
checks that the two agree exactly.

numpy itself is not used: it is only installed as a plotting dependency, and the
samples here are short Python lists.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-quantile (`q` a fraction, 0.99 for p99) of `values`, by linear
    interpolation between the closest ranks: `numpy.percentile(values, 100 * q)`.

    Contract: `values` may come in any order (they are sorted here, on a copy; an
    already sorted list sorts in linear time, so callers that sort once for
    several percentiles lose nothing). No values: None, never an exception, so a
    run where nothing succeeded still writes its result file; callers that want
    NaN in their JSON convert with `in_ms`. `q` outside [0, 1] is a caller's bug:
    ValueError."""
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be a fraction in [0, 1], not {q!r}")
    ordered = sorted(values)
    if not ordered:
        return None
    last = len(ordered) - 1
    position = last * q
    if position >= last:
        return ordered[last]
    low = math.floor(position)
    fraction = position - low
    below, above = ordered[low], ordered[low + 1]
    # numpy interpolates from the nearer end: from below under the midpoint, from
    # above past it. The two forms round differently, and the same form is what
    # makes the results equal to numpy's to the last bit.
    step = above - below
    if fraction >= 0.5:
        return above - step * (1.0 - fraction)
    return below + step * fraction


def median(values: Iterable[float | None]) -> float | None:
    """The median of the known values (None entries are skipped: an interval with
    no observations does not count); None if no value is known. It is
    `percentile(known, 0.5)`, `numpy.percentile(known, 50)`; `numpy.median`
    averages the two middle values instead, which may differ in the last bit."""
    return percentile((v for v in values if v is not None), 0.5)


def in_ms(seconds: float | None) -> float:
    """Seconds as milliseconds; no value (None) as NaN, which is how the churn,
    overhead and pick result files write a percentile of no samples."""
    return math.nan if seconds is None else seconds * 1000.0


def latency_ms(seconds: Iterable[float]) -> dict[str, float]:
    """p50, p90, p99 and the mean of latencies given in seconds, in milliseconds
    (keys `p50_ms`, `p90_ms`, `p99_ms`, `mean_ms`), in any order; each NaN when
    there are no samples."""
    ordered = sorted(seconds)
    return {
        "p50_ms": in_ms(percentile(ordered, 0.50)),
        "p90_ms": in_ms(percentile(ordered, 0.90)),
        "p99_ms": in_ms(percentile(ordered, 0.99)),
        "mean_ms": in_ms(statistics.fmean(ordered) if ordered else None),
    }
