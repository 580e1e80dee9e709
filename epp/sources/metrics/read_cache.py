"""`ReadCache`: what the page readers keep from one page to the next, and
`read_series`, which reads a series through it.

Why: a pod's page is read 20 times a second, and most of the lines the EPP wants
repeat from one page to the next (a queue length takes a few values, the LoRA and
cache-config info series hardly change). What is kept is keyed by a block: the
bytes of a series' lines from its first sample line to the next comment line (the
next family's HELP or TYPE), every line reading the series could look at; so the
same block reads the same, whichever endpoint sent it. Three tables:
- `labels`: label sets, parsed once per distinct text (`Sample.labels` fills it);
- `series`: per series name, its reads (`SeriesRead`) by block, which `read_page`
  searches for a fact's alternative metrics, label selectors and custom metrics;
- `facts`, the fact cache: per (engine name, fact), what the fact's derivation
  gave, by the block of its first metric. Both page readers look a fact up there
  before deriving it and store what they derive, so a fact derived by one is a
  lookup for the other.

Contract:
- One `ReadCache` per owner (a `MetricsExtractor`, or a caller of `read_page`),
  used from one thread. Only `read_series` and the page readers write it.
- Every entry is a pure function of its key, so entries are shared across
  endpoints and between the readers, and any may be dropped: each table is
  emptied when full (`LABEL_CACHE_SIZE`, `SERIES_CACHE_SIZE`), since the same few
  entries come back.
- A fact table holds the outcomes of one spec tuple (`ReadCache.fact_table`). It is
  emptied in place, and replaced only when another spec tuple asks for the same
  (engine name, fact): a reader may keep the one it was given
  (`SinglePassReader` does), whose entries stay right for its specs.
- A `SeriesRead` is never changed once read.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

from epp.sources.metrics.facts import Derived
from epp.sources.metrics.specs import MetricSpec
from epp.sources.metrics.text_format import (
    Sample,
    find_first_sample,
    read_sample_lines,
    sample_lines,
)

# Reads of a series by the bytes of their sample lines, and outcomes of a fact by
# those of its metric (a pod's queue length or LoRA state takes the same few values
# again and again), at most this many per series name and per fact: a KV usage that
# is new on every page must not flush the others.
SERIES_CACHE_SIZE: Final = 1024
# Sample-line blocks longer than this are read, not cached.
MAX_CACHED_BLOCK_BYTES: Final = 2048


class SeriesRead:
    """A series read off a page: its samples, a note per line that could not be
    read, and the block it was read from when it is kept in a cache (None: read
    from the page alone, or not on it)."""

    __slots__ = ("block", "problems", "samples")

    def __init__(
        self, samples: Sequence[Sample], problems: Sequence[str], block: bytes | None = None
    ) -> None:
        self.samples = samples
        self.problems = problems
        self.block = block


class ReadCache:
    """What one page shares with the next (see the module's contract): label sets
    by their text, series reads by their block, and facts by the block of their
    first metric."""

    __slots__ = ("facts", "labels", "series")

    def __init__(self) -> None:
        self.labels: dict[bytes, dict[str, str]] = {}
        self.series: dict[str, dict[bytes, SeriesRead]] = {}
        # Per (engine name, fact): the spec tuple the table was made for, and the
        # table.
        self.facts: dict[tuple[str, str], tuple[tuple[MetricSpec, ...], dict[bytes, Derived]]] = {}

    def fact_table(
        self, key: tuple[str, str], specs: tuple[MetricSpec, ...]
    ) -> dict[bytes, Derived]:
        """What the fact `key` (engine name, fact) gave, by the block of its first
        spec's lines, for the spec tuple `specs`. Made at the first call; replaced
        by an empty one only for another tuple (another engine config under the
        same name), so that one config never takes the other's outcomes."""
        entry = self.facts.get(key)
        if entry is None or entry[0] is not specs:
            entry = self.facts[key] = (specs, {})
        return entry[1]


def remember(known: dict[bytes, Derived], block: bytes, derived: Derived) -> None:
    """Keeps what a fact gave for `block` in its table (`ReadCache.fact_table`)."""
    if len(known) >= SERIES_CACHE_SIZE:
        known.clear()
    known[block] = derived


def read_series(page: bytes, name: str, cache: ReadCache | None = None) -> SeriesRead:
    """The samples of the series `name` on a Prometheus text page, and a note per
    sample line that could not be read. `cache` keeps what was read across pages,
    by the block of lines from the series' first sample to the next comment line."""
    encoded = name.encode("ascii")
    start = find_first_sample(page, encoded)
    if start < 0:
        return SeriesRead((), ())
    if cache is None:
        return SeriesRead(*read_sample_lines(sample_lines(page, encoded, start), name, None))
    comment = page.find(b"\n#", start)
    stop = comment + 1 if comment >= 0 else len(page)
    if stop - start > MAX_CACHED_BLOCK_BYTES:
        lines = sample_lines(page, encoded, start)
        return SeriesRead(*read_sample_lines(lines, name, cache.labels))
    block = page[start:stop]
    reads = cache.series.get(name)
    if reads is None:
        reads = cache.series[name] = {}
    found = reads.get(block)
    if found is None:
        if len(reads) >= SERIES_CACHE_SIZE:
            reads.clear()
        samples, problems = read_sample_lines(sample_lines(block, encoded, 0), name, cache.labels)
        found = reads[block] = SeriesRead(samples, problems, block)
    return found
