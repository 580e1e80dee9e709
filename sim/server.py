"""A vLLM-compatible model-server pod, simulated (aiohttp).

This is the HTTP surface of a vLLM pod: OpenAI `/v1/completions` and
`/v1/chat/completions` (streaming and not), `/v1/models`, `/health`, and
`/metrics` with vLLM's metric names. Every response says which pod served it in
the `x-sim-pod` header, so tests and benchmarks can check where a request landed.

The engine behind it is deliberately simple for now: a fixed number of output
tokens after a fixed delay, no KV cache. The simulator issue grows it into a paged
KV block pool with vLLM's prefix caching, KV events and a latency model.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
from aiohttp import web

POD_HEADER = "x-sim-pod"


@dataclass(frozen=True)
class SimConfig:
    name: str = "sim-0"
    model: str = "sim-model"
    output_tokens: int = 8
    # Time per output token, in seconds (0: answer at once).
    token_delay_s: float = 0.0


class _Body(msgspec.Struct):
    model: str | None = None
    stream: bool = False
    max_tokens: int | None = None
    prompt: Any = None
    messages: Any = None


_decoder = msgspec.json.Decoder(_Body)
_json = msgspec.json.Encoder()


def _error(status: int, message: str, error_type: str = "BadRequestError") -> web.Response:
    # vLLM's error shape
    body = {"error": {"message": message, "type": error_type, "param": None, "code": status}}
    return web.Response(body=_json.encode(body), status=status, content_type="application/json")


class SimPod:
    def __init__(self, config: SimConfig) -> None:
        self.config = config
        self.running = 0
        self.requests_total = 0
        self.app = web.Application(client_max_size=64 * 1024 * 1024)
        self.app.router.add_post("/v1/completions", self.completions)
        self.app.router.add_post("/v1/chat/completions", self.chat_completions)
        self.app.router.add_get("/v1/models", self.models)
        self.app.router.add_get("/health", self.health)
        self.app.router.add_get("/metrics", self.metrics)

    def _headers(self) -> dict[str, str]:
        return {POD_HEADER: self.config.name}

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(headers=self._headers())

    async def models(self, request: web.Request) -> web.Response:
        body = {
            "object": "list",
            "data": [{"id": self.config.model, "object": "model", "owned_by": "sim"}],
        }
        return web.Response(
            body=_json.encode(body), content_type="application/json", headers=self._headers()
        )

    async def metrics(self, request: web.Request) -> web.Response:
        name = self.config.model
        text = (
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="{name}"}} {self.running}\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="{name}"}} 0\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{model_name="{name}"}} 0.0\n'
        )
        return web.Response(text=text, content_type="text/plain", headers=self._headers())

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        raw = await request.read()
        try:
            body = _decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            return _error(400, f"invalid request body: {exc}")
        if chat and not body.messages:
            return _error(400, "messages must be a non-empty list")
        if not chat and body.prompt is None:
            return _error(400, "prompt is required")
        prompt_tokens = max(1, len(raw) // 4)  # no tokenizer yet: ~4 bytes per token
        n = body.max_tokens if body.max_tokens is not None else self.config.output_tokens
        self.requests_total += 1
        self.running += 1
        try:
            if body.stream:
                return await self._stream(
                    request, chat, body.model or self.config.model, n, prompt_tokens
                )
            for _ in range(n):
                await self._token_delay()
            return self._complete(chat, body.model or self.config.model, n, prompt_tokens)
        finally:
            self.running -= 1

    async def _token_delay(self) -> None:
        if self.config.token_delay_s > 0:
            await asyncio.sleep(self.config.token_delay_s)

    def _usage(self, prompt_tokens: int, n: int) -> dict[str, Any]:
        return {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n,
            "total_tokens": prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": 0},
        }

    def _complete(self, chat: bool, model: str, n: int, prompt_tokens: int) -> web.Response:
        text = " tok" * n
        choice: dict[str, Any] = (
            {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "finish_reason": "length",
            }
            if chat
            else {"index": 0, "text": text, "finish_reason": "length"}
        )
        body = {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": self._usage(prompt_tokens, n),
        }
        return web.Response(
            body=_json.encode(body), content_type="application/json", headers=self._headers()
        )

    async def _stream(
        self, request: web.Request, chat: bool, model: str, n: int, prompt_tokens: int
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                **self._headers(),
            }
        )
        await response.prepare(request)
        request_id = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        for i in range(n):
            await self._token_delay()
            delta: dict[str, Any] = (
                {"index": 0, "delta": {"content": " tok"}, "finish_reason": None}
                if chat
                else {"index": 0, "text": " tok", "finish_reason": None}
            )
            if i == n - 1:
                delta["finish_reason"] = "length"
            chunk = {
                "id": request_id,
                "object": "chat.completion.chunk" if chat else "text_completion",
                "created": created,
                "model": model,
                "choices": [delta],
            }
            await response.write(b"data: " + _json.encode(chunk) + b"\n\n")
        # Like vLLM with stream_options.include_usage: a last chunk with usage only.
        final: dict[str, Any] = {
            "id": request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": model,
            "choices": [],
            "usage": self._usage(prompt_tokens, n),
        }
        await response.write(b"data: " + _json.encode(final) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def serve(config: SimConfig, host: str, port: int) -> web.AppRunner:
    pod = SimPod(config)
    runner = web.AppRunner(pod.app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    return runner
