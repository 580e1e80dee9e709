"""Prefill/decode disaggregation end to end: client -> real Envoy -> `epp serve` with
manifests/config/llm-d-pd.yaml -> a P/D fleet of simulated pods (separate processes,
`python -m sim fleet --prefill-pods 1`): the EPP picks the decode pod and names the
prefill pod in `x-prefiller-host-port`; the decode pod's sidecar runs the prefill leg
on the prefill pod over HTTP, pulls the KV cache and streams the answer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from bench.stack import ROOT, ManagedProcess, start_sim_fleet
from tests.integration.conftest import Stack, running_stack

POD_HEADER = "x-sim-pod"
# Long enough that the decode pod lacks far more than nonCachedTokens (16) tokens.
SYSTEM = "You answer questions about the ferry timetable of a quiet harbour. " * 30


@pytest.fixture(scope="module")
def pd_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Stack, dict[str, Any]]]:
    workdir = tmp_path_factory.mktemp("pd")
    config = (ROOT / "manifests" / "config" / "llm-d-pd.yaml").read_text()
    with contextlib.ExitStack() as cleanup:
        fleet: ManagedProcess
        fleet, endpoints = start_sim_fleet(
            2, workdir, ["--prefill-pods", "1", "--time-scale", "0.05"]
        )
        cleanup.callback(fleet.stop)
        stack = cleanup.enter_context(
            running_stack(workdir, endpoints_file=endpoints, config_text=config)
        )
        pods = {e["name"]: e for e in yaml.safe_load(Path(endpoints).read_text())["endpoints"]}
        yield stack, pods


async def _state(session: aiohttp.ClientSession, pod: dict[str, Any]) -> dict[str, Any]:
    async with session.get(f"http://{pod['address']}/sim/state") as response:
        state: dict[str, Any] = await response.json()
        return state


async def test_a_request_is_served_by_the_decode_pod_after_its_prefill_leg_on_the_prefill_pod(
    pd_stack: tuple[Stack, dict[str, Any]],
) -> None:
    stack, pods = pd_stack
    assert pods["sim-0"]["labels"] == {"llm-d.ai/role": "prefill"}
    assert pods["sim-1"]["labels"] == {"llm-d.ai/role": "decode"}
    body = {
        "model": "sim-model",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "When does the first ferry leave?"},
        ],
        "max_tokens": 6,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        async with session.post(stack.url + "/v1/chat/completions", json=body) as response:
            assert response.status == 200
            # The decode pod answers (the decode filter never picks the prefill pod).
            assert response.headers[POD_HEADER] == "sim-1"
            lines = [raw.decode().strip() async for raw in response.content]
        assert "data: [DONE]" in lines
        prefill = await _state(session, pods["sim-0"])
        decode = await _state(session, pods["sim-1"])
    # From the pods' own counters: the prefill pod served the prefill leg (one
    # token), the decode pod sent it, pulled the KV cache and generated the answer.
    assert prefill["role"] == "prefill"
    assert prefill["pd"]["prefillLegsServed"] == 1
    assert prefill["counters"]["generationTokens"] == 1
    assert decode["role"] == "decode"
    assert decode["pd"]["prefillLegsSent"] == 1
    assert decode["pd"]["decodeLegsServed"] == 1
    assert decode["pd"]["kvTransfers"] == 1
    assert sum(decode["pd"]["fallbacks"].values()) == 0
    assert decode["counters"]["generationTokens"] == 6
