"""`static-usage-limit-policy`: llm-d's default usage limit: one dispatch ceiling for
every band, `threshold` (default 1.0, in (0, 1]). While the pool's saturation is at
or above it, nothing is dispatched; 1.0 gates only a saturated pool, 0.8 keeps a
fifth of the pool's capacity in reserve."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

import msgspec

from epp.scheduling import PluginContext


class StaticUsageLimitPolicy:
    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        threshold: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        self.threshold = params.threshold

    def compute_limits(self, saturation: float, priorities: Sequence[int]) -> Sequence[float]:
        return [self.threshold] * len(priorities)
