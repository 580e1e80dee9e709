"""The benchmark's statistics: one percentile for every result file, and the 95%
confidence interval of a mean over repeated runs.

Each measurement used to carry its own percentile (nearest rank rounded, nearest
rank rounded up, the sample at floor(q·n), linear interpolation), so the same
samples gave a different p99 in each report. The one kept is numpy's default
(`numpy.percentile(values, 100 * q)`, method "linear", Hyndman and Fan's type 7):
linear interpolation between the two closest ranks. A figure in a result file can
then be recomputed from its raw samples with numpy, and tests/bench/test_stats.py
checks that the two agree exactly.

numpy itself is not used: it is only installed as a plotting dependency, and the
samples here are short Python lists. Neither is scipy (not a dependency): the t
quantiles of the confidence interval are a table, checked in the tests against the
t distribution integrated numerically.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

# Student's t distribution's 0.975 quantile, t_{0.975, df}, for df = 1..30
# (`scipy.stats.t.ppf(0.975, df)` to 7 decimals): a two-sided 95% interval.
T_975 = (
    12.7062047, 4.3026527, 3.1824463, 2.7764451, 2.5705818,
    2.4469119, 2.3646243, 2.3060041, 2.2621572, 2.2281389,
    2.2009852, 2.1788128, 2.1603687, 2.1447867, 2.1314495,
    2.1199053, 2.1098156, 2.1009220, 2.0930241, 2.0859634,
    2.0796138, 2.0738731, 2.0686576, 2.0638986, 2.0595386,
    2.0555294, 2.0518305, 2.0484071, 2.0452296, 2.0422725,
)  # fmt: skip
# Above 30 degrees of freedom, the normal distribution's 0.975 quantile (t_{0.975, 31}
# is 2.040, so the interval is then up to 4% narrow).
Z_975 = 1.96


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


def t_975(df: int) -> float:
    """Student's t 0.975 quantile with `df` degrees of freedom (df >= 1): the table
    T_975 up to 30, 1.96 above."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, not {df!r}")
    return T_975[df - 1] if df <= len(T_975) else Z_975


def ci95(values: Sequence[float]) -> float | None:
    """The half-width of the 95% confidence interval of the mean of `values` (N
    independent repeats of a measurement): `t_{0.975, N-1} * s / sqrt(N)`, with s the
    sample standard deviation (N - 1 in its denominator). The interval is
    mean +/- ci95. None for fewer than 2 values (no spread to estimate)."""
    n = len(values)
    if n < 2:
        return None
    return t_975(n - 1) * statistics.stdev(values) / math.sqrt(n)


def pm(result: Mapping[str, Any], key: str, spec: str, scale: float = 1.0) -> str:
    """`result[key]` formatted by `spec` (after `scale`), and ` ± ` the half-width of
    its 95% interval when the result has one (`<key>_ci95`: a mean over seeds or
    repeats); "-" when the figure is missing. A sign in `spec` (`+.1f`) is kept for
    the value only."""
    value, half = result.get(key), result.get(f"{key}_ci95")
    if value is None:
        return "-"
    text = format(value * scale, spec)
    return text if half is None else f"{text} ± {format(half * scale, spec.lstrip('+'))}"
