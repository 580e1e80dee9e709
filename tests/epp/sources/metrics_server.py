"""A real HTTP server (aiohttp, on the test's event loop) serving a /metrics page the
test controls: its bytes, status, delay, framing and connection behaviour."""

from __future__ import annotations

import asyncio
import gzip
from collections.abc import Callable
from dataclasses import dataclass, field

from aiohttp import web

from tests.epp.sources.pages import vllm_page


@dataclass
class MetricsServer:
    page: bytes = field(default_factory=vllm_page)
    status: int = 200
    delay_s: float = 0.0
    chunked: bool = False
    gzip: bool = False
    close: bool = False  # answer with Connection: close
    requests: int = 0
    # Called as each request arrives (a test moving its clock while a scrape is out).
    on_request: Callable[[], None] | None = None
    peers: set[tuple[str, int]] = field(default_factory=set)  # client connections seen
    _runner: web.AppRunner | None = None
    port: int = 0

    async def start(self, port: int = 0) -> MetricsServer:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/other/path", self._metrics)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        if self.on_request is not None:
            self.on_request()
        peer = request.transport.get_extra_info("peername") if request.transport else None
        if peer is not None:
            self.peers.add((str(peer[0]), int(peer[1])))
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        body = gzip.compress(self.page) if self.gzip else self.page
        headers = {"Content-Type": "text/plain; version=0.0.4"}
        if self.gzip:
            headers["Content-Encoding"] = "gzip"
        if self.close:
            headers["Connection"] = "close"
        if not self.chunked:
            return web.Response(body=body, status=self.status, headers=headers)
        response = web.StreamResponse(status=self.status, headers=headers)
        response.enable_chunked_encoding()
        await response.prepare(request)
        for i in range(0, len(body), 4096):
            await response.write(body[i : i + 4096])
        await response.write_eof()
        return response
