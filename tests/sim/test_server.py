"""The pod end to end: real HTTP (aiohttp client), real ZMQ subscriber, real tokenizer."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from prometheus_client.parser import text_string_to_metric_families

from sim.hashing import BlockHasher, to_event_hash
from sim.server import POD_HEADER, SimPod
from sim.tokenizer import HFTokenizer
from tests.sim.conftest import StartPod

TIMEOUT_S = 5.0


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


def url(pod: SimPod, path: str) -> str:
    return f"http://127.0.0.1:{pod.port}{path}"


async def post(
    http: aiohttp.ClientSession, pod: SimPod, path: str, body: Any
) -> tuple[int, dict[str, Any], dict[str, str]]:
    async with http.post(url(pod, path), json=body) as response:
        return response.status, await response.json(), dict(response.headers)


async def state(http: aiohttp.ClientSession, pod: SimPod) -> dict[str, Any]:
    async with http.get(url(pod, "/sim/state")) as response:
        result: dict[str, Any] = await response.json()
        return result


async def subscriber(ctx: zmq.asyncio.Context, pod: SimPod) -> zmq.asyncio.Socket:
    assert pod.kv_events_endpoint is not None
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pod.kv_events_endpoint)
    await asyncio.sleep(0.2)  # let the subscription reach the PUB socket
    return sub


async def next_batch(sub: zmq.asyncio.Socket) -> tuple[int, list[dict[str, Any]]]:
    _, seq, payload = await asyncio.wait_for(sub.recv_multipart(), TIMEOUT_S)
    _, events, _ = msgspec.msgpack.decode(payload)
    return int.from_bytes(seq, "big"), events


LONG_PROMPT = " ".join(f"word{i}" for i in range(300))


async def test_cached_tokens_grow_on_a_repeated_prefix(
    start_pod: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start_pod()
    body = {"model": "sim-model", "prompt": LONG_PROMPT, "max_tokens": 3}
    status, first, headers = await post(http, pod, "/v1/completions", body)
    assert status == 200
    assert headers[POD_HEADER] == "sim-test"
    assert first["object"] == "text_completion"
    assert first["choices"][0]["finish_reason"] == "length"
    usage = first["usage"]
    assert usage["completion_tokens"] == 3
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}

    body["prompt"] = LONG_PROMPT + " and a different ending"
    _, second, _ = await post(http, pod, "/v1/completions", body)
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    # All full blocks of the shared prefix hit.
    assert cached == (usage["prompt_tokens"] // 16) * 16
    assert cached > 0


async def test_chat_with_the_real_tokenizer(
    start_pod: StartPod, http: aiohttp.ClientSession, qwen: HFTokenizer
) -> None:
    pod = await start_pod(tokenizer=qwen)
    messages = [
        {"role": "system", "content": "You answer briefly. " + LONG_PROMPT},
        {"role": "user", "content": "Hello"},
    ]
    status, first, _ = await post(
        http, pod, "/v1/chat/completions", {"messages": messages, "max_completion_tokens": 4}
    )
    assert status == 200
    assert first["object"] == "chat.completion"
    assert first["choices"][0]["message"]["role"] == "assistant"
    assert first["choices"][0]["message"]["content"] == " This is a simulated"
    assert qwen.chat_template is not None
    expected_ids = qwen.encode(qwen.chat_template.render(messages), add_special_tokens=False)
    assert first["usage"]["prompt_tokens"] == len(expected_ids)

    # The next turn shares the whole previous conversation as a prefix.
    messages += [first["choices"][0]["message"], {"role": "user", "content": "More"}]
    messages[2] = {"role": "assistant", "content": messages[2]["content"]}
    _, second, _ = await post(http, pod, "/v1/chat/completions", {"messages": messages})
    assert (
        second["usage"]["prompt_tokens_details"]["cached_tokens"] >= (len(expected_ids) // 16) * 16
    )
    assert second["choices"][0]["finish_reason"] == "stop"
    assert second["usage"]["completion_tokens"] == 8  # --output-tokens default


async def test_state_matches_hashes_and_kv_events(
    start_pod: StartPod, http: aiohttp.ClientSession, zctx: zmq.asyncio.Context
) -> None:
    pod = await start_pod(hash_algo="sha256_cbor", hash_seed="0")
    sub = await subscriber(zctx, pod)
    prompt = list(range(1, 49))  # token ids skip tokenization
    status, _, _ = await post(http, pod, "/v1/completions", {"prompt": prompt, "max_tokens": 1})
    assert status == 200
    seq, events = await next_batch(sub)
    assert seq == 0
    (stored,) = events
    assert stored["type"] == "BlockStored"
    # The prefill computes all 48 tokens: 3 full blocks, announced in one event.
    hashes = [to_event_hash(h) for h in BlockHasher("sha256_cbor", "0", 16).block_hashes(prompt)]
    assert stored["block_hashes"] == hashes
    assert stored["parent_block_hash"] is None
    assert stored["token_ids"] == prompt
    assert stored["medium"] == "GPU"
    assert stored["extra_keys"] == [None, None, None]
    truth = await state(http, pod)
    assert truth["cachedBlockHashes"] == sorted(hashes)
    assert truth["cachedBlocksDigest"] == f"{hashes[0] ^ hashes[1] ^ hashes[2]:016x}"
    assert truth["blocks"]["used"] == 0
    assert truth["kvEvents"]["lastSeq"] == 0


async def test_cache_salt_changes_block_zero(
    start_pod: StartPod, http: aiohttp.ClientSession, zctx: zmq.asyncio.Context
) -> None:
    pod = await start_pod(hash_algo="sha256_cbor", hash_seed="0")
    sub = await subscriber(zctx, pod)
    body = {"prompt": list(range(1, 18)), "max_tokens": 1, "cache_salt": "salt-A"}
    await post(http, pod, "/v1/completions", body)
    _, (stored,) = await next_batch(sub)
    assert stored["block_hashes"] == [9301669309045965076]  # vLLM >= 0.31, tagged salt
    assert stored["extra_keys"] == [["salt-A"]]
    # Same tokens without the salt: no hit.
    _, result, _ = await post(http, pod, "/v1/completions", {**body, "cache_salt": None})
    assert result["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_streaming(start_pod: StartPod, http: aiohttp.ClientSession) -> None:
    pod = await start_pod()

    async def stream(path: str, body: dict[str, Any]) -> list[Any]:
        async with http.post(url(pod, path), json=body) as response:
            assert response.status == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers[POD_HEADER] == "sim-test"
            text = await response.text()
        lines = [line for line in text.split("\n\n") if line]
        assert all(line.startswith("data: ") for line in lines)
        assert lines[-1] == "data: [DONE]"
        return [json.loads(line[6:]) for line in lines[:-1]]

    chunks = await stream(
        "/v1/completions",
        {"prompt": LONG_PROMPT, "max_tokens": 3, "stream": True,
         "stream_options": {"include_usage": True}},
    )  # fmt: skip
    assert [c["choices"][0]["text"] for c in chunks[:3]] == [" This", " is", " a"]
    assert [c["choices"][0]["finish_reason"] for c in chunks[:3]] == [None, None, "length"]
    assert chunks[3]["choices"] == []
    assert chunks[3]["usage"]["completion_tokens"] == 3
    assert chunks[3]["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    chunks = await stream(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "stream": True},
    )
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [c["choices"][0]["delta"]["content"] for c in chunks[1:]] == [" This", " is"]
    assert all("usage" not in c for c in chunks)  # no include_usage: no usage chunk


async def test_metrics(start_pod: StartPod, http: aiohttp.ClientSession) -> None:
    pod = await start_pod(num_gpu_blocks=500)
    body = {"prompt": LONG_PROMPT, "max_tokens": 2}
    _, first, _ = await post(http, pod, "/v1/completions", body)
    _, second, _ = await post(http, pod, "/v1/completions", body)
    async with http.get(url(pod, "/metrics")) as response:
        assert response.headers[POD_HEADER] == "sim-test"
        text = await response.text()
    samples = {
        (
            s.name,
            tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("engine", "model_name"))),
        ): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("vllm:num_requests_running", ())] == 0
    assert samples[("vllm:num_requests_waiting", ())] == 0
    assert samples[("vllm:kv_cache_usage_perc", ())] == 0
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert samples[("vllm:prefix_cache_queries_total", ())] == 2 * prompt_tokens
    assert (
        samples[("vllm:prefix_cache_hits_total", ())]
        == second["usage"]["prompt_tokens_details"]["cached_tokens"]
        > 0
    )
    info = [k for k in samples if k[0] == "vllm:cache_config_info"]
    assert ("block_size", "16") in info[0][1]
    assert ("num_gpu_blocks", "500") in info[0][1]
    assert samples[("vllm:time_to_first_token_seconds_count", ())] == 2
    assert samples[("vllm:time_to_first_token_seconds_bucket", (("le", "+Inf"),))] == 2
    assert 'model_name="sim-model"' in text


async def test_kv_usage_while_a_request_runs(
    start_pod: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start_pod(num_gpu_blocks=101, time_scale=0.05)
    task = asyncio.create_task(
        post(http, pod, "/v1/completions", {"prompt": LONG_PROMPT, "max_tokens": 200})
    )
    for _ in range(200):
        truth = await state(http, pod)
        if truth["requests"]["running"]:
            break
        await asyncio.sleep(0.005)
    assert truth["requests"]["running"] == 1
    assert truth["blocks"]["used"] > 0
    assert truth["kvCacheUsage"] == pytest.approx(truth["blocks"]["used"] / 100)
    await task


async def test_bad_requests(start_pod: StartPod, http: aiohttp.ClientSession) -> None:
    pod = await start_pod(max_model_len=64)

    async def error(path: str, body: Any, status: int = 400) -> dict[str, Any]:
        async with http.post(
            url(pod, path), data=body if isinstance(body, bytes) else json.dumps(body)
        ) as response:
            assert response.status == status
            assert response.headers[POD_HEADER] == "sim-test"
            payload: dict[str, Any] = await response.json()
        assert set(payload["error"]) == {"message", "type", "param", "code"}
        assert payload["error"]["code"] == status
        details: dict[str, Any] = payload["error"]
        return details

    assert (await error("/v1/completions", b"{not json"))["type"] == "BadRequestError"
    assert "prompt" in (await error("/v1/completions", {"model": "sim-model"}))["message"]
    assert (await error("/v1/completions", {"prompt": ""}))["message"] == "Prompt cannot be empty."
    await error("/v1/completions", {"prompt": "x", "max_tokens": 0})
    await error("/v1/completions", {"prompt": "x", "stream_options": {"include_usage": True}})
    await error("/v1/chat/completions", {"messages": []})
    await error(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}
    )
    too_long = await error("/v1/completions", {"prompt": list(range(100))})
    assert "maximum context length is 64" in too_long["message"]
    await error("/v1/completions", {"prompt": list(range(10)), "max_tokens": 60})
    missing = await error("/v1/completions", {"prompt": "x", "model": "other"}, status=404)
    assert missing["type"] == "NotFoundError"


async def test_models_and_health(start_pod: StartPod, http: aiohttp.ClientSession) -> None:
    pod = await start_pod(model="org/model-8b")
    async with http.get(url(pod, "/health")) as response:
        assert response.status == 200
        assert response.headers[POD_HEADER] == "sim-test"
    async with http.get(url(pod, "/v1/models")) as response:
        models = await response.json()
    assert [m["id"] for m in models["data"]] == ["org/model-8b"]


async def test_restart(
    start_pod: StartPod, http: aiohttp.ClientSession, zctx: zmq.asyncio.Context
) -> None:
    pod = await start_pod()
    sub = await subscriber(zctx, pod)
    body = {"prompt": list(range(100, 140)), "max_tokens": 1}
    await post(http, pod, "/v1/completions", body)
    await post(http, pod, "/v1/completions", {**body, "prompt": list(range(200, 240))})
    assert [(await next_batch(sub))[0] for _ in range(2)] == [0, 1]
    status, result, _ = await post(http, pod, "/sim/restart", {})
    assert status == 200
    assert result["restarts"] == 1
    truth = await state(http, pod)
    assert truth["cachedBlockHashes"] == []
    assert truth["kvEvents"]["lastSeq"] is None
    assert truth["counters"]["requests"] == 0
    # The cache is gone: nothing hits; and the seq starts again at 0.
    _, again, _ = await post(http, pod, "/v1/completions", body)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert (await next_batch(sub))[0] == 0


async def test_restart_fails_in_flight_requests(
    start_pod: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start_pod(time_scale=0.05)
    task = asyncio.create_task(
        post(http, pod, "/v1/completions", {"prompt": "x", "max_tokens": 500})
    )
    for _ in range(1000):
        if (await state(http, pod))["requests"]["running"]:
            break
        await asyncio.sleep(0.005)
    await post(http, pod, "/sim/restart", {})
    status, body, _ = await task
    assert status == 500
    assert body["error"]["message"] == "engine restarted"


async def test_reset_prefix_cache_publishes_all_blocks_cleared(
    start_pod: StartPod, http: aiohttp.ClientSession, zctx: zmq.asyncio.Context
) -> None:
    pod = await start_pod()
    sub = await subscriber(zctx, pod)
    await post(http, pod, "/v1/completions", {"prompt": list(range(40)), "max_tokens": 1})
    await next_batch(sub)
    async with http.post(url(pod, "/reset_prefix_cache")) as response:
        assert response.status == 200
    seq, events = await next_batch(sub)
    assert (seq, events) == (1, [{"type": "AllBlocksCleared"}])
    assert (await state(http, pod))["cachedBlockHashes"] == []


async def test_dropped_events_make_a_gap(
    start_pod: StartPod, http: aiohttp.ClientSession, zctx: zmq.asyncio.Context
) -> None:
    pod = await start_pod()
    sub = await subscriber(zctx, pod)
    status, result, _ = await post(http, pod, "/sim/drop-events", {"count": 2})
    assert (status, result) == (200, {"pendingDrops": 2, "nextSeq": 0})
    for i in range(3):
        await post(
            http,
            pod,
            "/v1/completions",
            {"prompt": list(range(i * 100, i * 100 + 40)), "max_tokens": 1},
        )
    seq, _ = await next_batch(sub)
    assert seq == 2  # batches 0 and 1 never arrived
    truth = await state(http, pod)
    assert truth["kvEvents"]["dropped"] == 2
    assert truth["kvEvents"]["replayBuffered"] == 3
    status, _, _ = await post(http, pod, "/sim/drop-events", {"count": -1})
    assert status == 400


async def test_slow_metrics(start_pod: StartPod, http: aiohttp.ClientSession) -> None:
    pod = await start_pod()
    status, result, _ = await post(http, pod, "/sim/metrics-delay", {"seconds": 0.3})
    assert (status, result) == (200, {"metricsDelaySeconds": 0.3})
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with http.get(url(pod, "/metrics")) as response:
        assert response.status == 200
    assert loop.time() - started >= 0.3
    with pytest.raises(asyncio.TimeoutError):
        async with http.get(url(pod, "/metrics"), timeout=aiohttp.ClientTimeout(total=0.1)):
            pass


async def test_a_stalled_engine_behind_a_server_that_answers(
    start_pod: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start_pod(time_scale=0.05)
    status, result, _ = await post(http, pod, "/sim/stall", {"stalled": True})
    assert (status, result) == (200, {"stalled": True})
    request = asyncio.ensure_future(
        post(http, pod, "/v1/completions", {"prompt": list(range(40)), "max_tokens": 2})
    )
    await asyncio.sleep(0.5)
    assert not request.done()  # it waits: no step runs
    async with http.get(url(pod, "/metrics")) as response:
        assert response.status == 200  # the server answers...
        # ...with the gauges of the moment the engine stopped: nothing waiting then.
        text = await response.text()
        waiting = [line for line in text.splitlines() if line.startswith("vllm:num_requests_wait")]
        assert len(waiting) == 1
        assert waiting[0].endswith(" 0.0"), waiting
    status, result, _ = await post(http, pod, "/sim/stall", {"stalled": False})
    assert (status, result) == (200, {"stalled": False})
    status, _, _ = await asyncio.wait_for(request, 5.0)
    assert status == 200  # it goes on where it stopped
    status, _, _ = await post(http, pod, "/sim/stall", {"stalled": "yes"})
    assert status == 400


async def test_client_disconnect_aborts_the_request(
    start_pod: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start_pod(time_scale=0.05)
    with pytest.raises(asyncio.TimeoutError):
        async with http.post(
            url(pod, "/v1/completions"),
            json={"prompt": "x", "max_tokens": 2000},
            timeout=aiohttp.ClientTimeout(total=0.2),
        ) as response:
            await response.read()
    for _ in range(100):
        truth = await state(http, pod)
        if truth["counters"]["aborted"]:
            break
        await asyncio.sleep(0.01)
    assert truth["counters"]["aborted"] == 1
    assert truth["blocks"]["used"] == 0


async def test_every_response_names_the_pod(
    start_pod: StartPod, http: aiohttp.ClientSession
) -> None:
    pod = await start_pod()
    async with http.get(url(pod, "/no/such/route")) as response:
        assert response.status == 404
        assert response.headers[POD_HEADER] == "sim-test"
