"""`soft-reflective-ceiling-policy`: llm-d's graduated, priority-aware ceilings.

With N bands, highest first, and the pool's saturation s, band i's reflective
ceiling is `1 - i * s / (N - 1)`. A band whose ceiling is above s is open (1.0);
the highest band always is (it stops only at s >= 1, where everything stops). At
s >= 1 the others are closed (0.0). A lower band at or past its ceiling is opened
on one call in `round(s / (1 - s))` and closed on the others, all such bands on the
same calls (one tick for the policy), so their dispatch rate falls smoothly as s
rises instead of switching off at a threshold. One band: always open. Only the
bands' rank matters, not their priority values.

llm-d's policy takes no parameters; this one takes one of its own,
`highestBandCeiling` (default 1.0, llm-d's behaviour): the highest band's ceiling,
at least 1. Above 1 the highest band is still dispatched while the pool is past
saturation and every other band is closed, up to that reading: on a small pool,
where the pool sits at saturation 1 through an overload, the top band's requests
otherwise wait for a request to end like everyone's (docs/flow-control.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import msgspec

from epp.scheduling import PluginContext


class SoftReflectiveCeilingPolicy:
    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        highest_band_ceiling: Annotated[float, msgspec.Meta(ge=1.0)] = 1.0

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        self.highest = params.highest_band_ceiling
        self._tick = 0

    def compute_limits(self, saturation: float, priorities: Sequence[int]) -> Sequence[float]:
        n = len(priorities)
        if n <= 1:
            return [self.highest] * n
        self._tick += 1
        s = saturation
        open_now = False
        if s < 1.0:
            period = max(1, round(s / (1.0 - s)))
            open_now = self._tick % period == 0
        ceilings = []
        for i in range(n):
            reflective = 1.0 - i * s / (n - 1)
            if i == 0:
                ceilings.append(self.highest)
            elif s < reflective:
                ceilings.append(1.0)
            elif s >= 1.0:
                ceilings.append(0.0)
            else:
                ceilings.append(1.0 if open_now else 0.0)
        return ceilings
