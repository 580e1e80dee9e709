"""The EPP side of the lab: the real scheduling code, fed as production feeds it.

Built exactly as `epp serve` builds it (the config loader, the plugin registry's
entry points, the datastore, the director), on the lab's virtual clock. What the
lab does instead of the network:

- **Picks** go through `Director.pick_endpoint` with the request body a client
  would send, parsed by the EPP's own parser. A data producer that awaits (the
  precise scorer tokenizing in a worker thread) runs on a private asyncio loop
  until it is done; no virtual time passes meanwhile (the pick's time is the
  `route_s` delay).
- **Ends**: `Director.finish` with the usage the engine reports, when the response
  has ended at the client (in-flight counts and post-response plugins).
- **Metrics**: every pod is scraped every `metrics_interval_s`, each pod at its own
  phase of the interval; a scrape reads the pod's state at that moment and lands
  in the datastore `metrics_latency_s` later, with the endpoint's routed count as
  of that moment (`EndpointMetrics.routed_seen`, from the times of the picks that
  chose it). The datastore is brought up to date only when a pick is about to read
  it, which is when it matters.
- **Roles**: each pod's role is its `llm-d.ai/role` label in the datastore, as an
  endpoints file or Kubernetes gives it, for the role filters of a P/D config; a
  disaggregated decision names the prefill pod in its `x-prefiller-host-port`
  request header (`prefill_pod_of`).
- **Flow control** (a config with `featureGates: [flowControl]`): the controller
  runs on the lab's clock and sleeps in virtual time (`_sleep`: a future the event
  loop resolves when the time comes). A pick is then a task on the private asyncio
  loop: it returns at once when the controller dispatches the request on arrival,
  or waits in its queue until a lab event (a response's first chunk or end, the
  controller's own timer: its TTLs and its recheck per metrics interval) runs a
  dispatch pass that lets it go; `pick` hands the decision, or the 429/503 it was
  answered with, to its callback then. Every call that can run a pass (`finish`,
  `first_chunk`, the timer) first brings the datastore's metrics up to date, runs
  inside the private loop (so the controller can arm its timer), and lets every
  task that became runnable finish before the lab goes on (`_settle`). Configs
  without flow control are picked exactly as before, one at a time.
- **KV events**: a step's events are encoded as the engine publishes them
  (vLLM's msgpack), decoded by the EPP's own decoder and applied through the
  precise service's real ingestion, `kv_event_s` after the step ended. Only when
  the config has a precise prefix service.
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import math
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from bench.lab.loop import EventLoop
from bench.lab.pod import LabPod
from epp.config import load_config
from epp.datastore import Datastore, Endpoint, EndpointMetrics, EndpointSpec
from epp.director import Decision, Director
from epp.errors import EppError
from epp.flowcontrol import QueueItem
from epp.kvindex.events import decode_batch
from epp.kvindex.service import PrecisePrefixService
from epp.requests import PREFILLER_HEADER, parse_request
from epp.scheduling.interfaces import ServerSettings
from epp.scheduling.registry import PluginRegistry
from epp.scheduling.types import ResponseInfo, Usage
from epp.telemetry import Telemetry
from sim.kv_events import EventBatchEncoder, KVEvent

_HEADERS = {"content-type": "application/json"}
# The EPP's CPU time for one pick, charged in series to the picks flow control
# dispatches: a dispatch pass lets requests go as fast as the EPP can pick them,
# which bounds what it sends between two metrics scrapes (measured: a pick on 16
# pods, p50 0.91 ms, mean 1.04 ms, docs/results/pick/run-1.json). Picks without
# flow control arrive spread out and are not charged (their route delay covers it).
PICK_CPU_S = 0.001
# Where a deferred pick's outcome goes: the decision, or the error it was answered with.
PickCallback = Callable[["Decision | EppError"], None]
# The pods' role label (llm-d's, docs/disaggregation.md).
ROLE_LABEL = "llm-d.ai/role"


@dataclass(frozen=True)
class Delays:
    """How stale what the EPP sees is, and what the real stack adds to a request
    outside the engine, in virtual seconds. The defaults are measured on the real
    stack (`python -m bench.lab.calibrate`, docs/lab.md says which figure each one is)."""

    # Through Envoy and the EPP's pick: what that path adds over sending straight to
    # the pod (measured: round-robin 3.6, default 3.8, precise-prefix 5.1 ms + 9 us
    # per prompt token it tokenizes).
    route_s: float = 0.0038
    # ... plus, per prompt token the EPP tokenizes for the pick (text its tokenizer
    # has not seen: the precise prefix scorer), 9.3 us measured.
    route_per_token_s: float = 9.3e-6
    # Through a peer router's model: the transport of a gateway whose pick costs
    # nothing (round-robin through Envoy and the EPP: 3.6 ms measured), so that the
    # peers' algorithms are compared with ours as if they ran in the same gateway.
    # Their own routers' transport is measured where they really run (`bench run`).
    peer_route_s: float = 0.0036
    # In the pod before the engine takes the request (HTTP, parsing, chat template,
    # tokenizing), and the way back of the first and last token: 2.7 ms measured
    # straight to a simulated pod, less `response_s`; plus, per prompt token the
    # pod's prefix cache does not hold, the tokenizing of text the pod has not seen
    # (its tokenizer remembers the messages it tokenized): 9.2 us measured.
    pod_overhead_s: float = 0.0022
    pod_overhead_per_token_s: float = 9.2e-6
    # Engine first token / last token -> the client (and the EPP's end of stream).
    response_s: float = 0.0005
    # A step's KV events: published after the step, applied to the index
    # (measured: median 0.73 ms, mean 1.14 ms, `bench.lab.calibrate --parts staleness`).
    kv_event_s: float = 0.001
    # The metrics scrape period (GIE's --refresh-metrics-interval default) and
    # how long a scrape's answer takes to reach the datastore (measured: median
    # 2.3 ms, mean 2.6 ms, same run).
    metrics_interval_s: float = 0.05
    metrics_latency_s: float = 0.002

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (value >= 0 and math.isfinite(value)):
                raise ValueError(f"delay {name} must be a finite number >= 0, got {value}")
        if self.metrics_interval_s <= 0:
            raise ValueError("metrics_interval_s must be > 0")

    def to_json(self) -> dict[str, float]:
        return asdict(self)


class _LabDatastore(Datastore):
    """The datastore, remembering when each endpoint was chosen (the virtual time of
    every `acquire`), so that a scrape landing late can tell how many of them it
    was sent after."""

    def __init__(self, clock: Callable[[], float]) -> None:
        super().__init__()
        self._clock = clock
        self.routed_at: dict[Endpoint, list[float]] = {}

    def acquire(self, endpoint: Endpoint) -> None:  # type: ignore[override]
        Datastore.acquire(endpoint)
        self.routed_at.setdefault(endpoint, []).append(self._clock())

    def routed_by(self, endpoint: Endpoint, at: float) -> int:
        """How many requests had been routed to `endpoint` by virtual time `at`."""
        return bisect.bisect_right(self.routed_at.get(endpoint, ()), at)


class LabEpp:
    """One EPP process's scheduling side over the lab's pods."""

    def __init__(
        self,
        config_text: str,
        source: str,
        pods: Sequence[LabPod],
        loop: EventLoop,
        delays: Delays,
        seed: int,
        registry: PluginRegistry,
        tokenizer_dirs: Sequence[tuple[str, str]] = (),
    ) -> None:
        """`tokenizer_dirs`: (model, directory) pairs, as `epp serve --tokenizer-dir`
        gives them (the pods' tokenizer for their model)."""
        self.loop = loop
        self.delays = delays
        self.pods = list(pods)
        self.datastore = _LabDatastore(loop.clock)
        self.datastore.replace_all(
            EndpointSpec(p.name, p.address, labels={ROLE_LABEL: p.role} if p.role else {})
            for p in pods
        )
        self.endpoints = [self.datastore.get(p.name) for p in pods]
        self._by_name = {p.name: p for p in pods}
        self._by_address = {p.address: p for p in pods}
        telemetry = Telemetry(self.datastore)
        self.config = load_config(
            config_text,
            registry,
            source=source,
            datastore=self.datastore,
            clock=loop.clock,
            seed=seed,
            settings=ServerSettings(
                tokenizer_dirs=tuple(tokenizer_dirs),
                # Flow control's recheck while requests wait on a saturated pool.
                refresh_metrics_interval_s=delays.metrics_interval_s,
            ),
        )
        self.director = Director(self.datastore, self.config, telemetry, clock=loop.clock)
        self.flow_control = self.config.flow_control
        if self.flow_control is not None:
            # Its timers wait in virtual time (the config's build handed it the
            # wall clock's sleep; its clock is the lab's already).
            self.flow_control.sleep = self._sleep
            # A pick is over (for the controller) when the EPP's CPU has done it.
            self._picked = self.flow_control.picked
            self.flow_control.picked = self._pick_over  # type: ignore[method-assign]
        self.precise = [
            s for s in self.config.services.values() if isinstance(s, PrecisePrefixService)
        ]
        self._aio = asyncio.new_event_loop()
        for service in self.precise:
            self._aio.run_until_complete(service.tokenizers.load())
        self._encoder = EventBatchEncoder()
        rng = random.Random(f"lab-scrape-phases:{seed}")
        self._phases = [rng.uniform(0.0, delays.metrics_interval_s) for _ in pods]
        self._scraped = [-1] * len(self.pods)
        self._block_size = pods[0].core.config.block_size if pods else 0
        self._num_blocks = pods[0].core.config.num_gpu_blocks if pods else 0
        self.picks = 0
        self.refusals: dict[str, int] = {}
        # Tokens the EPP's tokenizers produced for the last pick.
        self.last_tokens_encoded = 0
        # Flow control: picks under way (waiting in the controller or being picked)
        # and their callbacks, the tasks that have ended (in the order they ended),
        # and what the queue held at most.
        self._waiting: dict[asyncio.Task[Decision], PickCallback] = {}
        self._ended: list[asyncio.Task[Decision]] = []
        self.queue_peak = 0
        self.queue_peak_bytes = 0
        # Picks take the EPP's CPU one at a time (PICK_CPU_S each): when it is free,
        # and when each pick's answer goes out (by task).
        self._cpu_free_at = 0.0
        self._answer_at: dict[asyncio.Task[Any], float] = {}
        self._charging = 0  # picks decided, their CPU time not over yet
        self.timer_wakeups = 0  # the controller's timer fired (a TTL, a recheck)
        self.idle_wakeups = 0  # ... with nothing queued: never, if it is idle when idle

    def close(self) -> None:
        for task in list(self._waiting):
            task.cancel()
        if self._waiting:
            self._settle()
        for service in self.precise:
            service.tokenizers.close()
        self._aio.close()

    # -- KV events -----------------------------------------------------------------------

    @property
    def wants_events(self) -> bool:
        return bool(self.precise)

    def on_events(self, pod: LabPod, events: Sequence[KVEvent]) -> None:
        payload = self._encoder.encode(self.loop.now(), events)
        endpoint = self.endpoints[pod.index]
        assert endpoint is not None

        def deliver() -> None:
            batch = decode_batch(payload)
            for service in self.precise:
                service.feed(endpoint, batch)

        self.loop.after(self.delays.kv_event_s, deliver)

    # -- metrics -------------------------------------------------------------------------

    def _refresh_metrics(self) -> None:
        """Every pod's metrics as of its latest scrape that has landed by now."""
        now = self.loop.now()
        interval = self.delays.metrics_interval_s
        latency = self.delays.metrics_latency_s
        for i, pod in enumerate(self.pods):
            k = math.floor((now - latency - self._phases[i]) / interval)
            if k < 0 or k == self._scraped[i]:
                continue
            self._scraped[i] = k
            taken = self._phases[i] + k * interval
            state = pod.state_at(taken)
            endpoint = self.endpoints[i]
            assert endpoint is not None
            self.datastore.set_metrics(
                pod.name,
                EndpointMetrics(
                    routed_seen=self.datastore.routed_by(endpoint, taken),
                    waiting_requests=state.waiting,
                    running_requests=state.running,
                    kv_cache_usage=state.kv_usage,
                    block_size=self._block_size,
                    num_gpu_blocks=self._num_blocks,
                    updated_at=taken + latency,
                ),
            )

    # -- requests ------------------------------------------------------------------------

    def pick(
        self,
        request_id: str,
        path: str,
        body: bytes,
        headers: Mapping[str, str] | None = None,
    ) -> Decision | None:
        """The EPP's decision for one request now, or None when it refused it (counted
        in `refusals` by the error's status). Without flow control only."""
        self._refresh_metrics()
        self.picks += 1
        before = self._tokens_encoded()
        try:
            request = parse_request(
                request_id=request_id,
                method="POST",
                path=path,
                headers=_HEADERS if not headers else {**_HEADERS, **headers},
                body=body,
            )
            return self._aio.run_until_complete(self.director.pick_endpoint(request))
        except EppError as error:
            self._refused(error)
            return None
        finally:
            self.last_tokens_encoded = self._tokens_encoded() - before

    def pick_later(
        self,
        request_id: str,
        path: str,
        body: bytes,
        headers: Mapping[str, str] | None,
        done: PickCallback,
    ) -> None:
        """With flow control: `done` gets the decision, or the error the request was
        answered with, when the controller lets it go or sheds it: at once, or at a
        later lab event."""
        assert self.flow_control is not None
        self._refresh_metrics()
        self.picks += 1
        try:
            request = parse_request(
                request_id=request_id,
                method="POST",
                path=path,
                headers=_HEADERS if not headers else {**_HEADERS, **headers},
                body=body,
            )
        except EppError as error:
            self._refused(error)
            done(error)
            return
        task = self._aio.create_task(self.director.pick_endpoint(request))
        self._waiting[task] = done
        task.add_done_callback(self._ended.append)
        self._settle()

    def _refused(self, error: EppError) -> None:
        key = f"{error.status} {type(error).__name__}"
        self.refusals[key] = self.refusals.get(key, 0) + 1

    def _pick_over(self, item: QueueItem) -> None:
        """The director's `controller.picked(item)`, at the end of a dispatched
        request's pick: charged to the EPP's CPU in series. The pick starts when the
        CPU is free, its answer goes out then (the route delay covers its own cost,
        as without flow control), and the controller hears that it is over
        PICK_CPU_S later, when the CPU is free for the next one."""
        now = self.loop.now()
        start = max(now, self._cpu_free_at)
        self._cpu_free_at = start + PICK_CPU_S
        task = asyncio.current_task()
        if task is not None:
            self._answer_at[task] = start
        self._charging += 1

        def over() -> None:
            self._charging -= 1
            self._picked(item)

        self.loop.at(self._cpu_free_at, lambda: self._call(over))

    def _sleep(self, seconds: float) -> asyncio.Future[None]:
        """The controller's `sleep`: a future resolved by the lab's event loop
        `seconds` of virtual time from now (unless the timer was cancelled)."""
        future: asyncio.Future[None] = self._aio.create_future()

        def wake() -> None:
            if future.done():
                return  # the timer was cancelled (re-armed, or the queue emptied)
            self.timer_wakeups += 1
            assert self.flow_control is not None
            if not self.flow_control.queued:
                self.idle_wakeups += 1
            self._refresh_metrics()
            future.set_result(None)
            self._settle()

        self.loop.after(seconds, wake)
        return future

    def _call(self, action: Callable[[], None]) -> None:
        """Run a director call that may start a dispatch pass: inside the private
        loop (the controller arms its timer there), on metrics as fresh as a pass
        would read them, then everything it made runnable."""
        self._refresh_metrics()
        failed: list[BaseException] = []

        def run() -> None:
            try:
                action()
            except Exception as error:  # re-raised below, outside the loop
                failed.append(error)

        self._aio.call_soon(run)
        self._settle()
        if failed:
            raise failed[0]

    def _settle(self) -> None:
        """Run the private loop until nothing is runnable and no dispatched request
        is still being picked, handing each ended pick to its callback, in the order
        the picks ended. No virtual time passes."""
        loop = self._aio
        controller = self.flow_control
        ready = loop._ready  # type: ignore[attr-defined]  # asyncio's run queue
        while True:
            loop.call_soon(loop.stop)
            loop.run_forever()
            if controller is not None:
                self.queue_peak = max(self.queue_peak, controller.queued)
                self.queue_peak_bytes = max(self.queue_peak_bytes, controller.queued_bytes)
            while self._ended:
                task = self._ended.pop(0)
                done = self._waiting.pop(task)
                at = self._answer_at.pop(task, None)
                if task.cancelled():
                    continue
                error = task.exception()
                if error is None:
                    outcome: Decision | EppError = task.result()
                elif isinstance(error, EppError):
                    self._refused(error)
                    outcome = error
                else:
                    raise error
                if at is None or at <= self.loop.now():
                    done(outcome)
                else:
                    self.loop.at(at, functools.partial(done, outcome))
            if ready:
                continue
            if controller is not None and controller.picking > self._charging:
                # A dispatched pick waits on a worker thread (a tokenizer).
                time.sleep(0.0001)
                continue
            return

    def _tokens_encoded(self) -> int:
        return sum(s.tokenizers.tokens_encoded() for s in self.precise)

    def first_chunk(self, decision: Decision) -> None:
        if self.flow_control is None:
            self.director.first_chunk(decision)
        else:
            self._call(lambda: self.director.first_chunk(decision))

    def finish(self, decision: Decision, usage: Usage | None, completed: bool = True) -> None:
        info = ResponseInfo(
            completed=completed,
            status=200 if completed else None,
            usage=usage,
            duration_s=self.loop.now() - decision.picked_at,
        )
        if self.flow_control is None:
            self.director.finish(decision, info)
        else:
            self._call(lambda: self.director.finish(decision, info))

    def pod_of(self, decision: Decision) -> LabPod:
        return self._by_name[decision.endpoint.name]

    def prefill_pod_of(self, decision: Decision) -> LabPod | None:
        """The pod a disaggregated decision runs the prefill on (its
        `x-prefiller-host-port` header), or None: the request runs whole."""
        address = decision.result.request_headers.get(PREFILLER_HEADER)
        return None if address is None else self._by_address[address]

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"picks": self.picks, "refusals": dict(self.refusals)}
        controller = self.flow_control
        if controller is not None:
            out["flow_control"] = {
                "queue_peak": self.queue_peak,
                "queue_peak_bytes": self.queue_peak_bytes,
                "queued_at_end": controller.queued,
                "picks_waiting_at_end": len(self._waiting),
                "dispatch_passes": controller.passes,
                "timer_wakeups": self.timer_wakeups,
                "timer_wakeups_with_empty_queue": self.idle_wakeups,
            }
        return out
