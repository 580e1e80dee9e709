"""What this EPP has sent to one pod and not yet seen finish its prefill: the pod's
prefill backlog, in predicted seconds of work, kept exact and current.

An engine runs prefills first come, first served (vLLM's FCFS scheduler, chunked
prefill). The ledger mirrors that queue:

- `charge` (at the pick): the request joins the queue with its predicted prefill
  time; the backlog grows by it.
- time passing: the pod works through the backlog at one second per second, so
  `backlog(now)` is what was charged minus the time since, never below zero.
- `started` (the request's first response chunk: its prefill is over): everything
  charged before it is over too, so the backlog can be at most the work charged
  after it. This re-anchors the estimate to what the pod really did, at every
  first token, whether the pod ran slower or faster than predicted.
- `release` (the request ended): if it ended before its first token (aborted) its
  work leaves the queue; if it was decoding, the pod decodes one fewer request.
- `rescale` (the model learned the pods are faster or slower than it predicted
  when the work was charged): the work still queued is re-valued. From a cold
  start the first charges are the prior's, and until each pod's first token
  re-anchors it a backlog charged at twice the real work reads as a pod busy for
  twice as long (docs/routing-evidence.md, Queued work from a cold start).

A disaggregated request (prefill on one pod, decode on another) is in two
ledgers: the prefill pod's queue, which it leaves at its first token without
decoding there (`started(..., decodes=False)`), and the decode pod's decoding
requests from its first token on (`decoding_started`), never its queue: the
decode pod computes no prefill for it.

A request charged to a pod is tracked by an opaque key (the caller's), and a
state machine keeps each request's transitions in order: queued -> decoding ->
gone, or queued -> gone.

`expected_at(t)` counts the requests this EPP expected to be still queued at an
earlier instant t: charged by then, not started or released until after it, and
not yet due (`charge`'s `due`: when their first token was predicted). The pod's
scraped metrics are a snapshot taken at t, and its waiting requests are those,
plus what the ledger cannot know: other replicas' traffic, requests preempted
back to waiting, and requests overdue at t (the pod is behind what this EPP
predicted: a full KV cache, a full batch). The ledger keeps the instants of the
requests that left its queue for `horizon_s` (none by default; its caller's
`DEPARTURE_HORIZON_S`, as long as a snapshot may be read at the metrics' default
staleness threshold: with a longer one set, a request forgotten while a snapshot
still counts it waiting counts as another's), and at most `MAX_LEFT`.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Final

from epp import defaults

# How long departures are kept for `expected_at`: as long as a scrape stays fresh.
DEPARTURE_HORIZON_S: Final = defaults.METRICS_STALENESS_THRESHOLD.seconds
# At most this many departures are kept per pod (a bound on memory whatever the
# rate; at 2 s of a pod's departures it is a rate of 2,000 requests a second).
MAX_LEFT: Final = 4096


@dataclass(slots=True)
class _Queued:
    work_s: float
    since: float  # when it was charged
    due: float  # when its first token was predicted


class PodLedger:
    """One pod's queued prefill work and decoding requests, as this EPP sent them."""

    __slots__ = ("_as_of", "_backlog_s", "_horizon_s", "_left", "_queued", "decoding")

    def __init__(self, horizon_s: float = 0.0) -> None:
        self._queued: OrderedDict[Hashable, _Queued] = OrderedDict()
        self._backlog_s = 0.0
        self._as_of = 0.0
        self.decoding = 0
        self._horizon_s = horizon_s
        # (charged, due, left) of the requests that left the queue within the
        # horizon, in the order they left.
        self._left: deque[tuple[float, float, float]] = deque(maxlen=MAX_LEFT)

    def _drain(self, now: float) -> None:
        if now > self._as_of:
            self._backlog_s = max(0.0, self._backlog_s - (now - self._as_of))
            self._as_of = now

    def backlog(self, now: float) -> float:
        """Predicted seconds of prefill work ahead of a request arriving now."""
        # `_drain` spelled out (`x if x > 0.0 else 0.0` is `max(0.0, x)`, NaN
        # included): a pick asks this of every candidate.
        if now > self._as_of:
            left = self._backlog_s - (now - self._as_of)
            self._backlog_s = left if left > 0.0 else 0.0
            self._as_of = now
        return self._backlog_s

    @property
    def queued(self) -> int:
        """Requests charged here that have not produced a first token."""
        return len(self._queued)

    def charge(self, key: Hashable, work_s: float, now: float, due: float | None = None) -> None:
        """The request joins the queue with `work_s` of predicted prefill; its
        first token is predicted at `due` (default: once the backlog, its own work
        included, is done)."""
        self._drain(now)
        work_s = max(0.0, work_s)
        self._backlog_s += work_s
        self._queued[key] = _Queued(work_s, now, now + self._backlog_s if due is None else due)

    def overdue(self, now: float) -> int:
        """Requests queued here whose first token was due before `now`: the pod
        is behind what was predicted (O(queued))."""
        return sum(1 for entry in self._queued.values() if entry.due < now)

    def expected_at(self, t: float) -> int:
        """Requests this EPP expected to be queued at instant `t` (in the past or
        now): charged at or before it, started or released after it, and due after
        it."""
        expected = 0
        for entry in self._queued.values():
            if entry.since <= t < entry.due:
                expected += 1
        for since, due, left in reversed(self._left):  # the latest to leave first
            if left <= t:
                break
            expected += since <= t < due
        return expected

    def _leave(self, entry: _Queued, now: float) -> None:
        if self._horizon_s <= 0.0:
            return  # nobody asks what was queued earlier
        while self._left and self._left[0][2] < now - self._horizon_s:
            self._left.popleft()
        self._left.append((entry.since, entry.due, now))

    def started(self, key: Hashable, now: float, decodes: bool = True) -> None:
        """The request's first token arrived: it decodes from now on (here, unless
        `decodes` is False: a prefill pod's part ends there)."""
        entry = self._queued.get(key)
        if entry is None:
            return  # not queued here (already started, or released)
        self._drain(now)
        # FCFS: the requests queued before this one are past their prefill too;
        # they stay queued (their own first chunk moves them), but the work left
        # is at most what was charged after this one.
        after = 0.0
        seen = False
        for other, queued in self._queued.items():
            if seen:
                after += queued.work_s
            elif other == key:
                seen = True
        del self._queued[key]
        self._leave(entry, now)
        self._backlog_s = min(self._backlog_s, after)
        if decodes:
            self.decoding += 1

    def rescale(self, ratio: float, now: float) -> None:
        """The work still queued was predicted `ratio` times too short (or long):
        the model it was charged under has since learned the pod's speed, and the
        backlog is re-valued as the model now predicts it."""
        self._drain(now)
        self._backlog_s *= ratio
        for entry in self._queued.values():
            entry.work_s *= ratio

    def decoding_started(self) -> None:
        """A request whose prefill ran on another pod decodes here from now on;
        `release(..., was_decoding=True)` takes it off."""
        self.decoding += 1

    def release(self, key: Hashable, was_decoding: bool, now: float) -> None:
        """The request ended (completed or aborted)."""
        entry = self._queued.pop(key, None)
        if entry is not None:
            self._drain(now)
            self._leave(entry, now)
            self._backlog_s = max(0.0, self._backlog_s - entry.work_s)
        elif was_decoding:
            self.decoding = max(0, self.decoding - 1)
