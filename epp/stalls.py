"""Stalled engines: found from what the EPP itself sees of its requests.

An engine can stop making progress while its HTTP server still answers: a
scheduler stuck behind a live API process, a hung collective between GPUs. The
scrapes see nothing wrong (`/metrics` answers, with numbers that no longer
move), and a request routed there hangs. Left among the candidates, such a pod
keeps its share and more: the prompt groups it holds stay with it, and the
predicted-TTFT model drains its queue with time.

The EPP sees, for every request it routed, the first chunk of its response (when
Envoy streams response bodies to it; not in lean mode) and its end. An endpoint
is *stalled* when a request routed there has waited longer than the threshold
(`--stall-threshold`, 30 s) for its first chunk and nothing has progressed there
for as long: no first chunk came from it, no request there completed. A stalled
endpoint is no candidate for the threshold, doubled at each stall in a row up to
`MAX_BACKOFF` times it. Any progress (a first chunk, even of a request that
waited through the stall, or a completed request) ends it at once, so while
requests still wait there nothing more is needed to see the engine move: at the
exclusion's end such an endpoint stays stalled, for twice as long. Only once
every request there has been given up on is it tried again, taking requests
like any other, and stalled again if one of them waits the threshold with
nothing progressing. A pod that is only slow is never stalled: its first chunks
keep coming, however late.

Contract: the director calls `routed`, `first_chunk` and `ended` for every
request it routes, and asks `check` at each pick of each candidate that could be
stalled (excluded, or quiet for longer than the threshold); only a
pick's `check` (with `record`) starts a stall, so /debug/explain changes
nothing. All times are the director's clock. State lives on each endpoint
(`Endpoint.progress`), so it goes when the endpoint does.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Final

from epp.datastore import Endpoint

log = logging.getLogger(__name__)

# The longest exclusion, in thresholds: a pod that stays stalled is looked at
# again at least this often.
MAX_BACKOFF: Final = 8


class StallWatch:
    def __init__(
        self, threshold_s: float, on_stall: Callable[[Endpoint], object] | None = None
    ) -> None:
        """`threshold_s` 0 turns the watch off: nothing is ever stalled. `on_stall`
        is called with each endpoint at the start of each of its stalls."""
        self.threshold_s = threshold_s
        self.on_stall = on_stall

    # -- events (the director) -----------------------------------------------------

    def routed(self, endpoint: Endpoint, key: int, now: float, reports_first_chunk: bool) -> None:
        if reports_first_chunk and self.threshold_s > 0:
            endpoint.progress.awaiting[key] = now

    def first_chunk(self, endpoint: Endpoint, key: int, now: float) -> None:
        progress = endpoint.progress
        if progress.awaiting.pop(key, None) is not None:
            self._progressed(endpoint, now)

    def ended(self, endpoint: Endpoint, key: int, now: float, completed: bool) -> None:
        """A request ended. Completed (its response ended, whatever its status: the
        engine answered) is progress; a request given up on is not."""
        endpoint.progress.awaiting.pop(key, None)
        if completed:
            self._progressed(endpoint, now)

    def _progressed(self, endpoint: Endpoint, now: float) -> None:
        progress = endpoint.progress
        if progress.stalls:
            log.warning("endpoint %s progresses again: a candidate again", endpoint.name)
        progress.quiet_since = now
        progress.excluded_until = 0.0
        progress.stalls = 0

    # -- reads (a pick) --------------------------------------------------------------

    def check(self, endpoint: Endpoint, now: float, record: bool) -> bool:
        """Whether `endpoint` is stalled now. With `record` (a pick), a stall that
        the rule finds now starts: the endpoint is excluded from now on.

        Never true of an endpoint that is not excluded and has progressed within
        the threshold or has no request waiting: a pick asks only the others
        (epp/director.py)."""
        progress = endpoint.progress
        threshold = self.threshold_s
        if threshold <= 0:
            return False
        if now < progress.excluded_until:
            return True
        if not progress.awaiting or now - progress.quiet_since <= threshold:
            return False
        waited = now - next(iter(progress.awaiting.values()))
        if waited <= threshold:
            return False
        if record:
            exclusion = threshold * min(2**progress.stalls, MAX_BACKOFF)
            log.warning(
                "endpoint %s stalled: %d requests wait for their first token, the oldest"
                " for %.1fs, and nothing has progressed there for %.1fs; no candidate for"
                " %.0fs (stall %d in a row)",
                endpoint.name,
                len(progress.awaiting),
                waited,
                now - progress.quiet_since,
                exclusion,
                progress.stalls + 1,
            )
            progress.stalls += 1
            progress.excluded_until = now + exclusion
            if self.on_stall is not None:
                self.on_stall(endpoint)
        return True

    def describe(self, endpoint: Endpoint, now: float) -> dict[str, Any]:
        """The `progress` object of /debug/endpoints."""
        progress = endpoint.progress
        oldest = next(iter(progress.awaiting.values()), None)
        return {
            "awaitingFirstChunk": len(progress.awaiting),
            "oldestWaitSeconds": None if oldest is None else round(now - oldest, 3),
            "quietSeconds": round(now - progress.quiet_since, 3),
            "stalled": self.check(endpoint, now, record=False),
            "excludedForSeconds": round(max(0.0, progress.excluded_until - now), 3),
            "stallsInARow": progress.stalls,
        }
