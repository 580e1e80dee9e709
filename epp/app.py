"""The composition root: builds every part of `epp serve` and runs it.

Everything that can be wrong with the input (config file, endpoints file) is
checked before any port is opened, so a bad file never leaves a half-configured
server running.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from epp import accesslog
from epp.accesslog import AccessLogService
from epp.admin import AdminServer
from epp.completion import DEFAULT_TIMEOUT_S, CompletionTracker
from epp.config import (
    DEFAULT_CONFIG,
    InvalidConfig,
    SchedulingConfig,
    load_config,
    load_config_file,
)
from epp.datastore import Datastore
from epp.director import Director
from epp.extproc.server import SERVICE_NAME, ExternalProcessor, add_to_server
from epp.extproc.stream import DEFAULT_MAX_BODY_BYTES, StreamSettings
from epp.scheduling.interfaces import ServerSettings
from epp.scheduling.registry import PluginRegistry
from epp.sources.static import InvalidEndpointsFile, StaticEndpointSource
from epp.telemetry import Telemetry

log = logging.getLogger(__name__)

# gRPC health services (GIE's): liveness is always SERVING; the others once the
# endpoint source has synced.
HEALTH_READINESS_SERVICES = ("", "readiness", SERVICE_NAME)


@dataclass(frozen=True)
class ServeOptions:
    endpoints_file: str
    config_file: str | None = None
    config_text: str | None = None
    bind: str = "0.0.0.0"
    grpc_port: int = 9002
    grpc_health_port: int = 9003
    metrics_port: int = 9090
    debug_endpoints: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    log_prompts: bool = False
    shutdown_grace_s: float = 5.0
    # Lean mode: how long a routed request may wait for its access-log entry.
    lean_completion_timeout_s: float = DEFAULT_TIMEOUT_S
    # Model-server metrics (GIE's flags): scrape period, when data stops being
    # trusted, and how long a scrape may take.
    refresh_metrics_interval_s: float = 0.05
    metrics_staleness_threshold_s: float = 2.0
    metrics_scrape_timeout_s: float = 1.0


class StartupError(Exception):
    """The input is invalid; the message lists every problem found."""


class EppApp:
    def __init__(self, options: ServeOptions, registry: PluginRegistry | None = None) -> None:
        self.options = options
        self.registry = registry if registry is not None else PluginRegistry.from_entry_points()
        self.datastore = Datastore()
        self.telemetry = Telemetry(self.datastore)
        problems: list[str] = []
        config: SchedulingConfig | None = None
        try:
            config = self._load_config()
        except InvalidConfig as exc:
            problems.append(str(exc))
        self.source = StaticEndpointSource(options.endpoints_file, self.datastore)
        try:
            self.source.load()
        except InvalidEndpointsFile as exc:
            problems.append(str(exc))
        if problems or config is None:
            raise StartupError("\n".join(problems))
        for warning in config.warnings:
            log.warning("config: %s", warning)
        self.director = Director(self.datastore, config, self.telemetry)
        self.tracker = CompletionTracker(
            self.director, self.telemetry, timeout_s=options.lean_completion_timeout_s
        )
        self.access_log = AccessLogService(self.tracker, self.telemetry)
        self.health = health_aio.HealthServicer()
        self.admin = AdminServer(
            self.datastore,
            self.director,
            self.telemetry,
            self.not_ready_reason,
            debug_endpoints=options.debug_endpoints,
        )
        self.datastore.add_listener(lambda added, removed: self._schedule_health_update())
        self.grpc_server: grpc.aio.Server | None = None
        self.health_server: grpc.aio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._health_tasks: set[asyncio.Task[None]] = set()
        self._started = False
        self.ports: dict[str, int] = {}

    def _load_config(self) -> SchedulingConfig:
        kwargs = {
            "datastore": self.datastore,
            "metrics": self.telemetry.registry,
            "observe": self.telemetry.plugin_timer,
            "settings": ServerSettings(
                refresh_metrics_interval_s=self.options.refresh_metrics_interval_s,
                metrics_staleness_threshold_s=self.options.metrics_staleness_threshold_s,
                metrics_scrape_timeout_s=self.options.metrics_scrape_timeout_s,
            ),
        }
        if self.options.config_file:
            return load_config_file(self.options.config_file, self.registry, **kwargs)
        text = self.options.config_text or DEFAULT_CONFIG
        source = "--config-text" if self.options.config_text else "<default config>"
        return load_config(text, self.registry, source=source, **kwargs)  # type: ignore[arg-type]

    def not_ready_reason(self) -> str | None:
        if not self._started:
            return "starting"
        if not self.datastore.synced:
            return "the endpoint source has not synced yet"
        return None

    def _schedule_health_update(self) -> None:
        if self._started:
            task = asyncio.get_running_loop().create_task(self._update_health())
            # asyncio keeps only a weak reference to a task: hold it until it is done.
            self._health_tasks.add(task)
            task.add_done_callback(self._health_tasks.discard)

    async def _update_health(self) -> None:
        ready = self.not_ready_reason() is None
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ready
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in HEALTH_READINESS_SERVICES:
            await self.health.set(service, status)

    async def start(self) -> None:
        o = self.options
        # Room for a whole BUFFERED body in one message, plus the envelope. Never
        # less than for the default body limit: a body over a small --max-body-bytes
        # must reach the stream and get its 413, not break the gRPC stream (which
        # Envoy turns into a 500).
        message_limit = max(o.max_body_bytes, DEFAULT_MAX_BODY_BYTES) + 1024 * 1024
        grpc_options = [
            ("grpc.max_receive_message_length", message_limit),
            ("grpc.max_send_message_length", message_limit),
            # gRPC turns SO_REUSEPORT on by default: a second EPP started on the same
            # port would silently share its traffic instead of failing.
            ("grpc.so_reuseport", 0),
        ]
        self.grpc_server = grpc.aio.server(options=grpc_options)
        add_to_server(
            self.grpc_server,
            ExternalProcessor(
                self.director,
                StreamSettings(max_body_bytes=o.max_body_bytes, log_prompts=o.log_prompts),
                self.telemetry,
                self.tracker,
            ),
        )
        # Lean mode's access log comes to the same port: Envoy's `epp` cluster serves both.
        accesslog.add_to_server(self.grpc_server, self.access_log)
        self.ports["grpc"] = _listen(self.grpc_server, o.bind, o.grpc_port)
        self.health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
        self.ports["health"] = _listen(self.health_server, o.bind, o.grpc_health_port)
        await self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        await self.grpc_server.start()
        await self.health_server.start()
        self.ports["metrics"] = await self.admin.start(o.bind, o.metrics_port)
        self._tasks.append(asyncio.create_task(self.source.run(), name="endpoints-file"))
        for name, run in self.director.config.background.tasks:
            self._tasks.append(asyncio.create_task(_logged(name, run), name=name))
        self._tasks.append(asyncio.create_task(self.tracker.run(), name="lean-completions"))
        self._started = True
        await self._update_health()
        log.info(
            "serving: ext_proc on :%d, gRPC health on :%d, admin HTTP on :%d; %d endpoints",
            self.ports["grpc"],
            self.ports["health"],
            self.ports["metrics"],
            len(self.datastore.ready_endpoints()),
        )

    async def stop(self) -> None:
        self._started = False
        for service in HEALTH_READINESS_SERVICES:
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # Access-log streams never end by themselves: end them first, so they do not
        # hold the shutdown for the whole grace period.
        self.access_log.stop()
        if self.grpc_server is not None:
            # Open streams get the grace period to finish their requests.
            await self.grpc_server.stop(self.options.shutdown_grace_s)
        if self.health_server is not None:
            await self.health_server.stop(0)
        await self.admin.stop()

    async def serve_forever(self) -> None:
        """Run until SIGINT or SIGTERM, then shut down gracefully."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await self.start()
        try:
            await stop.wait()
            log.info("shutting down")
        finally:
            await self.stop()


def _listen(server: grpc.aio.Server, host: str, port: int) -> int:
    """Bind `server`; the bound port. gRPC reports a failed bind as a RuntimeError
    without saying why: say what could not be bound, as an OSError like aiohttp's."""
    try:
        return int(server.add_insecure_port(f"{host}:{port}"))
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {host}:{port} (is the port in use?): {exc}") from None


async def _logged(name: str, run: Callable[[], Awaitable[None]]) -> None:
    """Run a plugin's background task; if it dies, say so (it is not restarted:
    a task that wants to survive errors handles them itself)."""
    try:
        await run()
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("background task %s stopped with an error", name)
