"""Time, passed in from outside.

Every piece of the EPP that decides by time (metrics staleness, speculative index
entries, session and LoRA affinity, in-flight ages, the approximate index's
recency) reads it from a `Clock` it was given, never from the `time` module itself.
In production that clock is `time.monotonic`; in a simulation it is a
`VirtualClock` that the simulation moves forward, so the same scheduling code runs
on virtual time and gives the same answer twice.

Durations that only measure the EPP's own CPU cost (the pick latency histograms)
stay on `time.perf_counter`: they are measurements of this process, not inputs to
a decision.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Final

Clock = Callable[[], float]
"""Monotonic seconds (any origin): the time a decision is made at."""

SYSTEM_CLOCK: Final[Clock] = time.monotonic


class VirtualClock:
    """A clock that only moves when told to: `advance` or `set`. Never goes back."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def __call__(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError(f"a clock does not go back ({seconds} s)")
        self._now += seconds

    def set(self, now: float) -> None:
        if now < self._now:
            raise ValueError(f"a clock does not go back (from {self._now} to {now})")
        self._now = now
