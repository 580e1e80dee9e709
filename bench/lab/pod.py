"""A simulated pod in virtual time: the simulator's engine core, stepped by the
lab's event loop, with what the EPP can see of it.

- **Steps**: as `sim.engine.Engine` runs them, back to back while there is work,
  each taking the latency model's time; a request that arrives while the engine
  is idle starts a step at once.
- **KV events**: each step's batch goes to `on_events` when the step ends (the
  EPP side adds the delivery delay).
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
from sim.engine import EngineConfig, EngineCore, EngineRequest, OutputSink, Step
from sim.kv_cache import TokenSequence
from sim.kv_events import KVEvent
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


class LabPod:
    def __init__(
        self,
        index: int,
        config: EngineConfig,
        answer_token_ids: Sequence[int],
        loop: EventLoop,
        latency: LatencyModel | None = None,
        on_events: EventsHandler | None = None,
    ) -> None:
        self.index = index
        self.name = f"pod-{index}"
        # Addresses as a pool's pods have them; nothing listens on them.
        self.address = f"10.{index // 250}.{index % 250}.1:8000"
        self.loop = loop
        self.core = EngineCore(config, answer_token_ids, latency, clock=loop.now)
        self.on_events = on_events
        self._stepping = False
        self._times: list[float] = []
        self._states: list[PodState] = []
        self.busy_s = 0.0
        self._record()

    # -- requests ---------------------------------------------------------------------

    def submit(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        outputs: OutputSink,
        cache_salt: str | None = None,
        sequence: TokenSequence | None = None,
    ) -> EngineRequest:
        request = self.core.add_request(
            prompt_token_ids,
            max_tokens,
            "length",
            outputs,
            cache_salt,
            stream=True,
            sequence=sequence,
        )
        self._record()
        if not self._stepping:
            self._start_step()
        return request

    def prepare(self, prompt_token_ids: Sequence[int]) -> tuple[TokenSequence, int]:
        """The prompt's sequence for `submit`, and how many of its tokens the pod's
        prefix cache does not hold now."""
        kv = self.core.kv
        sequence = kv.new_sequence(list(prompt_token_ids))
        hits = kv.find_prefix_hit(sequence)
        return sequence, len(prompt_token_ids) - len(hits) * self.core.config.block_size

    # -- steps ------------------------------------------------------------------------

    def _start_step(self) -> None:
        for _ in range(MAX_EMPTY_STEPS):
            step = self.core.begin_step()
            if step.scheduled:
                break
            self._emit(self.core.take_events())
            if not step.preempted:
                self._stepping = False
                self._record()
                return
        else:
            raise RuntimeError(f"{self.name}: the engine preempts without ever scheduling")
        self._stepping = True
        self._record()  # what the step admitted is running from now on
        self.busy_s += step.duration
        self.loop.after(step.duration, lambda: self._end_step(step))

    def _end_step(self, step: Step) -> None:
        self.core.finish_step(step)
        self._emit(self.core.take_events())
        self._record()
        if self.core.has_work:
            self._start_step()
        else:
            self._stepping = False

    def _emit(self, events: list[KVEvent]) -> None:
        if events and self.on_events is not None:
            self.on_events(self, events)

    # -- what a scrape sees -------------------------------------------------------------

    def _record(self) -> None:
        core = self.core
        state = PodState(len(core.waiting), len(core.running), core.kv.pool.usage())
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
