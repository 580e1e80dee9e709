"""`MetricsExtractor`: which engine an endpoint runs (its engine-type label), and
its /metrics page -> its `EndpointMetrics` snapshot (GIE's `core-metrics-extractor`).

Contract: an extractor's engine table (the built-in engines, with the configured
ones added or replacing them) is fixed once it is built. It owns one `ReadCache`,
shared by every endpoint and both page readers, and one `SinglePassReader` per
engine that suits one (built at the engine's first page); it writes nothing else.
The snapshots it returns are new objects, the caller's. Used from one thread (the
scraper's event loop).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from epp import defaults
from epp.datastore import Endpoint, EndpointMetrics
from epp.sources.metrics.page import PageError, SinglePassReader, read_page
from epp.sources.metrics.read_cache import ReadCache
from epp.sources.metrics.specs import BUILTIN_ENGINES, DEFAULT_ENGINE, EngineSpec

ENGINE_LABEL: Final = "inference.networking.k8s.io/engine-type"
# llm-d's newer name for the same label, read when the configured one is absent.
LLMD_ENGINE_LABEL: Final = "llm-d.ai/engine-type"


class MetricsExtractor:
    """Turns an endpoint's /metrics page into its `EndpointMetrics` (GIE's
    `core-metrics-extractor`; the plugin of that type is this class with GIE's
    parameters)."""

    def __init__(
        self,
        engines: Mapping[str, EngineSpec] | None = None,
        default_engine: str = DEFAULT_ENGINE,
        engine_label_key: str = ENGINE_LABEL,
    ) -> None:
        merged = dict(BUILTIN_ENGINES)
        merged.update(engines or {})
        if default_engine not in merged:
            raise ValueError(
                f"defaultEngine {default_engine!r} is not an engine config"
                f" (known: {', '.join(sorted(merged))})"
            )
        self.engines: Mapping[str, EngineSpec] = merged
        self.default_engine = default_engine
        self.engine_label_key = engine_label_key
        self._read_cache = ReadCache()
        # Per engine name: its single-pass reader, or None if it suits none.
        self._single_pass: dict[str, SinglePassReader | None] = {}

    def engine_for(self, endpoint: Endpoint) -> EngineSpec:
        """The endpoint's engine, from its engine-type label; PageError if the label
        names an engine nobody configured (scraping it could only mislead)."""
        labels = endpoint.labels
        name = labels.get(self.engine_label_key) or labels.get(LLMD_ENGINE_LABEL)
        if not name:
            return self.engines[self.default_engine]
        engine = self.engines.get(name)
        if engine is None:
            raise PageError(
                f"engine type {name!r} (endpoint label) has no engine config"
                f" (known: {', '.join(sorted(self.engines))})"
            )
        return engine

    def extract(
        self,
        data: bytes,
        endpoint: Endpoint,
        *,
        now: float = 0.0,
        staleness_s: float = defaults.METRICS_STALENESS_THRESHOLD.seconds,
        routed_seen: int = 0,
    ) -> EndpointMetrics:
        """The snapshot for a page scraped at `now`, whose scrape was sent when the
        endpoint's `routed` count was `routed_seen`; PageError if unusable."""
        engine = self.engine_for(endpoint)
        if engine.name in self._single_pass:
            single_pass = self._single_pass[engine.name]
        else:
            single_pass = self._single_pass[engine.name] = (
                SinglePassReader(engine, self._read_cache)
                if SinglePassReader.suits(engine)
                else None
            )
        values = single_pass.read(data) if single_pass is not None else None
        if values is None:
            values = read_page(data, engine, self._read_cache)
        return EndpointMetrics(
            updated_at=now,
            staleness_s=staleness_s,
            routed_seen=routed_seen,
            **values,  # type: ignore[arg-type]
        )
