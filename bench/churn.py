"""Pod churn: how long a change of a pod in the Kubernetes API takes to change the
EPP's routing.

    python -m bench churn --pods 500 --rate 20 --duration 30

The simulated API server (sim/kubeapi.py, in this process) holds an InferencePool
and `--pods` Ready pods; a real `epp serve --pool-name` process watches it through
the official client. Then pods change at `--rate` changes per second: a Ready pod
turns unready, an unready one turns Ready, or a pod is deleted (and a new, unready
pod with a new name and address is created in its place, to turn Ready later).

What is measured, per change: from the moment the API server committed it to the
first real pick that reflects it. A pick is one ext_proc stream to the EPP's gRPC
port, exactly as Envoy opens it, carrying Envoy's subset hint
(`x-gateway-destination-endpoint-subset`) with the changed pod's address only: the
EPP routes it there iff the pod is routable, and answers 503 otherwise. Picks for
a pending change go back to back (with `--probe-gap` between them) until the
answer flips; the time recorded is when that answer arrived, so each figure
includes one pick's round trip (reported as `probe_rtt`). A pod never changes
again while a change of it is pending, so each answer is unambiguous; addresses
are never reused.

After the churn the EPP's view (/debug/endpoints) is compared with the API's: the
same pods, with the same readiness (`consistent`).

Writes `churn.json` (every change, and the summary) and `churn.md` to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import random
import shlex
import sys
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
from google.protobuf import struct_pb2
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from bench.overhead import process_cpu_seconds
from bench.provenance import provenance
from bench.stack import EppPorts, ManagedProcess, start_epp
from bench.stats import in_ms, percentile
from epp._proto.envoy.config.core.v3 import base_pb2 as core
from epp._proto.envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from epp._proto.envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from epp.extproc.messages import SUBSET_HINT_KEY, SUBSET_HINT_NAMESPACE
from sim.kubeapi import FakeKubeApi

POOL = "churn"
LABELS = {"app": "vllm"}
TARGET_PORT = 8000
KINDS = ("ready", "unready", "deleted")
# What the change means for routing: routable from now on, or not any more.
WANT_ROUTED = {"ready": True, "unready": False, "deleted": False}
DESTINATION = "x-gateway-destination-endpoint"
BODY = json.dumps({"model": "m", "prompt": "churn probe"}).encode()


@dataclass(frozen=True)
class ChurnOptions:
    out_dir: Path = Path("out/churn")
    pods: int = 500
    rate: float = 20.0  # changes per second
    duration_s: float = 30.0
    burst: int = 1  # changes committed together at each tick
    delete_share: float = 0.25  # of the changes; the rest toggle readiness
    seed: int = 0
    probe_gap_s: float = 0.001
    timeout_s: float = 10.0  # a change not reflected by then is `missed`
    progress: bool = False
    epp_args: Sequence[str] = ()
    command: str = ""


@dataclass
class Change:
    kind: str  # ready, unready, deleted
    pod: str
    address: str
    at: float  # time.perf_counter() when the API server committed it
    seen: float | None = None  # when the first pick reflecting it came back
    probe_sent: float | None = None  # when that pick was sent
    # When the last pick that still saw the old routing was sent (None: the first
    # pick already saw the change). The EPP changed after that pick reached it.
    last_miss_sent: float | None = None
    probes: int = 0

    @property
    def latency_s(self) -> float | None:
        """An upper bound: to the arrival of the first answer reflecting the change."""
        return None if self.seen is None else self.seen - self.at

    @property
    def floor_s(self) -> float | None:
        """A lower bound: to the sending of the last answer that did not."""
        if self.seen is None:
            return None
        return 0.0 if self.last_miss_sent is None else self.last_miss_sent - self.at


class Prober:
    """Real picks over one gRPC channel to the EPP."""

    def __init__(self, grpc_port: int) -> None:
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{grpc_port}")
        self.stub = pb_grpc.ExternalProcessorStub(self.channel)  # type: ignore[no-untyped-call]
        self.errors = 0

    async def routed(self, address: str) -> bool:
        """Whether the EPP routes a request restricted to `address` there now."""
        headers = core.HeaderMap(
            headers=[
                core.HeaderValue(key=k, raw_value=v.encode())
                for k, v in (
                    (":path", "/v1/completions"),
                    (":method", "POST"),
                    (":authority", "churn"),
                    ("content-type", "application/json"),
                )
            ]
        )
        first = pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=headers))
        hint = first.metadata_context.filter_metadata[SUBSET_HINT_NAMESPACE]
        hint.fields[SUBSET_HINT_KEY].list_value.values.append(
            struct_pb2.Value(string_value=address)
        )
        call = self.stub.Process()
        try:
            await call.write(first)
            await call.write(
                pb.ProcessingRequest(request_body=pb.HttpBody(body=BODY, end_of_stream=True))
            )
            reply = await call.read()
        except grpc.aio.AioRpcError:
            self.errors += 1
            return False
        finally:
            # The decision is all a probe needs; the EPP counts the rest as abandoned.
            call.cancel()
        if reply is grpc.aio.EOF or reply.WhichOneof("response") != "request_headers":
            return False
        mutation = reply.request_headers.response.header_mutation
        return any(
            option.header.key == DESTINATION
            and (option.header.raw_value.decode() or option.header.value) == address
            for option in mutation.set_headers
        )

    async def close(self) -> None:
        await self.channel.close()


class Churner:
    """The pods, and the changes made to them through the API server."""

    def __init__(self, api: FakeKubeApi, pods: int, seed: int, delete_share: float) -> None:
        self.api = api
        self.rng = random.Random(seed)
        self.delete_share = delete_share
        self.ready: dict[str, bool] = {}
        self.ips: dict[str, str] = {}
        self.pending: set[str] = set()  # pods with a change not yet reflected
        self._ips = (f"10.{(i >> 16) & 255}.{(i >> 8) & 255}.{i & 255}" for i in itertools.count(1))
        self._names = (f"vllm-{i:05d}" for i in itertools.count())
        for _ in range(pods):
            self._create(ready=True)

    def _create(self, ready: bool) -> str:
        name, ip = next(self._names), next(self._ips)
        self.api.put_pod(name, labels=LABELS, ip=ip, ready=ready, container_ports=[TARGET_PORT])
        self.ready[name] = ready
        self.ips[name] = ip
        return name

    def step(self) -> Change | None:
        """Make one change (None: every pod has one pending)."""
        idle = [name for name in self.ready if name not in self.pending]
        if not idle:
            return None
        name = self.rng.choice(idle)
        address = f"{self.ips[name]}:{TARGET_PORT}"
        if self.rng.random() < self.delete_share:
            self.api.delete_pod(name)
            kind = "deleted"
            del self.ready[name]
            self._create(ready=False)
        else:
            ready = not self.ready[name]
            self.api.update_pod(name, ready=ready)
            kind = "ready" if ready else "unready"
            self.ready[name] = ready
        change = Change(kind, name, address, time.perf_counter())
        self.pending.add(name)
        return change


def summarize(changes: Sequence[Change]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in KINDS:
        of_kind = [c for c in changes if c.kind == kind]
        latencies = sorted(c.latency_s for c in of_kind if c.latency_s is not None)
        floors = sorted(c.floor_s for c in of_kind if c.floor_s is not None)
        rtts = sorted(c.seen - c.probe_sent for c in of_kind if c.seen is not None and c.probe_sent)
        # A kind with no seen change has no percentiles: NaN in churn.json.
        out[kind] = {
            "changes": len(of_kind),
            "missed": sum(1 for c in of_kind if c.seen is None),
            "p50_ms": in_ms(percentile(latencies, 0.50)),
            "p90_ms": in_ms(percentile(latencies, 0.90)),
            "p99_ms": in_ms(percentile(latencies, 0.99)),
            "max_ms": in_ms(latencies[-1] if latencies else None),
            "floor_p50_ms": in_ms(percentile(floors, 0.50)),
            "floor_p99_ms": in_ms(percentile(floors, 0.99)),
            "probe_rtt_p50_ms": in_ms(percentile(rtts, 0.50)),
        }
    return out


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        body: bytes = response.read()
        return body


def _kube_metrics(text: str) -> dict[str, float]:
    """The EPP's epp_kubernetes_* counters, as `name{labels}` -> value."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith("epp_kubernetes_"):
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}"] = float(sample.value)
    return out


async def _churn(
    options: ChurnOptions, churner: Churner, prober: Prober, bar: tqdm[Any] | None
) -> list[Change]:
    changes: list[Change] = []
    trackers: list[asyncio.Task[None]] = []

    async def track(change: Change) -> None:
        want = WANT_ROUTED[change.kind]
        deadline = change.at + options.timeout_s
        try:
            while time.perf_counter() < deadline:
                sent = time.perf_counter()
                routed = await prober.routed(change.address)
                change.probes += 1
                if routed == want:
                    change.seen, change.probe_sent = time.perf_counter(), sent
                    return
                change.last_miss_sent = sent
                await asyncio.sleep(options.probe_gap_s)
        finally:
            churner.pending.discard(change.pod)
            if bar is not None:
                bar.update(1)

    loop = asyncio.get_running_loop()
    ticks = max(1, round(options.duration_s * options.rate / options.burst))
    start = loop.time()
    for tick in range(ticks):
        # Paced on a schedule, not by sleeping a fixed time after each change.
        await asyncio.sleep(max(0.0, start + tick * options.burst / options.rate - loop.time()))
        for _ in range(options.burst):
            change = churner.step()
            if change is not None:
                changes.append(change)
                trackers.append(asyncio.create_task(track(change)))
    await asyncio.gather(*trackers)
    return changes


async def run_churn_async(options: ChurnOptions) -> dict[str, Any]:
    out = options.out_dir
    out.mkdir(parents=True, exist_ok=True)
    api = FakeKubeApi(bookmark_interval_s=1.0, history_limit=1_000_000)
    await api.start()
    epp: ManagedProcess | None = None
    prober: Prober | None = None
    try:
        api.put_pool(POOL, selector=LABELS, ports=[TARGET_PORT])
        churner = Churner(api, options.pods, options.seed, options.delete_share)
        kubeconfig = api.kubeconfig(out / "kubeconfig")
        ports = EppPorts.free()
        started = time.perf_counter()
        # Blocking (it polls /readyz): off this loop, which serves the API.
        epp = await asyncio.to_thread(
            start_epp,
            None,
            out,
            ports,
            extra_args=[
                "--pool-name", POOL, "--kubeconfig", str(kubeconfig), "--debug-endpoints",
                *options.epp_args,
            ],
            ready_timeout_s=120.0,
        )  # fmt: skip
        ready_s = time.perf_counter() - started
        assert epp.process is not None
        pid = epp.process.pid
        prober = Prober(ports.grpc)
        # The channel connects on first use: not inside a measurement.
        await prober.routed(f"{churner.ips[next(iter(churner.ips))]}:{TARGET_PORT}")
        cpu_before = process_cpu_seconds(pid)
        total = max(1, round(options.duration_s * options.rate / options.burst)) * options.burst
        bar = (
            tqdm(total=total, desc=f"churn {options.pods} pods", unit="change")
            if options.progress
            else None
        )
        wall = time.perf_counter()
        try:
            changes = await _churn(options, churner, prober, bar)
        finally:
            if bar is not None:
                bar.close()
        wall = time.perf_counter() - wall
        epp_cpu_s = process_cpu_seconds(pid) - cpu_before
        admin = f"http://127.0.0.1:{ports.metrics}"
        # The EPP's final view against the API's (after a moment to settle).
        await asyncio.sleep(0.5)
        endpoints = json.loads(await asyncio.to_thread(_get, f"{admin}/debug/endpoints"))
        seen_view = {e["name"]: bool(e["ready"]) for e in endpoints}
        consistent = seen_view == churner.ready
        metrics_text = (await asyncio.to_thread(_get, f"{admin}/metrics")).decode()
    finally:
        if prober is not None:
            await prober.close()
        if epp is not None:
            await asyncio.to_thread(epp.stop)
        await api.stop()
    document = {
        **provenance(options.command),
        "options": {k: v for k, v in asdict(options).items() if k not in ("out_dir", "command")},
        "method": "real picks (ext_proc, subset hint = the changed pod) until the answer flips",
        "start_to_ready_s": ready_s,
        "wall_s": wall,
        "epp_cpu_s": epp_cpu_s,
        "probe_errors": prober.errors if prober is not None else 0,
        "consistent": consistent,
        "summary": summarize(changes),
        "epp_metrics": _kube_metrics(metrics_text),
        "changes": [
            {**asdict(c), "latency_ms": None if c.latency_s is None else c.latency_s * 1000}
            for c in changes
        ],
    }
    (out / "churn.json").write_text(json.dumps(document, indent=1))
    (out / "churn.md").write_text(report(document))
    return document


def report(document: dict[str, Any]) -> str:
    o = document["options"]
    lines = [
        f"Pod churn: {o['pods']} pods, {o['rate']:g} changes/s for {o['duration_s']:g} s"
        f" (bursts of {o['burst']}), {document['machine']['cpus']} CPUs",
        "",
        "| change | what is timed | changes | p50 ms | p90 ms | p99 ms | max ms | missed |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    what = {
        "ready": "Ready in the API → routed to",
        "unready": "not Ready in the API → not routed to",
        "deleted": "deleted in the API → not routed to",
    }
    for kind in KINDS:
        s = document["summary"][kind]
        lines.append(
            f"| {kind} | {what[kind]} | {s['changes']} | {s['p50_ms']:.1f} | {s['p90_ms']:.1f}"
            f" | {s['p99_ms']:.1f} | {s['max_ms']:.1f} | {s['missed']} |"
        )
    summary = document["summary"]
    rtt = summary["ready"]["probe_rtt_p50_ms"]
    floors = ", ".join(
        f"{kind} p50 {summary[kind]['floor_p50_ms']:.1f} / p99 {summary[kind]['floor_p99_ms']:.1f}"
        for kind in KINDS
    )
    lines += [
        "",
        f"The figures are upper bounds: to the answer of the first pick that reflected the"
        f" change, so each includes one pick's round trip (p50 {rtt:.1f} ms). Lower bounds"
        f" (to the sending of the last pick that did not) in ms: {floors}. EPP start to ready"
        f" (process start, list of {o['pods']} pods): {document['start_to_ready_s']:.2f} s."
        f" EPP CPU during the churn (probes included): {document['epp_cpu_s']:.2f} s over"
        f" {document['wall_s']:.1f} s. Final view consistent with the API:"
        f" {'yes' if document['consistent'] else 'NO'}.",
    ]
    if document["command"]:
        lines += ["", f"`{document['command']}`"]
    return "\n".join(lines) + "\n"


def run_churn(options: ChurnOptions) -> dict[str, Any]:
    return asyncio.run(run_churn_async(options))


def add_parser(commands: Any) -> None:
    churn = commands.add_parser(
        "churn",
        help="time from a pod change in the Kubernetes API to the EPP's routing",
        description="Start the simulated Kubernetes API server with N Ready pods and a real"
        " `epp serve --pool-name`, then churn the pods (Ready, unready, deleted and"
        " re-created) and time each change from the API to the first real pick that"
        " reflects it. Writes churn.json and churn.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    churn.add_argument("--pods", type=int, default=500, help="pods in the pool")
    churn.add_argument("--rate", type=float, default=20.0, help="changes per second")
    churn.add_argument("--duration", type=float, default=30.0, help="seconds of churn")
    churn.add_argument("--burst", type=int, default=1, help="changes committed together")
    churn.add_argument(
        "--delete-share", type=float, default=0.25, help="share of changes that delete a pod"
    )
    churn.add_argument("--seed", type=int, default=0)
    churn.add_argument(
        "--probe-gap", type=float, default=0.001, help="seconds between picks of a pending change"
    )
    churn.add_argument(
        "--timeout", type=float, default=10.0, help="a change not reflected by then is missed"
    )
    churn.add_argument("--out", type=Path, default=Path("out/churn"), help="output directory")
    churn.add_argument(
        "--epp-arg", action="append", default=[], metavar="ARG", help="extra `epp serve` option"
    )
    churn.add_argument("--no-progress", action="store_true", help="no progress bar")


def command(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if args.pods < 1 or args.rate <= 0 or args.duration <= 0 or args.burst < 1:
        print("error: --pods, --rate, --duration and --burst must be positive", file=sys.stderr)
        return 2
    if not 0.0 <= args.delete_share <= 1.0:
        print("error: --delete-share must be in [0, 1]", file=sys.stderr)
        return 2
    options = ChurnOptions(
        out_dir=args.out,
        pods=args.pods,
        rate=args.rate,
        duration_s=args.duration,
        burst=args.burst,
        delete_share=args.delete_share,
        seed=args.seed,
        probe_gap_s=args.probe_gap,
        timeout_s=args.timeout,
        progress=not args.no_progress and sys.stderr.isatty(),
        epp_args=tuple(args.epp_arg),
        command="python -m bench " + shlex.join(argv),
    )
    with contextlib.suppress(KeyboardInterrupt):
        document = run_churn(options)
        print(report(document), end="")
        print(f"results: {args.out / 'churn.json'}, {args.out / 'churn.md'}")
        missed = sum(document["summary"][k]["missed"] for k in KINDS)
        return 0 if document["consistent"] and not missed else 1
    print("\ninterrupted: everything started was stopped", file=sys.stderr)
    return 130


__all__ = ["ChurnOptions", "add_parser", "command", "report", "run_churn", "summarize"]
