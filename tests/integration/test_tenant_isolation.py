"""Tenant isolation end to end: client -> real Envoy -> `epp serve` (precise and
approximate prefix scorers side by side) -> simulated vLLM pods (separate
processes, real tokenizer, salted block hashes published as vLLM KV events).

A conversation cached under one `cache_salt` gives affinity to requests with that
salt only: under another salt, or none, neither scorer sees it, and the request
finds nothing in any pod's cache either."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from bench.stack import ManagedProcess, start_sim_fleet
from tests.integration.conftest import Stack, running_stack
from tests.testdata import qwen_dir

POD_HEADER = "x-sim-pod"
SELECT = "test-epp-endpoint-selection"
SYSTEM = "You draft the internal memos of the finance department of a shipyard. " * 40
TENANT = "tenant-finance"


def config() -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
            "kind": "EndpointPickerConfig",
            "plugins": [
                {"type": "header-based-testing-filter"},
                {
                    "type": "precise-prefix-cache-scorer",
                    "name": "precise",
                    "parameters": {
                        "blockSize": 16,
                        "tokenizers": [{"model": "*", "path": str(qwen_dir())}],
                    },
                },
                {
                    "type": "prefix-cache-scorer",
                    "name": "approx",
                    "parameters": {"autoTune": False},
                },
                {"type": "max-score-picker"},
            ],
            "schedulingProfiles": [
                {
                    "name": "default",
                    "plugins": [
                        {"pluginRef": "header-based-testing-filter"},
                        {"pluginRef": "precise", "weight": 1},
                        {"pluginRef": "approx", "weight": 1},
                        {"pluginRef": "max-score-picker"},
                    ],
                }
            ],
        }
    )


@pytest.fixture(scope="module")
def fleet_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path]]:
    workdir = tmp_path_factory.mktemp("tenants")
    with contextlib.ExitStack() as cleanup:
        fleet: ManagedProcess
        fleet, endpoints = start_sim_fleet(
            3,
            workdir,
            # A seed drawn per run, which the EPP is not told (its index keys
            # blocks by their tokens): the salts must keep tenants apart anyway.
            [
                "--tokenizer",
                str(qwen_dir()),
                "--hash-seed",
                f"{random.getrandbits(64):x}",
                "--time-scale",
                "0.02",
            ],
        )
        cleanup.callback(fleet.stop)
        stack = cleanup.enter_context(
            running_stack(workdir, endpoints_file=endpoints, config_text=config())
        )
        yield stack, endpoints


def chat(question: str, salt: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": "sim-model",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ],
        "max_tokens": 2,
    }
    if salt is not None:
        body["cache_salt"] = salt
    return body


async def debug(stack: Stack) -> dict[str, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(stack.admin_url + "/debug/endpoints") as response,
    ):
        return {e["name"]: e for e in await response.json()}


async def eventually(stack: Stack, check: Any, what: str) -> None:
    deadline = asyncio.get_running_loop().time() + 20
    while not check(await debug(stack)):
        assert asyncio.get_running_loop().time() < deadline, f"never: {what}"
        await asyncio.sleep(0.05)


async def explain(stack: Stack, body: dict[str, Any]) -> dict[str, dict[str, float]]:
    """plugin -> pod -> score, for `body` as the EPP would score it now."""
    query = {"path": "/v1/chat/completions", "body": body}
    async with (
        aiohttp.ClientSession() as session,
        session.post(stack.admin_url + "/debug/explain", json=query) as response,
    ):
        assert response.status == 200, await response.text()
        explained = await response.json()
    return {
        plugin: {c["name"]: c["scores"][plugin] for c in explained["candidates"]}
        for plugin in ("precise", "approx")
    }


async def send(
    stack: Stack, body: dict[str, Any], headers: dict[str, str] | None = None
) -> tuple[str, dict[str, Any]]:
    """Through Envoy: the pod that served it and its usage."""
    async with (
        aiohttp.ClientSession() as session,
        session.post(stack.url + "/v1/chat/completions", json=body, headers=headers) as r,
    ):
        assert r.status == 200, await r.text()
        return r.headers[POD_HEADER], (await r.json())["usage"]


async def test_a_prefix_cached_for_one_tenant_gives_no_affinity_to_another(
    fleet_stack: tuple[Stack, Path],
) -> None:
    stack, endpoints = fleet_stack
    pods = {e["name"]: e for e in yaml.safe_load(endpoints.read_text())["endpoints"]}
    await eventually(
        stack,
        lambda d: (
            all(e.get("index", {}).get("state") == "live" for e in d.values())
            and d["sim-1"]["index"]["tokenizers"] == {"*": "ready"}
        ),
        "streams live and the tokenizer loaded",
    )
    # The tenant's conversation goes to sim-1 (chosen by the test): sim-1 caches its
    # salted blocks and says so in KV events; the EPP's own index learns it too.
    served_by, _ = await send(
        stack, chat("Memo on Q3 dry-dock costs.", TENANT), {SELECT: pods["sim-1"]["address"]}
    )
    assert served_by == "sim-1"
    await eventually(stack, lambda d: d["sim-1"]["index"]["blocks"] >= 30, "sim-1's blocks")

    owner = await explain(stack, chat("Memo on hull insurance.", TENANT))
    assert owner["precise"]["sim-1"] > 0.8
    assert owner["approx"]["sim-1"] > 0.5
    assert owner["precise"]["sim-0"] == owner["precise"]["sim-2"] == 0.0

    for salt in ("tenant-marketing", None, ""):
        other = await explain(stack, chat("Memo on hull insurance.", salt))
        assert set(other["precise"].values()) == {0.0}, (salt, other)
        assert set(other["approx"].values()) == {0.0}, (salt, other)

    # Through Envoy: another tenant's request finds nothing cached wherever it
    # lands, while the owner's goes to sim-1 and hits its cache.
    _, usage = await send(stack, chat("Memo on hull insurance.", "tenant-marketing"))
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0
    served_by, usage = await send(stack, chat("Memo on hull insurance.", TENANT))
    assert served_by == "sim-1"
    assert usage["prompt_tokens_details"]["cached_tokens"] > 0.8 * usage["prompt_tokens"]
