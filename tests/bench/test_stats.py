"""bench.stats: the benchmark's one percentile is numpy's default, to the last bit,
whatever the order, size and ties of the samples."""

from __future__ import annotations

import math
import random

import numpy
import pytest

from bench.stats import in_ms, latency_ms, median, percentile

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
