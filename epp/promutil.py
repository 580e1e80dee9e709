"""Prometheus helpers for plugins.

Two instances of one plugin type in a config (two prefix indexes, say) register the
same metric names in the application's registry; prometheus_client refuses a name
twice. `shared` hands the second instance the collector the first one registered,
so both report through one family, told apart by a `plugin` label.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar, cast

from prometheus_client import CollectorRegistry
from prometheus_client.registry import Collector

C = TypeVar("C", bound=Collector)


def shared(registry: CollectorRegistry, name: str, build: Callable[[], C]) -> C:
    """The collector registered in `registry` under the metric name `name`, or the
    one `build()` makes (which must register itself there under that name)."""
    # prometheus_client has no public lookup by name; this mapping is what it checks
    # duplicates against (the library's version is pinned).
    existing = registry._names_to_collectors.get(name)
    if existing is not None:
        return cast("C", existing)
    return build()
