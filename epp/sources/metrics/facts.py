"""The load facts a page gives, and how each is derived from the samples of its
series: request counts (summed over a data-parallel pod's engines), KV usage (its
fullest engine's), the LoRA state (the latest series) and the cache configuration
(an info gauge's labels).

A derivation gives the `EndpointMetrics` fields and None, or no fields and why the
fact is unknown (NaN, infinite, negative, a KV usage above 1, a missing label): a
bad number never becomes a wrong one.

Contract: pure functions of their arguments, keeping nothing. Both page readers
(`epp.sources.metrics.page`) derive every fact through these, so they derive the
same; what a derivation gave is kept by the readers in the `ReadCache`, with the
read it came from.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Final

from epp.datastore import KV_CACHE_USAGE, RUNNING, WAITING
from epp.sources.metrics.specs import EngineSpec, MetricSpec
from epp.sources.metrics.text_format import Sample

# What a fact gives: the `EndpointMetrics` fields, and why it is unknown (or None).
Derived = tuple[dict[str, object], str | None]

# How a fact is derived from the samples of the first spec that has matching ones.
Derivation = Callable[[MetricSpec, list[Sample]], Derived]

_INF: Final = math.inf


def _bad_value(value: float, spec: MetricSpec, upper: float | None = None) -> str | None:
    if math.isnan(value):
        return f"{spec} is NaN"
    if math.isinf(value):
        return f"{spec} is infinite"
    if value < 0:
        return f"{spec} is negative ({value:g})"
    if upper is not None and value > upper:
        return f"{spec} is {value:g}, above {upper:g}"
    return None


def _int_label(labels: Mapping[str, str], name: str) -> int | None:
    text = labels.get(name, "").strip()
    if not text.isdigit():
        return None
    return int(text)


def _adapters(text: str) -> frozenset[str]:
    return frozenset(part.strip() for part in text.split(",") if part.strip())


def derive_request_count(spec: MetricSpec, samples: list[Sample]) -> Derived:
    return _gauge(spec, samples, None)


def derive_kv_usage(spec: MetricSpec, samples: list[Sample]) -> Derived:
    return _gauge(spec, samples, 1.0)


def _gauge(spec: MetricSpec, samples: list[Sample], upper: float | None) -> Derived:
    """Request counts are summed over the series (data-parallel engines), KV usage
    is the highest."""
    total = 0.0
    highest = 0.0
    for sample in samples:
        value = sample.value
        # The usual values (finite, >= 0, at most 1 for KV usage) pass with one
        # comparison chain; anything else gets its reason.
        if not ((0.0 <= value <= 1.0) if upper else (0.0 <= value < _INF)):
            problem = _bad_value(value, spec, upper) or f"{spec} is {value}"
            return {}, problem + (" (expected a fraction in [0, 1])" if upper else "")
        total += value
        highest = max(highest, value)
    return {"": highest if upper else round(total)}, None


def derive_lora(spec: MetricSpec, samples: list[Sample]) -> Derived:
    # The gauge's value is when the series was set: the latest one is current.
    latest = max(samples, key=lambda s: s.value if not math.isnan(s.value) else -1.0)
    max_lora = _int_label(latest.labels, "max_lora")
    if max_lora is None:
        return {}, f"{spec} has no integer max_lora label"
    return {
        "running_adapters": _adapters(latest.labels.get("running_lora_adapters", "")),
        "waiting_adapters": _adapters(latest.labels.get("waiting_lora_adapters", "")),
        "max_adapters": max_lora,
    }, None


def labelled_cache_info(engine: EngineSpec) -> Derivation:
    """The cache configuration from an info gauge's labels (vLLM, SGLang)."""

    def labelled(spec: MetricSpec, samples: list[Sample]) -> Derived:
        labels = samples[0].labels
        block_size = _int_label(labels, engine.cache_block_size_label)
        num_blocks = _int_label(labels, engine.cache_num_blocks_label)
        if not block_size or not num_blocks:
            return {}, (
                f"{spec} has no positive integer {engine.cache_block_size_label}"
                f" and {engine.cache_num_blocks_label} labels"
            )
        return {"block_size": block_size, "num_gpu_blocks": num_blocks}, None

    return labelled


# The request and KV facts: (fact, the `EngineSpec` field of its specs, the
# `EndpointMetrics` field it sets, its derivation). A page with none of them is not
# the engine's page.
GAUGE_FACTS: Final = (
    (WAITING, "waiting", "waiting_requests", derive_request_count),
    (RUNNING, "running", "running_requests", derive_request_count),
    (KV_CACHE_USAGE, "kv_usage", "kv_cache_usage", derive_kv_usage),
)
