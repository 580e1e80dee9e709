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
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from prometheus_client import CollectorRegistry

from epp import accesslog, defaults, heap, tls
from epp.accesslog import AccessLogService
from epp.admin import AdminServer
from epp.completion import DEFAULT_TIMEOUT_S, CompletionTracker
from epp.config import (
    DEFAULT_CONFIG,
    ConfigError,
    InvalidConfig,
    SchedulingConfig,
    load_config,
)
from epp.datastore import Datastore
from epp.director import Director
from epp.extproc.server import SERVICE_NAME, ExternalProcessor, add_to_server
from epp.extproc.stream import DEFAULT_MAX_BODY_BYTES, StreamSettings
from epp.reload import (
    BuiltConfig,
    ConfigReloader,
    ConfigRuntime,
    Signature,
    build_tracked,
    file_signature,
)
from epp.scheduling.interfaces import ServerSettings
from epp.scheduling.registry import PluginRegistry
from epp.sources.kube import KubeConfigError, KubeOptions
from epp.sources.static import InvalidEndpointsFile, StaticEndpointSource
from epp.telemetry import Telemetry

log = logging.getLogger(__name__)

# gRPC health services (GIE's): liveness is always SERVING; the others once the
# endpoint source has synced.
HEALTH_READINESS_SERVICES = ("", "readiness", SERVICE_NAME)


class EndpointSource(Protocol):
    """Keeps the datastore's endpoints current (the endpoints file, or Kubernetes)."""

    async def run(self) -> None: ...

    def not_ready_reason(self) -> str | None:
        """Why the source has no complete view of the pool yet (None: it has)."""


@dataclass(frozen=True)
class ServeOptions:
    # The endpoint source, exactly one: the endpoints file, or Kubernetes.
    endpoints_file: str | None = None
    kube: KubeOptions | None = None
    config_file: str | None = None
    config_text: str | None = None
    bind: str = defaults.BIND
    grpc_port: int = defaults.GRPC_PORT
    grpc_health_port: int = defaults.GRPC_HEALTH_PORT
    metrics_port: int = defaults.METRICS_PORT
    debug_endpoints: bool = False
    # --trace-memory: tracemalloc's frames per allocation (0: not tracing); the CLI
    # starts the tracing before the app is built (epp/memory.py).
    trace_memory_frames: int = 0
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    log_prompts: bool = False
    score_header: bool = False
    shutdown_grace_s: float = defaults.SHUTDOWN_GRACE.seconds
    # Lean mode: how long a routed request may wait for its access-log entry.
    lean_completion_timeout_s: float = DEFAULT_TIMEOUT_S
    # Model-server metrics (GIE's flags): scrape period, when data stops being
    # trusted, and how long a scrape may take.
    refresh_metrics_interval_s: float = defaults.REFRESH_METRICS_INTERVAL.seconds
    metrics_staleness_threshold_s: float = defaults.METRICS_STALENESS_THRESHOLD.seconds
    metrics_scrape_timeout_s: float = defaults.METRICS_SCRAPE_TIMEOUT.seconds
    # A pod whose engine makes no progress this long is left out (epp/stalls.py; 0: off).
    stall_threshold_s: float = defaults.STALL_THRESHOLD.seconds
    # --tokenizer-dir: (model, directory) pairs, in place of the config's tokenizers
    # for those models (ServerSettings.tokenizer_dirs).
    tokenizer_dirs: tuple[tuple[str, str], ...] = ()
    # How often the --config file is checked for a new version (0: never).
    config_reload_interval_s: float = defaults.CONFIG_RELOAD_INTERVAL.seconds
    # A replaced config's background tasks stop when its last request ends, or
    # after this long.
    config_drain_timeout_s: float = defaults.CONFIG_DRAIN_TIMEOUT.seconds
    # TLS on the ext_proc port (epp/tls.py): a certificate directory, or a
    # self-signed certificate made at start-up; optionally reloaded when renewed.
    secure_serving: bool = False
    cert_path: str | None = None
    enable_cert_reload: bool = False
    # ext_proc streams open at once; past it a new request is answered 503 at once
    # (0: no limit).
    max_concurrent_streams: int = defaults.MAX_CONCURRENT_STREAMS


class StartupError(Exception):
    """The input is invalid; the message lists every problem found."""


class EppApp:
    def __init__(self, options: ServeOptions, registry: PluginRegistry | None = None) -> None:
        self.options = options
        self.registry = registry if registry is not None else PluginRegistry.from_entry_points()
        self.datastore = Datastore()
        self.telemetry = Telemetry(self.datastore)
        problems: list[str] = []
        built: BuiltConfig | None = None
        config_text: str | None = None
        # The --config file's signature when it was read (for the reloader).
        self._config_signature: Signature | None = None
        try:
            config_text = self._config_text()
            built = self._build_config(config_text)
        except InvalidConfig as exc:
            problems.append(str(exc))
        source: EndpointSource | None = None
        try:
            source = self._endpoint_source()
        except (InvalidEndpointsFile, KubeConfigError, ValueError) as exc:
            problems.append(str(exc))
        self.tls: tls.CertificatePair | None = None
        self.cert_reloader: tls.ReloadingCertificate | None = None
        try:
            self._load_tls()
        except tls.TlsError as exc:
            problems.append(str(exc))
        if problems or built is None or source is None:
            raise StartupError("\n".join(problems))
        self.source = source
        for warning in built.config.warnings:
            log.warning("config: %s", warning)
        self.director = Director(
            self.datastore,
            built.config,
            self.telemetry,
            stall_threshold_s=options.stall_threshold_s,
        )
        self.runtime = ConfigRuntime(
            self.director,
            self.datastore,
            self.telemetry,
            built,
            drain_timeout_s=options.config_drain_timeout_s,
        )
        self.reloader: ConfigReloader | None = None
        if options.config_file and options.config_reload_interval_s > 0:
            self.reloader = ConfigReloader(
                options.config_file,
                self._build_config,
                self.runtime,
                self.telemetry,
                poll_interval_s=options.config_reload_interval_s,
            )
            self.reloader.loaded(config_text or "", self._config_signature)
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

    def _load_tls(self) -> None:
        o = self.options
        if not o.secure_serving:
            return
        if o.cert_path:
            self.tls = tls.load_pair(o.cert_path)
            if o.enable_cert_reload:
                self.cert_reloader = tls.ReloadingCertificate(o.cert_path, self.tls)
        else:
            self.tls = tls.self_signed()

    def _grpc_credentials(self) -> grpc.ServerCredentials | None:
        if self.cert_reloader is not None:
            return self.cert_reloader.server_credentials()
        if self.tls is not None:
            return self.tls.server_credentials()
        return None

    def _endpoint_source(self) -> EndpointSource:
        o = self.options
        if (o.endpoints_file is None) == (o.kube is None):
            raise ValueError(
                "give exactly one endpoint source: --endpoints-file FILE, or Kubernetes"
                " (--pool-name NAME, or --endpoint-selector k=v,... with"
                " --endpoint-target-ports PORT)"
                + ("; both were given" if o.endpoints_file is not None else "")
            )
        if o.endpoints_file is not None:
            static = StaticEndpointSource(o.endpoints_file, self.datastore)
            static.load()
            return static
        assert o.kube is not None
        # Imported only now: the official client takes half a second to import, which
        # an EPP serving an endpoints file should not pay at every start.
        from epp.sources.kube.source import KubernetesEndpointSource

        return KubernetesEndpointSource(
            o.kube,
            self.datastore,
            registry=self.telemetry.registry,
            on_status=self._schedule_health_update,
        )

    def _config_text(self) -> str:
        """The config's text: the --config file, --config-text, or the default."""
        if self.options.config_file:
            self._config_signature = file_signature(self.options.config_file)
            try:
                return Path(self.options.config_file).read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise InvalidConfig(
                    self.options.config_file, [ConfigError((), f"cannot read the file: {exc}")]
                ) from None
        return self.options.config_text or DEFAULT_CONFIG

    def _build_config(self, text: str) -> BuiltConfig:
        """Validate and build a config (at start-up and on every reload)."""
        o = self.options
        source = o.config_file or ("--config-text" if o.config_text else "<default config>")
        settings = ServerSettings(
            refresh_metrics_interval_s=o.refresh_metrics_interval_s,
            metrics_staleness_threshold_s=o.metrics_staleness_threshold_s,
            metrics_scrape_timeout_s=o.metrics_scrape_timeout_s,
            tokenizer_dirs=o.tokenizer_dirs,
        )

        def build(registry: CollectorRegistry) -> SchedulingConfig:
            return load_config(
                text,
                self.registry,
                source=source,
                datastore=self.datastore,
                metrics=registry,
                observe=self.telemetry.plugin_timer,
                settings=settings,
            )

        return build_tracked(self.datastore, build)

    def not_ready_reason(self) -> str | None:
        if not self._started:
            return "starting"
        if not self.datastore.synced:
            return self.source.not_ready_reason() or "the endpoint source has not synced yet"
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
        self.processor = ExternalProcessor(
            self.director,
            StreamSettings(
                max_body_bytes=o.max_body_bytes,
                log_prompts=o.log_prompts,
                score_header=o.score_header,
            ),
            self.telemetry,
            self.tracker,
            max_streams=o.max_concurrent_streams,
        )
        add_to_server(self.grpc_server, self.processor)
        # Lean mode's access log comes to the same port: Envoy's `epp` cluster serves
        # both, over TLS too when it is on.
        accesslog.add_to_server(self.grpc_server, self.access_log)
        self.ports["grpc"] = _listen(
            self.grpc_server, o.bind, o.grpc_port, self._grpc_credentials()
        )
        self.health_server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
        self.ports["health"] = _listen(self.health_server, o.bind, o.grpc_health_port)
        await self.health.set("liveness", health_pb2.HealthCheckResponse.SERVING)
        await self.grpc_server.start()
        await self.health_server.start()
        self.ports["metrics"] = await self.admin.start(o.bind, o.metrics_port)
        self._tasks.append(asyncio.create_task(self.source.run(), name="endpoint-source"))
        self.runtime.start()
        if self.reloader is not None:
            self._tasks.append(asyncio.create_task(self.reloader.run(), name="config-reload"))
        self._tasks.append(asyncio.create_task(self.tracker.run(), name="lean-completions"))
        self._started = True
        await self._update_health()
        log.info(
            "serving: ext_proc (%s) on :%d, gRPC health on :%d, admin HTTP on :%d; %d endpoints",
            "plaintext" if self.tls is None else f"TLS, certificate {self.tls.source}",
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
        await self.runtime.stop()
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
        try:
            await self.start()
        except BaseException:
            # A listener that could not be bound fails the start half-way: close
            # what was started, or gRPC's servers outlive the event loop.
            await self.stop()
            raise
        heap.freeze()  # what it built lives as long as it (epp.heap)
        try:
            await stop.wait()
            log.info("shutting down")
        finally:
            await self.stop()


def _listen(
    server: grpc.aio.Server,
    host: str,
    port: int,
    credentials: grpc.ServerCredentials | None = None,
) -> int:
    """Bind `server` (with TLS when `credentials` are given); the bound port. gRPC
    reports a failed bind as a RuntimeError without saying why: say what could not
    be bound, as an OSError like aiohttp's."""
    address = f"{host}:{port}"
    try:
        if credentials is not None:
            return int(server.add_secure_port(address, credentials))
        return int(server.add_insecure_port(address))
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {host}:{port} (is the port in use?): {exc}") from None
