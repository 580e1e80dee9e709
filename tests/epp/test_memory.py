"""epp/memory.py: the readings /debug/memory serves."""

from __future__ import annotations

import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from epp.memory import (
    MAX_FRAMES,
    MAX_SITES,
    _short,
    malloc_in_use,
    read_memory,
    rss_bytes,
    start_tracing,
    top_sites,
)


@pytest.fixture
def tracing() -> Iterator[None]:
    assert not tracemalloc.is_tracing(), "another test left tracemalloc on"
    start_tracing(1)
    try:
        yield
    finally:
        tracemalloc.stop()


def _hold_a_megabyte_here() -> list[bytes]:
    return [bytes(1024) for _ in range(1024)]  # the line the trace must name


def test_a_structure_that_grows_is_named_by_its_line(tracing: None) -> None:
    held = _hold_a_megabyte_here()
    sites = top_sites(20)
    line = _hold_a_megabyte_here.__code__.co_firstlineno + 1
    ours = [s for s in sites if s.site == f"tests/epp/test_memory.py:{line}"]
    assert ours, [s.site for s in sites]
    # 1,024 objects of a kilobyte and more each (their headers), and the list.
    assert ours[0].bytes >= 1024 * 1024
    assert ours[0].blocks >= 1024
    reading = read_memory(sites=5)
    assert reading.tracing
    assert reading.traced_bytes is not None
    assert reading.traced_bytes >= 1024 * 1024
    assert reading.traced_peak_bytes is not None
    assert reading.traced_peak_bytes >= reading.traced_bytes
    assert len(reading.sites) == 5
    assert reading.sites == sorted(reading.sites, key=lambda s: -s.bytes)
    del held


def test_without_tracing_there_are_no_sites() -> None:
    assert not tracemalloc.is_tracing()
    reading = read_memory(sites=10)
    assert reading.tracing is False
    assert reading.traced_bytes is None
    assert reading.sites == []
    assert reading.python_blocks > 0


@pytest.mark.skipif(malloc_in_use() is None, reason="not glibc")
def test_the_c_allocator_reading_follows_native_memory() -> None:
    before = malloc_in_use()
    held = bytearray(64 * 2**20)  # allocated by the C allocator (mmapped)
    after = malloc_in_use()
    assert before is not None
    assert after is not None
    assert after - before >= 64 * 2**20
    del held


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="no /proc")
def test_rss_of_this_process_and_of_none() -> None:
    own = rss_bytes()
    assert own is not None
    assert own > 10 * 2**20
    assert rss_bytes(2**22 + 12345) is None  # no such process


@pytest.mark.parametrize("frames", [0, -1, MAX_FRAMES + 1])
def test_a_bad_frame_count_is_refused_before_tracing(frames: int) -> None:
    with pytest.raises(ValueError, match=f"frames must be between 1 and {MAX_FRAMES}"):
        start_tracing(frames)
    assert not tracemalloc.is_tracing()


@pytest.mark.parametrize("sites", [-1, MAX_SITES + 1])
def test_a_bad_site_count_is_refused(sites: int) -> None:
    with pytest.raises(ValueError, match=f"sites must be between 0 and {MAX_SITES}"):
        read_memory(sites)


def test_sites_are_named_from_their_package_not_this_machine() -> None:
    root = Path(sys.path[-1])
    assert _short("/opt/py/lib/python3.11/site-packages/grpc/aio/_call.py") == "grpc/aio/_call.py"
    assert _short(str(root / "pkg" / "mod.py")) == "pkg/mod.py"
    assert _short("/nowhere/known/file.py") == "file.py"
