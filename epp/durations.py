"""Durations written the way GIE's flags and parameters write them (Go's
`time.ParseDuration` syntax): `50ms`, `2s`, `1m30s`, `1.5h`.

A bare number is read as seconds too, for the command line (`--metrics-staleness-threshold 2`).
"""

from __future__ import annotations

import re
from typing import Annotated, Final

import msgspec

_UNITS: Final = {
    "ns": 1e-9,
    "us": 1e-6,
    "µs": 1e-6,
    "μs": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "m": 60.0,
    "h": 3600.0,
}
_PART: Final = r"(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:ns|us|µs|μs|ms|s|m|h)"
# For msgspec: a config parameter that must be a Go duration string.
DURATION_PATTERN: Final = rf"^(?:{_PART})+$"
_ONE_PART: Final = re.compile(r"([0-9]+(?:\.[0-9]*)?|\.[0-9]+)(ns|us|µs|μs|ms|s|m|h)")

Duration = Annotated[str, msgspec.Meta(pattern=DURATION_PATTERN)]
"""A config parameter holding a Go duration string ("200ms")."""


def parse_duration(text: str) -> float:
    """Seconds in `text` ("50ms", "1m30s", or a bare number of seconds); ValueError
    if it is neither."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    if not re.fullmatch(DURATION_PATTERN[1:-1], text):
        raise ValueError(f"{text!r} is not a duration (like 50ms, 2s, 1m30s)")
    return sum(float(number) * _UNITS[unit] for number, unit in _ONE_PART.findall(text))
