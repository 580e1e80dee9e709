"""`describe_metrics`: the `metrics` object of /debug/endpoints, an endpoint's
snapshot with its age and, when it is not plainly usable, why (never scraped,
unreachable, stale, facts missing).

Contract: a pure function of the snapshot and the time.
"""

from __future__ import annotations

import math
import time

from epp.datastore import EndpointMetrics


def describe_metrics(metrics: EndpointMetrics, now: float | None = None) -> dict[str, object]:
    """The `metrics` object of /debug/endpoints."""
    now = time.monotonic() if now is None else now
    age = metrics.age(now)
    stale = metrics.stale(now)
    reason: str | None = None
    if metrics.updated_at == 0.0:
        reason = "never scraped" + (f": {metrics.error}" if metrics.error else "")
    elif metrics.unreachable:
        reason = f"unreachable: {metrics.error} (last good scrape {age:.1f}s ago)"
    elif stale:
        reason = f"stale: last good scrape {age:.1f}s ago (threshold {metrics.staleness_s:g}s)"
        if metrics.error:
            reason += f"; last error: {metrics.error}"
    elif metrics.missing:
        reason = "; ".join(f"{fact}: {why}" for fact, why in metrics.missing.items())
    return {
        "waiting": metrics.waiting_requests,
        "running": metrics.running_requests,
        "kvCacheUsage": metrics.kv_cache_usage,
        "stale": stale,
        "ageSeconds": None if math.isinf(age) else round(age, 3),
        "error": metrics.error,
        "unreachable": metrics.unreachable,
        "unanswered": metrics.unanswered,
        # Left out of every request's candidates (unless every endpoint is).
        "down": metrics.down(now),
        "missing": dict(metrics.missing),
        "reason": reason,
        "lora": {
            "running": sorted(metrics.running_adapters),
            "waiting": sorted(metrics.waiting_adapters),
            "max": metrics.max_adapters,
        },
        "cacheInfo": {"blockSize": metrics.block_size, "numGpuBlocks": metrics.num_gpu_blocks},
    }
