"""Command line: `python -m sim serve ...` (one pod) and `python -m sim fleet ...` (N pods)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from sim.engine import EngineConfig
from sim.fleet import plan_fleet, run_fleet
from sim.hashing import EXTRA_KEYS_FORMATS, HASH_ALGOS, resolve_hash_seed
from sim.kv_events import EVENT_FORMATS
from sim.latency import LatencyModel
from sim.publisher import REPLAY_LAYOUTS
from sim.server import ROLES, SimConfig, SimPod

# Options the fleet sets for each pod itself.
FLEET_OWNED = ("--host", "--port", "--name", "--kv-events-port", "--replay-port", "--role")


def add_pod_options(parser: argparse.ArgumentParser) -> None:
    """Everything about one pod except where it listens."""
    api = parser.add_argument_group("model and API")
    api.add_argument(
        "--model",
        "--served-model-name",
        dest="model",
        default="sim-model",
        help="served model name",
    )
    api.add_argument(
        "--output-tokens",
        type=int,
        default=8,
        help="tokens generated when a request sets no max_tokens",
    )
    api.add_argument(
        "--tokenizer",
        default=None,
        metavar="DIR",
        help="directory with tokenizer.json + tokenizer_config.json (none: built-in tokenizer)",
    )
    api.add_argument("--chat-template", default=None, metavar="FILE", help="Jinja chat template")

    engine = parser.add_argument_group("engine (vLLM's meaning)")
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    engine.add_argument(
        "--num-gpu-blocks", "--num-gpu-blocks-override", dest="num_gpu_blocks", type=int,
        default=EngineConfig.num_gpu_blocks, help="KV blocks in the pool (block 0 is reserved)",
    )  # fmt: skip
    engine.add_argument(
        "--max-num-seqs",
        type=int,
        default=EngineConfig.max_num_seqs,
        help="running requests at most",
    )
    engine.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=EngineConfig.max_num_batched_tokens,
        help="tokens per engine step (longer prefills are chunked)",
    )
    engine.add_argument(
        "--max-model-len",
        type=int,
        default=EngineConfig.max_model_len,
        help="prompt + output at most",
    )
    engine.add_argument(
        "--hash-algo", "--prefix-caching-hash-algo", dest="hash_algo",
        choices=HASH_ALGOS, default="sha256", help="vLLM's --prefix-caching-hash-algo",
    )  # fmt: skip
    engine.add_argument(
        "--hash-seed",
        default=None,
        help="NONE_HASH seed (none: $PYTHONHASHSEED, else 'vllm-none-hash', as vLLM >= 0.29)",
    )
    engine.add_argument(
        "--extra-keys-format",
        choices=EXTRA_KEYS_FORMATS,
        default="tagged",
        help="cache_salt in block 0's hash: 'tagged' = vLLM >= 0.31, 'plain' = vLLM <= 0.30",
    )
    engine.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="wall seconds per simulated second (0.1: ten times faster than real time)",
    )

    events = parser.add_argument_group("KV events (need --kv-events-port)")
    events.add_argument(
        "--kv-events-format",
        choices=EVENT_FORMATS,
        default="map",
        help="'map' = vLLM >= 0.24, 'array' = vLLM <= 0.23 (0.22/0.23 fields)",
    )
    events.add_argument("--kv-events-topic", default="", help="ZMQ topic (vLLM's default: empty)")
    events.add_argument(
        "--kv-events-bytes-hashes",
        action="store_true",
        default=os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES") == "0",
        help="raw digest bytes instead of uint64 block hashes"
        " (set by default when VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0)",
    )
    events.add_argument(
        "--replay-layout",
        choices=REPLAY_LAYOUTS,
        default="current",
        help="'current' = vLLM >= 0.26 [topic, seq, payload]; 'legacy' = [seq, payload]",
    )
    events.add_argument(
        "--replay-buffer-steps", type=int, default=10_000, help="event batches kept for replay"
    )
    events.add_argument(
        "--kv-events-hwm",
        type=int,
        default=100_000,
        help="PUB high-water mark (vLLM's hwm): messages beyond it are dropped for a slow"
        " subscriber",
    )

    pd = parser.add_argument_group("prefill/decode disaggregation (docs/disaggregation.md)")
    pd.add_argument(
        "--kv-transfer-bandwidth",
        type=float,
        default=LatencyModel.kv_transfer_bandwidth,
        help="bytes/s a decode pod pulls a prefill pod's KV cache at (KV bytes per token"
        " are the model's: 128 KiB for Llama-3.1-8B)",
    )
    pd.add_argument(
        "--kv-transfer-latency",
        type=float,
        default=LatencyModel.kv_transfer_latency_s,
        help="simulated seconds each KV transfer costs on top of its bytes",
    )
    pd.add_argument(
        "--prefill-timeout",
        type=float,
        default=60.0,
        help="wall seconds the pod's sidecar waits for a prefill leg before it prefills"
        " the request itself",
    )

    knobs = parser.add_argument_group("test knobs")
    knobs.add_argument(
        "--metrics-delay", type=float, default=0.0, help="wall seconds /metrics waits"
    )
    knobs.add_argument("--log-level", default="WARNING", help="Python logging level")


def _serve_parser(prog: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Run one simulated vLLM pod. Durations are simulated seconds: the pod"
        " sleeps duration x --time-scale of wall time and reports simulated seconds"
        " (divide wall-clock measurements by the time scale).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    listen = parser.add_argument_group("listening")
    listen.add_argument("--host", default="127.0.0.1", help="HTTP and ZMQ bind address")
    listen.add_argument("--port", type=int, required=True, help="HTTP port")
    listen.add_argument("--name", default=None, help="pod name (x-sim-pod header); none: sim-PORT")
    listen.add_argument("--kv-events-port", type=int, default=None, help="KV-event PUB port")
    listen.add_argument("--replay-port", type=int, default=None, help="replay ROUTER port")
    listen.add_argument(
        "--role",
        choices=ROLES,
        default=None,
        help="the pod's llm-d.ai/role (none: no label, a pod serving whole requests)",
    )
    add_pod_options(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> SimConfig:
    if args.replay_port is not None and args.kv_events_port is None:
        raise SystemExit("--replay-port needs --kv-events-port")
    seed = args.hash_seed if args.hash_seed is not None else resolve_hash_seed(os.environ)
    if not args.prefill_timeout > 0:
        raise SystemExit("error: --prefill-timeout must be > 0")
    try:
        latency = LatencyModel(
            kv_transfer_bandwidth=args.kv_transfer_bandwidth,
            kv_transfer_latency_s=args.kv_transfer_latency,
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc
    try:
        engine = EngineConfig(
            block_size=args.block_size,
            num_gpu_blocks=args.num_gpu_blocks,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len,
            hash_algo=args.hash_algo,
            hash_seed=seed,
            extra_keys_format=args.extra_keys_format,
            time_scale=args.time_scale,
        )
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from exc
    return SimConfig(
        name=args.name or f"sim-{args.port}",
        model=args.model,
        output_tokens=args.output_tokens,
        tokenizer=args.tokenizer,
        chat_template=args.chat_template,
        engine=engine,
        kv_events_port=args.kv_events_port,
        replay_port=args.replay_port,
        zmq_host=args.host,
        kv_events_format=args.kv_events_format,
        kv_events_topic=args.kv_events_topic,
        int_block_hashes=not args.kv_events_bytes_hashes,
        replay_layout=args.replay_layout,
        replay_buffer_steps=args.replay_buffer_steps,
        kv_events_hwm=args.kv_events_hwm,
        metrics_delay_s=args.metrics_delay,
        role=args.role,
        prefill_timeout_s=args.prefill_timeout,
        latency=latency,
    )


async def _serve(config: SimConfig, host: str, port: int) -> None:
    pod = SimPod(config)
    await pod.start(host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    events = f", KV events on {pod.kv_events_endpoint}" if pod.kv_events_endpoint else ""
    replay = f", replay on {pod.replay_endpoint}" if pod.replay_endpoint else ""
    print(f"sim pod {config.name} serving on {host}:{pod.port}{events}{replay}", flush=True)
    try:
        await stop.wait()
    finally:
        await pod.stop()


def serve_main(argv: Sequence[str]) -> int:
    args = _serve_parser("python -m sim serve").parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
    config = config_from_args(args)
    asyncio.run(_serve(config, args.host, args.port))
    return 0


def fleet_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sim fleet",
        description="Run N simulated vLLM pods and write their endpoints file. Any other"
        " option is passed to every pod (see `python -m sim serve --help`).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--n", type=int, required=True, help="number of pods")
    parser.add_argument("--base-port", type=int, required=True, help="HTTP port of pod 0")
    parser.add_argument("--endpoints-file", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--kv-events-base-port", type=int, default=None, help="none: base-port + n")
    parser.add_argument("--replay-base-port", type=int, default=None, help="none: base-port + 2n")
    parser.add_argument("--no-kv-events", action="store_true", help="pods publish no KV events")
    parser.add_argument("--name-prefix", default="sim")
    parser.add_argument(
        "--prefill-pods",
        type=int,
        default=0,
        metavar="N",
        help="a P/D fleet: pods 0..N-1 get the llm-d.ai/role prefill, the others decode"
        " (0: no roles, no labels)",
    )
    parser.add_argument("--log-dir", type=Path, default=None, help="one log file per pod")
    args, serve_args = parser.parse_known_args(argv)
    owned = [a for a in serve_args if a.split("=", 1)[0] in FLEET_OWNED]
    if owned:
        parser.error(f"the fleet sets {', '.join(owned)} for each pod itself")
    # Check the pod options here, so a typo fails before any pod starts.
    _serve_parser("python -m sim fleet").parse_args(["--port", "1", *serve_args])
    try:
        pods = plan_fleet(
            args.n,
            args.base_port,
            args.kv_events_base_port,
            args.replay_base_port,
            args.name_prefix,
            kv_events=not args.no_kv_events,
            prefill_pods=args.prefill_pods,
        )
    except ValueError as exc:
        parser.error(str(exc))
    return run_fleet(pods, args.host, args.endpoints_file, serve_args, args.log_dir)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    usage = (
        "usage: python -m sim serve --port P [options]   (one pod; serve --help)\n"
        "       python -m sim fleet --n N --base-port P --endpoints-file OUT [serve options]\n"
        "       python -m sim kubeapi [--port P --pods N --pool NAME ...]   (kubeapi --help)"
    )
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "serve":
        return serve_main(rest)
    if command == "fleet":
        return fleet_main(rest)
    if command == "kubeapi":
        # Imported here: the pods' own start-up does not need it.
        from sim.kubeapi import main as kubeapi_main

        return kubeapi_main(rest)
    print(f"unknown command {command!r}\n{usage}", file=sys.stderr)
    return 2
