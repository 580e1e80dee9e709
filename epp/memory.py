"""What the EPP's memory is made of, for /debug/memory (with `--debug-endpoints`).

A long-running EPP whose resident memory keeps growing has one of three causes,
and each reading here tells them apart:

- `rss_bytes`: what the kernel counts against the pod's memory limit;
- `malloc_in_use_bytes`: what the C allocator has handed out and not had back
  (glibc's `mallinfo2`; None with another C library): native memory (grpcio's,
  tokenizers', Python objects over 512 bytes). RSS above it and growing while it
  stays level is the allocator keeping freed pages (fragmentation), not a leak;
- `python_blocks`: the blocks Python's own small-object allocator has handed out
  (`sys.getallocatedblocks`): Python objects of 512 bytes or less, which live in
  arenas Python maps itself and `mallinfo2` does not see;
- with `--trace-memory` (tracemalloc started at start-up), `traced_bytes` (every
  Python allocation still alive) and, when asked for (`?sites=N`), the N source
  lines holding the most of it. A structure that grows without bound shows as a
  line whose bytes keep growing from one reading to the next.

Tracing costs: every Python allocation then records its stack (about twice the
CPU for allocation-heavy code, and memory for each trace), and listing the sites
takes a snapshot of every live trace (tens to hundreds of ms for a busy EPP, off
the event loop but holding the interpreter for part of it). A debugging aid, not
for a production fleet.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import tracemalloc
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

# Frames of these files are the tracer's and the import system's, not the EPP's.
_IGNORED = (
    tracemalloc.Filter(False, tracemalloc.__file__),
    tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
    tracemalloc.Filter(False, "<frozen importlib._bootstrap_external>"),
    tracemalloc.Filter(False, "<unknown>"),
)
MAX_SITES = 500
MAX_FRAMES = 100


_MALLINFO2_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS.split()]


@cache
def _mallinfo2() -> Any:
    """glibc's `mallinfo2`, or None where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        function = ctypes.CDLL(name).mallinfo2
    except (OSError, AttributeError):
        return None
    function.restype = _MallInfo2
    return function


def malloc_in_use() -> int | None:
    """Bytes the C allocator has handed out and not had back (small blocks from its
    arenas plus mmapped ones), or None where the C library cannot tell (not glibc)."""
    function = _mallinfo2()
    if function is None:
        return None
    info: _MallInfo2 = function()
    return int(info.uordblks) + int(info.hblkhd)


def rss_bytes(pid: int | None = None) -> int | None:
    """A process's resident set size (Linux /proc; this process's by default), or
    None where unknown."""
    try:
        with open(f"/proc/{'self' if pid is None else pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


@dataclass(frozen=True)
class AllocationSite:
    """A source line and the Python memory allocated there that is still alive."""

    site: str  # file:line, the file's path from its package on
    bytes: int
    blocks: int


@dataclass(frozen=True)
class MemoryReading:
    rss_bytes: int | None
    malloc_in_use_bytes: int | None
    python_blocks: int
    tracing: bool
    traced_bytes: int | None = None
    traced_peak_bytes: int | None = None
    # The lines holding the most traced memory, most first (asked for, and tracing).
    sites: list[AllocationSite] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def start_tracing(frames: int) -> None:
    """Trace Python allocations from now on, keeping `frames` frames of each
    allocation's stack (a site is its innermost frame; more frames cost more)."""
    if not 1 <= frames <= MAX_FRAMES:
        raise ValueError(f"frames must be between 1 and {MAX_FRAMES}, got {frames}")
    if not tracemalloc.is_tracing():
        tracemalloc.start(frames)


def _short(filename: str) -> str:
    """A traced file's path from its package on: `epp/kvindex/index.py`, not this
    machine's path to it."""
    path = Path(filename)
    for anchor in ("site-packages", "dist-packages", "lib-dynload"):
        if anchor in path.parts:
            return "/".join(path.parts[path.parts.index(anchor) + 1 :])
    for root in map(Path, sys.path):
        if root.parts and path.is_relative_to(root) and root != Path("/"):
            return path.relative_to(root).as_posix()
    return path.name


def top_sites(count: int) -> list[AllocationSite]:
    """The `count` source lines holding the most traced memory (none when not
    tracing). Takes a snapshot of every live trace: run it off the event loop."""
    if not tracemalloc.is_tracing() or count <= 0:
        return []
    snapshot = tracemalloc.take_snapshot().filter_traces(_IGNORED)
    return [
        AllocationSite(
            site=f"{_short(stat.traceback[0].filename)}:{stat.traceback[0].lineno}",
            bytes=stat.size,
            blocks=stat.count,
        )
        for stat in snapshot.statistics("lineno")[:count]
    ]


def read_memory(sites: int = 0) -> MemoryReading:
    """The process's memory now; with tracing on, and `sites` > 0, the lines
    holding the most of it (a snapshot: see `top_sites`)."""
    if not 0 <= sites <= MAX_SITES:
        raise ValueError(f"sites must be between 0 and {MAX_SITES}, got {sites}")
    tracing = tracemalloc.is_tracing()
    traced, peak = tracemalloc.get_traced_memory() if tracing else (None, None)
    return MemoryReading(
        rss_bytes=rss_bytes(),
        malloc_in_use_bytes=malloc_in_use(),
        python_blocks=sys.getallocatedblocks(),
        tracing=tracing,
        traced_bytes=traced,
        traced_peak_bytes=peak,
        sites=top_sites(sites),
    )
