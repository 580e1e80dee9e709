"""The simulated engine: vLLM's scheduler loop over the KV block pool.

Each step, like vLLM v1's scheduler:

1. Running requests first, in arrival order: each gets its remaining tokens (a
   prefill chunk, or 1 token in decode), within the step's token budget
   (`max_num_batched_tokens`: long prompts are prefilled in chunks). A running
   request that needs a new block when none is free preempts the most recently
   admitted running request (possibly itself): that one frees its blocks (which
   stay cached) and goes back to the head of the waiting queue, to be recomputed -
   mostly from its own cached blocks - when it is admitted again.
2. Then waiting requests, first come first served, while there is budget and fewer
   than `max_num_seqs` run: look up the longest cached prefix (those tokens are not
   computed again), allocate blocks for the rest, run. If the pool cannot hold the
   head request now, it and everyone behind it wait for blocks to be freed (no
   reordering, as in vLLM). Nothing is admitted in a step that preempted.
3. The step takes `LatencyModel.step_time` of what was scheduled (sleeping that long
   times the time scale). Then every request whose tokens are all computed samples
   one token; finished requests free their blocks (tail first).
4. The step's KV events (blocks cached and evicted while scheduling it) are
   published as one batch after the step, as vLLM does when it processes a step's
   output. Steps with no events publish nothing (no seq is used).

Blocks are cached when the tokens filling them are scheduled (`KVCacheManager`), so
a request admitted later in the same step already hits them.

Quiet decoding: a request whose consumer only times its first token and its end
(`quiet=True`: the routing lab's client) is not touched in the decode steps where
nothing but its token count changes: no block to cache, no block to take, not its
last token. Its fields stand still from the step it went quiet (`quiet_since`) to
the step it must be scheduled one by one again (`quiet_until`, known in advance:
where its last block is full, where it needs a new block, where it ends) and are
brought up to date then, or earlier when something else needs them (preemption,
abort, a step whose token budget does not cover everyone). Those steps are priced
from running totals of the quiet requests' contexts. Every step, event, block and
time comes out exactly as if each request were scheduled one by one: a quiet step
of a request is one in which the scheduler's decode path would have appended it
to the batch and done nothing else, and the step's price depends only on the
batch's totals.

Prefill/decode disaggregation (docs/disaggregation.md), as vLLM with its NIXL KV
connector does it:

- A prefill leg (`remote_decode`: the request's `kv_transfer_params` ask for a
  remote decode; the sidecar sets max_tokens 1) runs as any request. When it ends
  on its length it records the ids of the blocks holding its prompt's full blocks
  (`kv_block_ids`), which the server returns as `remote_block_ids`: the decode pod
  pulls those. (vLLM then keeps the blocks held until the decode pod has read them;
  here they are freed at once and only stay cached.)
- A decode leg (`remote`: the prefill leg's answer) waiting at the head of the
  queue looks up its local prefix hits, allocates blocks for every token the
  prefill pod holds, and leaves the queue for `receiving` (vLLM's
  WAITING_FOR_REMOTE_KVS: blocks held, never scheduled, counted as waiting) for
  `LatencyModel.kv_transfer_time` of the tokens it lacks locally, from the moment
  it was allocated. The first step that begins after that caches the loaded blocks
  and puts the request back at the head of the waiting queue with those tokens
  computed; it then computes only what the prefill pod did not send (the last
  partial block, and always the prompt's last token, whose logits give the first
  token) and decodes normally. A preempted decode leg recomputes locally. A
  core with only receiving requests has no step to run: its driver wakes it at
  `next_ready_at()`.

Two layers: `EngineCore` is the scheduler loop's state and its steps, synchronous
and driven from outside (`begin_step` schedules one step and says how long it
takes, `finish_step` applies it at the time it ends); it reads time from the
clock it is given. `Engine` runs a core on asyncio, sleeping through each step,
for the HTTP server. The routing lab (`bench/lab/`) drives cores in virtual time.

Time: `SimClock`. Every duration the engine computes is in simulated seconds; it
sleeps `duration x time_scale` of wall time. Everything it reports (metrics, TTFT)
is in simulated seconds, i.e. measured wall time divided by the time scale.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import enum
import heapq
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from sim.hashing import DEFAULT_HASH_SEED, BlockHasher, ExtraKeysFormat, HashAlgo
from sim.kv_cache import BlockPool, KVCacheManager, TokenSequence
from sim.kv_events import KVEvent
from sim.latency import LatencyModel
from sim.metrics import EngineStats

# How far behind schedule (wall seconds) the step clock may catch up: steps after a
# late one are shortened by up to this much, so Python overhead does not slow the
# simulated GPU down, without letting a long stall be made up all at once.
MAX_CATCH_UP_WALL_S = 0.05


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    # An 8B model in BF16 on an 80 GB H100 at 90% memory utilisation leaves ~56 GB
    # for the KV cache: ~440k tokens at 128 KiB per token, ~27k blocks of 16.
    num_gpu_blocks: int = 27_000
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 32_768
    hash_algo: HashAlgo = "sha256"
    hash_seed: str = DEFAULT_HASH_SEED
    extra_keys_format: ExtraKeysFormat = "tagged"
    time_scale: float = 1.0

    def __post_init__(self) -> None:
        if self.time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.num_gpu_blocks < 2:
            raise ValueError("num_gpu_blocks must be >= 2 (block 0 is reserved)")
        if self.block_size < 1:
            raise ValueError("block_size must be >= 1")


class SimClock:
    """Simulated time = wall (monotonic) time / time_scale."""

    def __init__(self, time_scale: float) -> None:
        self.time_scale = time_scale

    def now(self) -> float:
        return time.monotonic() / self.time_scale


class RequestState(enum.Enum):
    WAITING = "waiting"
    # A decode leg whose KV cache is being pulled from its prefill pod.
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    FINISHED = "finished"
    ABORTED = "aborted"


# The error every request in flight gets when the engine restarts.
RESTARTED_ERROR = "engine restarted"


@dataclass(frozen=True)
class TokenOutput:
    """What a request's consumer receives: new tokens (the end when finish_reason is
    set), or an error."""

    choice_index: int
    token_ids: tuple[int, ...]
    finish_reason: str | None = None
    error: str | None = None


class OutputSink(Protocol):
    """Where a request's outputs go: an asyncio.Queue for the server, anything with
    `put_nowait` for a simulation."""

    def put_nowait(self, item: TokenOutput, /) -> None: ...


@dataclass(frozen=True, slots=True)
class RemotePrefill:
    """What a decode leg knows of its prefill leg (vLLM's `kv_transfer_params` with
    `do_remote_prefill`): the prefill pod's engine and the blocks holding the prompt's
    KV there, in token order (block i holds tokens [i*B, (i+1)*B))."""

    engine_id: str | None
    block_ids: tuple[int, ...]


@dataclass(eq=False)
class EngineRequest:
    request_id: str
    seq: TokenSequence
    max_tokens: int
    # The finish reason once max_tokens are generated: "length" when the client set
    # max_tokens, "stop" when the simulated model "chose" to stop there.
    finish_reason: str
    outputs: OutputSink
    choice_index: int = 0
    # False: one output at the end with every token (no per-token wake-ups for a
    # client that waits for the whole answer anyway).
    stream: bool = True
    prompt_len: int = 0
    state: RequestState = RequestState.WAITING
    num_computed_tokens: int = 0
    # Prompt tokens found in the prefix cache when first scheduled (usage.cached_tokens).
    num_cached_tokens: int | None = None
    output_token_ids: list[int] = field(default_factory=list)
    arrival_time: float = 0.0
    # When it was first taken from the waiting queue into a step (None: not yet); a
    # preempted request keeps its first.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    # True: `outputs` gets the first token and the end only, for a consumer that times
    # just those; the core may then skip the request in the decode steps between
    # (quiet decoding, in the module docstring).
    quiet: bool = False
    # Admission order: the running queue is always sorted by it.
    order: int = 0
    # While the request decodes quietly: the step its fields are up to date for (the
    # core's count of finished steps then), else -1; and the step at which it must be
    # scheduled one by one again.
    quiet_since: int = -1
    quiet_until: int = 0
    # Prefill/decode disaggregation (module docstring). A prefill leg: its prompt's
    # blocks, recorded when it finished on its length.
    remote_decode: bool = False
    kv_block_ids: tuple[int, ...] | None = None
    # A decode leg: where its KV comes from; once allocated, when the transfer ends
    # (core clock), the tokens it loads (local hits included), the tokens and the
    # time it transfers; `loaded`: back in the waiting queue with its tokens computed.
    remote: RemotePrefill | None = None
    kv_ready_at: float | None = None
    kv_loaded_tokens: int = 0
    kv_transfer_tokens: int = 0
    kv_transfer_s: float = 0.0
    loaded: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.seq.token_ids)


class EventSink(Protocol):
    async def publish(self, events: Sequence[KVEvent]) -> int: ...


# Scheduled and Step are made once per request and step: slotted and not frozen,
# which makes them about 4x cheaper to build. Nothing changes them once built.


@dataclass(slots=True)
class Scheduled:
    """One request's share of a step: `new_tokens` computed after `context_tokens`."""

    request: EngineRequest
    new_tokens: int
    context_tokens: int


@dataclass(slots=True)
class Step:
    """A scheduled step: what runs in it, whether scheduling preempted, how long it takes
    (simulated seconds; 0 when nothing was scheduled)."""

    scheduled: tuple[Scheduled, ...]
    preempted: bool
    duration: float
    # Quiet requests that also compute one decode token each in this step, not listed
    # in `scheduled` (quiet decoding, in the module docstring).
    quiet: int = 0

    @property
    def empty(self) -> bool:
        return not self.scheduled and not self.quiet


def _order(request: EngineRequest) -> int:
    return request.order


class EngineCore:
    """The engine's state and its steps, with no I/O and no sleeping: `begin_step`,
    then `finish_step` once the step's duration has passed on `clock`."""

    def __init__(
        self,
        config: EngineConfig,
        answer_token_ids: Sequence[int],
        latency: LatencyModel | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        if not answer_token_ids:
            raise ValueError("answer_token_ids must not be empty")
        self.config = config
        self.latency = latency or LatencyModel()
        self.now: Callable[[], float] = clock or SimClock(config.time_scale).now
        self.hasher = BlockHasher(
            config.hash_algo, config.hash_seed, config.block_size, config.extra_keys_format
        )
        self._answer = list(answer_token_ids)
        self.kv = self._new_kv_cache()
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        # Decode legs pulling their KV cache (WAITING_FOR_REMOTE_KVS), in the order
        # their transfers started.
        self.receiving: list[EngineRequest] = []
        # Names this engine in the `remote_engine_id` of its prefill legs' answers.
        self.engine_id = "sim-engine"
        self.stats = EngineStats()
        self.restarts = 0
        self._request_counter = 0
        self._admissions = 0
        self._budget = config.max_num_batched_tokens
        # Quiet decoding (module docstring). Steps finished: the quiet requests' clock.
        self._steps = 0
        # The running requests scheduled one by one, in running order (the others are
        # in `_quiet`).
        self._loud: list[EngineRequest] = []
        self._quiet: dict[EngineRequest, None] = {}
        # Sum over quiet requests of num_computed_tokens - quiet_since: their contexts
        # in step s add up to this + s x their number.
        self._quiet_context = 0
        # (quiet_until, tie-breaker, request): when each quiet request must be woken.
        # Entries of requests woken earlier are skipped when they come up.
        self._due: list[tuple[int, int, EngineRequest]] = []
        self._due_counter = 0

    def _new_kv_cache(self) -> KVCacheManager:
        pool = BlockPool(self.config.num_gpu_blocks, self.config.block_size)
        return KVCacheManager(pool, self.hasher)

    @property
    def has_work(self) -> bool:
        """Whether there is a step to run (receiving requests wait for no step)."""
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        """Waiting requests as vLLM counts them: those pulling remote KVs included."""
        return len(self.waiting) + len(self.receiving)

    def next_ready_at(self) -> float | None:
        """When the first receiving request's transfer ends (core clock), or None."""
        if not self.receiving:
            return None
        return min(r.kv_ready_at for r in self.receiving if r.kv_ready_at is not None)

    def restart(self) -> None:
        """Like an engine process restart: requests fail, cache and counters are empty."""
        for request in [*self.waiting, *self.receiving, *self.running]:
            request.state = RequestState.ABORTED
            request.outputs.put_nowait(TokenOutput(request.choice_index, (), error=RESTARTED_ERROR))
        self.waiting.clear()
        self.receiving.clear()
        self.running.clear()
        self._loud.clear()
        self._quiet.clear()
        self._quiet_context = 0
        self._due.clear()
        self.kv = self._new_kv_cache()
        self.stats = EngineStats()
        self.restarts += 1

    # -- steps -------------------------------------------------------------------

    def begin_step(self) -> Step:
        """Schedule the next step (see the module docstring) and price it."""
        if self.receiving:
            self._receive()
        quiet = len(self._quiet)
        due = self._due
        if (
            quiet
            and not self._loud
            and not self.waiting
            and quiet <= self._budget
            and (not due or due[0][0] > self._steps)
        ):
            # Only quiet requests, none due, all within the budget (the most common
            # step of a lightly loaded engine): what `_schedule` would find.
            scheduled: list[Scheduled] = []
            preempted = False
        else:
            scheduled, preempted = self._schedule()
            quiet = len(self._quiet)
        if not scheduled and not quiet:
            return Step((), preempted, 0.0)
        # The step's totals, as integers: a quiet request decoding after c tokens is
        # 1 new token, c + 1 attention pairs and c + 1 tokens touched. (Summed as
        # floats one request at a time, the pairs would come out the same: every
        # partial sum is an integer far below 2**53.)
        context = self._quiet_context + quiet * self._steps
        new_tokens = quiet
        pairs = touched = context + quiet
        for item in scheduled:
            n, c = item.new_tokens, item.context_tokens
            new_tokens += n
            pairs += n * c + n * (n + 1) // 2
            touched += c + n
        duration = self.latency.time_of(new_tokens, float(pairs), touched)
        return Step(tuple(scheduled), preempted, duration, quiet)

    def finish_step(self, step: Step) -> None:
        """Apply a step once its time has passed: tokens sampled, requests finished."""
        # The quiet requests' tokens: counted now, appended when they are woken. (Only
        # an abort changes who is quiet during a step, and it takes its request out.)
        self.stats.generation_tokens += len(self._quiet)
        if step.scheduled:
            self._update(step.scheduled)
        self._steps += 1
        self.stats.steps += 1

    def take_events(self) -> list[KVEvent]:
        """The KV events since the last call (published after each step)."""
        return self.kv.pool.take_events()

    # -- requests ----------------------------------------------------------------

    @property
    def max_model_len(self) -> int:
        """Longest prompt + output a request may ask for. vLLM refuses to start when
        max_model_len does not fit in the KV pool; the simulator caps it instead."""
        pool = self.kv.pool.num_usable_blocks * self.config.block_size
        return min(self.config.max_model_len, pool)

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        max_tokens: int,
        finish_reason: str,
        outputs: OutputSink,
        cache_salt: str | None = None,
        choice_index: int = 0,
        stream: bool = True,
        sequence: TokenSequence | None = None,
        quiet: bool = False,
        remote_decode: bool = False,
        remote: RemotePrefill | None = None,
    ) -> EngineRequest:
        """Queue a request. `sequence`: the prompt's `kv.new_sequence`, if the caller
        already made it (its block hashes are not computed again). `quiet`: only the
        first token and the end are put to `outputs` (`EngineRequest.quiet`).
        `remote_decode`: a prefill leg; `remote`: a decode leg (module docstring)."""
        if remote_decode and remote is not None:
            raise ValueError("a request is a prefill leg or a decode leg, not both")
        if not prompt_token_ids:
            raise ValueError("empty prompt")
        if len(prompt_token_ids) + max_tokens > self.max_model_len:
            raise ValueError("request longer than max_model_len")
        self._request_counter += 1
        request = EngineRequest(
            request_id=f"req-{self._request_counter}",
            seq=sequence or self.kv.new_sequence(list(prompt_token_ids), cache_salt),
            max_tokens=max_tokens,
            finish_reason=finish_reason,
            outputs=outputs,
            choice_index=choice_index,
            stream=stream,
            prompt_len=len(prompt_token_ids),
            arrival_time=self.now(),
            quiet=quiet,
            remote_decode=remote_decode,
            remote=remote,
        )
        self.waiting.append(request)
        if remote_decode:
            self.stats.prefill_legs += 1
        elif remote is not None:
            self.stats.decode_legs += 1
        self.stats.requests_received += 1
        self.stats.prompt_tokens += len(prompt_token_ids)
        self._on_new_work()
        return request

    def abort(self, request: EngineRequest) -> None:
        """Drop a request (its client went away); its blocks are freed at once."""
        if request.state is RequestState.WAITING:
            with contextlib.suppress(ValueError):
                self.waiting.remove(request)
        elif request.state is RequestState.WAITING_FOR_REMOTE_KVS:
            with contextlib.suppress(ValueError):
                self.receiving.remove(request)
        elif request.state is RequestState.RUNNING:
            if request.quiet_since >= 0:
                self._catch_up(request)
            else:
                with contextlib.suppress(ValueError):
                    self._loud.remove(request)
            with contextlib.suppress(ValueError):
                self.running.remove(request)
        else:
            return
        self.kv.free(request.seq)
        request.state = RequestState.ABORTED
        self.stats.aborted += 1
        self.stats.finished["abort"] += 1
        self._on_new_work()

    def _on_new_work(self) -> None:
        """Called when a request arrives or leaves; the asyncio runner wakes up."""

    def _schedule(self) -> tuple[list[Scheduled], bool]:
        config = self.config
        budget = config.max_num_batched_tokens
        block_size = config.block_size
        scheduled: list[Scheduled] = []
        preempted = False
        kv = self.kv
        running = self.running
        loud = self._loud

        quiet = len(self._quiet)
        if quiet:
            due = self._due
            steps = self._steps
            while due and due[0][0] <= steps:
                until, _, request = heapq.heappop(due)
                if request.quiet_since >= 0 and request.quiet_until == until:
                    self._catch_up(request)
                    bisect.insort(loud, request, key=_order)
            quiet = len(self._quiet)
        if quiet and not self._budget_covers_quiet(budget):
            # Some quiet request would not get its token this step: schedule every
            # running request one by one.
            for request in list(self._quiet):
                self._catch_up(request)
            loud[:] = running
            quiet = 0
        # The quiet requests' tokens are taken off the budget up front. Exact: the loud
        # requests before the last quiet one get all their tokens either way
        # (`_budget_covers_quiet`), and those after it see the same budget left.
        budget -= quiet

        # Running requests first, in running order: the loud ones here, the quiet ones
        # (each 1 token within its last block, nothing to cache) implicitly. Preemption
        # victims come from the tail of the running queue, as in vLLM.
        index = 0
        while index < len(loud) and budget > 0:
            request = loud[index]
            seq = request.seq
            computed = request.num_computed_tokens
            left = len(seq.token_ids) - computed
            new_tokens = left if left < budget else budget
            if new_tokens == 1 and computed < len(seq.blocks) * block_size:
                # A decode step within the request's last block: no block to take,
                # and a block to cache only if this token completes one.
                if (computed + 1) // block_size > seq.num_cached_blocks:
                    kv.allocate_slots(seq, computed, 1)
                scheduled.append(Scheduled(request, 1, computed))
                budget -= 1
                index += 1
                continue
            fits = True
            while not kv.allocate_slots(request.seq, request.num_computed_tokens, new_tokens):
                victim = running.pop()
                if victim.quiet_since >= 0:
                    self._catch_up(victim)
                    budget += 1  # its token, taken off up front, is not computed
                else:
                    loud.pop()  # the last running request, so the last loud one
                self._preempt(victim)
                preempted = True
                if victim is request:
                    fits = False
                    break
            if not fits:
                break  # it was the last running request
            scheduled.append(Scheduled(request, new_tokens, request.num_computed_tokens))
            budget -= new_tokens
            index += 1

        while not preempted and self.waiting and budget > 0 and len(running) < config.max_num_seqs:
            request = self.waiting[0]
            if request.remote is not None and request.kv_ready_at is None:
                # A decode leg at the head for the first time: its transfer starts.
                started = self._start_receiving(request)
                if started is None:
                    break  # head-of-line: wait for blocks to be freed
                if started:
                    continue  # it left the queue; the next one may run
                # Nothing to pull: it prefills here like any request.
            if request.loaded:
                # Its KV arrived: its blocks are held, its loaded tokens computed.
                computed = request.num_computed_tokens
                new_tokens = min(request.num_tokens - computed, budget)
                if not kv.allocate_slots(request.seq, computed, new_tokens):
                    break
                request.loaded = False
            else:
                hits = kv.find_prefix_hit(request.seq)
                computed = len(hits) * block_size
                new_tokens = min(request.num_tokens - computed, budget)
                if not kv.allocate_slots(request.seq, computed, new_tokens, hits):
                    break  # head-of-line: wait for blocks to be freed
            self.waiting.popleft()
            request.state = RequestState.RUNNING
            request.num_computed_tokens = computed
            request.order = self._admissions
            self._admissions += 1
            if request.first_scheduled_time is None:
                request.first_scheduled_time = self.now()
            running.append(request)
            loud.append(request)
            if request.num_cached_tokens is None:
                request.num_cached_tokens = computed
                self.stats.prefix_cache_queries += request.num_tokens
                self.stats.prefix_cache_hits += computed
            scheduled.append(Scheduled(request, new_tokens, computed))
            budget -= new_tokens
        return scheduled, preempted

    # -- prefill/decode disaggregation (module docstring) ----------------------------

    def _start_receiving(self, request: EngineRequest) -> bool | None:
        """Start pulling a decode leg's KV cache: True when it now waits for it, False
        when there is nothing to pull (it stays at the head of the queue, to be
        prefilled here), None when the pool cannot hold it now."""
        remote = request.remote
        assert remote is not None
        kv = self.kv
        seq = request.seq
        block_size = self.config.block_size
        now = self.now()
        hits = kv.find_prefix_hit(seq)
        local = len(hits) * block_size
        # The prefill pod's full blocks of this prompt (no more than the prompt has),
        # and the tokens they give: all but the prompt's last token, which is always
        # computed here for its logits.
        remote_blocks = min(len(remote.block_ids), len(seq.token_ids) // block_size)
        loaded = min(remote_blocks * block_size, request.num_tokens - 1)
        if loaded <= local:
            request.kv_ready_at = now
            return False
        if not kv.allocate_for_load(seq, hits, remote_blocks * block_size):
            return None
        self.waiting.popleft()
        request.state = RequestState.WAITING_FOR_REMOTE_KVS
        stats = self.stats
        request.num_cached_tokens = local
        stats.prefix_cache_queries += request.num_tokens
        stats.prefix_cache_hits += local
        stats.external_prefix_cache_queries += request.num_tokens
        stats.external_prefix_cache_hits += loaded - local
        # Whole blocks move: those the prefill pod holds beyond the local hits.
        request.kv_transfer_tokens = remote_blocks * block_size - local
        request.kv_transfer_s = self.latency.kv_transfer_time(request.kv_transfer_tokens)
        request.kv_loaded_tokens = loaded
        request.kv_ready_at = now + request.kv_transfer_s
        self.receiving.append(request)
        return True

    def _receive(self) -> None:
        """Decode legs whose transfer has ended go back to the head of the waiting
        queue (in the order their transfers started), their loaded tokens computed."""
        now = self.now()
        ready = [r for r in self.receiving if r.kv_ready_at is not None and r.kv_ready_at <= now]
        if not ready:
            return
        stats = self.stats
        for request in ready:
            self.receiving.remove(request)
            self.kv.cache_loaded(request.seq, request.kv_loaded_tokens)
            request.num_computed_tokens = request.kv_loaded_tokens
            request.state = RequestState.WAITING
            request.loaded = True
            stats.nixl_xfer_time.observe(request.kv_transfer_s)
            stats.nixl_bytes_transferred.observe(
                self.latency.kv_transfer_bytes(request.kv_transfer_tokens)
            )
        self.waiting.extendleft(reversed(ready))

    def _budget_covers_quiet(self, budget: int) -> bool:
        """Whether every quiet request gets its token this step: the tokens of the
        running requests up to the last quiet one (in running order) fit the budget."""
        quiet = self._quiet
        demand = len(quiet)
        loud = self._loud
        for request in loud:
            demand += len(request.seq.token_ids) - request.num_computed_tokens
        if demand <= budget:
            return True
        last = max(request.order for request in quiet)
        demand = len(quiet)
        for request in loud:
            if request.order > last:
                break
            demand += len(request.seq.token_ids) - request.num_computed_tokens
        return demand <= budget

    def _preempt(self, request: EngineRequest) -> None:
        self.kv.free(request.seq)
        request.state = RequestState.WAITING
        request.num_computed_tokens = 0
        request.loaded = False
        request.num_preemptions += 1
        self.waiting.appendleft(request)
        self.stats.preemptions += 1

    def _update(self, scheduled: Sequence[Scheduled]) -> None:
        # The hot loop of a simulation (once per scheduled request and step): locals,
        # and a generated token hashed only when it completes a block.
        now = self.now()
        answer = self._answer
        block_size = self.config.block_size
        hasher = self.kv.hasher
        stats = self.stats
        for item in scheduled:
            request = item.request
            if request.state is not RequestState.RUNNING:
                continue  # aborted during the step
            computed = request.num_computed_tokens + item.new_tokens
            request.num_computed_tokens = computed
            seq = request.seq
            tokens = seq.token_ids
            if computed < len(tokens):
                continue  # a prefill chunk: no token yet
            generated = request.output_token_ids
            token = answer[len(generated) % len(answer)]
            generated.append(token)
            tokens.append(token)
            if len(tokens) % block_size == 0:
                hasher.extend(seq.block_hashes, tokens, seq.cache_salt)
            stats.generation_tokens += 1
            first = request.first_token_time is None
            if first:
                request.first_token_time = now
                stats.ttft.observe(now - request.arrival_time)
            if len(generated) >= request.max_tokens:
                if request.remote_decode and request.finish_reason == "length":
                    # The prefill leg's answer (before its consumer hears of its end):
                    # the blocks its prompt's full blocks are in.
                    full = request.prompt_len // block_size
                    request.kv_block_ids = tuple(seq.blocks[:full])
                request.outputs.put_nowait(
                    TokenOutput(
                        request.choice_index,
                        (token,) if request.stream else tuple(generated),
                        request.finish_reason,
                    )
                )
                self._finish(request, request.finish_reason, now)
                continue
            if request.quiet:
                if first and request.stream:
                    request.outputs.put_nowait(TokenOutput(request.choice_index, (token,)))
                self._quiet_down(request)
            elif request.stream:
                request.outputs.put_nowait(TokenOutput(request.choice_index, (token,)))

    # -- quiet decoding (module docstring) ------------------------------------------

    def _quiet_down(self, request: EngineRequest) -> None:
        """Let a quiet request that just sampled a token skip the coming steps that
        would only append its next tokens, if there are any."""
        seq = request.seq
        computed = request.num_computed_tokens
        block_size = self.config.block_size
        # Its i-th coming step (i = 0, 1, ...) computes the token at position
        # computed + i. That step is quiet while the position lies in a block the
        # request holds, the token does not fill a block past the num_cached_blocks
        # cached already (which would be cached then), and it is not the last token.
        quiet_steps = min(
            len(seq.blocks) * block_size - computed,
            (seq.num_cached_blocks + 1) * block_size - 1 - computed,
            request.max_tokens - len(request.output_token_ids) - 1,
        )
        if quiet_steps < 1:
            return
        since = self._steps + 1  # the step being finished is applied to its fields
        self._loud.remove(request)
        self._quiet[request] = None
        self._quiet_context += computed - since
        request.quiet_since = since
        request.quiet_until = since + quiet_steps
        self._due_counter += 1
        heapq.heappush(self._due, (request.quiet_until, self._due_counter, request))

    def _catch_up(self, request: EngineRequest) -> None:
        """A quiet request's fields as of now (`_steps` steps finished), and it is no
        longer quiet. (It stays in the running queue; the caller puts it in `_loud`
        or takes it out.)"""
        since = request.quiet_since
        del self._quiet[request]
        self._quiet_context -= request.num_computed_tokens - since
        request.quiet_since = -1
        skipped = self._steps - since
        if skipped <= 0:
            return
        answer = self._answer
        generated = request.output_token_ids
        start = len(generated) % len(answer)
        tokens = answer[start : start + skipped]
        if len(tokens) < skipped:  # round the end of the answer
            tokens = [answer[(start + i) % len(answer)] for i in range(skipped)]
        generated += tokens
        seq = request.seq
        seq.token_ids += tokens
        request.num_computed_tokens += skipped
        self.kv.hasher.extend(seq.block_hashes, seq.token_ids, seq.cache_salt)

    def _finish(self, request: EngineRequest, reason: str, now: float) -> None:
        self.running.remove(request)
        self._loud.remove(request)
        self.kv.free(request.seq)
        request.state = RequestState.FINISHED
        self.stats.finished[reason] += 1
        self.stats.e2e.observe(now - request.arrival_time)


class Engine(EngineCore):
    """An `EngineCore` run on asyncio: each step sleeps its duration (times the time
    scale) and its KV events go to `sink` as one batch after it."""

    def __init__(
        self,
        config: EngineConfig,
        answer_token_ids: Sequence[int],
        latency: LatencyModel | None = None,
        sink: EventSink | None = None,
    ) -> None:
        super().__init__(config, answer_token_ids, latency)
        self.sink = sink
        # Bumped by restart(): a step in flight across a restart is discarded.
        self._generation = 0
        self._wakeup = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._next_step_wall: float | None = None
        # Cleared while the engine is stalled (`stall`): no step runs, requests are
        # still accepted and wait, and the server answers as before.
        self._moving = asyncio.Event()
        self._moving.set()

    # -- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="sim-engine")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    @property
    def stalled(self) -> bool:
        return not self._moving.is_set()

    def stall(self, stalled: bool) -> None:
        """Stop stepping (a hung engine behind a live API server), or go on."""
        if stalled:
            self._moving.clear()
        else:
            self._moving.set()
            self._next_step_wall = None  # the time stalled is not caught up

    def restart(self) -> None:
        self._generation += 1
        super().restart()
        self._next_step_wall = None
        self._wakeup.set()

    async def reset_prefix_cache(self) -> bool:
        """vLLM's /reset_prefix_cache: refused while requests hold blocks; on success
        publishes AllBlocksCleared at once (as a batch of its own)."""
        if not self.kv.pool.reset_prefix_cache():
            return False
        events = self.kv.pool.take_events()
        if self.sink is not None:
            await self.sink.publish(events)
        return True

    def _on_new_work(self) -> None:
        self._wakeup.set()

    # -- the loop ----------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            await self._moving.wait()
            if not self.waiting and not self.running:
                ready = self.next_ready_at()
                if ready is None or ready > self.now():
                    await self._idle()
                    continue
            generation = self._generation
            step = self.begin_step()
            if step.empty:
                await self._publish(self.take_events())
                if not step.preempted:
                    await self._idle()
                continue
            await self._sleep_step(step.duration)
            if generation != self._generation:
                continue  # the engine restarted during this step
            self.finish_step(step)
            await self._publish(self.take_events())

    async def _idle(self) -> None:
        """Wait for new work, or for the first receiving request's transfer to end."""
        self._next_step_wall = None
        self._wakeup.clear()
        ready = self.next_ready_at()
        if ready is None:
            await self._wakeup.wait()
            return
        delay = max(0.0, (ready - self.now()) * self.config.time_scale)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wakeup.wait(), delay)

    async def _publish(self, events: list[KVEvent]) -> None:
        if events and self.sink is not None:
            await self.sink.publish(events)

    async def _sleep_step(self, duration: float) -> None:
        now = time.monotonic()
        start = now
        if self._next_step_wall is not None:
            start = max(self._next_step_wall, now - MAX_CATCH_UP_WALL_S)
            # Lateness the catch-up could not absorb: simulated time lost.
            self.stats.lag_s += max(0.0, now - MAX_CATCH_UP_WALL_S - self._next_step_wall) / (
                self.config.time_scale
            )
        self.stats.busy_s += duration
        end = start + duration * self.config.time_scale
        self._next_step_wall = end
        # Always yield, so HTTP handlers run between steps even when catching up.
        await asyncio.sleep(max(0.0, end - now))
