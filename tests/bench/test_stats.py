"""bench.stats: the benchmark's one percentile is numpy's default, to the last bit,
whatever the order, size and ties of the samples; the 95% confidence half-width of a
mean over repeats uses Student's t quantiles that are checked here against the t
distribution itself."""

from __future__ import annotations

import math
import random

import numpy
import pytest

from bench.stats import T_975, ci95, in_ms, latency_ms, median, percentile, pm, t_975

# Percents as numpy.percentile takes them; bench.stats takes the fraction p / 100
# (the same division numpy does, so the same q reaches both).
PERCENTS = (0.0, 1.0, 10.0, 25.0, 33.0, 50.0, 66.0, 75.0, 90.0, 95.0, 99.0, 99.9, 100.0)
# 1 and 2 samples, odd and even sizes, and sizes where p99 falls between ranks.
SIZES = (1, 2, 3, 4, 7, 10, 101, 1000)


def _samples(size: int, seed: int, ties: bool) -> list[float]:
    rng = random.Random(seed)
    if ties:
        # Few distinct values: most neighbouring ranks are equal.
        return [float(rng.randint(0, 3)) for _ in range(size)]
    return [rng.lognormvariate(-5.0, 1.5) for _ in range(size)]


@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("size", SIZES)
def test_percentile_is_numpys_default(size: int, ties: bool) -> None:
    for seed in range(5):
        values = _samples(size, seed, ties)
        for p in PERCENTS:
            expected = float(numpy.percentile(values, p))
            assert percentile(values, p / 100) == expected, (size, seed, p)
            # Input order does not matter: sorted, reversed, as drawn.
            assert percentile(sorted(values, reverse=True), p / 100) == expected


def test_percentile_at_every_fraction_between_two_ranks() -> None:
    # Both interpolation forms (from below under the midpoint, from above past
    # it) and the midpoint itself.
    values = [0.1, 0.7]
    for step in range(101):
        q = step / 100
        assert percentile(values, q) == float(numpy.quantile(values, q)), q


def test_no_samples() -> None:
    assert percentile([], 0.5) is None
    assert percentile(iter(()), 0.99) is None
    assert median([]) is None
    assert median([None, None]) is None
    assert math.isnan(in_ms(None))
    summary = latency_ms([])
    assert set(summary) == {"p50_ms", "p90_ms", "p99_ms", "mean_ms"}
    assert all(math.isnan(v) for v in summary.values())


def test_a_fraction_outside_zero_to_one_is_refused() -> None:
    # 99 (a percent where a fraction belongs) would otherwise return the maximum.
    with pytest.raises(ValueError, match="fraction"):
        percentile([1.0, 2.0], 99)


def test_median_skips_unknown_values() -> None:
    assert median([3.0, None, 1.0, 2.0]) == 2.0
    assert median([4.0, None, 1.0]) == 2.5
    for seed in range(20):
        values = _samples(10, seed, ties=False)
        assert median([None, *values]) == float(numpy.percentile(values, 50))
        assert median(values) == pytest.approx(float(numpy.median(values)), rel=1e-15)


def test_latency_summary_in_milliseconds() -> None:
    seconds = _samples(101, 2, ties=False)
    summary = latency_ms(seconds)
    assert summary["p50_ms"] == float(numpy.percentile(seconds, 50)) * 1000
    assert summary["p90_ms"] == float(numpy.percentile(seconds, 90)) * 1000
    assert summary["p99_ms"] == float(numpy.percentile(seconds, 99)) * 1000
    assert summary["mean_ms"] == pytest.approx(float(numpy.mean(seconds)) * 1000)
    assert in_ms(0.25) == 250.0


def _t_cdf(x: float, df: int, steps: int = 4000) -> float:
    """Student's t CDF at x >= 0: 1/2 plus its density integrated from 0 to x
    (Simpson's rule), the density from its closed form."""
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def density(t: float) -> float:
        return math.exp(log_norm - (df + 1) / 2 * math.log1p(t * t / df))

    h = x / steps
    total = density(0.0) + density(x)
    total += sum((4 if i % 2 else 2) * density(i * h) for i in range(1, steps))
    return 0.5 + total * h / 3


@pytest.mark.parametrize("df", range(1, 31))
def test_the_t_quantiles_are_the_t_distributions(df: int) -> None:
    assert t_975(df) == T_975[df - 1]
    # The table's 7 decimals: the CDF at the tabulated value is 0.975 to within
    # what the rounding moves it.
    assert _t_cdf(T_975[df - 1], df) == pytest.approx(0.975, abs=2e-7)


def test_t_quantiles_known_values_and_above_the_table() -> None:
    # Textbook values: 12.706 (1 degree of freedom), 2.776 (4), 2.042 (30).
    assert t_975(1) == pytest.approx(12.706, abs=5e-4)
    assert t_975(4) == pytest.approx(2.776, abs=5e-4)
    assert t_975(30) == pytest.approx(2.042, abs=5e-4)
    assert t_975(31) == t_975(1000) == 1.96
    with pytest.raises(ValueError, match="degrees of freedom"):
        t_975(0)


def test_ci95_half_width() -> None:
    # 1..5: mean 3, sample standard deviation sqrt(2.5), t(0.975, 4) = 2.7764451:
    # 2.7764451 * 1.5811388 / sqrt(5) = 1.9632432 (scipy.stats.t.interval agrees).
    assert ci95([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx(1.9632432, abs=1e-6)
    # Three repeats of a hit rate: t(0.975, 2) = 4.3026527, s = 0.0264575.
    assert ci95([0.51, 0.52, 0.56]) == pytest.approx(0.0657241, abs=1e-6)
    # The sample standard deviation (N - 1), as numpy's ddof=1.
    values = _samples(12, 3, ties=False)
    expected = T_975[10] * float(numpy.std(values, ddof=1)) / math.sqrt(12)
    assert ci95(values) == pytest.approx(expected, rel=1e-12)
    # Forty repeats: the normal quantile.
    values = _samples(40, 4, ties=False)
    assert ci95(values) == pytest.approx(
        1.96 * float(numpy.std(values, ddof=1)) / math.sqrt(40), rel=1e-12
    )
    assert ci95([2.0, 2.0, 2.0]) == 0.0
    assert ci95([1.0]) is None
    assert ci95([]) is None


@pytest.mark.parametrize(
    ("result", "spec", "scale", "text"),
    [
        ({"p90": 0.0541, "p90_ci95": 0.0099}, ".1f", 1000, "54.1 ± 9.9"),
        ({"p90": 0.0541}, ".1f", 1000, "54.1"),
        ({"p90": 0.0541, "p90_ci95": None}, ".1f", 1000, "54.1"),
        ({"p90": None, "p90_ci95": 0.01}, ".1f", 1000, "-"),
        ({}, ".1f", 1, "-"),
        # A sign asked for shows on the value, not on the half-width.
        ({"p90": 0.25, "p90_ci95": 0.05}, "+.0%", 1, "+25% ± 5%"),
    ],
)
def test_a_figure_reads_as_its_mean_and_half_width(
    result: dict[str, float | None], spec: str, scale: float, text: str
) -> None:
    assert pm(result, "p90", spec, scale) == text
