"""One lab run (a policy, a workload, a seed) and the statistics over seeds.

A run: fresh pods (empty caches), a fresh router, the workload's sessions started
at their arrival times (Poisson at the run's rate, seeded as `bench run` seeds
them, or the trace's own timestamps scaled), each turn picked by the router when
it is sent, handed to its pod `route_s` later, and its next turn sent when the
answer is complete (plus think time). TTFT and end-to-end latency are counted from
the moment the request was due to be sent (the lab's client never falls behind),
to the moment the client sees the first and last token.

The result has `bench run`'s keys (`bench.runner.summarize`, from the same kind of
records and pod counters), plus the lab's own: wall time, events run, the virtual
duration, what the router refused, and each request's time per output token
(`tpot_p50_s`, `tpot_p90_s`: (last token - first token) / (output tokens - 1), over
the requests with two tokens or more).

Prefill/decode disaggregation: a P/D fleet (`FleetSpec.prefill_pods`) labels its
first pods `prefill` and the others `decode`. When the router's decision names a
prefill pod (the EPP's `x-prefiller-host-port` header), the lab's client plays the
decode pod's sidecar, as the simulator's own does (sim/server.py): the request
reaches the decode pod `route_s` after it was sent; its prefill leg (max_tokens 1)
reaches the prefill pod at once and is submitted after that pod's overhead; its
answer (the blocks holding the prompt's KV) is back `response_s` after the leg's
token, and the decode leg is submitted to the decode pod after its overhead, to
pull the KV cache (sim/engine.py) and decode. TTFT is the decode leg's first token
at the client. If the prefill leg fails (longer than the prefill pod's context, an
engine error, no blocks to give) the decode pod prefills the request itself
(`pd.fallbacks`). `pd` in the result counts what the pods did: prefill legs served
and decode legs pulling KV, per pod, from the engines' own counters.
"""

from __future__ import annotations

import functools
import json
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Final, Protocol

from tqdm import tqdm

from bench.bounds import Bounds, compute_bounds
from bench.client import Record, RunTiming, poisson_starts
from bench.lab.breakdown import PART_KEYS, RequestKey, ServedWhole, summarize_parts
from bench.lab.epp import Delays, LabEpp
from bench.lab.floor import TtftFloor, ttft_floor
from bench.lab.loop import EventLoop
from bench.lab.peers import DynamoKv, SglangCacheAware
from bench.lab.pod import LabPod
from bench.lab.tenants import over_seeds_tenants, tenants_summary
from bench.lab.workload import (
    MODEL,
    LabSession,
    LabTurn,
    LabWorkload,
    PromptIds,
    capacity_rps,
    from_workload,
    trace_workload,
)
from bench.provenance import portable_path, provenance
from bench.runner import PodCounters, resolve_policy, summarize
from bench.stats import ci95, percentile
from bench.workloads import Words, WorkloadSpec, answer_ids, load_words
from epp.clock import VirtualClock
from epp.director import Decision
from epp.errors import EppError
from epp.scheduling.registry import PluginRegistry
from epp.scheduling.types import TTFT_OBSERVED, Usage
from sim.engine import (
    RESTARTED_ERROR,
    EngineConfig,
    EngineRequest,
    RemotePrefill,
    TokenOutput,
)
from sim.kv_events import KVEvent
from sim.latency import LatencyModel

PATH = "/v1/chat/completions"
# A predicted-TTFT policy's prediction error (`prediction_error`).
PREDICTION_KEYS = (
    "ttft_prediction_error_p50",
    "ttft_prediction_error_p90",
    "ttft_prediction_bias_p50",
    "ttft_prediction_error_p50_warm",
)
# Observations a run's model is given to learn before its error counts as "after
# warm-up": about the model's memory (`forgetting` 0.995 weighs an observation 200
# later at e^-1), several times what it takes to override its prior.
PREDICTION_WARMUP: Final = 200
# Keys averaged over seeds, each with its `_ci95` beside it.
MEAN_KEYS = (
    "hit_rate",
    "ttft_p50_s",
    "ttft_p90_s",
    "ttft_p99_s",
    "ttft_mean_s",
    "e2e_p50_s",
    "e2e_p90_s",
    "e2e_p99_s",
    "tpot_p50_s",
    "tpot_p90_s",
    "throughput_rps",
    "output_tokens_per_s",
    "max_over_mean_load",
    "errors",
    "preemptions",
    "duration_s",
    "wall_s",
    *PREDICTION_KEYS,
    *PART_KEYS,
)


class Router(Protocol):
    """What the lab asks of a routing policy: the EPP (`LabEpp`) or a peer's model."""

    # What the router's path adds before the last request routed reaches its pod.
    route_delay_s: float
    # (predicted, observed) TTFT in seconds, pick to first chunk, of each request
    # whose policy predicted one (predicted-TTFT configs); empty for the others.
    ttft_predictions: list[tuple[float, float]]

    @property
    def wants_events(self) -> bool: ...

    def on_events(self, pod: LabPod, events: Sequence[KVEvent]) -> None: ...

    def route(
        self,
        request_id: str,
        body: bytes,
        prompt: Sequence[int],
        headers: Mapping[str, str],
        done: Callable[[Routed], None],
    ) -> None:
        """Hand `done` the pod for this request and a handle for `end`, or the
        router's refusal: at once, or later (the EPP's flow control holds it until
        a lab event frees capacity)."""
        ...

    def prefill_pod(self, handle: Any) -> LabPod | None:
        """The pod a routed request's prefill runs on, if the router disaggregated it."""
        ...

    def first_token(self, handle: Any) -> None:
        """The request's first token reached the client."""
        ...

    def end(self, handle: Any, usage: Usage | None, completed: bool) -> None: ...

    def close(self) -> None: ...

    def describe(self) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Refusal:
    """The router answered the request itself: its status (429, 503, ...) and why
    (the error's type, and flow control's dropped reason when it has one)."""

    status: int
    kind: str

    @property
    def shed(self) -> bool:
        """An answer a client can act on (retry later): not an error of the lab."""
        return self.status in (429, 503)


Routed = tuple[LabPod, Any] | Refusal | None  # None: refused without a status


def _refusal(error: EppError) -> Refusal:
    reason = getattr(error, "reason", None)
    kind = type(error).__name__ + (f" {reason}" if isinstance(reason, str) else "")
    return Refusal(error.status, kind)


class EppRouter:
    """The EPP's real scheduling code as a lab router: one EPP, or several replicas
    behind one Envoy, each with its own state (in-flight counts, approximate index,
    its own subscription to every pod's KV events), requests split between them in
    turn as Envoy's round-robin splits ext_proc streams."""

    def __init__(self, replicas: Sequence[LabEpp]) -> None:
        if not replicas:
            raise ValueError("an EPP router needs at least one replica")
        self.replicas = list(replicas)
        self.route_delay_s = replicas[0].delays.route_s
        self.ttft_predictions: list[tuple[float, float]] = []
        self._next = 0

    @property
    def wants_events(self) -> bool:
        return self.replicas[0].wants_events

    def on_events(self, pod: LabPod, events: Sequence[KVEvent]) -> None:
        for epp in self.replicas:
            epp.on_events(pod, events)

    def route(
        self,
        request_id: str,
        body: bytes,
        prompt: Sequence[int],
        headers: Mapping[str, str],
        done: Callable[[Routed], None],
    ) -> None:
        epp = self.replicas[self._next]
        self._next = (self._next + 1) % len(self.replicas)
        delays = epp.delays
        if epp.flow_control is not None:

            def picked(outcome: Decision | EppError) -> None:
                # Flow control picks no tokenizing text into the route delay.
                self.route_delay_s = delays.route_s
                if isinstance(outcome, EppError):
                    done(_refusal(outcome))
                else:
                    done((epp.pod_of(outcome), (epp, outcome)))

            epp.pick_later(request_id, PATH, body, headers, picked)
            return
        decision = epp.pick(request_id, PATH, body, headers)
        self.route_delay_s = delays.route_s + delays.route_per_token_s * epp.last_tokens_encoded
        if decision is None:
            done(None)
            return
        done((epp.pod_of(decision), (epp, decision)))

    def prefill_pod(self, handle: Any) -> LabPod | None:
        epp, decision = handle
        prefill: LabPod | None = epp.prefill_pod_of(decision)
        return prefill

    def first_token(self, handle: Any) -> None:
        # Envoy's full config streams response bodies to the EPP: it sees the first
        # chunk as the client does.
        epp, decision = handle
        epp.first_chunk(decision)
        observed = decision.cycle.get(TTFT_OBSERVED)
        if observed is not None:
            self.ttft_predictions.append((observed.predicted_s, observed.observed_s))

    def end(self, handle: Any, usage: Usage | None, completed: bool) -> None:
        epp, decision = handle
        epp.finish(decision, usage, completed)

    def close(self) -> None:
        for epp in self.replicas:
            epp.close()

    def describe(self) -> dict[str, Any]:
        parts = [epp.describe() for epp in self.replicas]
        refusals: dict[str, int] = {}
        for part in parts:
            for key, count in part["refusals"].items():
                refusals[key] = refusals.get(key, 0) + count
        out: dict[str, Any] = {"picks": sum(p["picks"] for p in parts), "refusals": refusals}
        fcs = [p["flow_control"] for p in parts if "flow_control" in p]
        if fcs:
            # Replicas' own queues: peaks at most, counts summed.
            out["flow_control"] = {
                key: (max if key.startswith("queue_peak") else sum)(fc[key] for fc in fcs)
                for key in fcs[0]
            }
        return out


PREFILL_ROLES: Final = ("prefill", "prefill-decode")


@dataclass(frozen=True)
class FleetSpec:
    pods: int
    engine: EngineConfig = field(default_factory=EngineConfig)
    latency: LatencyModel = field(default_factory=LatencyModel)
    delays: Delays = field(default_factory=Delays)
    epp_replicas: int = 1  # EPP replicas behind Envoy (configs only; peers are one router)
    # A P/D fleet: pods 0..prefill_pods-1 have the role `prefill_role`, the others
    # decode; 0: no roles (an aggregated fleet, no labels).
    prefill_pods: int = 0
    # `prefill`: those pods only prefill; `prefill-decode`: they may also take whole
    # requests and decode (llm-d's role for pods that do both), so a decider that
    # disaggregates only when it pays loses no decode capacity.
    prefill_role: str = "prefill"
    # Pod restarts over the run (`restart_schedule`); each pod stays in the pool.
    restarts: int = 0

    def __post_init__(self) -> None:
        if self.pods < 1 or self.epp_replicas < 1:
            raise ValueError("a fleet needs at least one pod and one EPP replica")
        if self.restarts < 0:
            raise ValueError("restarts must be 0 or more")
        if self.restarts and self.prefill_pods:
            raise ValueError("pod restarts are not modelled in a P/D fleet (--prefill-pods)")
        if self.prefill_role not in PREFILL_ROLES:
            raise ValueError(f"the prefill role must be one of {', '.join(PREFILL_ROLES)}")
        most = self.pods if self.prefill_role == "prefill-decode" else self.pods - 1
        if not 0 <= self.prefill_pods <= most:
            raise ValueError(
                "prefill pods must be 0 (no roles) or fewer than the pods (a P/D fleet"
                " needs a decode pod; with the role prefill-decode, at most all of them)"
            )

    def role(self, index: int) -> str | None:
        """Pod `index`'s llm-d.ai/role."""
        if not self.prefill_pods:
            return None
        return self.prefill_role if index < self.prefill_pods else "decode"


class _Request:
    """One turn in flight: its record, and the engine's outputs as they come."""

    __slots__ = (
        "engine_request",
        "first",
        "first_seen",
        "handle",
        "pod",
        "record",
        "routed_at",
        "run",
        "scheduled",
        "session",
        "turn_index",
    )

    def __init__(self, run: LabRun, session: LabSession, turn_index: int, scheduled: float) -> None:
        self.run = run
        self.session = session
        self.turn_index = turn_index
        self.scheduled = scheduled
        self.record = Record(
            session=session.id,
            turn=turn_index,
            group=session.group,
            scheduled_s=scheduled,
            sent_s=scheduled,
        )
        self.handle: Any = None
        self.pod: LabPod | None = None
        self.engine_request: EngineRequest | None = None
        self.first = True
        self.first_seen = 0.0
        self.routed_at: float | None = None  # when the router answered

    def put_nowait(self, output: TokenOutput) -> None:
        now = self.run.loop.now()
        seen = now + self.run.fleet.delays.response_s
        if output.error is not None:
            # A pod that restarted dropped the request: the client sends it again.
            again = output.error == RESTARTED_ERROR
            self.run.loop.at(seen, lambda: self.run.failed(self, f"engine: {output.error}", again))
            return
        if self.first:
            self.first = False
            self.first_seen = seen
            self.record.ttft_s = seen - self.scheduled
            self.run.loop.at(seen, lambda: self.run.router.first_token(self.handle))
        if output.finish_reason is not None:
            self.run.loop.at(seen, lambda: self.run.done(self))


class _PrefillLeg:
    """A disaggregated request's prefill leg on its prefill pod: its one output (the
    end) hands the request on to the decode pod, or back to it to prefill."""

    __slots__ = ("engine_request", "prefill", "prompt", "request", "run")

    def __init__(self, run: LabRun, request: _Request, prefill: LabPod, prompt: list[int]) -> None:
        self.run = run
        self.request = request
        self.prefill = prefill
        self.prompt = prompt
        self.engine_request: EngineRequest | None = None

    def put_nowait(self, output: TokenOutput) -> None:
        # The answer reaches the sidecar `response_s` after the engine's last token.
        run = self.run
        at = run.loop.now() + run.fleet.delays.response_s
        leg = self.engine_request
        blocks = None if leg is None or output.error is not None else leg.kv_block_ids
        remote = None if blocks is None else RemotePrefill(self.prefill.core.engine_id, blocks)
        if remote is None:
            run.pd_fallbacks += 1
        run.loop.at(at, lambda: run.submit_local(self.request, self.prompt, remote))


class LabRun:
    def __init__(
        self,
        router: Router,
        pods: Sequence[LabPod],
        loop: EventLoop,
        fleet: FleetSpec,
        workload: LabWorkload,
        starts: Sequence[float],
    ) -> None:
        self.router = router
        self.pods = pods
        self.loop = loop
        self.fleet = fleet
        self.workload = workload
        self.starts = starts
        self.records: list[Record] = []
        self.timing = RunTiming()
        self.picks: list[tuple[float, int]] = []  # (time, pod index), for the load plot
        # Per request of two tokens or more: its time per output token at the client.
        self.tpots: list[float] = []
        # Requests the router disaggregated, and those whose prefill leg failed (the
        # decode pod prefilled them).
        self.pd_requests = 0
        self.pd_fallbacks = 0
        self.resent = 0  # requests sent again after their pod restarted
        # Each request served whole, as its engine timed it (bench/lab/breakdown.py).
        self.served_whole: list[ServedWhole] = []
        self._ids = 0
        # Every request sent, with the headers it carried (per-tenant accounting).
        self.sent: list[tuple[_Request, tuple[tuple[str, str], ...]]] = []

    def start(self) -> None:
        for session, start in zip(self.workload.sessions, self.starts, strict=True):
            self.loop.at(start, functools.partial(self.send, session, 0, start))

    def send(self, session: LabSession, index: int, scheduled: float) -> None:
        turn: LabTurn = session.turns[index]
        request = _Request(self, session, index, scheduled)
        self.records.append(request.record)
        self.sent.append((request, turn.headers))
        self.timing.first_sent = min(self.timing.first_sent, scheduled)
        body, prompt = turn.build()
        self._ids += 1
        self.router.route(
            f"lab-{self._ids}",
            body,
            prompt,
            dict(turn.headers),
            functools.partial(self.routed, request, turn, prompt),
        )

    def routed(self, request: _Request, turn: LabTurn, prompt: list[int], outcome: Routed) -> None:
        """The router's answer to `request`: now, or later when it held it."""
        request.routed_at = self.loop.now()
        if outcome is None or isinstance(outcome, Refusal):
            if isinstance(outcome, Refusal) and outcome.shed:
                request.record.status = outcome.status
                request.record.error = f"shed: {outcome.status} {outcome.kind}"
            else:
                request.record.error = "refused: the router answered with an error"
            self.timing.last_done = max(self.timing.last_done, self.loop.now())
            return
        pod, request.handle = outcome
        request.pod = pod
        self.picks.append((self.loop.now(), pod.index))
        prefill = self.router.prefill_pod(request.handle)

        def arrive() -> None:
            if len(prompt) + turn.max_tokens > pod.core.max_model_len:
                self.failed(request, "400: longer than the engine's max_model_len")
                return
            if prefill is not None and prefill is not pod:
                self.pd_requests += 1
                request.record.prefill_pod = prefill.name
                self.prefill_leg(request, prefill, prompt)
                return
            self.submit_local(request, prompt, None)

        self.loop.after(self.router.route_delay_s, arrive)

    def submit_local(
        self, request: _Request, prompt: list[int], remote: RemotePrefill | None
    ) -> None:
        """The request reaches its (decode) pod's engine after the pod's overhead; with
        `remote`, as a decode leg pulling the KV cache the prefill pod holds."""
        pod = request.pod
        assert pod is not None
        turn = request.session.turns[request.turn_index]
        delays = self.fleet.delays
        sequence, uncached = pod.prepare(prompt)
        overhead = delays.pod_overhead_s + delays.pod_overhead_per_token_s * uncached

        def submit() -> None:
            request.engine_request = pod.submit(
                prompt, turn.max_tokens, request, None, sequence, remote=remote
            )

        self.loop.after(overhead, submit)

    def prefill_leg(self, request: _Request, prefill: LabPod, prompt: list[int]) -> None:
        """The sidecar sends the prefill leg (max_tokens 1) to the prefill pod; it
        reaches its engine after that pod's overhead."""
        if len(prompt) + 1 > prefill.core.max_model_len:
            # The prefill pod would answer 400: the sidecar prefills here instead.
            self.pd_fallbacks += 1
            self.submit_local(request, prompt, None)
            return
        delays = self.fleet.delays
        sequence, uncached = prefill.prepare(prompt)
        overhead = delays.pod_overhead_s + delays.pod_overhead_per_token_s * uncached
        leg = _PrefillLeg(self, request, prefill, prompt)

        def submit() -> None:
            leg.engine_request = prefill.submit(prompt, 1, leg, None, sequence, remote_decode=True)

        self.loop.after(overhead, submit)

    def failed(self, request: _Request, reason: str, again: bool = False) -> None:
        """`again`: the client sends the same turn at once, as a new request (the
        failed one stays an error; the new one's TTFT counts from its own send)."""
        now = self.loop.now()
        request.record.error = reason
        self.timing.last_done = max(self.timing.last_done, now)
        self.router.end(request.handle, None, completed=False)
        if again:
            self.resent += 1
            self.send(request.session, request.turn_index, now)

    def done(self, request: _Request) -> None:
        now = self.loop.now()
        record = request.record
        engine_request = request.engine_request
        assert engine_request is not None
        assert request.pod is not None
        record.ok = True
        record.status = 200
        record.e2e_s = now - request.scheduled
        record.pod = request.pod.name
        record.prompt_tokens = engine_request.prompt_len
        record.cached_tokens = engine_request.num_cached_tokens or 0
        record.output_tokens = len(engine_request.output_token_ids)
        scheduled_at = engine_request.first_scheduled_time
        first_token_at = engine_request.first_token_time
        if (
            record.prefill_pod is None
            and record.ttft_s is not None
            and scheduled_at is not None
            and first_token_at is not None
        ):
            self.served_whole.append(
                ServedWhole(
                    (request.session.id, request.turn_index),
                    record.ttft_s,
                    record.prompt_tokens,
                    record.cached_tokens,
                    scheduled_at - engine_request.arrival_time,
                    first_token_at - scheduled_at,
                )
            )
        # `done` runs when the last token reaches the client.
        record.last_token_s = now - request.scheduled
        tpot = record.tpot_s  # None without two tokens to time
        if tpot is not None:
            self.tpots.append(tpot)
        self.timing.last_done = max(self.timing.last_done, now)
        usage = Usage(record.prompt_tokens, record.output_tokens, record.cached_tokens)
        self.router.end(request.handle, usage, completed=True)
        session = request.session
        if request.turn_index + 1 < len(session.turns):
            at = now + session.think_s
            self.loop.at(at, lambda: self.send(session, request.turn_index + 1, at))


def restart_schedule(
    restarts: int, pods: int, starts: Sequence[float], seed: int
) -> list[tuple[float, int]]:
    """(time, pod index) of each restart: evenly spaced inside the arrivals' span,
    the pods taken in a seeded order, each once before any twice. The same for
    every policy of a seed."""
    if not restarts or not starts:
        return []
    first, last = min(starts), max(starts)
    order = list(range(pods))
    random.Random(f"lab-restarts:{seed}").shuffle(order)
    return [
        (first + (last - first) * (k + 1) / (restarts + 1), order[k % pods])
        for k in range(restarts)
    ]


def start_times(
    workload: LabWorkload, rate: float | None, seed: int, burst: int = 1
) -> list[float]:
    """Each session's start: the trace's (already scaled) timestamps, or Poisson
    arrivals at `rate` (in bursts of `burst`) drawn exactly as `bench run` draws
    them for the same seed."""
    if rate is None:
        return [s.arrival_s or 0.0 for s in workload.sessions]
    return poisson_starts(len(workload.sessions), rate, seed, burst)


RouterFactory = Callable[[Sequence[LabPod], EventLoop, "FleetSpec", int], Router]


def run_once(
    make_router: RouterFactory,
    workload: LabWorkload,
    fleet: FleetSpec,
    answer_token_ids: Sequence[int],
    rate: float | None,
    seed: int,
    burst: int = 1,
    star_hits: Mapping[RequestKey, int] | None = None,
    keep_records: bool = False,
) -> dict[str, Any]:
    """One policy on one seed, from cold; its `bench run`-shaped summary plus the
    lab's own keys and the raw TTFTs (`ttfts_s`) and picks over time (`picks`);
    with `keep_records`, every request's `Record` too (`records`).
    With each request's h* hit tokens (`star_hits`, from `_bounds`), where its
    requests' TTFT went (bench/lab/breakdown.py); without, those keys are None."""
    wall = time.perf_counter()
    clock = VirtualClock(0.0)
    loop = EventLoop(clock)
    pods = [
        LabPod(i, fleet.engine, answer_token_ids, loop, fleet.latency, role=fleet.role(i))
        for i in range(fleet.pods)
    ]
    router: Router = make_router(pods, loop, fleet, seed)
    try:
        if router.wants_events:
            for pod in pods:
                pod.on_events = router.on_events
        starts = start_times(workload, rate, seed, burst)
        run = LabRun(router, pods, loop, fleet, workload, starts)
        run.start()
        restarts = restart_schedule(fleet.restarts, len(pods), starts, seed)
        for at, index in restarts:
            loop.at(at, pods[index].restart)
        loop.run()
        counters = {
            pod.name: PodCounters(
                queries=pod.core.stats.prefix_cache_queries,
                hits=pod.core.stats.prefix_cache_hits,
                prompt_tokens=pod.core.stats.prompt_tokens,
                generation_tokens=pod.core.stats.generation_tokens,
                preemptions=pod.core.stats.preemptions,
                requests=pod.core.stats.requests_received,
                busy_s=pod.busy_s,
            )
            for pod in pods
        }
        result = summarize(run.records, run.timing, counters, 1.0, max_error_rate=1.0)
        result["router"] = router.describe()
        account(run.records, result)
        result.update(
            dict.fromkeys(PART_KEYS)
            if star_hits is None
            else summarize_parts(
                run.served_whole, star_hits, fleet.engine, fleet.latency, fleet.delays
            )
        )
        if workload.name == "tenants":
            result["tenants"] = tenants_summary(
                [(r.record, headers, r.routed_at) for r, headers in run.sent],
                workload.burst_window_s,
                result["router"],
                int(workload.params["output_len"]),
            )
        tpots = sorted(run.tpots)
        result["tpot_p50_s"] = percentile(tpots, 0.50)
        result["tpot_p90_s"] = percentile(tpots, 0.90)
        if fleet.prefill_pods:
            result["pd"] = pd_summary(run, pods)
        if fleet.restarts:
            result["restarts"] = {
                "at_s": [at for at, _ in restarts],
                "pods": [pods[index].name for _, index in restarts],
                "resent": run.resent,
            }
    finally:
        router.close()
    result["wall_s"] = time.perf_counter() - wall
    result["events_run"] = loop.actions_run
    result["virtual_end_s"] = clock()
    result["busy_fraction"] = (
        sum(p.busy_s for p in pods) / (len(pods) * result["duration_s"])
        if result["duration_s"]
        else None
    )
    result["ttfts_s"] = sorted(r.ttft_s for r in run.records if r.ok and r.ttft_s is not None)
    result["picks"] = run.picks
    result.update(prediction_error(router.ttft_predictions))
    result["ttft_prediction_error_p50_by_tenth"] = prediction_error_by_tenth(
        router.ttft_predictions
    )
    result["ttft_predictions"] = router.ttft_predictions
    if keep_records:
        result["records"] = run.records
    return result


def account(records: Sequence[Record], result: dict[str, Any]) -> None:
    """Every request sent was served, answered by the router with a status it can
    act on (shed: 429/503), or failed; none is left hanging. (`summarize` counts
    the shed ones apart from the errors, as `bench run` does.)"""
    hung = [r for r in records if not r.ok and r.error is None]
    if hung:
        raise RuntimeError(
            f"lab accounting: {len(hung)} of {len(records)} requests neither served nor"
            f" answered (first: session {hung[0].session}, turn {hung[0].turn})"
        )


def pd_summary(run: LabRun, pods: Sequence[LabPod]) -> dict[str, Any]:
    """What a P/D fleet did, from the client's side (requests disaggregated, prefill
    legs that failed) and from the engines' own counters (legs served, KV pulled)."""
    transfers = sum(p.core.stats.nixl_xfer_time.count for p in pods)
    seconds = sum(p.core.stats.nixl_xfer_time.total for p in pods)
    return {
        "disaggregated": run.pd_requests,
        "fallbacks": run.pd_fallbacks,
        "roles": {p.name: p.role for p in pods},
        "prefill_legs_per_pod": {p.name: p.core.stats.prefill_legs for p in pods},
        "decode_legs_per_pod": {p.name: p.core.stats.decode_legs for p in pods},
        "kv_transfers": transfers,
        "kv_transfer_mean_s": seconds / transfers if transfers else None,
        "kv_transfer_bytes": sum(p.core.stats.nixl_bytes_transferred.total for p in pods),
        "external_prefix_cache_hits": sum(p.core.stats.external_prefix_cache_hits for p in pods),
    }


def _relative_errors(pairs: Sequence[tuple[float, float]]) -> list[float]:
    return [abs(p - o) / o for p, o in pairs if o > 0]


def prediction_error(pairs: Sequence[tuple[float, float]]) -> dict[str, float | None]:
    """How far a policy's TTFT predictions were from what it then observed, from
    its (predicted, observed) pairs in the order observed: the median and p90 of
    |predicted - observed| / observed, the median of the signed ratio predicted /
    observed - 1 (its bias), and the median error after warm-up (the pairs after
    the first `PREDICTION_WARMUP`; None for a run with no more). None without
    predictions."""
    if not pairs:
        return dict.fromkeys(PREDICTION_KEYS)
    absolute = _relative_errors(pairs)
    signed = [p / o - 1.0 for p, o in pairs if o > 0]
    warm = _relative_errors(pairs[PREDICTION_WARMUP:])
    return {
        "ttft_prediction_error_p50": percentile(absolute, 0.5),
        "ttft_prediction_error_p90": percentile(absolute, 0.9),
        "ttft_prediction_bias_p50": percentile(signed, 0.5),
        "ttft_prediction_error_p50_warm": percentile(warm, 0.5) if warm else None,
    }


def prediction_error_by_tenth(pairs: Sequence[tuple[float, float]]) -> list[float] | None:
    """The median relative error of each tenth of a run's predictions, in the order
    observed: where in a run the model errs (learning at the start, or a queue
    building later). None with fewer than ten pairs."""
    if len(pairs) < 10:
        return None
    tenths = [pairs[len(pairs) * i // 10 : len(pairs) * (i + 1) // 10] for i in range(10)]
    medians = [percentile(_relative_errors(part), 0.5) for part in tenths]
    return None if None in medians else [m for m in medians if m is not None]


def over_seeds(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The mean of each of `MEAN_KEYS` over the runs (one per seed), with its 95% CI
    half-width as `<key>_ci95`; None where a run has no value."""
    out: dict[str, Any] = {"seeds": len(runs)}
    for key in MEAN_KEYS:
        values = [r.get(key) for r in runs]
        known = [float(v) for v in values if v is not None]
        if len(known) < len(values) or not known:
            out[key], out[f"{key}_ci95"] = None, None
            continue
        out[key] = statistics.fmean(known)
        out[f"{key}_ci95"] = ci95(known)
    out["requests"] = runs[0]["requests"] if runs else 0
    out["status"] = "ok" if all(r["status"] == "ok" for r in runs) else "errors"
    if runs and all("tenants" in r for r in runs):
        out["tenants"] = over_seeds_tenants([r["tenants"] for r in runs])
    return out


# -- the whole lab run ----------------------------------------------------------------------


@dataclass(frozen=True)
class LabOptions:
    workload: WorkloadSpec
    policies: tuple[str, ...]
    fleet: FleetSpec
    seeds: tuple[int, ...]
    load: float | None  # a fraction of capacity; or
    rate: float | None  # requests/s; neither: a trace's own timestamps
    tokenizer: Path | None
    out: Path
    command: str
    progress: bool = False
    burst: int = 1  # Poisson arrivals in bursts of this many sessions
    # Write every run's requests to out/requests/<policy>-seed<seed>.jsonl.
    save_requests: bool = False


@dataclass(frozen=True)
class LabPolicy:
    """A config file run by the EPP's real code, or a peer's model (bench/lab/peers.py)."""

    name: str
    config: Path | None = None

    def describe(self) -> dict[str, Any]:
        if self.config is None:
            return {"kind": "model", "model": self.name}
        return {"kind": "epp", "config": portable_path(self.config)}

    def router_factory(self, registry: PluginRegistry, tokenizer: Path | None) -> RouterFactory:
        """`tokenizer`: the pods' (None: the simulator's built-in one), which the
        EPP uses for their model, as `bench run` does (`--tokenizer-dir`)."""
        if self.config is None:
            return PEER_MODELS[self.name]
        text = self.config.read_text(encoding="utf-8")
        source = str(self.config)
        local = ((MODEL, str(tokenizer)),) if tokenizer is not None else ()

        def make(pods: Sequence[LabPod], loop: EventLoop, fleet: FleetSpec, seed: int) -> Router:
            # Replica r draws from its own seed; replica 0 from the run's, so one
            # replica is exactly the single EPP.
            return EppRouter(
                [
                    LabEpp(text, source, pods, loop, fleet.delays, seed + 7919 * r, registry, local)
                    for r in range(fleet.epp_replicas)
                ]
            )

        return make


class PeerRouter:
    """A peer's model (bench/lab/peers.py) as a lab router: it answers every request
    at once, and reads no headers."""

    def __init__(self, model: SglangCacheAware | DynamoKv) -> None:
        self.model = model
        self.route_delay_s = model.route_delay_s
        self.ttft_predictions = model.ttft_predictions

    @property
    def wants_events(self) -> bool:
        return self.model.wants_events

    def on_events(self, pod: LabPod, events: Sequence[KVEvent]) -> None:
        self.model.on_events(pod, events)

    def route(
        self,
        request_id: str,
        body: bytes,
        prompt: Sequence[int],
        headers: Mapping[str, str],
        done: Callable[[Routed], None],
    ) -> None:
        done(self.model.route(request_id, body, prompt))

    def prefill_pod(self, handle: Any) -> LabPod | None:
        return self.model.prefill_pod(handle)

    def first_token(self, handle: Any) -> None:
        self.model.first_token(handle)

    def end(self, handle: Any, usage: Usage | None, completed: bool) -> None:
        self.model.end(handle, usage, completed)

    def close(self) -> None:
        self.model.close()

    def describe(self) -> dict[str, Any]:
        return self.model.describe()


def _sglang(pods: Sequence[LabPod], loop: EventLoop, fleet: FleetSpec, seed: int) -> Router:
    router = SglangCacheAware(pods, seed)
    router.route_delay_s = fleet.delays.peer_route_s
    return PeerRouter(router)


def _dynamo(pods: Sequence[LabPod], loop: EventLoop, fleet: FleetSpec, seed: int) -> Router:
    router = DynamoKv(pods, loop, fleet.delays.kv_event_s, seed)
    router.route_delay_s = fleet.delays.peer_route_s
    return PeerRouter(router)


PEER_MODELS: dict[str, RouterFactory] = {"sglang-cache-aware": _sglang, "dynamo-kv": _dynamo}


def resolve_lab_policy(spec: str) -> LabPolicy:
    """A peer model's name, a config file or a name in manifests/config/ (the real
    routers of `bench run` are not run in the lab)."""
    if spec in PEER_MODELS:
        return LabPolicy(spec)
    policy = resolve_policy(spec)
    if policy.kind != "epp" or policy.config is None:
        raise ValueError(
            f"{spec}: the lab runs EndpointPickerConfig files and the models of peers"
            f" ({', '.join(PEER_MODELS)}); the real peer routers run in `python -m bench run`"
        )
    return LabPolicy(policy.name, policy.config)


def build_workload(spec: WorkloadSpec, words: Words, seed: int) -> LabWorkload:
    if spec.name == "trace":
        if spec.trace_path is None:
            raise ValueError("the trace workload needs a trace file (--trace FILE)")
        return trace_workload(spec.trace_path, words, seed=seed, **spec.options)
    return from_workload(replace(spec, seed=seed).build(words), words)


def _bounds(
    workload: LabWorkload, words: Words, fleet: FleetSpec
) -> tuple[Bounds, TtftFloor | None, dict[RequestKey, int]]:
    """The hit-rate bounds of the workload's requests (bench/bounds.py), their TTFT
    floor (bench/lab/floor.py) and each request's h* hit tokens by (session id, turn
    index). A trace's prompts are built here as when sent (under a minute for the
    whole Mooncake trace); its answers are never part of a later prompt."""
    source = workload.source
    builder = PromptIds(words)
    answers: dict[int, list[int]] = {}
    keys: list[RequestKey] = []

    def sequences() -> Iterator[tuple[list[int], list[int]]]:
        if source is None:
            for lab_session in workload.sessions:
                for index, lab_turn in enumerate(lab_session.turns):
                    keys.append((lab_session.id, index))
                    yield lab_turn.build()[1], []
            return
        for session in source.nominal_sessions():
            for index, turn in enumerate(session.turns):
                found = answers.get(turn.max_tokens)
                if found is None:
                    found = answers[turn.max_tokens] = answer_ids(words.tokenizer, turn.max_tokens)
                keys.append((session.id, index))
                yield builder.ids(turn.messages), found

    hits: list[tuple[int, int]] = []
    bounds = compute_bounds(sequences(), fleet.engine.block_size, fleet.pods, hits)
    star = {key: hit for key, (_, hit) in zip(keys, hits, strict=True)}
    return bounds, ttft_floor(hits, fleet.engine, fleet.latency, fleet.delays), star


def run_lab(options: LabOptions) -> dict[str, Any]:
    """Every policy on every seed; writes results.json, report.md and plots."""
    from bench.lab.report import write_outputs

    started = time.monotonic()
    policies = [resolve_lab_policy(p) for p in options.policies]
    names = [p.name for p in policies]
    if len(set(names)) != len(names):
        raise ValueError(f"a policy is named twice: {', '.join(names)}")
    words = load_words(options.tokenizer)
    answer = answer_ids(words.tokenizer, 4096)
    registry = PluginRegistry.from_entry_points()
    latency = options.fleet.latency
    workloads = {seed: build_workload(options.workload, words, seed) for seed in options.seeds}
    first = workloads[options.seeds[0]]
    capacity = capacity_rps(first, options.fleet.pods, latency)
    # Rates: `offered` is in requests per second; Poisson arrivals start sessions,
    # so a multi-turn workload's sessions arrive at offered x sessions / requests
    # (`--rate` is in sessions per second, as in `bench run`).
    share = len(first.sessions) / first.num_requests
    arrival_rate: float | None
    if options.rate is not None:
        arrival_rate = options.rate
        offered = options.rate / share
    elif options.load is not None:
        offered = options.load * capacity
        arrival_rate = offered * share
    else:
        arrival_rate = None
        offered = _natural_rate(first)
    if options.workload.name in ("trace", "tenants") and arrival_rate is not None:
        # A trace (and the tenants workload, whose burst is in its arrival times)
        # keeps its own arrival pattern, scaled in time to the asked rate.
        speed = offered / _natural_rate(first)
        workloads = {seed: _scaled(w, speed) for seed, w in workloads.items()}
        arrival_rate = None
    if options.burst > 1 and arrival_rate is None:
        raise ValueError("bursts shape Poisson arrivals; a trace keeps its own timestamps")
    bounds, floor, first_star = _bounds(first, words, options.fleet)
    # Each seed's own requests' h* (a seed draws other prompts).
    star_hits = {
        seed: first_star if seed == options.seeds[0] else _bounds(w, words, options.fleet)[2]
        for seed, w in workloads.items()
    }
    factories = {p.name: p.router_factory(registry, options.tokenizer) for p in policies}
    runs: dict[str, list[dict[str, Any]]] = {p.name: [] for p in policies}
    total = len(policies) * len(options.seeds)
    with tqdm(total=total, disable=not options.progress, unit="run") as bar:
        for i, seed in enumerate(options.seeds):
            # Alternate the order of policies from seed to seed, as `bench run` does.
            order = policies if i % 2 == 0 else list(reversed(policies))
            for policy in order:
                bar.set_description(f"{policy.name} seed {seed}")
                result = run_once(
                    factories[policy.name],
                    workloads[seed],
                    options.fleet,
                    answer,
                    arrival_rate,
                    seed,
                    options.burst,
                    star_hits[seed],
                    keep_records=options.save_requests,
                )
                if options.save_requests:
                    write_requests(
                        result.pop("records"), options.out / "requests", policy.name, seed
                    )
                result["seed"] = seed
                result.update(policy.describe())
                runs[policy.name].append(result)
                bar.update()
    results = {name: {**over_seeds(rs), "runs": rs} for name, rs in runs.items()}
    fleet = options.fleet
    document = {
        "schema": 1,
        **provenance(options.command),
        "wall_seconds": round(time.monotonic() - started, 1),
        "setup": {
            "pods": fleet.pods,
            "prefill_pods": fleet.prefill_pods,
            "prefill_role": fleet.prefill_role,
            "seeds": len(options.seeds),
            "seed_list": list(options.seeds),
            "load": offered / capacity,
            "load_label": f"load {offered / capacity:.2f}"
            + (f", bursts of {options.burst}" if options.burst > 1 else ""),
            "burst": options.burst,
            "rate_rps": offered,
            "capacity_rps": capacity,
            "capacity_definition": "docs/lab.md#capacity",
            "engine": asdict(fleet.engine),
            "latency_model": asdict(fleet.latency),
            "delays": fleet.delays.to_json(),
            "epp_replicas": fleet.epp_replicas,
            "restarts": fleet.restarts,
            "tokenizer": portable_path(options.tokenizer) if options.tokenizer else "builtin",
            **(
                {"burst_window_s": list(window)}
                if (window := workloads[options.seeds[0]].burst_window_s) is not None
                else {}
            ),
        },
        "workload": first.describe(),
        "oracle": {**bounds.to_json(), **(floor.to_json() if floor is not None else {})},
        "policies": results,
    }
    write_outputs(document, options.out)
    return document


def write_requests(records: Sequence[Record], directory: Path, policy: str, seed: int) -> Path:
    """One run's requests, one JSON line each in the order they were scheduled (the
    fields of `bench run`'s requests.jsonl; times in virtual seconds), to
    `directory`/<policy>-seed<seed>.jsonl; returns its path."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{policy}-seed{seed}.jsonl"
    with path.open("w") as out:
        for record in records:
            out.write(json.dumps(record.to_json()) + "\n")
    return path


def _natural_rate(workload: LabWorkload) -> float:
    starts = [s.arrival_s or 0.0 for s in workload.sessions]
    span = max(starts) - min(starts) if starts else 0.0
    return len(starts) / span if span > 0 else math.inf


def _scaled(workload: LabWorkload, speed: float) -> LabWorkload:
    """A trace replayed `speed` times faster."""
    sessions = [replace(s, arrival_s=(s.arrival_s or 0.0) / speed) for s in workload.sessions]
    window = workload.burst_window_s
    return replace(
        workload,
        sessions=sessions,
        burst_window_s=None if window is None else (window[0] / speed, window[1] / speed),
    )
