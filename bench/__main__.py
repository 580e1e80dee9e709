"""`python -m bench`: benchmarks and the demo.

python -m bench overhead   what the EPP adds per request, through real Envoy
python -m bench demo       Envoy + EPP + simulated pods, one request routed
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    overhead = commands.add_parser(
        "overhead",
        help="latency the EPP adds (Envoy direct vs Envoy + EPP) and its throughput",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    overhead.add_argument("--out", type=Path, default=Path("out/overhead"), help="output directory")
    overhead.add_argument(
        "--requests-c1", type=int, default=3000, help="requests per path at concurrency 1"
    )
    overhead.add_argument(
        "--requests-c32", type=int, default=12000, help="requests per path at concurrency 32"
    )
    overhead.add_argument("--rounds", type=int, default=3, help="alternating rounds per path")
    overhead.add_argument("--throughput-requests", type=int, default=20000)
    overhead.add_argument("--throughput-concurrency", type=int, default=64)
    overhead.add_argument(
        "--prompt-bytes", type=int, default=200, help="prompt size of each request"
    )

    demo = commands.add_parser("demo", help="start Envoy + EPP + simulated pods and route requests")
    demo.add_argument("--out", type=Path, default=Path("out/demo"), help="logs directory")
    demo.add_argument("--pods", type=int, default=3, help="simulated pods")
    demo.add_argument("--keep-running", action="store_true", help="keep the stack up until Ctrl-C")

    args = parser.parse_args(argv)
    if args.command == "overhead":
        from bench.overhead import OverheadOptions, run_overhead

        results = run_overhead(
            OverheadOptions(
                out_dir=args.out,
                requests_c1=args.requests_c1,
                requests_c32=args.requests_c32,
                rounds=args.rounds,
                throughput_requests=args.throughput_requests,
                throughput_concurrency=args.throughput_concurrency,
                prompt_bytes=args.prompt_bytes,
            )
        )
        from bench.overhead import report

        print(report(results))
        print(f"results: {args.out / 'overhead.json'}, {args.out / 'overhead.md'}")
        return 0
    from bench.demo import run_demo

    return run_demo(args.out, args.pods, args.keep_running)


if __name__ == "__main__":
    sys.exit(main())
