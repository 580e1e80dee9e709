"""A simulated pod in virtual time: the simulator's engine core, stepped by the
lab's event loop, with what the EPP can see of it.

- **Steps**: as `sim.engine.Engine` runs them, back to back while there is work,
  each taking the latency model's time; a request that arrives while the engine
  is idle starts a step at once.
- **Outputs**: the lab's client times a request's first token and its end, and
  nothing else, so only those are put to its sink: the engine core then need not
  touch a decoding request in the steps between (`EngineRequest.quiet`), which is
  most steps. Every step still happens, at the same time, as one loop event.
- **KV events**: each step's batch goes to `on_events` when the step ends (the
  EPP side adds the delivery delay). With no `on_events`, the block pool does not
  make them.
- **Prefill/decode disaggregation**: a pod has a role (`llm-d.ai/role`, None:
  unlabelled); a prefill leg and a decode leg are submitted as the simulator's
  sidecar submits them (`remote_decode`, `remote`). A decode leg waiting for its KV
  transfer needs no step: the pod wakes itself when the transfer ends
  (`EngineCore.next_ready_at`).
- **Restarts** (`restart`): at the end of the step in progress (at once when
  idle) the engine process starts again: every request in flight gets an error
  output, the cache is empty, and the pod keeps serving under the same address.
  The new engine's KV-event stream starts afresh; a subscriber learns it from the
  sequence numbers going back and clears what it held for the pod. The lab has no
  sequence numbers, so the restarted engine's first batch starts with
  `AllBlocksCleared`, which clears the same entries at the same moment. The pod's
  counters run on over the restart: they are the run's totals.
- **Metrics**: the EPP scrapes every pod every refresh interval; what a scrape
  returns is the pod's state at the moment it was taken. The pod keeps a short
  history of its state (waiting, running, KV usage after every change) so the
  EPP side can read it as of any recent scrape time (`state_at`) without a scrape
  event every 50 ms for every pod.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.lab.loop import EventLoop
from sim.engine import (
    EngineConfig,
    EngineCore,
    EngineRequest,
    OutputSink,
    RemotePrefill,
    Step,
    TokenOutput,
)
from sim.kv_cache import TokenSequence
from sim.kv_events import AllBlocksCleared, KVEvent
from sim.latency import LatencyModel

# How much state history a pod keeps (virtual seconds): longer than any scrape
# interval plus delivery delay the lab is run with.
HISTORY_S = 5.0
# Scheduling that preempts and schedules nothing is retried at once, as the
# engine's loop does; this many times in a row means the model is stuck.
MAX_EMPTY_STEPS = 10_000


@dataclass(frozen=True, slots=True)
class PodState:
    """What a metrics scrape reads."""

    waiting: int
    running: int
    kv_usage: float


EventsHandler = Callable[["LabPod", Sequence[KVEvent]], None]


class _Outputs:
    """A request's sink as the engine holds it: lets go of the real one after the
    end. The lab's client references its engine request back; without this each
    request and all it holds (tokens, blocks, the router's decision) would wait
    for the garbage collector."""

    __slots__ = ("sink",)

    def __init__(self, sink: OutputSink) -> None:
        self.sink: OutputSink | None = sink

    def put_nowait(self, item: TokenOutput, /) -> None:
        sink = self.sink
        assert sink is not None, "an output after the end"
        if item.finish_reason is not None or item.error is not None:
            self.sink = None
        sink.put_nowait(item)


class LabPod:
    def __init__(
        self,
        index: int,
        config: EngineConfig,
        answer_token_ids: Sequence[int],
        loop: EventLoop,
        latency: LatencyModel | None = None,
        on_events: EventsHandler | None = None,
        role: str | None = None,
    ) -> None:
        self.index = index
        self.name = f"pod-{index}"
        # Addresses as a pool's pods have them; nothing listens on them.
        self.address = f"10.{index // 250}.{index % 250}.1:8000"
        # Its `llm-d.ai/role` label (None: none, a pod serving whole requests).
        self.role = role
        self.loop = loop
        self.core = EngineCore(config, answer_token_ids, latency, clock=loop.now)
        self.core.engine_id = self.name
        # When the pod is to wake for a KV transfer's end (None: no wake-up pending).
        self._wake_at: float | None = None
        self.on_events = on_events
        self._stepping = False
        self._step: Step | None = None  # the step in flight
        self._end_step_action = self._end_step  # bound once: scheduled every step
        self._times: list[float] = []
        self._states: list[PodState] = []
        # (waiting, running, free blocks) of the last state recorded.
        self._last_state: tuple[int, int, int] | None = None
        self.busy_s = 0.0
        self._restart_due = False  # at the end of the step in progress
        self._cleared = False  # the next KV-event batch starts with AllBlocksCleared
        self._record()

    @property
    def on_events(self) -> EventsHandler | None:
        return self._on_events

    @on_events.setter
    def on_events(self, handler: EventsHandler | None) -> None:
        # Events nobody reads are not made (BlockStored copies its blocks' tokens).
        self._on_events = handler
        self.core.kv.pool.record_events = handler is not None

    # -- requests ---------------------------------------------------------------------

    def submit(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        outputs: OutputSink,
        cache_salt: str | None = None,
        sequence: TokenSequence | None = None,
        remote_decode: bool = False,
        remote: RemotePrefill | None = None,
    ) -> EngineRequest:
        """`remote_decode`: a prefill leg; `remote`: a decode leg (sim/engine.py)."""
        request = self.core.add_request(
            prompt_token_ids,
            max_tokens,
            "length",
            _Outputs(outputs),
            cache_salt,
            stream=True,
            sequence=sequence,
            quiet=True,  # the first token and the end only (module docstring)
            remote_decode=remote_decode,
            remote=remote,
        )
        self._record()
        if not self._stepping:
            self._start_step()
        return request

    def prepare(self, prompt_token_ids: Sequence[int]) -> tuple[TokenSequence, int]:
        """The prompt's sequence for `submit`, and how many of its tokens the pod's
        prefix cache does not hold now."""
        kv = self.core.kv
        sequence = kv.new_sequence(prompt_token_ids)
        hits = kv.find_prefix_hit(sequence)
        return sequence, len(prompt_token_ids) - len(hits) * self.core.config.block_size

    # -- restarts ---------------------------------------------------------------------

    def restart(self) -> None:
        """The engine process restarts (module docstring), now if it is idle, else
        when the step in progress ends (its work is lost with the process)."""
        if self._stepping:
            self._restart_due = True
            return
        self._restart_now()

    def _restart_now(self) -> None:
        stats = self.core.stats
        self.core.restart()  # every request in flight gets its error output
        self.core.stats = stats
        self.core.kv.pool.record_events = self._on_events is not None
        self._cleared = True
        self._record()

    # -- steps ------------------------------------------------------------------------

    def _start_step(self) -> None:
        core = self.core
        for _ in range(MAX_EMPTY_STEPS):
            step = core.begin_step()
            if step.scheduled or step.quiet:  # not empty
                break
            self._emit()
            if not step.preempted:
                self._stepping = False
                self._record()
                if core.receiving:
                    self._wake_for_transfer()
                return
        else:
            raise RuntimeError(f"{self.name}: the engine preempts without ever scheduling")
        self._stepping = True
        if step.scheduled or step.preempted:
            # What the step admitted is running from now on. (A step of quiet requests
            # alone changes nothing a scrape reads, nor makes KV events.)
            self._record()
        self.busy_s += step.duration
        self._step = step
        self.loop.after(step.duration, self._end_step_action)

    def _end_step(self) -> None:
        step = self._step
        assert step is not None
        if self._restart_due:
            self._restart_due = False
            self._step = None
            self._stepping = False
            self._restart_now()
            if self.core.has_work:
                self._start_step()
            return
        core = self.core
        core.finish_step(step)
        if step.scheduled:
            self._emit()
            self._record()
        if core.has_work:
            self._start_step()
        else:
            self._step = None
            self._stepping = False
            if core.receiving:
                self._wake_for_transfer()

    def _wake_for_transfer(self) -> None:
        """Start a step when the first pending KV transfer ends (no step runs until
        then: the engine has nothing else to do)."""
        ready = self.core.next_ready_at()
        if ready is None or (self._wake_at is not None and self._wake_at <= ready):
            return
        self._wake_at = ready

        def wake() -> None:
            if self._wake_at == ready:
                self._wake_at = None
            if not self._stepping:
                self._start_step()

        self.loop.at(ready, wake)

    def _emit(self) -> None:
        events = self.core.take_events()
        if events and self._on_events is not None:
            if self._cleared:
                self._cleared = False
                events = [AllBlocksCleared(), *events]
            self._on_events(self, events)

    # -- what a scrape sees -------------------------------------------------------------

    def _record(self) -> None:
        core = self.core
        pool = core.kv.pool
        key = (core.num_waiting, len(core.running), pool.num_free_blocks)
        if key == self._last_state:
            # Unchanged (most steps): the entry already there says the same from its
            # time on, which is all `state_at` reads.
            return
        self._last_state = key
        state = PodState(key[0], key[1], pool.usage())
        now = self.loop.now()
        times = self._times
        if times and times[-1] == now:
            self._states[-1] = state
            return
        times.append(now)
        self._states.append(state)
        if len(times) > 4096 and times[0] < now - HISTORY_S:
            cut = bisect.bisect_left(times, now - HISTORY_S) - 1
            if cut > 0:
                del times[:cut]
                del self._states[:cut]

    def state_at(self, when: float) -> PodState:
        """The pod's state at virtual time `when` (at most `HISTORY_S` ago)."""
        i = bisect.bisect_right(self._times, when) - 1
        return self._states[max(i, 0)]
