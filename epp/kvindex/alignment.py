"""The alignment self-check: do the EPP and an engine see the same blocks?

The index is keyed by the EPP's own hash of the token ids the engines publish
(`blockkeys`), so the engine's hash algorithm and seed no longer matter. What still
must agree, and fails silently when it does not (lookups just never match):

- **the block size**: the engine's `--block-size` and `blockSize`. Checked on every
  BlockStored event (free). An event of another block size is not indexed (the
  ingestion rejects it); the stream is marked misaligned, its pod scored 0 and the
  log says which size to configure;
- **the token ids**: `len(token_ids) == len(block_hashes) x block size`, every id a
  uint32. The ingestion rejects other events (counted per reason);
- **the tokenization**: the EPP tokenizes a request (chat template, tokenizer,
  special tokens) to look it up, the engine to serve it; if the two disagree, the
  events hold blocks no lookup ever computes. So one pick in `sample_every` is a
  *probe*: the key of the prompt's block `min(full blocks, PROBE_BLOCKS) - 1` (a
  key the lookup usually computed already) is expected in the chosen pod's
  BlockStored events within `window_s`. A probe is confirmed when the pod already
  held that block at pick time (the lookup matched it: both sides agree) or when
  an event brings it in time. It is a miss only when it expires unconfirmed while
  the pod's events were flowing (at least `min_events` BlockStored events with
  tokens since the pick); a probe of a silent stream proves nothing and is
  dropped. After `misses_to_flag` consecutive misses and no confirmation between
  them, the stream is flagged: one log line, `tokenizationAgreement: false` in
  /debug/endpoints. The flag does not change scores (if the tokenizations really
  differ, the pod scores 0 anyway, as nothing matches); one later confirmation
  clears it. Requests cut short, evicted at once, or queued past the window cost
  one miss each, and a run of them is broken by any confirmed probe, so only a
  pod that never shows a predicted block is flagged.

A probe is shared by the streams (data-parallel ranks) of the chosen endpoint: the
rank that got the request confirms it for all. At most `max_pending` probes wait
per stream (the oldest are dropped, not counted), and each costs a dict entry: the
check stays cheap and bounded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final

# The probe's block: the prompt's 4th (or last, if shorter) full block, a key the
# lookup computed already unless no pod held the prompt's first blocks.
PROBE_BLOCKS: Final = 4


@dataclass(slots=True)
class Probe:
    """A block key a pick predicts the chosen pod's events will bring; shared by
    the endpoint's streams."""

    key: int
    deadline: float
    confirmed: bool = False


@dataclass
class AlignmentState:
    """The check's state for one KV-event stream."""

    events_seen: int = 0  # BlockStored events with tokens
    checked_blocks: int = 0  # blocks whose token ids were checked
    mismatches: int = 0  # events whose block size disagreed
    aligned: bool | None = None  # None: nothing checked yet; False: block size differs
    cause: str | None = None  # why it is misaligned
    # The tokenization probes.
    probes: int = 0
    confirmed: int = 0
    missed: int = 0
    inconclusive: int = 0  # expired while the stream was silent, or dropped
    consecutive_misses: int = 0
    tokenization: bool | None = None  # None: nothing known; False: flagged
    # key -> (the probe, the stream's BlockStored events with tokens when it was
    # made: a miss needs events to have flowed since)
    pending: dict[int, tuple[Probe, int]] = field(default_factory=dict)

    def reset(self) -> None:
        """The engine restarted (or the stream's index was cleared): check afresh."""
        self.__init__()  # type: ignore[misc]


class AlignmentChecker:
    def __init__(
        self,
        block_size: int,
        sample_every: int = 32,
        *,
        clock: Callable[[], float],
        window_s: float = 30.0,
        min_events: int = 4,
        misses_to_flag: int = 8,
        max_pending: int = 16,
    ) -> None:
        self.block_size = block_size
        self.sample_every = max(1, sample_every)
        self.clock = clock
        self.window_s = window_s
        self.min_events = min_events
        self.misses_to_flag = max(1, misses_to_flag)
        self.max_pending = max(1, max_pending)
        self._picks = 0

    # -- every event ---------------------------------------------------------------------

    def block_size_agrees(self, state: AlignmentState, event_block_size: int) -> bool:
        """False (and the state says why) when a BlockStored with tokens was cut in
        blocks of another size than ours."""
        if event_block_size == self.block_size:
            if state.aligned is None:
                state.aligned = True
            return True
        state.mismatches += 1
        state.aligned = False
        state.cause = (
            f"the engine's block size is {event_block_size}, the scorer's blockSize is"
            f" {self.block_size}: set blockSize to the engine's --block-size"
        )
        return False

    # -- tokenization probes ---------------------------------------------------------------

    def wants_probe(self) -> bool:
        """One pick in `sample_every` is probed."""
        self._picks += 1
        return self._picks % self.sample_every == 1 or self.sample_every == 1

    def expect(self, streams: list[tuple[AlignmentState, int]], key: int, held: bool) -> None:
        """A pick sent a prompt whose probe block has `key` to the endpoint with
        these streams ((state, BlockStored events with tokens so far) each); `held`:
        the endpoint already held that block (the lookup matched it)."""
        for state, events in streams:
            self.expire(state, events)
            state.probes += 1
        if held:
            for state, _ in streams:
                self._confirm(state)
            return
        probe = Probe(key, self.clock() + self.window_s)
        for state, events in streams:
            pending = state.pending
            if key in pending:
                continue
            if len(pending) >= self.max_pending:
                del pending[next(iter(pending))]
                state.inconclusive += 1
            pending[key] = (probe, events)

    def on_stored(self, state: AlignmentState, keys: list[int]) -> None:
        """The stream stored `keys`: the probes they confirm are settled. Costs a set
        test per event while probes wait, nothing otherwise."""
        pending = state.pending
        if pending.keys().isdisjoint(keys):
            return
        for key in keys:
            found = pending.pop(key, None)
            if found is not None:
                found[0].confirmed = True
                self._confirm(state)

    def expire(self, state: AlignmentState, events: int) -> None:
        """Settle the probes whose window has passed; `events`: the stream's
        BlockStored events with tokens so far."""
        pending = state.pending
        if not pending:
            return
        now = self.clock()
        for key in [k for k, (p, _) in pending.items() if p.deadline <= now]:
            probe, events_at = pending.pop(key)
            if probe.confirmed:
                continue  # another rank of the endpoint stored it
            if events - events_at < self.min_events:
                state.inconclusive += 1
                continue
            state.missed += 1
            state.consecutive_misses += 1
            if state.consecutive_misses >= self.misses_to_flag:
                state.tokenization = False

    def _confirm(self, state: AlignmentState) -> None:
        state.confirmed += 1
        state.consecutive_misses = 0
        state.tokenization = True


TOKENIZATION_CAUSE: Final = (
    "its KV events never contained the blocks the scorer computed for the prompts sent"
    " to it ({missed} probes in a row, events flowing): the scorer's tokenization (chat"
    " template, tokenizer, special tokens) likely differs from the engine's; check the"
    " tokenizers configured for its model"
)
