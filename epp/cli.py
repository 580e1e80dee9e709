"""Command line: `epp serve`, `epp validate`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Sequence

from epp import __version__
from epp.app import EppApp, ServeOptions, StartupError
from epp.completion import DEFAULT_TIMEOUT_S
from epp.config import InvalidConfig, load_config_file
from epp.durations import parse_duration
from epp.extproc.stream import DEFAULT_MAX_BODY_BYTES
from epp.logs import setup_logging
from epp.scheduling.registry import PluginRegistry

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
    src = serve.add_argument_group("endpoints")
    src.add_argument(
        "--endpoints-file",
        metavar="FILE",
        required=True,
        help="YAML list of the pool's endpoints, re-read when it changes",
    )
    net = serve.add_argument_group("network")
    net.add_argument("--bind", default="0.0.0.0", help="address to listen on")
    net.add_argument("--grpc-port", type=_port, default=9002, help="ext_proc gRPC port")
    net.add_argument(
        "--grpc-health-port", type=_port, default=9003, help="gRPC health-checking port"
    )
    net.add_argument(
        "--metrics-port",
        type=_port,
        default=9090,
        help="admin HTTP port: /metrics, /healthz, /readyz",
    )
    req = serve.add_argument_group("requests")
    req.add_argument(
        "--max-body-bytes",
        type=_positive,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies are refused with 413",
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
        default="50ms",
        metavar="DURATION",
        help="how often each endpoint's /metrics is scraped (GIE's flag; 50ms, 1s, ...)",
    )
    met.add_argument(
        "--metrics-staleness-threshold",
        type=_duration,
        default="2s",
        metavar="DURATION",
        help="metrics older than this are stale: plugins score the endpoint neutrally",
    )
    met.add_argument(
        "--metrics-scrape-timeout",
        type=_duration,
        default="1s",
        metavar="DURATION",
        help="a scrape with no complete answer by then has failed",
    )
    obs = serve.add_argument_group("observability")
    obs.add_argument(
        "--debug-endpoints",
        action="store_true",
        help="serve /debug/endpoints and /debug/explain on the admin port",
    )
    obs.add_argument("--log-format", choices=["text", "json"], default="text")
    obs.add_argument(
        "-v",
        "--v",
        dest="verbosity",
        type=int,
        default=2,
        metavar="N",
        help="log verbosity: 1 warnings, 2 info, 3 one line per request, 4+ debug",
    )
    obs.add_argument(
        "--log-prompts",
        action="store_true",
        help="include prompts in per-request log lines (off: prompts never reach the logs)",
    )

    validate = commands.add_parser(
        "validate",
        help="check an EndpointPickerConfig file",
        description="Check a config file and print every error with its place in the file.",
    )
    validate.add_argument("file", metavar="FILE")
    return parser


def _serve(args: argparse.Namespace) -> int:
    setup_logging(args.log_format, args.verbosity)
    if args.config_file and args.config_text:
        log.error("give --config or --config-text, not both")
        return 2
    options = ServeOptions(
        endpoints_file=args.endpoints_file,
        config_file=args.config_file,
        config_text=args.config_text,
        bind=args.bind,
        grpc_port=args.grpc_port,
        grpc_health_port=args.grpc_health_port,
        metrics_port=args.metrics_port,
        debug_endpoints=args.debug_endpoints,
        max_body_bytes=args.max_body_bytes,
        log_prompts=args.log_prompts,
        lean_completion_timeout_s=args.lean_completion_timeout,
        refresh_metrics_interval_s=args.refresh_metrics_interval,
        metrics_staleness_threshold_s=args.metrics_staleness_threshold,
        metrics_scrape_timeout_s=args.metrics_scrape_timeout,
    )

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
