"""`python -m sim serve --port P`: one simulated vLLM pod."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from sim.server import SimConfig, serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sim", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    pod = commands.add_parser(
        "serve",
        help="run one simulated vLLM pod",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    pod.add_argument("--host", default="127.0.0.1")
    pod.add_argument("--port", type=int, required=True)
    pod.add_argument("--name", default=None, help="pod name (x-sim-pod header); default sim-PORT")
    pod.add_argument("--model", default="sim-model", help="served model name")
    pod.add_argument("--output-tokens", type=int, default=8, help="tokens per response")
    pod.add_argument("--token-delay", type=float, default=0.0, help="seconds per output token")
    args = parser.parse_args(argv)

    config = SimConfig(
        name=args.name or f"sim-{args.port}",
        model=args.model,
        output_tokens=args.output_tokens,
        token_delay_s=args.token_delay,
    )

    async def run() -> None:
        runner = await serve(config, args.host, args.port)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        print(f"sim pod {config.name} serving on {args.host}:{args.port}", flush=True)
        await stop.wait()
        await runner.cleanup()

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
