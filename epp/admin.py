"""The admin HTTP server (`--metrics-port`, 9090): /metrics, /healthz, /readyz, and
with `--debug-endpoints` the read-only /debug/endpoints, /debug/explain and
/debug/memory (epp/memory.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from epp.datastore import Datastore
from epp.director import Director
from epp.errors import BadRequest, EppError
from epp.memory import MAX_SITES, read_memory
from epp.requests import parse_request
from epp.sources.metrics import describe_metrics
from epp.telemetry import Telemetry

log = logging.getLogger(__name__)


class _ExplainRequest(msgspec.Struct, forbid_unknown_fields=True):
    path: str
    body: Any = None
    headers: dict[str, str] = {}
    method: str = "POST"


_explain_decoder = msgspec.json.Decoder(_ExplainRequest)
_json = msgspec.json.Encoder()


def _json_response(data: object, status: int = 200) -> web.Response:
    return web.Response(body=_json.encode(data), status=status, content_type="application/json")


def _error_response(error: EppError) -> web.Response:
    return web.Response(body=error.body(), status=error.status, content_type="application/json")


class AdminServer:
    def __init__(
        self,
        datastore: Datastore,
        director: Director,
        telemetry: Telemetry,
        is_ready: Callable[[], str | None],
        debug_endpoints: bool = False,
    ) -> None:
        """`is_ready` returns None when ready, else why not."""
        self.datastore = datastore
        self.director = director
        self.telemetry = telemetry
        self.is_ready = is_ready
        self.app = web.Application()
        self.app.router.add_get("/metrics", self.metrics)
        self.app.router.add_get("/healthz", self.healthz)
        self.app.router.add_get("/readyz", self.readyz)
        if debug_endpoints:
            self.app.router.add_get("/debug/endpoints", self.endpoints)
            self.app.router.add_post("/debug/explain", self.explain)
            self.app.router.add_get("/debug/memory", self.memory)
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> int:
        """Serve on host:port (port 0: any free port); returns the bound port."""
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, host, port).start()
        return int(self._runner.addresses[0][1])

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.telemetry.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    async def healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok\n")

    async def readyz(self, request: web.Request) -> web.Response:
        reason = self.is_ready()
        if reason is None:
            return web.Response(text="ready\n")
        return web.Response(text=f"not ready: {reason}\n", status=503)

    async def endpoints(self, request: web.Request) -> web.Response:
        now = time.monotonic()
        describers = self.director.config.endpoint_describers()
        out = []
        for endpoint in self.datastore.all_endpoints():
            entry: dict[str, Any] = {
                "name": endpoint.name,
                "address": endpoint.address,
                "ready": endpoint.ready,
                "labels": dict(endpoint.labels),
                # waiting, running, kvCacheUsage, stale, and why a value is not
                # trusted: reason, error, missing.
                "metrics": describe_metrics(endpoint.metrics, now),
                "inFlight": endpoint.in_flight,
                # Routed here since the scrape behind `metrics` was sent: what the
                # utilization detector adds to its waiting count.
                "routedSinceScrape": endpoint.unseen_routed,
                # Requests waiting for their first token, and whether the engine has
                # stalled (epp/stalls.py).
                "progress": self.director.stalls.describe(endpoint, now),
            }
            # Facts the services and plugins of the running config add (index state).
            for describer in describers:
                entry.update(describer.describe_endpoint(endpoint))
            out.append(entry)
        return _json_response(out)

    async def explain(self, request: web.Request) -> web.Response:
        try:
            query = _explain_decoder.decode(await request.read())
        except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
            return _error_response(
                BadRequest(f'expected {{"path": ..., "headers": {{...}}, "body": {{...}}}}: {exc}')
            )
        if query.body is None:
            body = b""
        elif isinstance(query.body, str):
            body = query.body.encode()
        else:
            body = _json.encode(query.body)
        headers = {k.lower(): v for k, v in query.headers.items()}
        try:
            inference_request = parse_request(
                request_id=headers.get("x-request-id", "explain"),
                method=query.method,
                path=query.path,
                headers=headers,
                body=body,
            )
            subset = headers.get("x-gateway-destination-endpoint-subset")
            explanation = await self.director.explain(
                inference_request,
                [s.strip() for s in subset.split(",") if s.strip()] if subset is not None else None,
            )
        except EppError as error:
            return _error_response(error)
        return _json_response(explanation)

    async def memory(self, request: web.Request) -> web.Response:
        """The EPP's memory (epp/memory.py); `?sites=N` adds the N source lines
        holding the most traced memory (with `--trace-memory`)."""
        text = request.query.get("sites", "0")
        try:
            # Listing the sites snapshots every live trace: off the event loop.
            sites = int(text)
            reading = await asyncio.to_thread(read_memory, sites) if sites else read_memory()
        except ValueError:  # not a number, or out of read_memory's range
            return _error_response(
                BadRequest(f"sites must be a whole number from 0 to {MAX_SITES}, got {text!r}")
            )
        return _json_response(reading.to_json())
