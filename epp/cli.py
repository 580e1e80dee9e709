"""Command line: `epp serve`, `epp validate`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

from epp import __version__, defaults
from epp.app import EppApp, ServeOptions, StartupError
from epp.completion import DEFAULT_TIMEOUT_S
from epp.config import InvalidConfig, load_config_file
from epp.durations import parse_duration
from epp.extproc.stream import DEFAULT_MAX_BODY_BYTES
from epp.logs import setup_logging
from epp.memory import MAX_FRAMES, start_tracing
from epp.scheduling.registry import PluginRegistry
from epp.sources.kube import KubeOptions, KvEventPorts, WatchSettings
from epp.sources.kube.objects import (
    POOL_VERSIONS,
    V1_GROUP,
    parse_ports_flag,
    parse_selector_flag,
)

log = logging.getLogger("epp")


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value < 65536:
        raise argparse.ArgumentTypeError(f"{value} is not a TCP port (0-65535)")
    return value


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {value}")
    return value


def _bool(text: str) -> bool:
    """A Go-style boolean flag value (GIE's flags are Go flags: --secure-serving=false)."""
    value = text.strip().lower()
    if value in ("1", "t", "true", "yes", "on"):
        return True
    if value in ("0", "f", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


class _HelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default, unless there is none worth showing."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default not in (None, False, argparse.SUPPRESS) and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def _duration(text: str) -> float:
    try:
        value = parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive duration, got {text}")
    return value


def _duration_or_zero(text: str) -> float:
    try:
        value = parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text}")
    return value


def _tokenizer_dir(text: str) -> tuple[str, str]:
    model, sep, directory = text.partition("=")
    if not sep or not model or not directory:
        raise argparse.ArgumentTypeError(f"expected MODEL=DIR, got {text!r}")
    return model, directory


def _selector(text: str) -> dict[str, str]:
    try:
        return parse_selector_flag(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _ports(text: str) -> tuple[int, ...]:
    try:
        return parse_ports_flag(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def kube_options(args: argparse.Namespace) -> KubeOptions | None:
    """The Kubernetes source's options, if any Kubernetes flag was given."""
    if not (args.pool_name or args.endpoint_selector or args.endpoint_target_ports):
        return None
    return KubeOptions(
        pool_name=args.pool_name,
        pool_namespace=args.pool_namespace,
        pool_group=args.pool_group,
        endpoint_selector=args.endpoint_selector,
        endpoint_target_ports=args.endpoint_target_ports or (),
        kubeconfig=args.kubeconfig,
        kv_events=KvEventPorts(args.kv_events_port, args.kv_events_replay_port),
        watch=WatchSettings(watch_timeout_s=args.kube_watch_timeout),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epp",
        description="A prefix-cache-aware Endpoint Picker for Envoy (ext_proc): routes each LLM"
        " request to the model-server pod that already holds its prompt's KV cache.",
    )
    parser.add_argument("--version", action="version", version=f"epp {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = commands.add_parser(
        "serve",
        help="run the endpoint picker",
        description="Serve Envoy's ext_proc protocol, pick an endpoint for each request.",
        formatter_class=_HelpFormatter,
    )
    cfg = serve.add_argument_group("configuration")
    cfg.add_argument(
        "--config",
        "--config-file",
        dest="config_file",
        metavar="FILE",
        help="EndpointPickerConfig YAML file (GIE format); without it a default profile is used",
    )
    cfg.add_argument(
        "--config-text", metavar="YAML", help="the EndpointPickerConfig given inline instead"
    )
    cfg.add_argument(
        "--config-reload-interval",
        type=_duration_or_zero,
        default=defaults.CONFIG_RELOAD_INTERVAL.text,
        metavar="DURATION",
        help="how often the --config file is checked for a new version, applied without a"
        " restart if valid (0: never)",
    )
    cfg.add_argument(
        "--config-drain-timeout",
        type=_duration,
        default=defaults.CONFIG_DRAIN_TIMEOUT.text,
        metavar="DURATION",
        help="after a reload, the old config's background tasks stop when its last request"
        " ends, or after this long",
    )
    cfg.add_argument(
        "--tokenizer-dir",
        dest="tokenizer_dirs",
        type=_tokenizer_dir,
        action="append",
        metavar="MODEL=DIR",
        help="the tokenizer of MODEL's requests (and its adapters') is the local directory"
        " DIR (tokenizer.json, tokenizer_config.json), in place of what the"
        " precise-prefix-cache-scorer's tokenizers say for MODEL; repeatable",
    )
    src = serve.add_argument_group(
        "endpoints (exactly one source: --endpoints-file, or Kubernetes: --pool-name, or"
        " --endpoint-selector with --endpoint-target-ports)"
    )
    src.add_argument(
        "--endpoints-file",
        metavar="FILE",
        help="YAML list of the pool's endpoints, re-read when it changes",
    )
    src.add_argument(
        "--pool-name",
        metavar="NAME",
        help="the InferencePool whose pods are the endpoints (watched: selector and port"
        " changes apply without a restart)",
    )
    src.add_argument(
        "--pool-namespace",
        metavar="NS",
        default=os.environ.get("NAMESPACE") or defaults.POOL_NAMESPACE,
        help="the namespace of the pool and its pods ($NAMESPACE when set)",
    )
    src.add_argument(
        "--pool-group",
        choices=sorted(POOL_VERSIONS),
        default=V1_GROUP,
        help="the InferencePool's API group: inference.networking.k8s.io (v1) or"
        " inference.networking.x-k8s.io (v1alpha2)",
    )
    src.add_argument(
        "--endpoint-selector",
        type=_selector,
        metavar="K=V,...",
        help="standalone (no InferencePool): the label selector of the model-server pods",
    )
    src.add_argument(
        "--endpoint-target-ports",
        type=_ports,
        metavar="PORT[,PORT]",
        help="standalone: the pods' serving ports; several ports give one endpoint per port"
        " (<pod>-rank-<i>)",
    )
    src.add_argument(
        "--kubeconfig",
        metavar="FILE",
        help="kubeconfig for the Kubernetes API (default: the in-cluster service account,"
        " else $KUBECONFIG or ~/.kube/config)",
    )
    src.add_argument(
        "--kv-events-port",
        type=_port,
        metavar="PORT",
        help="Kubernetes pods: the engines' KV-event PUB port for rank 0; rank i (the i-th"
        " target port) publishes on PORT + i",
    )
    src.add_argument(
        "--kv-events-replay-port",
        type=_port,
        metavar="PORT",
        help="Kubernetes pods: the engines' KV-event replay port for rank 0 (rank i: PORT + i)",
    )
    src.add_argument(
        "--kube-watch-timeout",
        type=_duration,
        default=defaults.KUBE_WATCH_TIMEOUT.text,
        metavar="DURATION",
        help="each watch asks the API server to end it after a time drawn from"
        " [DURATION, 2 x DURATION); a watch silent for that long plus 15s is presumed dead",
    )
    net = serve.add_argument_group("network")
    net.add_argument("--bind", default=defaults.BIND, help="address to listen on")
    net.add_argument(
        "--grpc-port", type=_port, default=defaults.GRPC_PORT, help="ext_proc gRPC port"
    )
    net.add_argument(
        "--grpc-health-port",
        type=_port,
        default=defaults.GRPC_HEALTH_PORT,
        help="gRPC health-checking port",
    )
    net.add_argument(
        "--metrics-port",
        type=_port,
        default=defaults.METRICS_PORT,
        help="admin HTTP port: /metrics, /healthz, /readyz",
    )
    net.add_argument(
        "--secure-serving",
        type=_bool,
        nargs="?",
        const=True,
        default=False,
        metavar="BOOL",
        help="serve ext_proc (and lean mode's access log) over TLS; `--secure-serving` alone"
        " means true. GIE's EPP defaults to true; this one to false, since the Envoy configs"
        " it ships talk plaintext to it. The gRPC health and admin ports stay plaintext"
        " (docs/security.md)",
    )
    net.add_argument(
        "--cert-path",
        metavar="DIR",
        help="with --secure-serving: the directory holding tls.crt and tls.key (PEM, a"
        " kubernetes.io/tls Secret's layout); without it a self-signed certificate is made"
        " at start-up",
    )
    net.add_argument(
        "--enable-cert-reload",
        action="store_true",
        help="with --cert-path: a renewed tls.crt/tls.key serves new connections without a"
        " restart (an invalid pair is logged and the previous one kept)",
    )
    net.add_argument(
        "--shutdown-grace",
        type=_duration_or_zero,
        default=defaults.SHUTDOWN_GRACE.text,
        metavar="DURATION",
        help="on SIGTERM, how long open streams may take to finish",
    )
    req = serve.add_argument_group("requests")
    req.add_argument(
        "--max-body-bytes",
        type=_positive,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies are refused with 413",
    )
    req.add_argument(
        "--max-concurrent-streams",
        type=_non_negative,
        default=defaults.MAX_CONCURRENT_STREAMS,
        metavar="N",
        help="ext_proc streams (requests in the EPP's hands, response included) served at"
        " once; a request beyond it is answered 503 at once, whatever Envoy's"
        " failure_mode_allow (0: no limit)",
    )
    req.add_argument(
        "--lean-completion-timeout",
        type=_positive_seconds,
        default=DEFAULT_TIMEOUT_S,
        metavar="SECONDS",
        help="lean mode (Envoy sends no response to the EPP, see"
        " manifests/envoy/envoy-lean.yaml): a routed request whose access-log entry has not"
        " come after this long is ended as aborted, releasing its in-flight count",
    )
    met = serve.add_argument_group(
        "model-server metrics (read by load-aware plugins; scraped only when a plugin needs them)"
    )
    met.add_argument(
        "--refresh-metrics-interval",
        type=_duration,
        default=defaults.REFRESH_METRICS_INTERVAL.text,
        metavar="DURATION",
        help="how often each endpoint's /metrics is scraped (GIE's flag; 50ms, 1s, ...)",
    )
    met.add_argument(
        "--metrics-staleness-threshold",
        type=_duration,
        default=defaults.METRICS_STALENESS_THRESHOLD.text,
        metavar="DURATION",
        help="metrics older than this are stale: plugins score the endpoint neutrally;"
        " a server that has answered no scrape for this long is down (no candidate)",
    )
    met.add_argument(
        "--metrics-scrape-timeout",
        type=_duration,
        default=defaults.METRICS_SCRAPE_TIMEOUT.text,
        metavar="DURATION",
        help="a scrape with no complete answer by then has failed",
    )
    met.add_argument(
        "--stall-threshold",
        type=_duration_or_zero,
        default=defaults.STALL_THRESHOLD.text,
        metavar="DURATION",
        help="a pod where a request has waited this long for its first token, with no"
        " first token or completed request there for as long, is stalled: no candidate"
        " for a while (a hung engine behind a server that still answers; 0: never)",
    )
    obs = serve.add_argument_group("observability")
    obs.add_argument(
        "--debug-endpoints",
        action="store_true",
        help="serve /debug/endpoints, /debug/explain and /debug/memory on the admin port",
    )
    obs.add_argument(
        "--trace-memory",
        type=_positive,
        default=0,
        metavar="FRAMES",
        help="trace Python allocations (tracemalloc, FRAMES frames each) so that"
        " /debug/memory?sites=N lists the source lines holding the most memory; costs"
        " CPU and memory, for finding what grows (needs --debug-endpoints)",
    )
    obs.add_argument("--log-format", choices=["text", "json"], default=defaults.LOG_FORMAT)
    obs.add_argument(
        "-v",
        "--v",
        dest="verbosity",
        type=int,
        default=defaults.LOG_VERBOSITY,
        metavar="N",
        help="log verbosity: 1 warnings, 2 info, 3 one line per request, 4+ debug",
    )
    obs.add_argument(
        "--log-prompts",
        action="store_true",
        help="include prompts in per-request log lines (off: prompts never reach the logs)",
    )
    obs.add_argument(
        "--score-header",
        action="store_true",
        help="debugging: add x-epp-scores to every response, each candidate's total score"
        " (the picked one marked *); needs Envoy to send response headers to the EPP",
    )

    validate = commands.add_parser(
        "validate",
        help="check an EndpointPickerConfig file",
        description="Check a config file and print every error with its place in the file.",
    )
    validate.add_argument("file", metavar="FILE")
    return parser


class UsageError(Exception):
    """A combination of `epp serve` flags that cannot work; the message says why."""


def serve_options(args: argparse.Namespace) -> ServeOptions:
    """`epp serve`'s options from its parsed flags; `UsageError` listing every
    problem with their combination."""
    problems: list[str] = []
    if args.config_file and args.config_text:
        problems.append("give --config or --config-text, not both")
    kube = kube_options(args)
    if kube is None and args.endpoints_file is not None:
        # Kubernetes-only flags beside an endpoints file would silently do nothing.
        stray = [
            flag
            for flag, value in (
                ("--kubeconfig", args.kubeconfig),
                ("--kv-events-port", args.kv_events_port),
                ("--kv-events-replay-port", args.kv_events_replay_port),
            )
            if value is not None
        ]
        if stray:
            problems.append(
                f"{', '.join(stray)}: for Kubernetes discovery only (--pool-name, or"
                " --endpoint-selector with --endpoint-target-ports); an endpoints file names"
                " its own KV-event sockets"
            )
    if (kube is None) == (args.endpoints_file is None):
        problems.append(
            "give exactly one endpoint source: --endpoints-file FILE, or Kubernetes"
            " (--pool-name NAME, or --endpoint-selector k=v,... with --endpoint-target-ports"
            " PORT)" + ("; both were given" if kube is not None else "")
        )
    elif kube is not None:
        problems.extend(kube.check())
    if args.cert_path and not args.secure_serving:
        problems.append(
            "--cert-path is only read with --secure-serving (this EPP serves plaintext"
            " unless told, unlike GIE's): add --secure-serving"
        )
    if args.enable_cert_reload and not args.cert_path:
        problems.append(
            "--enable-cert-reload needs --cert-path (a self-signed certificate is never renewed)"
        )
    if args.trace_memory and not args.debug_endpoints:
        problems.append(
            "--trace-memory needs --debug-endpoints (its readings are served at /debug/memory)"
        )
    elif args.trace_memory > MAX_FRAMES:
        problems.append(
            f"--trace-memory keeps at most {MAX_FRAMES} frames, got {args.trace_memory}"
        )
    if problems:
        raise UsageError("\n".join(problems))
    return ServeOptions(
        endpoints_file=args.endpoints_file,
        kube=kube,
        config_file=args.config_file,
        config_text=args.config_text,
        bind=args.bind,
        grpc_port=args.grpc_port,
        grpc_health_port=args.grpc_health_port,
        metrics_port=args.metrics_port,
        debug_endpoints=args.debug_endpoints,
        trace_memory_frames=args.trace_memory,
        max_body_bytes=args.max_body_bytes,
        log_prompts=args.log_prompts,
        score_header=args.score_header,
        lean_completion_timeout_s=args.lean_completion_timeout,
        refresh_metrics_interval_s=args.refresh_metrics_interval,
        metrics_staleness_threshold_s=args.metrics_staleness_threshold,
        metrics_scrape_timeout_s=args.metrics_scrape_timeout,
        stall_threshold_s=args.stall_threshold,
        tokenizer_dirs=tuple(args.tokenizer_dirs or ()),
        config_reload_interval_s=args.config_reload_interval,
        config_drain_timeout_s=args.config_drain_timeout,
        shutdown_grace_s=args.shutdown_grace,
        secure_serving=args.secure_serving,
        cert_path=args.cert_path,
        enable_cert_reload=args.enable_cert_reload,
        max_concurrent_streams=args.max_concurrent_streams,
    )


def _serve(args: argparse.Namespace) -> int:
    setup_logging(args.log_format, args.verbosity)
    try:
        options = serve_options(args)
    except UsageError as exc:
        for problem in str(exc).splitlines():
            log.error("%s", problem)
        return 2

    if options.trace_memory_frames:
        # Before the app is built, so that what it allocates at start-up is traced.
        start_tracing(options.trace_memory_frames)

    async def run() -> None:
        app = EppApp(options)
        await app.serve_forever()

    try:
        asyncio.run(run())
    except StartupError as exc:
        log.error("cannot start:\n%s", exc)
        return 1
    except OSError as exc:
        log.error("cannot start: %s", exc)
        return 1
    return 0


def _validate(args: argparse.Namespace) -> int:
    try:
        config = load_config_file(args.file, PluginRegistry.from_entry_points())
    except InvalidConfig as exc:
        print(exc, file=sys.stderr)
        return 1
    for warning in config.warnings:
        print(f"{args.file}: warning: {warning}", file=sys.stderr)
    scheduler = config.scheduler
    profiles = ", ".join(
        f"{name} ({len(p.filters)} filters, {len(p.scorers)} scorers, picker {p.picker.name})"
        for name, p in scheduler.profiles.items()
    )
    print(f"{args.file}: valid; {len(config.plugins)} plugins; profiles: {profiles}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    return _validate(args)
