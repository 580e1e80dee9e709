"""`soft-reflective-ceiling-policy`: llm-d's graduated, priority-aware ceilings.

With N bands, highest first, and the pool's saturation s, band i's reflective
ceiling is `1 - i * s / (N - 1)`. A band whose ceiling is above s is open (1.0);
the highest band always is (it stops only at s >= 1, where everything stops). At
s >= 1 the others are closed (0.0). A lower band at or past its ceiling is opened
on one call in `round(s / (1 - s))` and closed on the others, all such bands on the
same calls (one tick for the policy), so their dispatch rate falls smoothly as s
rises instead of switching off at a threshold. One band: always open. Only the
bands' rank matters, not their priority values. Takes no parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

from epp.scheduling import PluginContext


class SoftReflectiveCeilingPolicy:
    def __init__(self, params: object, context: PluginContext) -> None:
        self._tick = 0

    def compute_limits(self, saturation: float, priorities: Sequence[int]) -> Sequence[float]:
        n = len(priorities)
        if n <= 1:
            return [1.0] * n
        self._tick += 1
        s = saturation
        open_now = False
        if s < 1.0:
            period = max(1, round(s / (1.0 - s)))
            open_now = self._tick % period == 0
        ceilings = []
        for i in range(n):
            reflective = 1.0 - i * s / (n - 1)
            if i == 0 or s < reflective:
                ceilings.append(1.0)
            elif s >= 1.0:
                ceilings.append(0.0)
            else:
                ceilings.append(1.0 if open_now else 0.0)
        return ceilings
