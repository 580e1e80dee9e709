"""The lab's event loop: actions at virtual times, run in time order.

Actions at the same time run in the order they were scheduled (a sequence number
breaks ties), so a run does not depend on how the heap orders equal times.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

from epp.clock import VirtualClock

Action = Callable[[], None]


class EventLoop:
    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        # The virtual time now: the clock itself (read once or more per action).
        self.now: Callable[[], float] = clock
        self._heap: list[tuple[float, int, Action]] = []
        self._seq = 0
        self.actions_run = 0

    def at(self, when: float, action: Action) -> None:
        """Run `action` at virtual time `when` (now, if `when` is in the past)."""
        self._seq += 1
        now = self.clock()
        heapq.heappush(self._heap, (when if when > now else now, self._seq, action))

    def after(self, delay: float, action: Action) -> None:
        # `at(now + delay)`, written out: a pod schedules one of these per step.
        self._seq += 1
        now = self.clock()
        when = now + delay
        heapq.heappush(self._heap, (when if when > now else now, self._seq, action))

    def run(self) -> None:
        """Run every action, moving the clock to each one's time, until none is left."""
        heap = self._heap
        clock = self.clock
        pop = heapq.heappop
        while heap:
            when, _, action = pop(heap)
            if when > clock():
                clock.set(when)
            action()
            self.actions_run += 1
