"""Active-active EPP replicas: do they pick the same pod for the same prompt?

    python -m bench agreement --pods 4 --replicas 2 --requests 400 --rate 20

Two (or more) `epp serve` replicas with the same precise-prefix config sit behind
one real Envoy, whose `epp` cluster balances them round robin, one request (one
ext_proc stream) at a time; they follow the same pods' KV events. A shared-prefix
workload (token-id prompts drawn from `--groups` system prompts) goes through
Envoy to simulated pods, so each replica routes part of it.

What is measured:

- **under load**: every `--probe-interval` seconds a probe (a group already sent,
  with a new question) goes to every replica's `/debug/explain` at once, which runs
  the real pipeline on that replica's state and changes nothing. The probe agrees if
  every replica's first pick is the same pod. Reported: the pick agreement, the
  agreement of the precise-prefix scores alone (the index: the same score for every
  candidate), and how many probes had a tie for the best total (the picker breaks
  ties at random, so replicas may differ there even with equal states);
- **at rest**: once the load has ended and every replica's index holds exactly each
  engine's cached blocks (digests, `/debug/endpoints`), one probe per group;
- each replica's share of the requests Envoy sent (it does balance).

Disagreement under load comes from what a replica knows that the others do not:
its own in-flight requests and speculative entries (`speculativeIndexing`), and
KV events or metrics scrapes that reached one replica a moment before another.

Writes results.json and report.md to `--out`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shlex
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml
from tqdm import tqdm

from bench.longrun import (
    MODEL,
    OpenLoop,
    Outcome,
    PrefixSpace,
    fetch_json,
    fetch_page,
    total,
    wait_for,
)
from bench.provenance import provenance
from bench.stack import (
    ManagedProcess,
    Pods,
    envoy_config,
    free_ports,
    start_envoy,
    start_epp_on_free_ports,
)

PREFIX_PLUGIN = "prefix"
# The production-shaped precise profile of manifests/config/precise-prefix.yaml,
# with load scorers read from sources every replica shares (the pods' metrics) and
# no tokenizer (the prompts are token ids).
DEFAULT_CONFIG = {
    "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
    "kind": "EndpointPickerConfig",
    "plugins": [
        {
            "type": "precise-prefix-cache-scorer",
            "name": PREFIX_PLUGIN,
            "parameters": {
                "blockSize": 16,
                "speculativeIndexing": True,
                "speculativeTTL": "2s",
            },
        },
        {"type": "queue-scorer"},
        {"type": "kv-cache-utilization-scorer"},
        {"type": "max-score-picker"},
    ],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": PREFIX_PLUGIN, "weight": 3},
                {"pluginRef": "queue-scorer", "weight": 2},
                {"pluginRef": "kv-cache-utilization-scorer", "weight": 2},
                {"pluginRef": "max-score-picker"},
            ],
        }
    ],
}
SIM_ARGS = ("--hash-seed", "0")


@dataclass(frozen=True)
class AgreementOptions:
    out_dir: Path = Path("out/agreement")
    pods: int = 4
    replicas: int = 2
    groups: int = 32
    requests: int = 400
    rate: float = 20.0  # requests per wall second
    probe_interval_s: float = 0.1
    system_len: int = 512
    question_len: int = 32
    skew: float = 1.0
    output_tokens: int = 8
    time_scale: float = 0.05
    seed: int = 0
    config: Path | None = None
    prefix_plugin: str = PREFIX_PLUGIN
    settle_timeout_s: float = 60.0
    progress: bool = False
    command: str = ""


@dataclass
class Probe:
    at: float  # seconds since the load started
    group: int
    picks: list[str | None]  # each replica's first pick
    prefix_scores: list[dict[str, float]]  # each replica's precise-prefix scores
    tied: bool  # some replica had several candidates with the best total

    @property
    def picks_agree(self) -> bool:
        return len(set(self.picks)) == 1 and self.picks[0] is not None

    @property
    def scores_agree(self) -> bool:
        return all(s == self.prefix_scores[0] for s in self.prefix_scores)


def _explained(
    answer: dict[str, Any], prefix_plugin: str
) -> tuple[str | None, dict[str, float], bool]:
    picked = answer.get("picked") or [None]
    candidates = answer.get("candidates", [])
    scores = {c["name"]: float(c["scores"].get(prefix_plugin, 0.0)) for c in candidates}
    best = max((c["total"] for c in candidates), default=0.0)
    tied = sum(1 for c in candidates if abs(c["total"] - best) < 1e-9) > 1
    return picked[0], scores, tied


async def probe(
    session: aiohttp.ClientSession,
    admin_urls: Sequence[str],
    space: PrefixSpace,
    group: int,
    question: int,
    at: float,
    prefix_plugin: str,
) -> Probe:
    """Ask every replica at once what it would pick for one prompt."""
    query = {
        "path": "/v1/completions",
        "headers": {"content-type": "application/json"},
        "body": {"model": MODEL, "prompt": space.prompt(group, question), "max_tokens": 8},
    }

    async def ask(url: str) -> dict[str, Any]:
        async with session.post(
            url + "/debug/explain", json=query, timeout=aiohttp.ClientTimeout(total=10)
        ) as response:
            answer: dict[str, Any] = await response.json()
            return answer

    answers = await asyncio.gather(*(ask(url) for url in admin_urls))
    explained = [_explained(a, prefix_plugin) for a in answers]
    return Probe(
        at,
        group,
        [e[0] for e in explained],
        [e[1] for e in explained],
        any(e[2] for e in explained),
    )


def _rates(probes: Sequence[Probe]) -> dict[str, Any]:
    untied = [p for p in probes if not p.tied]
    return {
        "probes": len(probes),
        "pick_agreement": _share(sum(p.picks_agree for p in probes), len(probes)),
        "prefix_score_agreement": _share(sum(p.scores_agree for p in probes), len(probes)),
        "tied": sum(p.tied for p in probes),
        "pick_agreement_untied": _share(sum(p.picks_agree for p in untied), len(untied)),
    }


def _share(part: int, whole: int) -> float | None:
    return part / whole if whole else None


@dataclass
class _Run:
    probes_under_load: list[Probe] = field(default_factory=list)
    probes_at_rest: list[Probe] = field(default_factory=list)
    outcomes: list[Outcome] = field(default_factory=list)


async def _digests(
    session: aiohttp.ClientSession, admin_urls: Sequence[str], pods: Pods
) -> dict[str, Any] | None:
    """Each pod's engine digest and every replica's index digest of it; None until
    every replica's index holds exactly each engine's cached blocks."""
    # The EPP's digest XORs the low 60 bits of the engine's hashes (all its index
    # keeps of them): the engine's 64-bit digest, masked alike, is comparable.
    truth = {
        name: f"{int(state['cachedBlocksDigest'], 16) & ((1 << 60) - 1):016x}"
        for name, pod in pods.pods.items()
        for state in [await fetch_json(session, f"http://{pod.address}/sim/state")]
    }
    seen: dict[str, list[str]] = {name: [] for name in truth}
    for url in admin_urls:
        for entry in await fetch_json(session, url + "/debug/endpoints"):
            digest = entry.get("index", {}).get("digest", {}).get("gpu", "0" * 16)
            seen[entry["name"]].append(digest)
    settled = all(set(digests) == {truth[name]} for name, digests in seen.items())
    return {"engines": truth, "replicas": seen} if settled else None


async def _measure(
    options: AgreementOptions, pods: Pods, url: str, admin_urls: list[str]
) -> tuple[_Run, dict[str, Any]]:
    space = PrefixSpace(
        options.groups, options.system_len, options.question_len, options.skew, options.seed
    )
    run = _Run()
    bar = tqdm(total=options.requests, desc="agreement", unit="req") if options.progress else None
    errors = 0

    def done(outcome: Outcome) -> None:
        nonlocal errors
        if bar is not None:
            errors += not outcome.ok
            bar.set_postfix(errors=errors, probes=len(run.probes_under_load), refresh=False)
            bar.update()

    load = OpenLoop(
        url,
        space,
        options.rate,
        seed=options.seed,
        max_tokens=options.output_tokens,
        limit=options.requests,
        on_done=done,
    )
    rng = random.Random(f"probes:{options.seed}")
    async with aiohttp.ClientSession() as session:
        # Every replica follows every pod's KV events before the first request.
        async def live() -> bool:
            for admin in admin_urls:
                entries = await fetch_json(session, admin + "/debug/endpoints")
                if len(entries) != len(pods.pods) or any(
                    e.get("index", {}).get("state") != "live" for e in entries
                ):
                    return False
            return True

        if not await wait_for(live, options.settle_timeout_s):
            raise RuntimeError("the replicas never followed every pod's KV events")
        started = time.monotonic()
        sending = asyncio.create_task(load.run())
        question = 10_000_000  # probes ask questions no request asks
        try:
            while not sending.done():
                await asyncio.sleep(options.probe_interval_s)
                if not load.groups_sent:
                    continue
                question += 1
                group = rng.choice(load.groups_sent)
                run.probes_under_load.append(
                    await probe(
                        session,
                        admin_urls,
                        space,
                        group,
                        question,
                        time.monotonic() - started,
                        options.prefix_plugin,
                    )
                )
            run.outcomes = await sending
        finally:
            if bar is not None:
                bar.close()
        load_s = time.monotonic() - started
        settle_started = time.monotonic()
        digests = await wait_for(
            lambda: _digests(session, admin_urls, pods), options.settle_timeout_s, 0.2
        )
        settle_s = time.monotonic() - settle_started
        for group in sorted(set(load.groups_sent)):
            question += 1
            run.probes_at_rest.append(
                await probe(
                    session, admin_urls, space, group, question, load_s, options.prefix_plugin
                )
            )
        routed = []
        for admin in admin_urls:
            page = await fetch_page(session, admin + "/metrics")
            routed.append(total(page, "epp_requests_total"))
    facts = {
        "load_s": load_s,
        "settle_s": settle_s,
        "indexes_settled": digests is not None,
        "digests": digests,
        "requests_per_replica": routed,
    }
    return run, facts


async def run_agreement_async(options: AgreementOptions) -> dict[str, Any]:
    if options.replicas < 2:
        raise ValueError("agreement needs at least 2 replicas")
    out = options.out_dir
    out.mkdir(parents=True, exist_ok=True)
    sim_args = [
        *SIM_ARGS,
        "--time-scale", repr(options.time_scale),
        "--output-tokens", str(options.output_tokens),
    ]  # fmt: skip
    pods = Pods(out / "pods", options.pods, sim_args)
    processes: list[ManagedProcess] = []
    try:
        await asyncio.to_thread(pods.start)
        endpoints = pods.endpoints_file(out / "endpoints.yaml")
        config = options.config
        if config is None:
            config = out / "config.yaml"
            config.write_text(yaml.safe_dump(DEFAULT_CONFIG, sort_keys=False))
        started = await asyncio.gather(
            *(
                asyncio.to_thread(
                    start_epp_on_free_ports,
                    endpoints,
                    out / f"epp-{i}",
                    config_file=config,
                    extra_args=["--debug-endpoints"],
                )
                for i in range(options.replicas)
            )
        )
        epps = [epp for epp, _ in started]
        ports = [p for _, p in started]
        processes.extend(epps)
        listen, admin = free_ports(2)
        envoy = await asyncio.to_thread(
            start_envoy,
            envoy_config(
                listen_port=listen,
                epp_port=ports[0].grpc,
                admin_port=admin,
                more_epp_ports=[p.grpc for p in ports[1:]],
            ),
            out / "envoy",
        )
        processes.append(envoy)
        admin_urls = [f"http://127.0.0.1:{p.metrics}" for p in ports]
        run, facts = await _measure(options, pods, f"http://127.0.0.1:{listen}", admin_urls)
    finally:
        for process in processes:
            await asyncio.to_thread(process.stop)
        await asyncio.to_thread(pods.stop)
    ok = [o for o in run.outcomes if o.ok]
    document = {
        **provenance(options.command),
        "options": {
            k: (str(v) if isinstance(v, Path) else v)
            for k, v in asdict(options).items()
            if k not in ("out_dir", "command", "progress")
        },
        "config": str(config),
        "requests": {
            "sent": len(run.outcomes),
            "ok": len(ok),
            "errors": len(run.outcomes) - len(ok),
        },
        "under_load": _rates(run.probes_under_load),
        "at_rest": _rates(run.probes_at_rest),
        **facts,
        "probes": {
            "under_load": [_probe_json(p) for p in run.probes_under_load],
            "at_rest": [_probe_json(p) for p in run.probes_at_rest],
        },
    }
    (out / "results.json").write_text(_json(document))
    (out / "report.md").write_text(report(document))
    return document


def _probe_json(probe: Probe) -> dict[str, Any]:
    return {
        "at_s": round(probe.at, 3),
        "group": probe.group,
        "picks": probe.picks,
        "agree": probe.picks_agree,
        "scores_agree": probe.scores_agree,
        "tied": probe.tied,
    }


def _json(document: dict[str, Any]) -> str:
    return json.dumps(document, indent=1) + "\n"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def report(document: dict[str, Any]) -> str:
    o = document["options"]
    lines = [
        f"Active-active agreement: {o['replicas']} EPP replicas behind one Envoy, {o['pods']}"
        f" pods, {document['requests']['sent']} requests at {o['rate']:g}/s over"
        f" {o['groups']} prefix groups ({document['machine']['cpus']} CPUs)",
        "",
        "| when | probes | same pick | same prefix scores | ties for best | same pick, no tie |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for key, label in (("under_load", "under load"), ("at_rest", "at rest")):
        r = document[key]
        lines.append(
            f"| {label} | {r['probes']} | {_pct(r['pick_agreement'])}"
            f" | {_pct(r['prefix_score_agreement'])} | {r['tied']}"
            f" | {_pct(r['pick_agreement_untied'])} |"
        )
    share = ", ".join(f"{n:g}" for n in document["requests_per_replica"])
    lines += [
        "",
        f"Requests routed by each replica (Envoy round robin): {share}."
        f" Errors: {document['requests']['errors']}. After the load, every replica's index held"
        f" exactly each engine's cached blocks: {'yes' if document['indexes_settled'] else 'NO'}"
        f" (after {document['settle_s']:.2f} s).",
        "",
        "A probe asks every replica's /debug/explain for the same prompt at the same moment;"
        " it agrees when their first picks are the same pod. Ties for the best total are"
        " broken at random by the picker, so they can differ with identical state.",
    ]
    if document["command"]:
        lines += ["", f"`{document['command']}`"]
    return "\n".join(lines) + "\n"


def run_agreement(options: AgreementOptions) -> dict[str, Any]:
    return asyncio.run(run_agreement_async(options))


def add_parser(commands: Any) -> None:
    parser = commands.add_parser(
        "agreement",
        help="two EPP replicas behind one Envoy: how often they pick the same pod",
        description="Start simulated pods, several `epp serve` replicas with the same precise"
        " config and one Envoy balancing them; send a shared-prefix workload through Envoy"
        " and ask every replica, at the same moments, which pod it would pick for the same"
        " prompts (/debug/explain). Writes results.json and report.md.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--pods", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--groups", type=int, default=32, help="system prompts (prefix groups)")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--rate", type=float, default=20.0, help="requests per second")
    parser.add_argument(
        "--probe-interval", type=float, default=0.1, help="seconds between probes under load"
    )
    parser.add_argument("--system-len", type=int, default=512, help="tokens")
    parser.add_argument("--question-len", type=int, default=32, help="tokens")
    parser.add_argument("--skew", type=float, default=1.0, help="Zipf exponent of the groups")
    parser.add_argument("--time-scale", type=float, default=0.05, help="the pods' time scale")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--config", type=Path, default=None, help="EndpointPickerConfig (default: precise + load)"
    )
    parser.add_argument(
        "--prefix-plugin", default=PREFIX_PLUGIN, help="the precise scorer's name in the config"
    )
    parser.add_argument("--out", type=Path, default=Path("out/agreement"))
    parser.add_argument("--no-progress", action="store_true")


def command(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if args.pods < 1 or args.replicas < 2 or args.requests < 1 or args.rate <= 0:
        print(
            "error: need --pods >= 1, --replicas >= 2, --requests >= 1, --rate > 0", file=sys.stderr
        )
        return 2
    options = AgreementOptions(
        out_dir=args.out,
        pods=args.pods,
        replicas=args.replicas,
        groups=args.groups,
        requests=args.requests,
        rate=args.rate,
        probe_interval_s=args.probe_interval,
        system_len=args.system_len,
        question_len=args.question_len,
        skew=args.skew,
        time_scale=args.time_scale,
        seed=args.seed,
        config=args.config,
        prefix_plugin=args.prefix_plugin,
        progress=not args.no_progress and sys.stderr.isatty(),
        command="python -m bench " + shlex.join(argv),
    )
    with contextlib.suppress(KeyboardInterrupt):
        document = run_agreement(options)
        print(report(document), end="")
        print(f"results: {args.out / 'results.json'}, {args.out / 'report.md'}")
        return 0 if document["indexes_settled"] else 1
    print("\ninterrupted: everything started was stopped", file=sys.stderr)
    return 130


__all__ = ["AgreementOptions", "add_parser", "command", "report", "run_agreement"]
