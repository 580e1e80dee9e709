"""The scraping-cost measurement runs (a tiny version; the real one is by hand, see
docs/performance.md)."""

from __future__ import annotations

import os

import pytest

from tests.perf.scrape_cost import run


def test_the_measurement_runs_and_scrapes_every_endpoint() -> None:
    result = run(endpoints=4, interval_s=0.05, seconds=0.5, servers=1, warmup_s=0.5)
    assert result["fresh_endpoints"] == 4
    assert result["failed_scrapes"] == 0
    assert result["scrapes_per_s"] > 20
    assert 0 < result["cpu_us_per_scrape"] < 100_000


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="pinning needs 2 CPUs")
def test_a_pinned_run_scrapes_every_endpoint() -> None:
    before = os.sched_getaffinity(0)
    result = run(endpoints=2, interval_s=0.05, seconds=0.3, servers=1, warmup_s=0.3, pin=True)
    assert result["fresh_endpoints"] == 2
    assert result["failed_scrapes"] == 0
    assert os.sched_getaffinity(0) == before  # the caller's CPUs are given back
