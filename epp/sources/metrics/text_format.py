"""Reading the sample lines of one series off a Prometheus text page, without
parsing the rest of the page.

A sample line starts with its metric name at the beginning of a line, comment lines
(HELP, TYPE) start with `#`, and the text format keeps all lines of a family
together. So `find_first_sample` finds a series' first sample line with
`bytes.find`, `sample_lines` takes that series' lines from there up to the next
family, and `read_sample_lines` parses each line's value, and its label set only
when asked (`Sample.labels`), with the format's quoting and escapes.

Contract: functions of the bytes they are given, keeping nothing. The one table
written here belongs to the caller: `Sample.labels` adds the label sets it parses
to the label cache it was given (a `ReadCache`'s), and empties it once it holds
`LABEL_CACHE_SIZE` of them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

# Label sets parsed before, by their text: info series (LoRA, cache config) carry
# the same labels scrape after scrape, and parsing them is most of a page's cost.
LABEL_CACHE_SIZE: Final = 4096

# Byte values that may follow a metric name on a sample line: `{`, space, tab.
AFTER_NAME: Final = frozenset(b"{ \t")


class Sample:
    """One sample line: its value, and its labels, parsed only when asked for (the
    request counts of most engines need none)."""

    __slots__ = ("_cache", "_raw", "value")

    def __init__(
        self, raw_labels: bytes, value: float, cache: dict[bytes, dict[str, str]] | None = None
    ) -> None:
        self._raw = raw_labels
        self._cache = cache
        self.value = value

    @property
    def labels(self) -> Mapping[str, str]:
        cache = self._cache
        if cache is None:
            return parse_labels(self._raw)
        found = cache.get(self._raw)
        if found is None:
            if len(cache) >= LABEL_CACHE_SIZE:
                cache.clear()  # a crude bound; the same few label sets come back
            found = cache[self._raw] = parse_labels(self._raw)
        return found


# One name="value" pair of a label set; the value's pattern is the "unrolled loop"
# form, which consumes runs of ordinary bytes at once.
_LABEL_PAIR: Final = re.compile(
    rb'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*"([^"\\]*(?:\\.[^"\\]*)*)"\s*,?'
)
_ESCAPE: Final = re.compile(rb"\\(.)")
_ESCAPES: Final = {b"n": b"\n", b"\\": b"\\", b'"': b'"'}


def _unescape(value: bytes) -> str:
    if b"\\" in value:
        value = _ESCAPE.sub(lambda m: _ESCAPES.get(m.group(1), b"\\" + m.group(1)), value)
    return value.decode("utf-8", errors="replace")


def parse_labels(block: bytes) -> dict[str, str]:
    """The pairs of a label set (the text between `{` and `}`); labels that do not
    parse yield an empty set, which matches no spec that asks for labels."""
    labels: dict[str, str] = {}
    pos = 0
    size = len(block.rstrip())
    while pos < size:
        match = _LABEL_PAIR.match(block, pos)
        if match is None:
            return {}
        labels[match.group(1).decode("ascii")] = _unescape(match.group(2))
        pos = match.end()
    return labels


_METRIC_NAME: Final = re.compile(rb"[a-zA-Z_:][a-zA-Z0-9_:]*")
# Sample names a family's lines may carry besides its own (histograms, summaries,
# counters).
_SUFFIXES: Final = (b"_bucket", b"_count", b"_sum", b"_total", b"_created", b"_gcount", b"_gsum")


def _family_of(name: bytes) -> bytes:
    for suffix in _SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def find_first_sample(page: bytes, name: bytes) -> int:
    """Where the first sample line of exactly the series `name` starts; -1: none."""
    size = len(name)
    end = len(page)
    if page.startswith(name) and size < end and page[size] in AFTER_NAME:
        return 0
    needle = b"\n" + name
    pos = page.find(needle)
    while pos >= 0:
        after = pos + 1 + size
        # The name must end here: `vllm:num_requests_waiting` is also the start
        # of other metric names.
        if after < end and page[after] in AFTER_NAME:
            return pos + 1
        pos = page.find(needle, after)
    return -1


def sample_lines(page: bytes, name: bytes, line: int) -> list[bytes]:
    """The sample lines of exactly the series `name` from its first one, at `line`,
    each without the name (from its label set or value to the end of the line).

    The text format keeps all lines of a family together, so the others are among
    the lines right after the first, up to the next family: the rest of the page is
    not searched (a full search of a 40 KB page costs more than reading the few
    lines the EPP needs)."""
    size = len(name)
    end = len(page)
    lines: list[bytes] = []
    family: bytes | None = None
    while True:
        next_line = page.find(b"\n", line)
        stop = next_line if next_line >= 0 else end
        after = line + size
        if after < stop and page[after] in AFTER_NAME and page.startswith(name, line):
            lines.append(page[after:stop])
        else:
            # Another sample of the same family (a histogram's _count between two
            # label sets' _bucket lines) may be skipped; anything else ends it.
            found = _METRIC_NAME.match(page, line)
            if found is None:
                break  # a comment: the next family's HELP or TYPE
            if family is None:
                family = _family_of(name)
            if _family_of(found.group()) != family:
                break
        if next_line < 0:
            break
        line = next_line + 1
    return lines


def read_sample_lines(
    lines: list[bytes], name: str, label_cache: dict[bytes, dict[str, str]] | None
) -> tuple[tuple[Sample, ...], tuple[str, ...]]:
    """The samples of the lines `sample_lines` gave for the series `name`, and a note
    per line that could not be read (no value, a value that is not a number, an
    unterminated label set)."""
    samples: list[Sample] = []
    problems: list[str] = []
    for line in lines:
        raw_labels = b""
        if line[:1] == b"{":
            # Label values may hold `}`, but the value and timestamp after the set
            # never do: the set ends at the line's last `}`.
            close = line.rfind(b"}")
            if close < 0:
                problems.append(f"{name}: unterminated label set")
                continue
            raw_labels = line[1:close]
            line = line[close + 1 :]
        fields = line.split(None, 1)
        if not fields:
            problems.append(f"{name}: a sample without a value")
            continue
        try:
            value = float(fields[0])
        except ValueError:
            problems.append(f"{name}: value {fields[0][:20]!r} is not a number")
            continue
        samples.append(Sample(raw_labels, value, label_cache))
    return tuple(samples), tuple(problems)
