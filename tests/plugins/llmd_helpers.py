"""Helpers for the tests of llm-d's newer routing plugins (affinity filter, token
load, no-hit LRU, in-flight load, bursts): requests, picks and configs."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import msgspec
import yaml
from epp.plugins.inflight_load_producer import InFlightLoadProducer

from epp.config import SchedulingConfig, load_config
from epp.datastore import Datastore, Endpoint
from epp.requests import InferenceRequest, parse_request
from epp.scheduling import (
    CycleState,
    PluginContext,
    PrefixMatchInfo,
    ProfileResult,
    SchedulingResult,
    ScoredEndpoint,
    prefix_match_key,
)
from epp.scheduling.registry import PluginRegistry
from tests.plugins.helpers import context


def request(prompt: object = "hello", model: str = "m", **fields: object) -> InferenceRequest:
    """A completion request (`prompt` a string, token ids or a batch of either)."""
    body: dict[str, object] = {"model": model, "prompt": prompt, **fields}
    return parse_request(
        request_id="r",
        method="POST",
        path="/v1/completions",
        headers={},
        body=msgspec.json.encode(body),
    )


def routed(*profiles: tuple[str, Endpoint], prefill: str | None = None) -> SchedulingResult:
    """A result whose profiles each picked one endpoint; the first is primary, and
    `prefill` names the profile that computed the prompt's KV (a disaggregated pick)."""
    return SchedulingResult(
        profiles[0][0],
        {name: ProfileResult(name, (e,), (ScoredEndpoint(e, 1.0),)) for name, e in profiles},
        prefill_profile=prefill,
    )


def with_match(
    cycle: CycleState,
    matched: Mapping[Endpoint, float],
    total: int = 10,
    block_size: int = 10,
    producer: str = "approx-prefix-cache-producer",
    demand: float = 0.0,
) -> CycleState:
    cycle.put(
        prefix_match_key(producer),
        PrefixMatchInfo(total, block_size, dict(matched), demand=demand),
    )
    return cycle


def producer(datastore: Datastore | None = None, **params: object) -> InFlightLoadProducer:
    """An in-flight load producer counting one token per character."""
    params.setdefault("charsPerToken", 1.0)
    ctx = context("inflight-load-producer")
    if datastore is not None:
        ctx = PluginContext(
            "inflight-load-producer", "inflight-load-producer", datastore, ctx.metrics, {}
        )
    return InFlightLoadProducer(msgspec.convert(params, InFlightLoadProducer.Parameters), ctx)


def charge(load: InFlightLoadProducer, endpoint: Endpoint, tokens: int) -> CycleState:
    """Route a request of `tokens` prompt tokens to `endpoint`; its cycle, to end it."""
    cycle = CycleState()
    load.pre_request(request("x" * tokens), cycle, routed(("default", endpoint)))
    return cycle


def prepared(load: InFlightLoadProducer, req: InferenceRequest, cycle: CycleState) -> CycleState:
    asyncio.run(load.prepare(req, cycle, []))
    return cycle


def one_plugin_config(type_name: str, parameters: Mapping[str, Any]) -> str:
    """A config with one plugin of `type_name`, in the default profile unless it is a
    data producer."""
    refs = [] if type_name.endswith("-producer") else [{"pluginRef": type_name}]
    return yaml.safe_dump(
        {
            "apiVersion": "llm-d.ai/v1alpha1",
            "kind": "EndpointPickerConfig",
            "plugins": [{"type": type_name, "parameters": dict(parameters)}],
            "schedulingProfiles": [{"name": "default", "plugins": refs}],
        }
    )


def load(text: str) -> SchedulingConfig:
    return load_config(text, PluginRegistry.from_entry_points())
