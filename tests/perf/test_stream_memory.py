"""The per-request memory measurement runs (a tiny version; the real one is by hand,
see docs/reliability.md)."""

from __future__ import annotations

import sys

import pytest

from tests.perf.stream_memory import run


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads glibc's allocator")
def test_the_measurement_runs_through_both_envoy_configs() -> None:
    result = run(requests=200, concurrency=4)
    for config in ("shipped", "without_graceful_close"):
        measured = result[config]
        assert measured["requests"] == 200
        assert measured["errors"] == 0
        assert isinstance(measured["bytes_kept"], int)
