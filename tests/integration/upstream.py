"""Small real HTTP upstreams for end-to-end tests: they record every request they
get and answer like an OpenAI server (JSON, or SSE when the body asks to stream).

A streamed answer can be held open: with `"hold": "<key>"` in the request body the
upstream sends the first event, then waits until the test calls
`Upstreams.release("<key>")` before it sends the rest. A test thus sees a response
that is still streaming for as long as it needs, without relying on timing.

More knobs in the body, for the stress tests: `"event_delay": s` waits that long
before each streamed event after the first (a model generating tokens);
`"fail": "status"` answers 500 with an error document; `"fail": "abort"` streams
the first event (and waits for `hold`, if any), then drops the connection, as a
model server that crashes mid-answer.

They run on their own event loop in a background thread, so they live across tests
while Envoy and the EPP run as separate processes.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from bench.stack import free_port

NAME_HEADER = "x-upstream-name"


@dataclass(frozen=True)
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


def sse_events(count: int, big: int = 0) -> list[bytes]:
    """The SSE body the upstreams stream: `count` chunks, then usage, then [DONE].
    `big` > 0 makes the first event that many bytes long."""
    events = []
    for i in range(count):
        text = "x" * big if (i == 0 and big) else f" tok{i}"
        chunk = {"choices": [{"index": 0, "text": text, "finish_reason": None}]}
        events.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    usage = {
        "choices": [],
        "usage": {
            "prompt_tokens": 100,
            "completion_tokens": count,
            "total_tokens": 100 + count,
            "prompt_tokens_details": {"cached_tokens": 64},
        },
    }
    events.append(b"data: " + json.dumps(usage).encode() + b"\n\n")
    events.append(b"data: [DONE]\n\n")
    return events


@dataclass
class Upstream:
    name: str
    port: int
    received: list[Received] = field(default_factory=list)
    # Only touched on the upstreams' event loop.
    gates: dict[str, asyncio.Event] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def handle(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.received.append(
            Received(
                request.method,
                request.path_qs,
                {k.lower(): v for k, v in request.headers.items()},
                body,
            )
        )
        headers = {NAME_HEADER: self.name}
        try:
            document: Any = json.loads(body) if body else {}
        except ValueError:
            document = {}
        if not isinstance(document, dict):
            document = {}
        fail = document.get("fail")
        if fail == "status":
            error = {"error": {"message": "the model server failed", "code": 500}}
            return web.json_response(error, status=500, headers=headers)
        if document.get("stream") or fail == "abort":
            response = web.StreamResponse(headers={**headers, "content-type": "text/event-stream"})
            await response.prepare(request)
            events = sse_events(
                int(document.get("max_tokens", 5)), int(document.get("big_event", 0))
            )
            hold = document.get("hold")
            delay = float(document.get("event_delay", 0))
            try:
                for i, event in enumerate(events):
                    if i > 0 and delay:
                        await asyncio.sleep(delay)
                    await response.write(event)
                    if i == 0 and isinstance(hold, str):
                        await self.gates.setdefault(hold, asyncio.Event()).wait()
                    if i == 0 and fail == "abort":
                        assert request.transport is not None
                        request.transport.abort()
                        return response
                await response.write_eof()
            except ConnectionResetError:
                pass  # the client (or Envoy for it) hung up
            return response
        answer = {
            "object": "text_completion",
            "choices": [{"index": 0, "text": "ok", "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 1, "total_tokens": 11},
        }
        return web.json_response(answer, headers=headers)


class Upstreams:
    """N recording upstreams served from a background thread."""

    def __init__(self, count: int) -> None:
        self.upstreams = [Upstream(f"up-{i}", free_port()) for i in range(count)]
        self._loop = asyncio.new_event_loop()
        self._runners: list[web.AppRunner] = []
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)

    def __iter__(self) -> Iterator[Upstream]:
        return iter(self.upstreams)

    def __getitem__(self, index: int) -> Upstream:
        return self.upstreams[index]

    def by_name(self, name: str) -> Upstream:
        return next(u for u in self.upstreams if u.name == name)

    def clear(self) -> None:
        for upstream in self.upstreams:
            upstream.received.clear()

    def release(self, key: str) -> None:
        """Let every response held on `key` finish (also one not started yet)."""

        def release() -> None:
            for upstream in self.upstreams:
                upstream.gates.setdefault(key, asyncio.Event()).set()

        self._loop.call_soon_threadsafe(release)

    def start(self) -> Upstreams:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        return self

    async def _start(self) -> None:
        for upstream in self.upstreams:
            app = web.Application(client_max_size=64 * 1024 * 1024)
            app.router.add_route("*", "/{tail:.*}", upstream.handle)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", upstream.port).start()
            self._runners.append(runner)

    def stop(self) -> None:
        async def cleanup() -> None:
            for runner in self._runners:
                await runner.cleanup()

        asyncio.run_coroutine_threadsafe(cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
