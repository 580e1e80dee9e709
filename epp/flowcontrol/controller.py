"""The flow controller: holds requests in priority bands while the pool is
saturated, and hands them to the scheduler, one by one, as capacity frees.

A request's life in flow control is a small state machine (`ItemState`):

    admit() ──bounds full──▶ REJECTED (429 at once)
       │
       ▼
    QUEUED ──dispatch pass picks it──▶ DISPATCHED ──▶ the caller schedules it now
       │ ──its TTL runs out─────────▶ EXPIRED  (429; 503 if the pool is empty)
       │ ──the caller is cancelled──▶ CANCELLED (the client went away: gone at once)

Late binding: `admit` returns when the request may go, and only then does the
director pick its endpoint, on the state of that moment.

Dispatch is driven by events, never by polling. A pass (`_pass`) runs when:
- a request arrives (`admit`);
- capacity may have freed: a request ended or sent its first chunk, a dispatched
  request's pick finished (`notify`, `picked`);
- the earliest TTL among the waiting requests falls due (one timer);
- while requests wait on a saturated or empty pool: once per metrics refresh
  interval (one timer), since new metrics are the only other news that can open
  the gate; no timer runs while nothing waits, so an idle EPP does no work here.
A pass dispatches while the gate is open and returns; nothing loops in between.

The gate: the pool's saturation (from the config's saturation detector, read over
the ready endpoints) against the usage-limit policy's ceiling for the band. Two
rules keep it from freezing the pool:
- a detector with a dispatch reading (`DispatchSaturation`) is asked that one: the
  utilization detector then judges an endpoint with stale metrics by the EPP's own
  in-flight count instead of calling it saturated;
- when nothing this EPP routed is in flight on any ready endpoint and no pick is
  under way, one request is dispatched whatever the gate says: an idle pool never
  holds requests back, whatever a detector believes.
And one rule keeps a pass from overshooting: at most one pick per ready endpoint
may be under way at once (dispatched, its endpoint not yet chosen), since the
saturation a pass reads does not yet include requests that are still being picked.

Time is the injected clock's; waits (the timers) go through the injected `sleep`,
so a simulation drives both.
"""

from __future__ import annotations

import asyncio
import enum
import heapq
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from epp.clock import SYSTEM_CLOCK, Clock
from epp.datastore import Datastore, Endpoint
from epp.flowcontrol.errors import (
    FlowControlRejected,
    QueueFull,
    QueueTimeout,
    QueueTimeoutNoEndpoints,
)
from epp.flowcontrol.interfaces import (
    FairnessPolicy,
    OrderingPolicy,
    QueueItem,
    UsageLimitPolicy,
)
from epp.flowcontrol.metrics import FlowControlMetrics
from epp.flowcontrol.queue import Band, BandConfig

log = logging.getLogger(__name__)

Sleep = Callable[[float], Any]  # awaitable-returning, as PluginContext.sleep
Saturation = Callable[[Sequence[Endpoint]], float]


class ItemState(enum.Enum):
    QUEUED = "queued"
    DISPATCHED = "dispatched"
    REJECTED = "rejected"
    EXPIRED = "expired"
    CANCELLED = "cancelled"


@dataclass(frozen=True, slots=True)
class BandTemplate:
    """The settings a band gets when a priority without a band of its own first
    arrives (llm-d's defaultPriorityBand / defaultNegativePriorityBand)."""

    max_requests: int
    max_bytes: int
    fairness: FairnessPolicy
    ordering: OrderingPolicy
    fairness_name: str
    ordering_name: str

    def band(self, priority: int) -> BandConfig:
        return BandConfig(
            priority,
            self.max_requests,
            self.max_bytes,
            self.fairness,
            self.ordering,
            self.fairness_name,
            self.ordering_name,
        )


@dataclass(frozen=True)
class FlowControlSettings:
    """Everything the controller runs by, resolved by the config's build step."""

    bands: tuple[BandConfig, ...]  # configured bands (priority 0 always among them)
    default_band: BandTemplate
    default_negative_band: BandTemplate | None
    usage_limit: UsageLimitPolicy
    usage_limit_name: str
    max_requests: int = 0  # across all bands; 0: no global bound
    max_bytes: int = 0
    default_request_ttl_s: float = 60.0  # 0: no TTL
    no_endpoint_request_ttl_s: float = 60.0
    # While requests wait on a saturated or empty pool, a pass runs at most this
    # often without another event: the metrics refresh interval.
    recheck_interval_s: float = 0.05


# QueueItem.meta keys
_STATE = "state"
_FUTURE = "future"
_PICKING = "picking"


def _state(item: QueueItem) -> ItemState:
    state: ItemState = item.meta[_STATE]
    return state


class FlowController:
    def __init__(
        self,
        settings: FlowControlSettings,
        saturation: Saturation,
        datastore: Datastore,
        clock: Clock = SYSTEM_CLOCK,
        sleep: Sleep = asyncio.sleep,
        metrics: FlowControlMetrics | None = None,
    ) -> None:
        self.settings = settings
        self._saturation = saturation
        self.datastore = datastore
        self.clock = clock
        self.sleep = sleep
        self.metrics = metrics
        self._bands: dict[int, Band] = {}
        self._order: list[int] = []  # band priorities, highest first
        for config in settings.bands:
            self._add_band(config)
        self._seq = 0
        self.queued = 0  # requests waiting, all bands
        self.queued_bytes = 0
        self.picking = 0  # dispatched, pick not finished
        # Every waiting item by deadline (lazy: items that left are skipped).
        self._deadlines: list[tuple[float, int, QueueItem]] = []
        self._timer: asyncio.Task[None] | None = None
        self._timer_at = math.inf
        self.passes = 0  # dispatch passes run: the wake-ups tests count

    # -- bands -----------------------------------------------------------------------

    def _add_band(self, config: BandConfig) -> Band:
        band = self._bands[config.priority] = Band(config)
        self._order = sorted(self._bands, reverse=True)
        return band

    def _band_config(self, priority: int) -> BandConfig:
        band = self._bands.get(priority)
        if band is not None:
            return band.config
        s = self.settings
        template = (
            s.default_negative_band
            if priority < 0 and s.default_negative_band is not None
            else s.default_band
        )
        return template.band(priority)

    def _band(self, priority: int) -> Band:
        band = self._bands.get(priority)
        if band is None:
            # Provisioned on first use (priorities come from the config's objectives,
            # so their number is bounded).
            band = self._add_band(self._band_config(priority))
        return band

    # -- the request's side ------------------------------------------------------------

    async def admit(
        self,
        request_id: str,
        priority: int,
        flow_id: str,
        byte_size: int,
        *,
        on_wait: Callable[[], object] | None = None,
    ) -> QueueItem:
        """Wait until the request may be scheduled; the dispatched item, to be handed
        to `picked` once its pick is over (whatever its result). Raises a
        `FlowControlRejected` when the request is shed. Cancelling the caller takes
        the request out of its queue at once. `on_wait` is called, from the caller's
        task, when the request is queued rather than dispatched at once (not at all
        otherwise): the ext_proc server then watches its stream for the client
        leaving (epp/extproc/server.py)."""
        now = self.clock()
        band = self._band(priority)
        why = band.fits(byte_size)
        while why is not None and self._push_out_of_longest(band, flow_id):
            why = band.fits(byte_size)
        why = why or self._global_room(byte_size)
        if why is not None:
            self._left("rejected", priority, flow_id, 0.0)
            raise QueueFull(f"flow control cannot queue the request: {why}; retry later")
        self._seq += 1
        item = QueueItem(
            request_id=request_id,
            flow_id=flow_id,
            priority=priority,
            byte_size=byte_size,
            enqueued_at=now,
            seq=self._seq,
            ttl_s=self.settings.default_request_ttl_s,
        )
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        item.meta[_STATE] = ItemState.QUEUED
        item.meta[_FUTURE] = future
        band.push(item)
        self.queued += 1
        self.queued_bytes += byte_size
        if item.ttl_s > 0:
            heapq.heappush(self._deadlines, (item.deadline, item.seq, item))
        self._pass()
        if _state(item) is ItemState.DISPATCHED:
            return item
        if on_wait is not None:
            try:
                on_wait()
            except Exception:
                log.exception("the caller's on_wait hook failed")
        try:
            await future
        except asyncio.CancelledError:
            state = _state(item)
            if state is ItemState.QUEUED:
                self._take_out(item, ItemState.CANCELLED, "cancelled")
            elif state is ItemState.DISPATCHED:
                # Dispatched, but cancelled before it could resume: its pick is over.
                self.picked(item)
            raise
        return item

    def _push_out_of_longest(self, band: Band, flow_id: str) -> bool:
        """A full band makes room for a request of `flow_id` by shedding the newest
        request of its longest flow, if that flow holds more than `flow_id` would
        with the request: the band's bound is shared by its flows, and refusing the
        newcomer instead would let a flooding tenant shed everyone else's requests
        as often as its own. False when no flow holds more (the newcomer is shed)."""
        longest = band.longest_flow()
        mine = band.flows.get(flow_id)
        if longest is None or len(longest) <= (len(mine) if mine is not None else 0) + 1:
            return False
        newest = max(longest.items(), key=lambda item: item.seq)
        self._take_out(newest, ItemState.REJECTED, "rejected")
        future: asyncio.Future[None] = newest.meta[_FUTURE]
        if not future.done():
            future.set_exception(
                QueueFull(
                    f"flow control cannot keep the request: priority band {band.priority}"
                    f" is full and its flow holds the most of it ({len(longest) + 1}"
                    " requests); retry later"
                )
            )
        return True

    def _global_room(self, byte_size: int) -> str | None:
        s = self.settings
        if s.max_requests and self.queued + 1 > s.max_requests:
            return f"flow control holds its maximum of {s.max_requests} requests (maxRequests)"
        if s.max_bytes and self.queued_bytes + byte_size > s.max_bytes:
            return f"flow control would exceed its maximum of {s.max_bytes} bytes (maxBytes)"
        return None

    def picked(self, item: QueueItem) -> None:
        """The dispatched `item`'s pick is over (an endpoint chosen, or the pick
        failed): the next pick may start. Idempotent."""
        if item.meta.pop(_PICKING, False):
            self.picking -= 1
            self.notify()

    def notify(self) -> None:
        """Capacity may have freed (a request ended, sent its first chunk): run a
        pass if anything waits. Nothing at all while the queues are empty."""
        if self.queued:
            self._pass()

    # -- dispatch ------------------------------------------------------------------------

    def _pass(self) -> None:
        self.passes += 1
        if self.metrics is not None:
            self.metrics.passes.inc()
        now = self.clock()
        self._expire(now)
        waiting_for_news = False
        while self.queued:
            candidates = self.datastore.ready_endpoints()
            if not candidates:
                waiting_for_news = True
                break
            if self.picking >= len(candidates):
                break  # `picked` starts the next pass
            band = self._open_band(candidates)
            if band is None:
                waiting_for_news = True
                break
            flows = band.active_flows()
            chosen = None
            try:
                chosen = band.config.fairness.pick_flow(flows, band.state, now)
            except Exception:
                log.exception("fairness policy %s failed", band.config.fairness_name)
            index = next((i for i, flow in enumerate(flows) if flow is chosen), 0)
            item = band.pop(flows[index])
            self._left_queue(item)
            item.meta[_STATE] = ItemState.DISPATCHED
            item.meta[_PICKING] = True
            self.picking += 1
            future: asyncio.Future[None] = item.meta[_FUTURE]
            if not future.done():
                future.set_result(None)
            self._left("dispatched", item.priority, item.flow_id, now - item.enqueued_at)
        if len(self._deadlines) > 2 * self.queued + 64:
            # Items that left early stay in the deadline heap until their deadline
            # comes up: drop them once they outweigh the waiting ones.
            self._deadlines = [
                entry for entry in self._deadlines if _state(entry[2]) is ItemState.QUEUED
            ]
            heapq.heapify(self._deadlines)
        self._arm_timer(now, waiting_for_news)

    def _open_band(self, candidates: Sequence[Endpoint]) -> Band | None:
        """The band to dispatch from now, or None if the gate is closed."""
        saturation = self._read_saturation(candidates)
        # Nothing of ours in flight and no pick under way: let one through, whatever
        # the detector says (see the module's docstring).
        idle = self.picking == 0 and all(e.in_flight == 0 for e in candidates)
        ceilings: Sequence[float] = ()
        try:
            ceilings = self.settings.usage_limit.compute_limits(saturation, self._order)
        except Exception:
            log.exception("usage limit policy %s failed", self.settings.usage_limit_name)
        for i, priority in enumerate(self._order):
            band = self._bands[priority]
            if not band.requests:
                continue
            ceiling = ceilings[i] if i < len(ceilings) else 1.0
            if saturation >= ceiling and not idle:
                return None  # strict priority: a gated band is not overtaken
            return band
        return None

    def _read_saturation(self, candidates: Sequence[Endpoint]) -> float:
        try:
            saturation = float(self._saturation(candidates))
        except Exception:
            # A broken detector must not stop the traffic: read as room.
            log.exception("saturation detector failed; dispatching as if the pool had room")
            saturation = 0.0
        if math.isnan(saturation):
            saturation = 0.0
        if self.metrics is not None:
            self.metrics.saturation.set(saturation)
        return saturation

    def _expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, _, item = heapq.heappop(self._deadlines)
            if _state(item) is not ItemState.QUEUED:
                continue
            if self.datastore.ready_endpoints():
                error: FlowControlRejected = QueueTimeout(
                    f"the request waited {item.ttl_s:g}s in flow control (defaultRequestTTL)"
                    " without capacity freeing up; retry later"
                )
                outcome = "ttl_expired"
            else:
                error = QueueTimeoutNoEndpoints(
                    f"the request waited {item.ttl_s:g}s in flow control and no endpoint"
                    " is ready; retry later"
                )
                outcome = "no_endpoints"
            self._take_out(item, ItemState.EXPIRED, outcome)
            future: asyncio.Future[None] = item.meta[_FUTURE]
            if not future.done():
                future.set_exception(error)

    def _take_out(self, item: QueueItem, state: ItemState, outcome: str) -> None:
        self._bands[item.priority].remove(item)
        self._left_queue(item)
        item.meta[_STATE] = state
        self._left(outcome, item.priority, item.flow_id, self.clock() - item.enqueued_at)
        if not self.queued:
            self._cancel_timer()

    def _left_queue(self, item: QueueItem) -> None:
        self.queued -= 1
        self.queued_bytes -= item.byte_size

    def _left(self, outcome: str, priority: int, flow_id: str, waited_s: float) -> None:
        if self.metrics is not None:
            self.metrics.left(outcome, priority, flow_id, waited_s)

    # -- timers --------------------------------------------------------------------------

    def _next_deadline(self) -> float:
        while self._deadlines and _state(self._deadlines[0][2]) is not ItemState.QUEUED:
            heapq.heappop(self._deadlines)
        return self._deadlines[0][0] if self._deadlines else math.inf

    def _arm_timer(self, now: float, waiting_for_news: bool) -> None:
        if not self.queued:
            self._cancel_timer()
            return
        at = self._next_deadline()
        if waiting_for_news:
            at = min(at, now + self.settings.recheck_interval_s)
        if at == math.inf:
            self._cancel_timer()
            return
        if self._timer is not None and self._timer_at <= at:
            return  # an earlier pass is already due; it re-arms
        self._cancel_timer()
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return  # no loop (a synchronous caller): the next event runs the pass
        self._timer_at = at
        self._timer = loop.create_task(self._fire(at), name="flow-control-timer")

    async def _fire(self, at: float) -> None:
        await self.sleep(max(0.0, at - self.clock()))
        self._timer = None
        self._timer_at = math.inf
        self._pass()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
            self._timer_at = math.inf

    # -- reading -------------------------------------------------------------------------

    def flows(self) -> Iterator[tuple[int, str, int, int]]:
        """(priority, fairness id, requests, bytes) of every non-empty flow."""
        for priority in self._order:
            for flow in self._bands[priority].flows.values():
                yield priority, flow.flow_id, len(flow), flow.byte_size

    def explain(self, priority: int, flow_id: str) -> dict[str, Any]:
        """Where a request of `priority` and `flow_id` would wait now, and whether it
        would (for /debug/explain). Changes nothing."""
        config = self._band_config(priority)
        band = self._bands.get(priority)
        flow = band.flows.get(flow_id) if band is not None else None
        candidates = self.datastore.ready_endpoints()
        saturation = self._read_saturation(candidates) if candidates else None
        priorities = sorted({*self._order, priority}, reverse=True)
        ceiling = 1.0
        if saturation is not None:
            try:
                ceilings = self.settings.usage_limit.compute_limits(saturation, priorities)
                index = priorities.index(priority)
                ceiling = float(ceilings[index]) if index < len(ceilings) else 1.0
            except Exception:
                log.exception("usage limit policy %s failed", self.settings.usage_limit_name)
        ahead = sum(self._bands[p].requests for p in self._order if p > priority)
        in_band = band.requests if band is not None else 0
        idle = self.picking == 0 and all(e.in_flight == 0 for e in candidates)
        if not candidates:
            reason = "no ready endpoint"
        elif (band is not None and band.fits(0) is not None) or self._global_room(0):
            reason = "the band is full: the request would be rejected (429)"
        elif ahead or in_band:
            reason = f"{ahead + in_band} requests of this or higher priority wait first"
        elif saturation is not None and saturation >= ceiling and not idle:
            reason = f"saturation {saturation:.2f} is at or above the band's ceiling {ceiling:g}"
        else:
            reason = None
        return {
            "band": priority,
            "flow": flow_id,
            "fairnessPolicy": config.fairness_name,
            "orderingPolicy": config.ordering_name,
            "usageLimitPolicy": self.settings.usage_limit_name,
            "saturation": saturation,
            "ceiling": ceiling,
            "queuedAhead": ahead,
            "queuedInBand": in_band,
            "queuedInFlow": len(flow) if flow is not None else 0,
            "queued": self.queued,
            "wouldQueue": reason is not None,
            "reason": reason,
        }
