"""`python -m bench`: the routing benchmark, the demo, the overhead benchmark.

python -m bench run        a workload through routing policies to a simulated fleet
python -m bench lab        routing policies against a simulated fleet in virtual time
python -m bench demo       Envoy + EPP + 4 simulated pods: round-robin vs the others
python -m bench overhead   what the EPP adds per request, through real Envoy
python -m bench churn      time from a pod change in the Kubernetes API to routing
python -m bench agreement  two EPP replicas behind one Envoy: do they pick the same pod?
python -m bench soak       a long steady load with pod restarts: memory, index, latency drift
python -m bench peers      install the peer routers (sglang-router, vllm-router)
"""

from __future__ import annotations

import argparse
import math
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.client import Arrivals


def _rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a list of rates: {text!r}") from exc
    if not rates or any(r <= 0 or math.isnan(r) for r in rates):
        raise argparse.ArgumentTypeError("rates must be > 0 (inf: all at once)")
    return rates


def _rate(text: str) -> float:
    (rate,) = _rates(text)
    return rate


def _load(text: str) -> float:
    try:
        load = float(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a load: {text!r}") from exc
    if not (load > 0 and math.isfinite(load)):
        raise argparse.ArgumentTypeError("a load is a finite multiple of capacity > 0")
    return load


def add_run_parser(commands: Any) -> None:
    from bench.workloads import LAB_WORKLOADS, WORKLOADS, add_shape_arguments

    run = commands.add_parser(
        "run",
        help="drive a workload through routing policies to a simulated fleet",
        description="Drive a workload through each policy (an EndpointPickerConfig file,"
        " through real Envoy + EPP; or a peer router: sglang-router, vllm-router) to a fresh"
        " fleet of simulated vLLM pods, and write results.json, report.md and plots."
        " Rates and times are in simulated seconds.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run.add_argument(
        "--workload",
        choices=WORKLOADS + LAB_WORKLOADS,
        default="shared-prefix",
        help="tenants: two tenants, three objectives, one burst, for flow control"
        " (docs/flow-control.md); each request carries its objective and fairness-id"
        " headers; give it --load (or --rate)",
    )
    run.add_argument(
        "--policy",
        action="append",
        dest="policies",
        metavar="SPEC",
        help="a config file or a name in manifests/config/ (round-robin, random, ...), or"
        " sglang-router / vllm-router[:policy]; repeat for several (default: round-robin,"
        " random)",
    )
    load = run.add_mutually_exclusive_group()
    load.add_argument("--rate", type=_rate, help="open-loop Poisson rate (requests/s; inf)")
    load.add_argument(
        "--rates", type=_rates, help="a ladder of rates, e.g. 2,4,8 (each rung from cold)"
    )
    load.add_argument("--concurrency", type=int, help="closed loop with this many clients")
    load.add_argument(
        "--load",
        type=_load,
        metavar="F",
        help="offered load as F times the fleet's capacity with no cache hits, the lab's"
        " (docs/lab.md#capacity, computed for these --pods and this workload; 1.5: 150%%);"
        " the tenants and trace workloads keep their own arrival pattern, scaled in time"
        " to that mean rate, the others get Poisson arrivals at it. With --rate instead,"
        " tenants and trace timestamps are scaled to that rate",
    )
    run.add_argument(
        "--burst",
        type=int,
        default=1,
        metavar="N",
        help="with --rate/--rates: sessions arrive N at the same instant, the bursts a"
        " Poisson process of rate / N (same mean rate)",
    )
    run.add_argument("--pods", type=int, default=8, help="simulated pods")
    run.add_argument(
        "--prefill-pods",
        type=int,
        default=0,
        metavar="N",
        help="a prefill/decode fleet: pods 0..N-1 get the llm-d.ai/role prefill, the others"
        " decode (labels in the EPP's endpoints file; P/D configs such as llm-d-pd use them,"
        " other policies ignore them); 0: no roles (docs/disaggregation.md)",
    )
    run.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="wall seconds per simulated second (above 1: slower than real time)",
    )
    run.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    run.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="N",
        help="run every policy N times per rung, each from cold, the order of the policies"
        " alternating (A B C, C B A, ...); results are the means with 95%% confidence"
        " intervals",
    )
    run.add_argument("--out", type=Path, default=Path("out/bench"), help="output directory")
    add_shape_arguments(run)
    fleet = run.add_argument_group("fleet and data path")
    fleet.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer directory for pods and workload ('builtin': the simulator's own;"
        " default: the Qwen2.5 one of ../shared/testdata when present)",
    )
    fleet.add_argument("--block-size", type=int, default=16)
    fleet.add_argument("--num-gpu-blocks", type=int, help="KV blocks per pod (default: sim's)")
    fleet.add_argument(
        "--sim-arg", action="append", default=[], metavar="ARG", help="extra pod option"
    )
    fleet.add_argument(
        "--epp-arg", action="append", default=[], metavar="ARG", help="extra `epp serve` option"
    )
    fleet.add_argument(
        "--request-timeout", type=float, default=600.0, help="per request (simulated s)"
    )
    fleet.add_argument(
        "--wall-clock-ttl",
        action="store_true",
        help="keep a config's durations on the EPP's clock (flow control's defaultRequestTTL"
        " and noEndpointRequestTTL, the predicted-ttft-scorer's workWeightBusyForS) in wall"
        " seconds as written; by default they are multiplied by --time-scale, so that a"
        " request may wait as many simulated seconds as the config says (the EPP runs on"
        " wall time, the pods --time-scale times slower)",
    )
    fleet.add_argument(
        "--max-error-rate",
        type=float,
        default=0.05,
        help="a policy with a larger share of failed requests is marked failed",
    )
    fleet.add_argument("--no-progress", action="store_true", help="no progress bar")


def arrivals_from_args(args: argparse.Namespace) -> list[Arrivals]:
    """The load ladder `bench run`'s flags ask for; ValueError when they do not fit
    the workload. Workloads with arrival times of their own (trace, tenants) keep
    them, scaled to --rate or --load; the tenants workload's burst is in its
    arrival times, so it needs one of the two."""
    from bench.client import ArrivalKind, Arrivals

    timed = args.workload in ("trace", "tenants")
    if timed and args.burst > 1:
        raise ValueError(
            f"--burst shapes Poisson arrivals; the {args.workload} workload keeps its own"
        )
    if timed and args.concurrency is not None:
        raise ValueError(
            f"the {args.workload} workload keeps its own arrival times: give --load or --rate,"
            " not --concurrency"
        )
    kind: ArrivalKind = "trace" if timed else "poisson"
    if args.load is not None:
        return [Arrivals(kind, load=args.load, burst=args.burst)]
    if args.rates is not None:
        return [Arrivals(kind, rate=r, burst=args.burst) for r in args.rates]
    if args.rate is not None:
        return [Arrivals(kind, rate=args.rate, burst=args.burst)]
    if args.concurrency is not None:
        return [Arrivals("closed", concurrency=args.concurrency)]
    if args.workload == "trace":
        return [Arrivals("trace")]
    if args.workload == "tenants":
        raise ValueError("the tenants workload needs --load F (F x the fleet's capacity) or --rate")
    raise ValueError("give --rate, --rates, --load or --concurrency")


def run_command(args: argparse.Namespace, argv: list[str]) -> int:
    from bench.runner import (
        RunOptions,
        check_prefill_pods,
        resolve_policy,
        run_benchmark,
        unique_names,
    )
    from bench.workloads import spec_from_args, tokenizer_from_arg

    try:
        spec = spec_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print("error: --repeats must be at least 1", file=sys.stderr)
        return 2
    if args.burst < 1:
        print("error: --burst must be at least 1", file=sys.stderr)
        return 2
    if args.pods < 1:
        print("error: --pods must be at least 1", file=sys.stderr)
        return 2
    try:
        check_prefill_pods(args.prefill_pods, args.pods)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.burst > 1 and args.rate is None and args.rates is None and args.load is None:
        print(
            "error: --burst shapes Poisson arrivals: give --rate, --rates or --load",
            file=sys.stderr,
        )
        return 2
    try:
        ladder = arrivals_from_args(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        policies = unique_names(
            [resolve_policy(p) for p in args.policies or ["round-robin", "random"]]
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    tokenizer = tokenizer_from_arg(args.tokenizer)
    options = RunOptions(
        out=args.out,
        workload=spec,
        policies=policies,
        ladder=ladder,
        pods=args.pods,
        time_scale=args.time_scale,
        tokenizer=tokenizer,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        sim_args=args.sim_arg,
        epp_args=args.epp_arg,
        seed=args.seed,
        request_timeout_s=args.request_timeout,
        max_error_rate=args.max_error_rate,
        progress=not args.no_progress and sys.stderr.isatty(),
        command="python -m bench " + shlex.join(argv),
        repeats=args.repeats,
        prefill_pods=args.prefill_pods,
        scale_ttl=not args.wall_clock_ttl,
    )
    try:
        document = run_benchmark(options)
    except KeyboardInterrupt:
        print("\ninterrupted: everything started was stopped", file=sys.stderr)
        return 130
    except ValueError as exc:
        # A setup that cannot measure what it is asked (a timeout shorter than
        # flow control's TTL, ...): said before anything runs.
        print(f"error: {exc}", file=sys.stderr)
        return 2
    failed = [n for n, r in document["policies"].items() if r["status"] == "failed"]
    print(f"results: {args.out / 'results.json'}, report: {args.out / 'report.md'}")
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_run_parser(commands)

    demo = commands.add_parser(
        "demo",
        help="start Envoy + EPP + simulated pods, compare policies on a short workload",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    demo.add_argument("--out", type=Path, default=Path("out/demo"), help="output directory")
    demo.add_argument(
        "--policy",
        action="append",
        dest="policies",
        metavar="SPEC",
        help="policies to compare (default: bench/demo.py DEMO_POLICIES)",
    )
    demo.add_argument("--keep-running", action="store_true", help="keep the stack up until Ctrl-C")

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

    commands.add_parser("peers", help="install the peer routers into .venv-peers")

    # Imported for its parser only; the benchmark's own imports wait for its command.
    from bench import agreement, churn, soak
    from bench.lab import cli as lab

    lab.add_parser(commands)
    churn.add_parser(commands)
    agreement.add_parser(commands)
    soak.add_parser(commands)

    args = parser.parse_args(argv)
    if args.command == "run":
        return run_command(args, argv)
    if args.command == "lab":
        return lab.command(args, argv)
    if args.command == "churn":
        return churn.command(args, argv)
    if args.command == "agreement":
        return agreement.command(args, argv)
    if args.command == "soak":
        return soak.command(args, argv)
    if args.command == "peers":
        from bench.peers import ensure_peer_venv

        print(f"peer routers ready in {ensure_peer_venv()}")
        return 0
    if args.command == "overhead":
        from bench.overhead import OverheadOptions, report, run_overhead

        results = run_overhead(
            OverheadOptions(
                out_dir=args.out,
                requests_c1=args.requests_c1,
                requests_c32=args.requests_c32,
                rounds=args.rounds,
                throughput_requests=args.throughput_requests,
                throughput_concurrency=args.throughput_concurrency,
                prompt_bytes=args.prompt_bytes,
                command="python -m bench " + shlex.join(argv),
            )
        )
        print(report(results))
        print(f"results: {args.out / 'overhead.json'}, {args.out / 'overhead.md'}")
        return 0
    from bench.demo import run_demo

    return run_demo(args.out, args.policies, args.keep_running)


if __name__ == "__main__":
    sys.exit(main())
