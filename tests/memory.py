"""How much Python memory a piece of work leaves behind (for bounded structures)."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Callable


def traced_growth(warm: Callable[[], None], more: Callable[[], None]) -> int:
    """Bytes of Python memory still allocated after `more` that were not after
    `warm`, each run traced and followed by a collection. A structure that stays
    within its bound grows by nothing however much `more` pushes through it."""
    gc.collect()
    tracemalloc.start()
    try:
        warm()
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        more()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
