"""Prefill/decode disaggregation over real HTTP: the prefill leg's answer, the decode
pod's sidecar between two simulated pods, its 400 for a bad header, and its fallback
to a local prefill when the prefill pod fails."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from sim.latency import LatencyModel
from sim.server import PREFILLER_HEADER, SimConfig, SimPod, parse_host_port
from tests.sim.conftest import StartPod

PROMPT = list(range(1000, 1100))  # 100 tokens: 6 full blocks of 16


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


def url(pod: SimPod, path: str) -> str:
    return f"http://127.0.0.1:{pod.port}{path}"


async def state(http: aiohttp.ClientSession, pod: SimPod) -> dict[str, Any]:
    async with http.get(url(pod, "/sim/state")) as response:
        result: dict[str, Any] = await response.json()
        return result


async def metrics(http: aiohttp.ClientSession, pod: SimPod) -> dict[str, float]:
    async with http.get(url(pod, "/metrics")) as response:
        text = await response.text()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            key = s.name + "".join(
                f"[{k}={v}]"
                for k, v in sorted(s.labels.items())
                if k not in ("engine", "model_name")
            )
            out[key] = s.value
    return out


def completion(stream: bool = False, **more: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 4}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body | more


async def stream_text(response: aiohttp.ClientResponse) -> list[str]:
    lines = []
    async for raw in response.content:
        line = raw.decode().strip()
        if line.startswith("data: "):
            lines.append(line[len("data: ") :])
    return lines


# -- the engine's legs over HTTP ---------------------------------------------------------


async def test_a_prefill_leg_answers_with_vllms_kv_transfer_params(
    start_pod: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start_pod(role="prefill")
    body = completion(
        max_tokens=1, kv_transfer_params={"do_remote_decode": True, "do_remote_prefill": False}
    )
    async with http.post(url(pod, "/v1/completions"), json=body) as response:
        assert response.status == 200
        answer = await response.json()
    params = answer["kv_transfer_params"]
    assert params["do_remote_prefill"] is True
    assert params["do_remote_decode"] is False
    assert params["remote_engine_id"] == pod.engine.engine_id
    assert params["remote_host"] == "127.0.0.1"
    assert params["remote_port"] == pod.port
    assert len(params["remote_block_ids"]) == 6
    assert params["remote_num_tokens"] == 96
    assert isinstance(params["remote_request_id"], str)
    assert answer["usage"]["completion_tokens"] == 1
    st = await state(http, pod)
    assert st["role"] == "prefill"
    assert st["pd"]["prefillLegsServed"] == 1


async def test_a_decode_leg_over_http_pulls_the_kv_and_counts_it(
    start_pod: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start_pod(role="decode")
    params = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "elsewhere",
        "remote_block_ids": [1, 2, 3, 4, 5, 6],
        "remote_host": "127.0.0.1",
        "remote_port": 1,
    }
    async with http.post(
        url(pod, "/v1/completions"), json=completion(kv_transfer_params=params)
    ) as response:
        assert response.status == 200
        answer = await response.json()
    assert "kv_transfer_params" not in answer
    assert answer["usage"]["completion_tokens"] == 4
    st = await state(http, pod)
    assert st["pd"]["decodeLegsServed"] == 1
    assert st["pd"]["kvTransfers"] == 1
    assert st["pd"]["externalPrefixCacheHits"] == 96
    found = await metrics(http, pod)
    assert found["vllm:nixl_xfer_time_seconds_count"] == 1
    assert found["vllm:nixl_bytes_transferred_sum"] == 96 * 128 * 1024
    assert found["vllm:external_prefix_cache_hits_total"] == 96
    assert found["vllm:external_prefix_cache_queries_total"] == 100
    assert found["vllm:nixl_num_failed_transfers_total"] == 0


async def test_a_pod_without_a_role_shows_no_connector_metrics(
    start_pod: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start_pod()
    found = await metrics(http, pod)
    assert "vllm:nixl_xfer_time_seconds_count" not in found
    assert found["sim:pd_prefill_fallbacks_total[reason=connect]"] == 0
    assert (await state(http, pod))["role"] is None


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ("yes", "must be an object"),
        ({"do_remote_decode": "yes"}, "do_remote_decode' must be a boolean"),
        ({"do_remote_prefill": 1}, "do_remote_prefill' must be a boolean"),
        ({"do_remote_decode": True, "do_remote_prefill": True}, "both"),
        ({"do_remote_prefill": True, "remote_block_ids": "1,2"}, "remote_block_ids"),
        ({"do_remote_prefill": True, "remote_block_ids": [1, -2]}, "remote_block_ids"),
        ({"do_remote_prefill": True, "remote_block_ids": [1, True]}, "remote_block_ids"),
        ({"do_remote_prefill": True, "remote_port": "80"}, "remote_port' must be an integer"),
        ({"do_remote_prefill": True, "remote_engine_id": 5}, "remote_engine_id' must be a string"),
        ({"do_remote_prefill": True, "remote_host": ["h"]}, "remote_host' must be a string"),
    ],
)
async def test_bad_kv_transfer_params_are_a_400(
    start_pod: StartPod, http: aiohttp.ClientSession, params: Any, message: str
) -> None:
    pod = await start_pod()
    async with http.post(
        url(pod, "/v1/completions"), json=completion(kv_transfer_params=params)
    ) as response:
        assert response.status == 400
        error = (await response.json())["error"]
    assert message in error["message"]
    assert error["param"] == "kv_transfer_params"


async def test_kv_transfer_params_need_a_single_prompt(
    start_pod: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start_pod()
    body = completion(kv_transfer_params={"do_remote_decode": True})
    body["prompt"] = ["one prompt", "two prompts"]
    async with http.post(url(pod, "/v1/completions"), json=body) as response:
        assert response.status == 400
        assert "single prompt" in (await response.json())["error"]["message"]


async def test_remote_block_ids_may_come_per_kv_cache_group(
    start_pod: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start_pod()
    params = {"do_remote_prefill": True, "remote_block_ids": [[1, 2, 3]]}
    async with http.post(
        url(pod, "/v1/completions"), json=completion(kv_transfer_params=params)
    ) as response:
        assert response.status == 200
    assert (await state(http, pod))["pd"]["externalPrefixCacheHits"] == 48


# -- the sidecar -------------------------------------------------------------------------


async def test_the_sidecar_runs_the_prefill_leg_on_the_prefill_pod_then_decodes_here(
    start_pod: StartPod, http: aiohttp.ClientSession
) -> None:
    prefill = await start_pod(role="prefill", name="sim-p")
    decode = await start_pod(role="decode", name="sim-d")
    headers = {PREFILLER_HEADER: f"127.0.0.1:{prefill.port}"}
    async with http.post(
        url(decode, "/v1/completions"), json=completion(stream=True), headers=headers
    ) as response:
        assert response.status == 200
        assert response.headers["x-sim-pod"] == "sim-d"
        lines = await stream_text(response)
    assert lines[-1] == "[DONE]"
    p, d = await state(http, prefill), await state(http, decode)
    # The prefill pod served a prefill leg: one request, one token, the whole prompt.
    assert p["pd"]["prefillLegsServed"] == 1
    assert p["counters"]["requests"] == 1
    assert p["counters"]["generationTokens"] == 1
    assert p["counters"]["promptTokens"] == 100
    # The decode pod pulled the 6 blocks and generated the answer.
    assert d["pd"]["prefillLegsSent"] == 1
    assert d["pd"]["decodeLegsServed"] == 1
    assert d["pd"]["kvTransfers"] == 1
    assert d["pd"]["externalPrefixCacheHits"] == 96
    assert d["counters"]["generationTokens"] == 4
    assert sum(d["pd"]["fallbacks"].values()) == 0


async def test_the_sidecar_forwards_chat_requests_with_max_completion_tokens(
    start_pod: StartPod, http: aiohttp.ClientSession
) -> None:
    seen: list[dict[str, Any]] = []

    async def handler(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response({"kv_transfer_params": {"do_remote_prefill": True}})

    async with FakePrefiller(handler) as port:
        decode = await start_pod(role="decode")
        body = {
            "model": "sim-model",
            "messages": [{"role": "user", "content": "hello there " * 40}],
            "max_completion_tokens": 5,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        async with http.post(
            url(decode, "/v1/chat/completions"),
            json=body,
            headers={PREFILLER_HEADER: f"127.0.0.1:{port}"},
        ) as response:
            assert response.status == 200
            await stream_text(response)
    (leg,) = seen
    assert leg["max_tokens"] == 1
    assert leg["max_completion_tokens"] == 1
    assert leg["stream"] is False
    assert "stream_options" not in leg
    assert leg["messages"] == body["messages"]
    assert leg["kv_transfer_params"] == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


async def test_without_the_header_the_request_is_served_whole(
    start_pod: StartPod, http: aiohttp.ClientSession
) -> None:
    decode = await start_pod(role="decode")
    async with http.post(url(decode, "/v1/completions"), json=completion()) as response:
        assert response.status == 200
    d = await state(http, decode)
    assert d["pd"]["prefillLegsSent"] == 0
    assert d["pd"]["decodeLegsServed"] == 0
    assert d["counters"]["prefixCacheQueries"] == 100


@pytest.mark.parametrize(
    "value", ["", "nohost", "host:", ":8000", "host:0", "host:65536", "host:http", "a b:-1"]
)
async def test_a_malformed_prefiller_header_is_a_clear_400(
    start_pod: StartPod, http: aiohttp.ClientSession, value: str
) -> None:
    decode = await start_pod(role="decode")
    async with http.post(
        url(decode, "/v1/completions"), json=completion(), headers={PREFILLER_HEADER: value}
    ) as response:
        assert response.status == 400
        error = (await response.json())["error"]
    assert PREFILLER_HEADER in error["message"]
    assert "<host>:<port>" in error["message"]
    assert error["code"] == 400
    d = await state(http, decode)
    assert d["counters"]["requests"] == 0
    assert d["pd"]["prefillLegsSent"] == 0


def test_host_port_forms() -> None:
    assert parse_host_port("10.0.0.5:8000") == ("10.0.0.5", 8000)
    assert parse_host_port(" pod.local:1 ") == ("pod.local", 1)
    assert parse_host_port("[::1]:8000") == ("::1", 8000)


def test_a_bad_role_or_timeout_is_refused() -> None:
    with pytest.raises(ValueError, match="role"):
        SimConfig(role="encode")
    with pytest.raises(ValueError, match="prefill_timeout_s"):
        SimConfig(prefill_timeout_s=0.0)


class FakePrefiller:
    """An HTTP server on a free port answering POSTs with `handler`."""

    def __init__(self, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> None:
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", handler)
        self.app.router.add_post("/v1/chat/completions", handler)
        self.runner = web.AppRunner(self.app, shutdown_timeout=0.1)

    async def __aenter__(self) -> int:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        return int(self.runner.addresses[0][1])

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


async def _fails_over(
    start_pod: StartPod, http: aiohttp.ClientSession, port: int, reason: str, **pod: Any
) -> None:
    decode = await start_pod(role="decode", **pod)
    async with http.post(
        url(decode, "/v1/completions"),
        json=completion(stream=True),
        headers={PREFILLER_HEADER: f"127.0.0.1:{port}"},
    ) as response:
        assert response.status == 200
        lines = await stream_text(response)
    assert lines[-1] == "[DONE]"
    d = await state(http, decode)
    # Served here, whole: the prompt prefilled locally, no transfer.
    assert d["counters"]["generationTokens"] == 4
    assert d["pd"]["decodeLegsServed"] == 0
    assert d["pd"]["kvTransfers"] == 0
    assert d["pd"]["fallbacks"][reason] == 1
    assert sum(d["pd"]["fallbacks"].values()) == 1
    found = await metrics(http, decode)
    assert found[f"sim:pd_prefill_fallbacks_total[reason={reason}]"] == 1


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_prefill_pod_that_is_down_falls_back_to_a_local_prefill(
    start_pod: StartPod, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    await _fails_over(start_pod, http, _closed_port(), "connect")
    assert "prefill leg to" in caplog.text
    assert "prefilling here" in caplog.text


@pytest.mark.parametrize(
    ("answer", "reason"),
    [
        (web.Response(status=500, text="boom"), "status"),
        (web.Response(status=503), "status"),
        (web.Response(status=200, text="{not json", content_type="application/json"), "body"),
        (web.json_response({"choices": []}), "body"),
        (web.json_response({"kv_transfer_params": None}), "body"),
        (web.json_response({"kv_transfer_params": {"do_remote_prefill": False}}), "body"),
        (web.json_response([1, 2]), "body"),
    ],
    ids=["500", "503", "bad-json", "no-params", "null-params", "no-remote-prefill", "a-list"],
)
async def test_a_failing_prefill_pod_falls_back_to_a_local_prefill(
    start_pod: StartPod, http: aiohttp.ClientSession, answer: web.Response, reason: str
) -> None:
    async def handler(request: web.Request) -> web.Response:
        await request.read()
        return answer

    async with FakePrefiller(handler) as port:
        await _fails_over(start_pod, http, port, reason)


async def test_a_prefill_pod_that_does_not_answer_in_time_falls_back(
    start_pod: StartPod, http: aiohttp.ClientSession
) -> None:
    async def handler(request: web.Request) -> web.Response:
        await asyncio.sleep(5)
        return web.json_response({})

    async with FakePrefiller(handler) as port:
        await _fails_over(start_pod, http, port, "timeout", prefill_timeout_s=0.2)


async def test_a_prefill_leg_the_prefill_pod_refuses_falls_back_and_is_answered_here(
    start_pod: StartPod, http: aiohttp.ClientSession
) -> None:
    # The prefill pod's context is too short for the prompt: its 400 is a fallback,
    # and the decode pod (a longer context) serves the request.
    prefill = await start_pod(role="prefill", max_model_len=64)
    await _fails_over(start_pod, http, prefill.port, "status")


async def test_a_client_leaving_during_the_transfer_frees_the_decode_legs_blocks(
    start_pod: StartPod,
) -> None:
    # 96 tokens of KV at 1 MB/s: 12.6 simulated seconds, 0.25 s of wall time.
    pod = await start_pod(role="decode", latency=LatencyModel(kv_transfer_bandwidth=1e6))
    params = {"do_remote_prefill": True, "remote_block_ids": [1, 2, 3, 4, 5, 6]}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=0.1)) as http:
        with pytest.raises(asyncio.TimeoutError):
            async with http.post(
                url(pod, "/v1/completions"), json=completion(kv_transfer_params=params)
            ) as response:
                await response.read()
    for _ in range(100):
        if not pod.engine.receiving:
            break
        await asyncio.sleep(0.01)
    assert not pod.engine.receiving
    assert pod.engine.kv.pool.num_used_blocks == 0
    assert pod.engine.stats.aborted == 1
