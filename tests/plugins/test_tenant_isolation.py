"""Tenant isolation by `cache_salt`: a prefix cached under one salt gives no
affinity under another salt, or under none, in the precise scorer (fed the KV
events an engine publishes for the salted blocks) and in the approximate one
(which learns from the EPP's own routing).

Through the real pick path: a real EPP (`EppApp`: director, scheduler, both
plugins, their real indexes), requests parsed from JSON bodies, scores read from
`Director.explain` (what /debug/explain serves). The end-to-end version, with
simulated vLLM pods and Envoy, is tests/integration/test_tenant_isolation.py."""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from epp.app import EppApp
from epp.approxindex import chain_seed
from epp.datastore import Endpoint
from epp.kvindex.service import PrecisePrefixService
from epp.requests import InferenceRequest, parse_request
from epp.scheduling.types import ResponseInfo
from tests.epp.conftest import app_on_runner, local_options, write_endpoints
from tests.epp.extproc import envoy_client as ec
from tests.fuzzing import examples
from tests.plugins.engine_events import feed, stored_payload

ENDPOINTS = {"pod-a": "10.0.0.1:8000", "pod-b": "10.0.0.2:8000"}
CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: precise-prefix-cache-scorer
  name: precise
  parameters: {blockSize: 4, hashSeed: "0"}
- type: prefix-cache-scorer
  name: approx
  parameters: {autoTune: false, blockSizeTokens: 4}
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: precise, weight: 1}
  - {pluginRef: approx, weight: 1}
  - {pluginRef: max-score-picker}
"""


def completion(
    prompt: str | list[int], salt: str | None, model: str = "m", **extra: Any
) -> InferenceRequest:
    body: dict[str, Any] = {"model": model, "prompt": prompt, **extra}
    if salt is not None:
        body["cache_salt"] = salt
    return parse_request(
        request_id="t",
        method="POST",
        path="/v1/completions",
        headers={},
        body=json.dumps(body).encode(),
    )


def scores(explained: dict[str, Any]) -> dict[str, dict[str, float]]:
    """plugin -> endpoint name -> score."""
    out: dict[str, dict[str, float]] = {"precise": {}, "approx": {}}
    for candidate in explained["candidates"]:
        for plugin in out:
            out[plugin][candidate["name"]] = candidate["scores"][plugin]
    return out


NO_AFFINITY = {"precise": {"pod-a": 0.0, "pod-b": 0.0}, "approx": {"pod-a": 0.0, "pod-b": 0.0}}


@dataclass
class Running:
    runner: asyncio.Runner
    app: EppApp
    service: PrecisePrefixService
    endpoints: dict[str, Endpoint]
    counter: Iterator[int]

    def explain(self, request: InferenceRequest) -> dict[str, dict[str, float]]:
        return scores(self.runner.run(self.app.director.explain(request)))

    def route_to_pod_a(self, request: InferenceRequest) -> None:
        """Route as the ext_proc stream does (the approximate index learns pod-a)."""

        async def route() -> None:
            decision = await self.app.director.pick_endpoint(request, [ENDPOINTS["pod-a"]])
            assert decision.endpoint.name == "pod-a"
            self.app.director.finish(decision, ResponseInfo(completed=True))

        self.runner.run(route())


@pytest.fixture(scope="module")
def running(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    path: Path = tmp_path_factory.mktemp("tenants") / "endpoints.yaml"
    write_endpoints(path, ENDPOINTS)
    with app_on_runner(local_options(path, config_text=CONFIG)) as (runner, app):
        service = app.director.config.services["precise"]
        assert isinstance(service, PrecisePrefixService)
        endpoints = {e.name: e for e in app.datastore.all_endpoints()}
        yield Running(runner, app, service, endpoints, itertools.count())


# An empty salt is no salt, in vLLM and here; a few short values make collisions
# between the two drawn salts likely enough to test the equal case too.
salts = st.none() | st.sampled_from(["", "a", "b", "tenant-1", "tenant-1 "]) | st.text(max_size=6)


def same_tenant(a: str | None, b: str | None) -> bool:
    return (a or None) == (b or None)


@settings(max_examples=examples(100))
@given(salts, salts, st.lists(st.integers(0, 50_000), min_size=4, max_size=40))
def test_a_prefix_cached_under_one_salt_scores_only_for_that_salt(
    running: Running, cached_under: str | None, asked_under: str | None, tokens: list[int]
) -> None:
    # A prompt no earlier example used: each example starts from a clean slate.
    prompt = [60_000 + next(running.counter), *tokens]
    full = len(prompt) // 4 * 4
    # pod-a's engine caches the prompt under `cached_under`, and the EPP routed it there.
    feed(running.service, running.endpoints["pod-a"], stored_payload(prompt, salt=cached_under))
    running.route_to_pod_a(completion(prompt, cached_under))

    owner = running.explain(completion(prompt, cached_under))
    assert owner["precise"] == {"pod-a": 1.0 if full else 0.0, "pod-b": 0.0}
    assert owner["approx"] == {"pod-a": 1.0, "pod-b": 0.0}

    other = running.explain(completion(prompt, asked_under))
    if same_tenant(cached_under, asked_under):
        assert other == owner
    else:
        assert other == NO_AFFINITY


def test_salts_through_a_real_stream_and_a_forged_model_name(running: Running) -> None:
    """Over real gRPC as Envoy sends it. And a regression: the approximate chain
    started from the hash of `model + separator + salt`, so the pair (model
    "m<sep>tenant", salt "1") collided with (model "m", salt "tenant<sep>1") and
    scored that tenant's blocks. Salts are the client's to choose, separators
    included."""
    prompt = "The quarterly report of tenant one, strictly confidential. " * 4
    salt_1 = "tenant\x1f1"

    async def route() -> None:
        address = f"127.0.0.1:{running.app.ports['grpc']}"
        async with grpc.aio.insecure_channel(address) as channel:
            stream = ec.EnvoyStream(channel)
            body = {"model": "m", "prompt": prompt, "cache_salt": salt_1}
            routed = await ec.route(stream, json.dumps(body).encode(), subset=[ENDPOINTS["pod-a"]])
            assert routed.destination == ENDPOINTS["pod-a"]
            await ec.respond(stream, [b"{}"])
            assert await stream.close() == grpc.StatusCode.OK

    running.runner.run(route())
    owner = running.explain(completion(prompt, salt_1))
    assert owner["approx"]["pod-a"] == 1.0
    for model, salt in (
        ("m", "tenant\x1f2"),
        ("m", None),
        ("m", ""),
        ("m\x1ftenant", "1"),  # the old collision
        ("m\x1ftenant\x1f1", None),
        ("m\x1f", salt_1),
    ):
        explained = running.explain(completion(prompt, salt, model=model))
        assert explained["approx"] == NO_AFFINITY["approx"], (model, salt)


@settings(max_examples=examples(300))
@given(st.text(max_size=8), salts, st.text(max_size=8), salts)
def test_the_approximate_chain_start_tells_every_model_and_salt_apart(
    model_a: str, salt_a: str | None, model_b: str, salt_b: str | None
) -> None:
    if model_a == model_b and same_tenant(salt_a, salt_b):
        assert chain_seed(model_a, salt_a) == chain_seed(model_b, salt_b)
    else:
        assert chain_seed(model_a, salt_a) != chain_seed(model_b, salt_b)
