"""The director: from a parsed request to a routing decision, and back at its end.

    pick_endpoint:  candidates -> admission (priority; shed a sheddable request
                    while the pool is saturated; admitters) -> data producers ->
                    scheduler -> (side effects: in-flight count, pre-request
                    plugins) -> Decision
    finish:         in-flight count released, post-response plugins, metrics
    explain:        the same pick, stopping before the side effects

With the `flowControl` feature gate on (the config's `flow_control`), admission is
the flow controller's instead: the request waits in its priority band until the
controller dispatches it (or sheds it: 429/503 with Retry-After), and only then are
the candidates read again and the endpoint picked, on the pool as it is at that
moment (late binding). Nothing is shed by the detector directly. A request's end
and its first chunk tell the controller that capacity may have freed.

Admission runs before the data producers, so a request that is shed costs no
tokenizing or index lookup.

`explain` and `pick_endpoint` share `_schedule`, so /debug/explain shows exactly
what a real pick would do on the same state.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from epp import defaults
from epp.clock import SYSTEM_CLOCK, Clock
from epp.config import SchedulingConfig
from epp.config.defaults import DEFAULT_PRIORITY
from epp.datastore import Datastore, Endpoint
from epp.errors import EppError, NoCapacity, Shed, Unavailable
from epp.flowcontrol import fairness_id_of, objective_of
from epp.requests import InferenceRequest, rewrite_model
from epp.scheduling.types import (
    EXPLAIN_NOTES,
    PRIORITY,
    UNEXPLAINED,
    CycleState,
    ProfileResult,
    ResponseInfo,
    SchedulingResult,
)
from epp.stalls import StallWatch
from epp.telemetry import Telemetry

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class Decision:
    """A routed request, from its pick to its end."""

    request: InferenceRequest
    config: SchedulingConfig  # the configuration that picked it runs its end too
    cycle: CycleState
    result: SchedulingResult
    destinations: str  # "ip:port[,ip:port...]", primary first
    body: bytes  # what goes upstream: the request body, or its rewrite
    picked_at: float  # the director's clock at the pick
    first_chunk_at: float | None = None  # the director's clock at the first response chunk
    # The first-chunk hooks are still to run (`Director.first_chunk` with `defer`).
    first_chunk_pending: bool = False
    finished: bool = False
    # Its number among the director's decisions: its key in the stall watch's
    # records of the endpoint (epp/stalls.py).
    number: int = 0

    @property
    def endpoint(self) -> Endpoint:
        return self.result.targets[0]

    @property
    def body_changed(self) -> bool:
        return self.body is not self.request.body


def _in_subset(endpoint: Endpoint, subset: frozenset[str]) -> bool:
    if endpoint.address in subset:
        return True
    host = endpoint.address.rsplit(":", 1)[0]
    return host in subset


class Director:
    def __init__(
        self,
        datastore: Datastore,
        config: SchedulingConfig,
        telemetry: Telemetry,
        clock: Clock = SYSTEM_CLOCK,
        stall_threshold_s: float = defaults.STALL_THRESHOLD.seconds,
    ) -> None:
        """`clock` times requests (their pick, their duration); the pick's own CPU
        cost is measured on `time.perf_counter` for the latency histograms.
        `stall_threshold_s`: epp/stalls.py (0: no endpoint is ever stalled)."""
        self.datastore = datastore
        self.clock = clock
        self.stalls = StallWatch(stall_threshold_s, lambda _: telemetry.endpoint_stalls.inc())
        # Replaced as a whole on reload (`swap_config`); a request keeps the config
        # that picked it, to its end.
        self.config = config
        self.telemetry = telemetry
        # id(config) -> requests using it (from the start of their pick to their
        # end), and who waits for a retired config to fall idle. By id: a config is
        # not hashable, and a config in use is alive, so its id is not reused.
        self._users: dict[int, int] = {}
        self._idle: dict[int, asyncio.Event] = {}
        self._decisions = 0  # decisions made: the next one's `number`

    # -- configuration in use -------------------------------------------------------

    def swap_config(self, config: SchedulingConfig) -> SchedulingConfig:
        """Make `config` the one new requests get; the previous one (requests that
        already have it keep it to their end)."""
        old, self.config = self.config, config
        return old

    def users(self, config: SchedulingConfig) -> int:
        """Requests that hold `config`: picking, or routed and not finished."""
        return self._users.get(id(config), 0)

    async def wait_idle(self, config: SchedulingConfig) -> None:
        """Return once no request holds `config`."""
        if self.users(config) == 0:
            return
        event = self._idle.setdefault(id(config), asyncio.Event())
        await event.wait()

    def _retain(self, config: SchedulingConfig) -> None:
        key = id(config)
        self._users[key] = self._users.get(key, 0) + 1

    def _release(self, config: SchedulingConfig) -> None:
        key = id(config)
        left = self._users.get(key, 0) - 1
        if left > 0:
            self._users[key] = left
            return
        self._users.pop(key, None)
        event = self._idle.pop(key, None)
        if event is not None:
            event.set()

    def candidates(self, subset: Sequence[str] | None) -> tuple[Endpoint, ...]:
        """Ready endpoints, restricted to Envoy's subset hint when it sent one, less
        those whose server is down by its metrics scrapes (`EndpointMetrics.down`):
        it refused the latest (killed, restarting, not started yet), or has
        answered none for longer than `--metrics-staleness-threshold` (hung); and
        less those whose engine has stalled (epp/stalls.py: requests wait there for
        their first token and nothing progresses, while the server answers).

        A request sent to such a pod fails, or hangs. Left to the scorers it would
        draw its share and more: a dead pod's requests fail at once, so it reads
        as the least loaded, and a hung pod keeps the prompt groups it holds.
        Every config gets this, with or without `stale-metrics-filter` (which also
        drops pods whose metrics are merely old). When every candidate is down
        they all stay: the scraping (a blocked or wrong metrics port) is then the
        likelier fault, and refusing all traffic over it would make it an outage;
        likewise when every one left is stalled."""
        return self._candidates(subset, record=False).endpoints

    def _candidates(self, subset: Sequence[str] | None, record: bool) -> _Candidates:
        """`candidates`, and the ready endpoints left out. `record`: a pick, which
        may start a stall (explain's look changes nothing)."""
        endpoints = self.datastore.ready_endpoints()
        if subset is not None:
            if not subset:
                raise Unavailable("the proxy's endpoint subset hint is empty")
            wanted = frozenset(subset)
            endpoints = tuple(e for e in endpoints if _in_subset(e, wanted))
            if not endpoints:
                raise Unavailable(
                    "no ready endpoint is in the proxy's endpoint subset hint"
                    f" ({', '.join(sorted(wanted))})"
                )
        elif not endpoints:
            raise Unavailable("no ready endpoint in the pool")
        now = self.clock()
        # Every pick looks at every endpoint twice: the common case (scrapes
        # answered, progress within the threshold) is one attribute test each.
        down: tuple[Endpoint, ...] = ()
        found = [
            e for e in endpoints if ((m := e.metrics).unreachable or m.unanswered) and m.down(now)
        ]
        if found and len(found) < len(endpoints):
            down = tuple(found)
            endpoints = tuple(e for e in endpoints if e not in found)
        watch = self.stalls
        stalled: tuple[Endpoint, ...] = ()
        if watch.threshold_s > 0:
            quiet_before = now - watch.threshold_s
            found = [
                e
                for e in endpoints
                if (
                    ((p := e.progress).awaiting and p.quiet_since < quiet_before)
                    or now < p.excluded_until
                )
                and watch.check(e, now, record)
            ]
            if found and len(found) < len(endpoints):
                stalled = tuple(found)
                endpoints = tuple(e for e in endpoints if e not in found)
        return _Candidates(endpoints, down, stalled)

    @staticmethod
    def _priority(config: SchedulingConfig, request: InferenceRequest) -> int:
        """The request's priority: its objective's (x-llm-d-inference-objective, or
        x-gateway-inference-objective), DEFAULT_PRIORITY without one."""
        objective = objective_of(request)
        if not objective:
            return DEFAULT_PRIORITY
        return config.objectives.get(objective, DEFAULT_PRIORITY)

    def _admit(
        self,
        config: SchedulingConfig,
        request: InferenceRequest,
        cycle: CycleState,
        candidates: Sequence[Endpoint],
        report: dict[str, Any] | None = None,
    ) -> None:
        """Without flow control: raise `Shed` (429), or an admitter's error, if the
        request may not be scheduled now. `report` receives the pool's saturation
        when it was looked at (for /debug/explain)."""
        priority = self._priority(config, request)
        cycle.put(PRIORITY, priority)
        detector = config.saturation_detector
        if detector is not None and priority < 0:
            # Only sheddable requests pay for the look at the pool.
            t0 = time.perf_counter()
            saturation = detector.plugin.saturation(candidates)
            detector.observe(time.perf_counter() - t0)
            if report is not None:
                report["saturation"] = saturation
            if saturation >= 1.0:
                raise Shed(
                    f"the pool is saturated (saturation {saturation:.2f} by {detector.name})"
                    f" and objective {objective_of(request)!r} has priority {priority} < 0:"
                    " the request is shed"
                )
        self._run_admitters(config, request, cycle, candidates)

    @staticmethod
    def _run_admitters(
        config: SchedulingConfig,
        request: InferenceRequest,
        cycle: CycleState,
        candidates: Sequence[Endpoint],
    ) -> None:
        for slot in config.admitters:
            t0 = time.perf_counter()
            try:
                slot.plugin.admit(request, cycle, candidates)
            except EppError:
                raise
            except Exception:
                # A broken admitter must not stop the traffic it was meant to shape.
                log.exception("admitter %s failed; admitting the request", slot.name)
            finally:
                slot.observe(time.perf_counter() - t0)

    async def _schedule(
        self,
        config: SchedulingConfig,
        request: InferenceRequest,
        cycle: CycleState,
        candidates: Sequence[Endpoint],
    ) -> SchedulingResult:
        started = time.perf_counter()
        for slot in config.data_producers:
            t0 = time.perf_counter()
            try:
                await slot.plugin.prepare(request, cycle, candidates)
            except Exception:
                # A producer feeds optional data: the pick goes on without it.
                log.exception("data producer %s failed; scheduling without its data", slot.name)
            slot.observe(time.perf_counter() - t0)
        result = config.scheduler.schedule(request, cycle, candidates)
        self.telemetry.scheduler_duration.observe(time.perf_counter() - started)
        return result

    async def pick_endpoint(
        self,
        request: InferenceRequest,
        subset: Sequence[str] | None = None,
        *,
        on_wait: Callable[[], object] | None = None,
        reports_first_chunk: bool = True,
    ) -> Decision:
        """Choose where `request` goes and account for it as in flight there.

        Raises an `EppError` (503 nothing available, 429 everything filtered out).
        `on_wait`: called if the request is queued by flow control (the controller's
        `admit`), never otherwise; cancelling the caller then takes it out of the
        queue. `reports_first_chunk`: the caller will call `first_chunk` when the
        response's first chunk comes (not in lean mode), so a request still
        waiting for it tells the stall watch something (epp/stalls.py)."""
        config = self.config
        self._retain(config)
        try:
            return await self._pick(config, request, subset, on_wait, reports_first_chunk)
        except BaseException:
            # Cancelled or refused before a decision: nothing will finish it.
            self._release(config)
            raise

    async def _pick(
        self,
        config: SchedulingConfig,
        request: InferenceRequest,
        subset: Sequence[str] | None,
        on_wait: Callable[[], object] | None,
        reports_first_chunk: bool,
    ) -> Decision:
        found = self._candidates(subset, record=True)
        candidates = found.endpoints
        cycle = CycleState()
        cycle.put(UNEXPLAINED, True)  # only `explain`'s own picks keep notes
        controller = config.flow_control
        if controller is None:
            self._admit(config, request, cycle, candidates)
            return await self._decide(config, request, cycle, found, reports_first_chunk)
        priority = self._priority(config, request)
        cycle.put(PRIORITY, priority)
        # Waits while the pool is saturated; cancelled with the stream, the request
        # leaves its queue at once.
        item = await controller.admit(
            request.request_id,
            priority,
            fairness_id_of(request),
            len(request.body),
            on_wait=on_wait,
        )
        try:
            # Late binding: the pool as it is now, not as it was when the request came.
            found = self._candidates(subset, record=True)
            candidates = found.endpoints
            self._run_admitters(config, request, cycle, candidates)
            return await self._decide(config, request, cycle, found, reports_first_chunk)
        finally:
            controller.picked(item)

    async def _decide(
        self,
        config: SchedulingConfig,
        request: InferenceRequest,
        cycle: CycleState,
        found: _Candidates,
        reports_first_chunk: bool,
    ) -> Decision:
        result = await self._schedule(config, request, cycle, found.endpoints)
        targets = result.targets
        if not targets:
            profile = result.profiles[result.primary_profile]
            raise NoCapacity(_no_capacity_message(profile, found))
        # The rewrite may still fail (BadRequest): it runs before the pick has any
        # effect, so a request that is rejected never holds an in-flight slot.
        body = (
            rewrite_model(request.body, request.target_model)
            if request.model_rewritten
            else request.body
        )
        # From here on the pick has effects: nothing may await or raise until it is
        # returned, so concurrent picks always see each other's in-flight counts and
        # every acquire is matched by the release in `finish`.
        primary = targets[0]
        self.datastore.acquire(primary)
        for slot in config.pre_request:
            t0 = time.perf_counter()
            try:
                slot.plugin.pre_request(request, cycle, result)
            except Exception:
                log.exception("pre-request plugin %s failed", slot.name)
            slot.observe(time.perf_counter() - t0)
        decision = Decision(
            request=request,
            config=config,
            cycle=cycle,
            result=result,
            destinations=",".join(e.address for e in targets),
            body=body,
            picked_at=self.clock(),
            number=self._decisions,
        )
        self._decisions += 1
        self.stalls.routed(primary, decision.number, decision.picked_at, reports_first_chunk)
        return decision

    def first_chunk(self, decision: Decision, defer: bool = False) -> None:
        """The first chunk of a routed request's successful response body arrived:
        its time is read now. The plugins' first-chunk hooks run now or, with
        `defer`, on the event loop's next turn, once the caller has handed the
        chunk on: the client's first token then does not wait for them (the
        predicted-TTFT producer's fit takes about 0.07 ms). A request that ends
        first runs them at its end, before its post-response hooks, so every
        plugin still sees the first chunk before the end. Idempotent, and
        nothing once the request has ended."""
        if decision.first_chunk_at is not None or decision.finished:
            return
        decision.first_chunk_at = self.clock()
        decision.first_chunk_pending = True
        self.stalls.first_chunk(decision.endpoint, decision.number, decision.first_chunk_at)
        if defer:
            asyncio.get_running_loop().call_soon(self._first_chunk_hooks, decision)
        else:
            self._first_chunk_hooks(decision)

    def _first_chunk_hooks(self, decision: Decision) -> None:
        if not decision.first_chunk_pending or decision.first_chunk_at is None:
            return
        decision.first_chunk_pending = False
        elapsed = decision.first_chunk_at - decision.picked_at
        for slot in decision.config.response_first_chunk:
            t0 = time.perf_counter()
            try:
                slot.plugin.response_first_chunk(
                    decision.request, decision.cycle, decision.result, elapsed
                )
            except Exception:
                log.exception("first-chunk plugin %s failed", slot.name)
            slot.observe(time.perf_counter() - t0)
        if decision.config.flow_control is not None:
            # The prefill is over: an engine's queue may have room again.
            decision.config.flow_control.notify()

    def finish(self, decision: Decision, response: ResponseInfo) -> None:
        """End a routed request. Idempotent: only the first call counts."""
        if decision.finished:
            return
        self._first_chunk_hooks(decision)  # deferred and not yet run: before the end
        decision.finished = True
        primary = decision.endpoint
        self.datastore.release(primary)
        self.stalls.ended(primary, decision.number, self.clock(), response.completed)
        (self.telemetry.completed if response.completed else self.telemetry.aborted).inc()
        usage = response.usage
        if usage is not None:
            self.telemetry.prompt_tokens.observe(usage.prompt_tokens)
            self.telemetry.completion_tokens.observe(usage.completion_tokens)
            self.telemetry.prompt_tokens_total.inc(usage.prompt_tokens)
            self.telemetry.cached_prompt_tokens.inc(usage.cached_tokens)
        for slot in decision.config.post_response:
            t0 = time.perf_counter()
            try:
                slot.plugin.post_response(
                    decision.request, decision.cycle, decision.result, response
                )
            except Exception:
                log.exception("post-response plugin %s failed", slot.name)
            slot.observe(time.perf_counter() - t0)
        self._release(decision.config)
        if decision.config.flow_control is not None:
            decision.config.flow_control.notify()  # capacity freed: dispatch the next

    async def explain(
        self, request: InferenceRequest, subset: Sequence[str] | None = None
    ) -> dict[str, Any]:
        """What `pick_endpoint` would decide now, with every score, changing nothing."""
        config = self.config
        self._retain(config)
        try:
            return await self._explain(config, request, subset)
        finally:
            self._release(config)

    async def _explain(
        self, config: SchedulingConfig, request: InferenceRequest, subset: Sequence[str] | None
    ) -> dict[str, Any]:
        found = self._candidates(subset, record=False)
        candidates = found.endpoints
        cycle = CycleState()
        shed: str | None = None
        admission: dict[str, Any] = {}
        controller = config.flow_control
        try:
            if controller is None:
                self._admit(config, request, cycle, candidates, admission)
            else:
                priority = self._priority(config, request)
                cycle.put(PRIORITY, priority)
                # Where the request would wait, and whether it would.
                admission["flowControl"] = controller.explain(priority, fairness_id_of(request))
                self._run_admitters(config, request, cycle, candidates)
        except EppError as error:
            # Shown with the scores the request would have got, for debugging.
            shed = error.message
        try:
            result = await self._schedule(config, request, cycle, candidates)
        except EppError as error:  # a filter refused the request
            return {
                "error": error.message,
                "picked": [],
                "priority": cycle.get(PRIORITY),
                "notes": cycle.get(EXPLAIN_NOTES) or {},
            }
        primary = result.profiles[result.primary_profile]
        out = _explain_profile(primary)
        out["priority"] = cycle.get(PRIORITY)
        # Ready, but left out before the profiles ran: their server is down by its
        # metrics scrapes, or their engine has stalled (/debug/endpoints says why).
        out["down"] = [e.name for e in found.down]
        out["stalled"] = [e.name for e in found.stalled]
        out.update(admission)
        # What plugins said about their part (e.g. only the first blocks of a long
        # prompt were matched).
        out["notes"] = cycle.get(EXPLAIN_NOTES) or {}
        if result.request_headers:
            # What the request would carry upstream beside the destination (a
            # disaggregated pick's prefill endpoint).
            out["requestHeaders"] = dict(result.request_headers)
        if shed is not None:
            out["error"] = shed
            out["picked"] = []
        elif not primary.targets:
            out["error"] = _no_capacity_message(primary, found)
        return out


@dataclass(frozen=True, slots=True)
class _Candidates:
    endpoints: tuple[Endpoint, ...]
    down: tuple[Endpoint, ...]  # left out: down by their metrics scrapes
    stalled: tuple[Endpoint, ...]  # left out: their engine has stalled (epp/stalls.py)


def _no_capacity_message(result: ProfileResult, found: _Candidates) -> str:
    candidates = len(found.endpoints)
    if not result.filtered_out:
        message = f"the picker chose none of the {candidates} candidate endpoints"
    else:
        removed = "; ".join(f"{name} removed {len(e)}" for name, e in result.filtered_out.items())
        message = f"all {candidates} candidate endpoints were filtered out ({removed})"
    # A filter that names its endpoints (a testing header) may have named these.
    if found.down:
        names = ", ".join(e.name for e in found.down)
        message += f"; not candidates, as down by their metrics scrapes: {names}"
    if found.stalled:
        names = ", ".join(e.name for e in found.stalled)
        message += f"; not candidates, as stalled (no first token for too long): {names}"
    return message


def _explain_profile(result: ProfileResult) -> dict[str, Any]:
    candidates = [
        {
            "name": s.endpoint.name,
            "address": s.endpoint.address,
            "scores": {name: scores[s.endpoint] for name, scores in result.scores.items()},
            "total": s.score,
        }
        for s in sorted(result.scored, key=lambda s: s.score, reverse=True)
    ]
    return {
        "profile": result.profile,
        "candidates": candidates,
        "filteredOut": {
            name: [e.name for e in removed] for name, removed in result.filtered_out.items()
        },
        "picked": [e.address for e in result.targets],
    }
