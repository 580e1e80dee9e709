"""`python -m bench lab`: routing policies against a simulated fleet in virtual time."""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.lab.epp import Delays

DEFAULT_POLICIES = ("round-robin", "gie-default", "default")
# Each of `Delays`'s fields as a flag: (flag, field, help).
DELAY_FLAGS = (
    ("--route-delay", "route_s", "through Envoy and the EPP"),
    ("--route-delay-per-token", "route_per_token_s", "per prompt token the EPP tokenizes"),
    ("--peer-route-delay", "peer_route_s", "through a peer router's model"),
    ("--pod-overhead", "pod_overhead_s", "in the pod before the engine takes the request"),
    (
        "--pod-overhead-per-token",
        "pod_overhead_per_token_s",
        "per prompt token the pod's prefix cache does not hold",
    ),
    ("--response-delay", "response_s", "first and last token to the client"),
    ("--kv-event-delay", "kv_event_s", "a step's KV events to the precise index"),
    ("--metrics-interval", "metrics_interval_s", "between two scrapes of a pod"),
    ("--metrics-latency", "metrics_latency_s", "a scrape to the datastore"),
)


def add_parser(commands: Any) -> None:
    from bench.workloads import LAB_WORKLOADS, WORKLOADS, add_shape_arguments

    lab = commands.add_parser(
        "lab",
        help="routing policies against a simulated fleet in virtual time (fast, deterministic)",
        description="Run each policy (an EndpointPickerConfig file, through the EPP's real"
        " scheduling code) on a fresh simulated fleet in virtual time, once per seed, and"
        " write results.json (mean and 95%% CI over seeds), report.md and plots. One"
        " process, no sockets: a seed gives the same results every time.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    lab.add_argument(
        "--workload",
        choices=WORKLOADS + LAB_WORKLOADS,
        default="shared-prefix",
        help="tenants: two tenants, three priorities, one burst, for flow control"
        " (docs/flow-control.md)",
    )
    lab.add_argument(
        "--policy",
        action="append",
        dest="policies",
        metavar="SPEC",
        help="a config file, a name in manifests/config/ (gie-default,"
        " llm-d-optimized-baseline, default, precise-prefix, ...) or a peer's model"
        " (sglang-cache-aware, dynamo-kv); repeat for several"
        f" (default: {', '.join(DEFAULT_POLICIES)})",
    )
    load = lab.add_mutually_exclusive_group()
    load.add_argument(
        "--load",
        type=float,
        help="offered load as a fraction of the fleet's capacity with no cache hits"
        " (docs/lab.md); traces are sped up or slowed down to it (default 0.8, or the"
        " trace's own timestamps)",
    )
    load.add_argument("--rate", type=float, help="open-loop Poisson rate (requests/s)")
    lab.add_argument(
        "--burst",
        type=int,
        default=1,
        metavar="N",
        help="sessions arrive N at the same instant, the bursts a Poisson process of"
        " rate / N (same mean rate); not for a trace",
    )
    lab.add_argument("--pods", type=int, default=16, help="simulated pods")
    lab.add_argument(
        "--epp-replicas",
        type=int,
        default=1,
        metavar="N",
        help="EPP replicas behind Envoy, each with its own state (in-flight counts,"
        " approximate index, KV-event subscriptions), requests split between them in"
        " turn; the peers' models stay one router",
    )
    lab.add_argument(
        "--prefill-pods",
        type=int,
        default=0,
        metavar="N",
        help="a prefill/decode fleet: N of the --pods get the llm-d.ai/role prefill, the"
        " others decode (0: no roles, every pod serves whole requests); run it with a P/D"
        " config such as llm-d-pd (docs/disaggregation.md)",
    )
    lab.add_argument(
        "--prefill-role",
        choices=("prefill", "prefill-decode"),
        default="prefill",
        help="the role of the --prefill-pods: prefill (they only prefill) or"
        " prefill-decode (they may also serve whole requests, so all --pods may be"
        " given it)",
    )
    lab.add_argument("--seed", type=int, default=0, help="first seed")
    lab.add_argument("--seeds", type=int, default=5, help="seeds: --seed, --seed + 1, ...")
    lab.add_argument("--out", type=Path, default=Path("out/lab"), help="output directory")
    add_shape_arguments(lab)
    engine = lab.add_argument_group("engine")
    engine.add_argument("--block-size", type=int, default=16)
    engine.add_argument("--num-gpu-blocks", type=int, help="KV blocks per pod (default: sim's)")
    engine.add_argument("--max-num-seqs", type=int, help="default: sim's")
    engine.add_argument("--max-model-len", type=int, help="default: sim's")
    engine.add_argument(
        "--restarts",
        type=int,
        default=0,
        help="pod restarts, evenly spaced over the arrivals, the pods taken in a seeded"
        " order: a restarted pod's requests in flight fail (the client sends each again"
        " at once) and its cache starts empty, while it stays in the pool (an engine"
        " that restarts faster than the pod watcher sees, or a pool from an endpoints"
        " file); not with --prefill-pods (default: 0)",
    )
    defaults = Delays()
    delays = lab.add_argument_group("what the EPP sees, and how late (virtual seconds)")
    for flag, field, help_text in DELAY_FLAGS:
        delays.add_argument(
            flag, type=float, dest=field, default=getattr(defaults, field), help=help_text
        )
    lab.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer directory ('builtin': the simulator's own; default: the Qwen2.5 one"
        " of ../shared/testdata when present)",
    )
    lab.add_argument(
        "--save-requests",
        action="store_true",
        help="also write every run's requests, one JSON line each (the fields of bench"
        " run's requests.jsonl, in virtual seconds), to OUT/requests/POLICY-seedN.jsonl:"
        " for studies of single requests (which pod each went to, which ended the run)",
    )
    lab.add_argument("--no-progress", action="store_true", help="no progress bar")


def command(args: argparse.Namespace, argv: Sequence[str]) -> int:
    from bench.lab.run import FleetSpec, LabOptions, run_lab

    problems = []
    if args.pods < 1:
        problems.append("--pods must be at least 1")
    if args.seeds < 1:
        problems.append("--seeds must be at least 1")
    if args.epp_replicas < 1:
        problems.append("--epp-replicas must be at least 1")
    most = args.pods if args.prefill_role == "prefill-decode" else args.pods - 1
    if not 0 <= args.prefill_pods <= max(most, 0):
        problems.append(
            "--prefill-pods must be at least 0 and fewer than --pods (at most --pods with"
            " --prefill-role prefill-decode)"
        )
    if args.restarts < 0:
        problems.append("--restarts must be at least 0")
    elif args.restarts and args.prefill_pods:
        problems.append("--restarts are not modelled in a P/D fleet (--prefill-pods)")
    if args.burst < 1:
        problems.append("--burst must be at least 1")
    elif args.burst > 1 and args.workload == "trace":
        problems.append("--burst shapes Poisson arrivals; a trace keeps its own")
    for name in ("load", "rate"):
        value = getattr(args, name)
        if value is not None and not (value > 0 and math.isfinite(value)):
            problems.append(f"--{name} must be a finite number > 0")
    try:
        from bench.workloads import spec_from_args, tokenizer_from_arg

        spec = spec_from_args(args)
        delays = Delays(**{field: getattr(args, field) for _, field, _ in DELAY_FLAGS})
        from sim.engine import EngineConfig

        engine_args: dict[str, Any] = {"block_size": args.block_size}
        for flag in ("num_gpu_blocks", "max_num_seqs", "max_model_len"):
            if getattr(args, flag) is not None:
                engine_args[flag] = getattr(args, flag)
        engine = EngineConfig(**engine_args)
    except ValueError as exc:
        problems.append(str(exc))
    if problems:
        for problem in problems:
            print(f"error: {problem}", file=sys.stderr)
        return 2
    tokenizer = tokenizer_from_arg(args.tokenizer)
    load = args.load
    if load is None and args.rate is None and args.workload != "trace":
        load = 0.8
    options = LabOptions(
        workload=spec,
        policies=tuple(args.policies or DEFAULT_POLICIES),
        fleet=FleetSpec(
            args.pods,
            engine=engine,
            delays=delays,
            epp_replicas=args.epp_replicas,
            prefill_pods=args.prefill_pods,
            prefill_role=args.prefill_role,
            restarts=args.restarts,
        ),
        seeds=tuple(range(args.seed, args.seed + args.seeds)),
        load=load,
        rate=args.rate,
        burst=args.burst,
        tokenizer=tokenizer,
        out=args.out,
        command="python -m bench " + shlex.join(argv),
        progress=not args.no_progress and sys.stderr.isatty(),
        save_requests=args.save_requests,
    )
    started = time.monotonic()
    try:
        document = run_lab(options)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for name, r in document["policies"].items():
        print(_one_line(name, r))
    print(
        f"{len(options.policies)} policies x {len(options.seeds)} seeds in"
        f" {time.monotonic() - started:.1f} s; results: {args.out / 'results.json'},"
        f" report: {args.out / 'report.md'}"
    )
    return 0


def _fmt(r: dict[str, Any], key: str, spec: str, scale: float = 1.0) -> str:
    value, ci = r.get(key), r.get(f"{key}_ci95")
    if value is None:
        return "-"
    return format(value * scale, spec) + ("" if ci is None else f"±{format(ci * scale, spec)}")


def _one_line(name: str, r: dict[str, Any]) -> str:
    return (
        f"  {name}: hit rate {_fmt(r, 'hit_rate', '.3f')}, TTFT p50"
        f" {_fmt(r, 'ttft_p50_s', '.1f', 1000)} ms p90 {_fmt(r, 'ttft_p90_s', '.1f', 1000)} ms,"
        f" TPOT p50 {_fmt(r, 'tpot_p50_s', '.1f', 1000)} ms,"
        f" max/mean load {_fmt(r, 'max_over_mean_load', '.2f')},"
        f" errors {_fmt(r, 'errors', '.0f')}, {r['wall_s']:.1f} s a run"
    )
