"""Shared helpers for the plugin tests: real endpoints, a real plugin context."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from epp.clock import SYSTEM_CLOCK, Clock
from epp.datastore import Datastore, Endpoint, EndpointSpec
from epp.requests import Api, InferenceRequest
from epp.scheduling import PluginContext, ScoredEndpoint


def context(name: str, clock: Clock = SYSTEM_CLOCK) -> PluginContext:
    return PluginContext(
        name=name,
        type_name=name,
        datastore=Datastore(),
        metrics=CollectorRegistry(),
        plugins={},
        clock=clock,
    )


def make_endpoints(count: int) -> list[Endpoint]:
    return [Endpoint(EndpointSpec(f"ep-{i}", f"10.0.0.{i + 1}:8000")) for i in range(count)]


def scored(endpoints: list[Endpoint], scores: list[float]) -> list[ScoredEndpoint]:
    assert len(endpoints) == len(scores)
    return [ScoredEndpoint(e, s) for e, s in zip(endpoints, scores, strict=True)]


def make_request() -> InferenceRequest:
    return InferenceRequest(
        request_id="r", path="/v1/completions", method="POST", api=Api.COMPLETIONS, model="m"
    )
