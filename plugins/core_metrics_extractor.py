"""`core-metrics-extractor`: reads the load facts off a model server's /metrics page
(GIE's extractor of the same name), for `metrics-data-source`.

Contract: a data extractor: `extract(page, endpoint)` -> `EndpointMetrics`, raising
`PageError` for a page that is not the endpoint's engine's. The engine is chosen
per endpoint by its label `engineLabelKey` (default
`inference.networking.k8s.io/engine-type`; llm-d's `llm-d.ai/engine-type` is read
too), else `defaultEngine` (vllm). Built in: vllm, sglang, trtllm-serve,
triton-tensorrt-llm, triton (see epp/sources/metrics/specs.py for their series).

Parameters (GIE's): `engineLabelKey`, `defaultEngine`, `engineConfigs`: a list of
`{name, queuedRequestsSpec, runningRequestsSpec, kvUsageSpec, loraSpec,
cacheInfoSpec, cacheBlockSizeLabelName, cacheNumBlocksLabelName,
cacheBlockSizeSpec, cacheNumBlocksSpec, customMetrics: [{attributeKey,
metricSpec}]}` where a spec is `name` or `name{label=value,...}`. A config named
like a built-in engine replaces it; an empty spec means the engine does not report
that fact (scored neutrally).
"""

from __future__ import annotations

import msgspec

from epp.scheduling import PluginContext
from epp.sources.metrics import (
    DEFAULT_ENGINE,
    ENGINE_LABEL,
    EngineSpec,
    MetricsExtractor,
    MetricSpec,
)


class CustomMetric(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    attribute_key: str
    metric_spec: str


class EngineConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    name: str
    queued_requests_spec: str = ""
    running_requests_spec: str = ""
    kv_usage_spec: str = ""
    lora_spec: str = ""
    cache_info_spec: str = ""
    cache_block_size_label_name: str = ""
    cache_num_blocks_label_name: str = ""
    cache_block_size_spec: str = ""
    cache_num_blocks_spec: str = ""
    custom_metrics: list[CustomMetric] = []


def _spec(text: str, where: str) -> tuple[MetricSpec, ...]:
    if not text.strip():
        return ()
    try:
        return (MetricSpec.parse(text),)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def engine_spec(config: EngineConfig) -> EngineSpec:
    if not config.name:
        raise ValueError("an engine config needs a name")
    where = f"engine {config.name!r}"
    return EngineSpec(
        name=config.name,
        waiting=_spec(config.queued_requests_spec, f"{where} queuedRequestsSpec"),
        running=_spec(config.running_requests_spec, f"{where} runningRequestsSpec"),
        kv_usage=_spec(config.kv_usage_spec, f"{where} kvUsageSpec"),
        lora=_spec(config.lora_spec, f"{where} loraSpec"),
        cache_info=_spec(config.cache_info_spec, f"{where} cacheInfoSpec"),
        cache_block_size_label=config.cache_block_size_label_name or "block_size",
        cache_num_blocks_label=config.cache_num_blocks_label_name or "num_gpu_blocks",
        cache_block_size=_spec(config.cache_block_size_spec, f"{where} cacheBlockSizeSpec"),
        cache_num_blocks=_spec(config.cache_num_blocks_spec, f"{where} cacheNumBlocksSpec"),
        custom=tuple(
            (m.attribute_key, _spec(m.metric_spec, f"{where} customMetrics")[0])
            for m in config.custom_metrics
            if m.metric_spec.strip()
        ),
    )


class CoreMetricsExtractor(MetricsExtractor):
    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        engine_label_key: str = ENGINE_LABEL
        default_engine: str = DEFAULT_ENGINE
        engine_configs: list[EngineConfig] = []

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        engines: dict[str, EngineSpec] = {}
        for config in params.engine_configs:
            if config.name in engines:
                raise ValueError(f"engine {config.name!r} is configured twice")
            engines[config.name] = engine_spec(config)
        super().__init__(engines, params.default_engine, params.engine_label_key or ENGINE_LABEL)
