"""Metric specs and engine configs: which series of a model server's /metrics page
carry each load fact, per engine (GIE's engine configs: the built-in ones here,
custom ones from a `core-metrics-extractor`'s `engineConfigs`).

Contract: everything here is an immutable value (frozen dataclasses and tuples),
built at import (the built-in engines) or from the configuration. Nothing mutates
`BUILTIN_ENGINES`: an extractor copies it before adding its custom engines. The
page readers check what they remember of a fact against the engine's spec tuple
for it by identity (`EngineSpec.waiting` and the like), which is sound because an
`EngineSpec` never changes.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

# The engine of an endpoint without an engine-type label.
DEFAULT_ENGINE: Final = "vllm"

_SPEC: Final = re.compile(r"^\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*(?:\{(.*)\})?\s*$", re.DOTALL)
_SPEC_LABEL: Final = re.compile(r'\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*=\s*(?:"([^"]*)"|([^",}\s]+))\s*')


@dataclass(frozen=True, slots=True)
class MetricSpec:
    """A series selector: a metric name and labels the series must have."""

    name: str
    labels: tuple[tuple[str, str], ...] = ()

    @classmethod
    def parse(cls, text: str) -> MetricSpec:
        """`name`, `name{label=value}` or `name{label="value",...}`; ValueError if not."""
        match = _SPEC.match(text)
        if match is None:
            raise ValueError(f"{text!r} is not a metric spec like name or name{{label=value}}")
        labels: list[tuple[str, str]] = []
        block = (match.group(2) or "").strip()
        if block:
            for pair in block.split(","):
                found = _SPEC_LABEL.fullmatch(pair)
                if found is None:
                    raise ValueError(f"{text!r}: {pair.strip()!r} is not label=value")
                labels.append((found.group(1), found.group(2) or found.group(3) or ""))
        return cls(match.group(1), tuple(labels))

    def __str__(self) -> str:
        if not self.labels:
            return self.name
        return self.name + "{" + ",".join(f'{k}="{v}"' for k, v in self.labels) + "}"


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """Where an engine's /metrics page carries each fact. Each fact lists
    alternatives: the first one present on the page is used (vLLM renamed its KV
    usage gauge)."""

    name: str
    waiting: tuple[MetricSpec, ...] = ()
    running: tuple[MetricSpec, ...] = ()
    kv_usage: tuple[MetricSpec, ...] = ()
    lora: tuple[MetricSpec, ...] = ()
    # An info gauge whose labels carry the block size and block count...
    cache_info: tuple[MetricSpec, ...] = ()
    cache_block_size_label: str = "block_size"
    cache_num_blocks_label: str = "num_gpu_blocks"
    # ... or plain gauges holding them (TensorRT-LLM).
    cache_block_size: tuple[MetricSpec, ...] = ()
    cache_num_blocks: tuple[MetricSpec, ...] = ()
    custom: tuple[tuple[str, MetricSpec], ...] = ()

    def series_names(self) -> list[str]:
        specs = [
            *self.waiting,
            *self.running,
            *self.kv_usage,
            *self.lora,
            *self.cache_info,
            *self.cache_block_size,
            *self.cache_num_blocks,
            *(spec for _, spec in self.custom),
        ]
        return sorted({spec.name for spec in specs})


def _specs(*texts: str) -> tuple[MetricSpec, ...]:
    return tuple(MetricSpec.parse(t) for t in texts)


# GIE's built-in engine configs, by engine type.
BUILTIN_ENGINES: Final[Mapping[str, EngineSpec]] = {
    "vllm": EngineSpec(
        "vllm",
        waiting=_specs("vllm:num_requests_waiting"),
        running=_specs("vllm:num_requests_running"),
        kv_usage=_specs("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
        lora=_specs("vllm:lora_requests_info"),
        cache_info=_specs("vllm:cache_config_info"),
    ),
    "sglang": EngineSpec(
        "sglang",
        waiting=_specs("sglang:num_queue_reqs"),
        running=_specs("sglang:num_running_reqs"),
        kv_usage=_specs("sglang:token_usage"),
        cache_info=_specs("sglang:cache_config_info"),
        cache_block_size_label="page_size",
        cache_num_blocks_label="num_pages",
    ),
    "trtllm-serve": EngineSpec(
        "trtllm-serve",
        waiting=_specs("trtllm_num_requests_waiting"),
        running=_specs("trtllm_num_requests_running"),
        kv_usage=_specs("trtllm_kv_cache_utilization"),
        cache_block_size=_specs("trtllm_kv_cache_tokens_per_block"),
        cache_num_blocks=_specs("trtllm_kv_cache_max_blocks"),
    ),
    "triton-tensorrt-llm": EngineSpec(
        "triton-tensorrt-llm",
        waiting=_specs("nv_trt_llm_request_metrics{request_type=waiting}"),
        running=_specs("nv_trt_llm_request_metrics{request_type=scheduled}"),
        kv_usage=_specs("nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=fraction}"),
        cache_block_size=_specs(
            "nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=tokens_per}"
        ),
        cache_num_blocks=_specs("nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type=max}"),
    ),
    "triton": EngineSpec(
        "triton",
        waiting=_specs("nv_inference_pending_request_count"),
        running=_specs("nv_inference_exec_count"),
    ),
}
