"""Precise prefix routing end to end: client -> real Envoy -> `epp serve` with
manifests-style precise-prefix config -> a fleet of simulated vLLM pods (separate
processes, real tokenizer, vLLM-format KV events over ZMQ)."""

from __future__ import annotations

import asyncio
import contextlib
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
SYSTEM = "You answer questions about the train timetable of a small valley. " * 50


def config() -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
            "kind": "EndpointPickerConfig",
            "plugins": [
                {
                    "type": "precise-prefix-cache-scorer",
                    "name": "prefix",
                    "parameters": {
                        "blockSize": 16,
                        "tokenizers": [{"model": "*", "path": str(qwen_dir())}],
                    },
                },
                {"type": "max-score-picker"},
            ],
            "schedulingProfiles": [
                {
                    "name": "default",
                    "plugins": [{"pluginRef": "prefix"}, {"pluginRef": "max-score-picker"}],
                }
            ],
        }
    )


@pytest.fixture(scope="module")
def precise_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, Path]]:
    workdir = tmp_path_factory.mktemp("precise")
    qwen = qwen_dir()
    with contextlib.ExitStack() as cleanup:
        fleet: ManagedProcess
        fleet, endpoints = start_sim_fleet(
            3,
            workdir,
            ["--tokenizer", str(qwen), "--hash-seed", "0", "--time-scale", "0.02"],
        )
        cleanup.callback(fleet.stop)
        stack = cleanup.enter_context(
            running_stack(workdir, endpoints_file=endpoints, config_text=config())
        )
        yield stack, endpoints


async def _debug(stack: Stack) -> dict[str, dict[str, Any]]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(stack.admin_url + "/debug/endpoints") as response,
    ):
        return {e["name"]: e for e in await response.json()}


async def _eventually(stack: Stack, check: Any, what: str) -> dict[str, dict[str, Any]]:
    deadline = asyncio.get_running_loop().time() + 15
    while True:
        entries = await _debug(stack)
        if check(entries):
            return entries
        assert asyncio.get_running_loop().time() < deadline, f"never: {what}: {entries}"
        await asyncio.sleep(0.05)


def _chat(question: str) -> dict[str, Any]:
    return {
        "model": "sim-model",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ],
        "max_tokens": 2,
    }


async def test_a_request_whose_prefix_is_cached_on_pod_b_goes_to_pod_b(
    precise_stack: tuple[Stack, Path],
) -> None:
    stack, endpoints = precise_stack
    pods = {e["name"]: e for e in yaml.safe_load(endpoints.read_text())["endpoints"]}
    await _eventually(
        stack,
        lambda d: (
            all(e.get("index", {}).get("state") == "live" for e in d.values())
            and d["sim-1"]["index"]["tokenizers"] == {"*": "ready"}
        ),
        "streams live and the tokenizer loaded",
    )
    # Pod B (sim-1) serves the conversation once, directly: it caches the prefix.
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"http://{pods['sim-1']['address']}/v1/chat/completions", json=_chat("First train?")
        ) as response,
    ):
        assert response.status == 200
    await _eventually(
        stack, lambda d: d["sim-1"]["index"]["blocks"] >= 30, "pod B's blocks in the index"
    )
    # Requests sharing the prefix now go to B, through Envoy.
    async with aiohttp.ClientSession() as session:
        for question in ("Last train?", "Is there a bus on Sunday?", "Bikes allowed?"):
            async with session.post(stack.url + "/v1/chat/completions", json=_chat(question)) as r:
                assert r.status == 200, await r.text()
                assert r.headers[POD_HEADER] == "sim-1"
                usage = (await r.json())["usage"]
                # And B really had it: most of the prompt came from its prefix cache.
                assert (
                    usage["prompt_tokens_details"]["cached_tokens"] > 0.8 * usage["prompt_tokens"]
                )
    entries = await _debug(stack)
    assert entries["sim-1"]["index"]["aligned"] is True
    assert all(e["index"]["gaps"] == 0 for e in entries.values())
