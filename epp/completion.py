"""Lean mode: routed requests waiting for Envoy's word that they ended.

In lean mode (manifests/envoy/envoy-lean.yaml) the response never passes through
the EPP: the ext_proc stream ends once the request has been routed, long before the
model server has answered. The end of the request comes instead as an entry on
Envoy's gRPC access log (epp/accesslog.py), keyed by x-request-id. Until then the
request holds its in-flight count, so the tracker makes sure every one is ended
exactly once, whatever happens to the log:

    wait (at the pick) --access-log entry--> ended (status, and whether the whole
                                               response went out, from the entry)
                       --no entry within the timeout--> ended as aborted
                       --more than max_waiting waiting--> the oldest ended as aborted
                       --stream ends, no access log ever connected--> ended at once

Envoy opens its access-log stream lazily, when it first flushes an entry: the first
requests after a start end before any stream exists. They are ended when their
ext_proc stream ends (the best signal there is), and the warning that lean mode
needs the access log waits `warn_after_s` for a stream that may still come.

Two requests may carry the same x-request-id (a client reusing ids): an entry ends
the oldest one waiting under it, which keeps the counts right.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from typing import Final

from epp.clock import Clock
from epp.director import Decision, Director
from epp.scheduling.types import ResponseInfo
from epp.telemetry import Telemetry

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S: Final = 600.0
DEFAULT_MAX_WAITING: Final = 100_000
DEFAULT_WARN_AFTER_S: Final = 60.0


class CompletionTracker:
    def __init__(
        self,
        director: Director,
        telemetry: Telemetry,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        max_waiting: int = DEFAULT_MAX_WAITING,
        warn_after_s: float = DEFAULT_WARN_AFTER_S,
        clock: Clock | None = None,
    ) -> None:
        if timeout_s <= 0 or max_waiting <= 0:
            raise ValueError("the timeout and the bound must be positive")
        self.director = director
        self.telemetry = telemetry
        self.timeout_s = timeout_s
        self.max_waiting = max_waiting
        self.warn_after_s = warn_after_s
        # The director's clock unless told otherwise: deadlines and durations
        # on the time requests are picked at.
        self.clock = clock if clock is not None else director.clock
        # Every waiting request with its id and deadline, oldest first: one timeout
        # for all makes insertion order the deadline order, so expiry only ever
        # looks at the front. An OrderedDict: a dict's first item, once items are
        # deleted from its front, is found by scanning past their empty slots, a
        # cost that grows with every request ended before a resize.
        self._deadlines: OrderedDict[Decision, tuple[str, float]] = OrderedDict()
        self._by_id: dict[str, list[Decision]] = {}
        self.access_log_connected = False
        self._first_fallback_at: float | None = None
        self._warned_no_access_log = False
        self._warned_overflow = False
        self._ends = {
            how: telemetry.lean_ends.labels(how)
            for how in ("access_log", "stream_end", "timeout", "overflow")
        }
        self._handoffs = telemetry.lean_handoffs
        telemetry.lean_waiting.set_function(self.__len__)

    def __len__(self) -> int:
        return len(self._deadlines)

    # -- the ext_proc side ---------------------------------------------------------

    def wait(self, request_id: str, decision: Decision) -> None:
        """A request was routed in lean mode: it ends when its entry arrives."""
        if len(self._deadlines) >= self.max_waiting:
            self._evict_oldest()
        self._deadlines[decision] = (request_id, self.clock() + self.timeout_s)
        self._by_id.setdefault(request_id, []).append(decision)

    def stream_ended(self, request_id: str, decision: Decision, status: int | None) -> None:
        """The request's ext_proc stream ended before its response did. With an
        access log connected that means nothing: the entry will come. Without one,
        this is the only end the EPP will ever see."""
        self._handoffs.inc()
        if self.access_log_connected or decision.finished:
            return
        self._remove(request_id, decision)
        self._end(decision, "stream_end", completed=True, status=status)
        if self._first_fallback_at is None:
            self._first_fallback_at = self.clock()

    # -- the access-log side -------------------------------------------------------

    def connected(self) -> None:
        """An access-log stream opened: from now on its entries end requests."""
        self.access_log_connected = True

    def complete(
        self, request_id: str, status: int | None, completed: bool, duration_s: float | None
    ) -> bool:
        """Envoy logged the end of `request_id`: end the oldest request waiting
        under it. False when none is (already ended, or never routed here)."""
        waiting = self._by_id.get(request_id)
        if waiting is None:
            return False
        ended = False
        while waiting and not ended:
            decision = waiting.pop(0)
            del self._deadlines[decision]
            # One the ext_proc stream already ended (an error answered after the
            # pick) is only dropped.
            if not decision.finished:
                self._end(
                    decision,
                    "access_log",
                    completed=completed,
                    status=status,
                    duration_s=duration_s,
                )
                ended = True
        if not waiting:
            del self._by_id[request_id]
        return ended

    # -- time ----------------------------------------------------------------------

    def expire(self) -> int:
        """End, as aborted, every request whose entry is overdue; how many."""
        now = self.clock()
        expired = 0
        while self._deadlines:
            decision, (request_id, deadline) = next(iter(self._deadlines.items()))
            if deadline > now:
                break
            self._remove(request_id, decision)
            if not decision.finished:
                self._end(decision, "timeout", completed=False)
                expired += 1
        if expired:
            log.warning(
                "%d lean-mode requests got no access-log entry within %.0fs: ended as aborted",
                expired,
                self.timeout_s,
            )
        self._check_access_log(now)
        return expired

    async def run(self) -> None:
        """Expire overdue requests until cancelled."""
        interval = min(1.0, self.timeout_s / 4)
        while True:
            await asyncio.sleep(interval)
            self.expire()

    # -- helpers -------------------------------------------------------------------

    def _check_access_log(self, now: float) -> None:
        if (
            self._first_fallback_at is not None
            and not self.access_log_connected
            and not self._warned_no_access_log
            and now - self._first_fallback_at >= self.warn_after_s
        ):
            self._warned_no_access_log = True
            log.warning(
                "lean mode: Envoy sends this EPP no response (response_body_mode NONE) and no"
                " access-log stream has connected, so requests are ended when their ext_proc"
                " stream ends, before their responses do, and in-flight counts are too low."
                " Configure Envoy's gRPC access log to this EPP"
                " (see manifests/envoy/envoy-lean.yaml)."
            )

    def _evict_oldest(self) -> None:
        decision, (request_id, _) = next(iter(self._deadlines.items()))
        self._remove(request_id, decision)
        if decision.finished:
            return
        self._end(decision, "overflow", completed=False)
        if not self._warned_overflow:
            self._warned_overflow = True
            log.warning(
                "lean mode: %d requests are waiting for their access-log entry; ending the"
                " oldest as aborted (is Envoy's access log reaching this EPP?)",
                self.max_waiting,
            )

    def _remove(self, request_id: str, decision: Decision) -> None:
        if self._deadlines.pop(decision, None) is None:
            return
        waiting = self._by_id[request_id]
        waiting.remove(decision)
        if not waiting:
            del self._by_id[request_id]

    def _end(
        self,
        decision: Decision,
        how: str,
        *,
        completed: bool,
        status: int | None = None,
        duration_s: float | None = None,
    ) -> None:
        self._ends[how].inc()
        self.director.finish(
            decision,
            ResponseInfo(
                completed=completed,
                status=status,
                usage=None,
                duration_s=(
                    duration_s if duration_s is not None else self.clock() - decision.picked_at
                ),
            ),
        )
