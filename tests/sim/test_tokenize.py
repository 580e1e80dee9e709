"""`/tokenize` and the render endpoints: what routers that route on token ids ask a pod
for (vllm-router's cache_aware policy), with vLLM's response shapes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from sim.server import SimPod
from sim.tokenizer import HFTokenizer
from tests.sim.conftest import StartPod

MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name a prime number."},
]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


async def post(http: aiohttp.ClientSession, pod: SimPod, path: str, body: Any) -> tuple[int, Any]:
    async with http.post(f"http://127.0.0.1:{pod.port}{path}", json=body) as response:
        return response.status, await response.json()


async def usage_prompt_tokens(http: aiohttp.ClientSession, pod: SimPod, body: Any) -> int:
    status, answer = await post(http, pod, "/v1/chat/completions", {**body, "max_tokens": 1})
    assert status == 200
    tokens: int = answer["usage"]["prompt_tokens"]
    return tokens


async def test_chat_ids_are_the_ones_generation_uses(
    start_pod: StartPod, qwen: HFTokenizer, http: aiohttp.ClientSession
) -> None:
    pod = await start_pod(tokenizer=qwen)
    body = {"model": "sim-model", "messages": MESSAGES, "stream": True}
    assert qwen.chat_template is not None
    expected = qwen.encode(qwen.chat_template.render(MESSAGES), add_special_tokens=False)

    status, rendered = await post(http, pod, "/v1/chat/completions/render", body)
    assert status == 200
    assert rendered["token_ids"] == expected
    assert rendered["model"] == "sim-model"
    assert isinstance(rendered["request_id"], str)

    status, tokenized = await post(http, pod, "/tokenize", {"model": "sim-model", **body})
    assert status == 200
    assert tokenized["tokens"] == expected
    assert tokenized["count"] == len(expected)
    assert tokenized["max_model_len"] == pod.engine.max_model_len

    no_stream = {"model": "sim-model", "messages": MESSAGES}
    assert await usage_prompt_tokens(http, pod, no_stream) == len(expected)


async def test_completion_prompts_and_errors(
    start_pod: StartPod, qwen: HFTokenizer, http: aiohttp.ClientSession
) -> None:
    pod = await start_pod(tokenizer=qwen)
    prompts = ["Hello there", "General Kenobi"]
    status, rendered = await post(http, pod, "/v1/completions/render", {"prompt": prompts})
    assert status == 200
    assert [r["token_ids"] for r in rendered] == [qwen.encode(p) for p in prompts]
    status, rendered = await post(http, pod, "/v1/completions/render", {"prompt": [1, 2, 3]})
    assert [r["token_ids"] for r in rendered] == [[1, 2, 3]]

    status, tokenized = await post(http, pod, "/tokenize", {"prompt": "Hello there"})
    assert (status, tokenized["tokens"]) == (200, qwen.encode("Hello there"))

    status, error = await post(http, pod, "/tokenize", {"model": "other", "prompt": "x"})
    assert status == 404
    assert error["error"]["param"] == "model"
    status, error = await post(http, pod, "/v1/chat/completions/render", {"messages": []})
    assert status == 400


async def test_tokenizing_touches_no_engine_counter(
    start_pod: StartPod, qwen: HFTokenizer, http: aiohttp.ClientSession
) -> None:
    pod = await start_pod(tokenizer=qwen)
    await post(http, pod, "/v1/chat/completions/render", {"messages": MESSAGES})
    await post(http, pod, "/tokenize", {"messages": MESSAGES})
    stats = pod.engine.stats
    assert (stats.requests_received, stats.prefix_cache_queries) == (0, 0)
