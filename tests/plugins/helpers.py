"""Shared helpers for the plugin tests: real endpoints, a real plugin context."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from epp.clock import SYSTEM_CLOCK, Clock
from epp.datastore import Datastore, Endpoint, EndpointSpec
from epp.requests import Api, InferenceRequest
from epp.scheduling import PluginContext, ScoredEndpoint
from sim.server import SimPod


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


def write_sim_endpoints(path: Path, pods: Mapping[str, SimPod]) -> Path:
    """An endpoints file naming started simulator pods and their KV-event sockets."""
    document = {
        "endpoints": [
            {
                "name": name,
                "address": f"127.0.0.1:{pod.port}",
                "kvEvents": pod.kv_events_endpoint,
                "kvEventsReplay": pod.replay_endpoint,
            }
            for name, pod in pods.items()
        ]
    }
    path.write_text(yaml.safe_dump(document))
    return path
