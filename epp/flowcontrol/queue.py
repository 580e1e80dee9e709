"""The queues: one `FlowQueue` per flow, grouped in one `Band` per priority.

A flow's queue is a heap on its ordering policy's key (then arrival order), so FCFS
and EDF share one structure. Items leave in three ways: dispatched from the head,
or removed from anywhere (their client went away, their TTL ran out). Removal is
lazy: the item is marked gone and counted out at once (lengths and bytes are exact
at every moment, which is what the bounds and the metrics read), and the heap drops
it when it reaches the top, or when garbage outweighs the live items (then the heap
is rebuilt, so a flood of cancellations behind a long-held head cannot grow memory
without bound).

A band drops a flow as soon as its queue is empty: flows cost nothing while idle,
and a fairness id taken from a header cannot pile up state.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from epp.flowcontrol.interfaces import FairnessPolicy, OrderingPolicy, QueueItem

_GONE = "gone"  # QueueItem.meta key: removed from its queue, still in the heap


@dataclass(frozen=True, slots=True)
class BandConfig:
    """One priority band as configured (llm-d's PriorityBandConfig, resolved)."""

    priority: int
    max_requests: int  # > 0
    max_bytes: int  # > 0
    fairness: FairnessPolicy
    ordering: OrderingPolicy
    fairness_name: str  # the plugins' names, for /debug/explain
    ordering_name: str


class FlowQueue:
    """The waiting requests of one flow in one band, in dispatch order."""

    __slots__ = ("_heap", "_live", "byte_size", "flow_id", "ordering")

    def __init__(self, flow_id: str, ordering: OrderingPolicy) -> None:
        self.flow_id = flow_id
        self.ordering = ordering
        self._heap: list[tuple[tuple[float, ...], int, QueueItem]] = []
        self._live = 0
        self.byte_size = 0

    def __len__(self) -> int:
        return self._live

    def push(self, item: QueueItem) -> None:
        heapq.heappush(self._heap, (self.ordering.order_key(item), item.seq, item))
        self._live += 1
        self.byte_size += item.byte_size

    def _settle(self) -> None:
        while self._heap and self._heap[0][2].meta.get(_GONE):
            heapq.heappop(self._heap)

    def head(self) -> QueueItem:
        self._settle()
        return self._heap[0][2]

    def head_key(self) -> tuple[float, ...]:
        self._settle()
        return self._heap[0][0]

    def pop(self) -> QueueItem:
        self._settle()
        _, _, item = heapq.heappop(self._heap)
        self._count_out(item)
        return item

    def remove(self, item: QueueItem) -> None:
        """Take `item` out wherever it is (it must be in this queue)."""
        item.meta[_GONE] = True
        self._count_out(item)
        if len(self._heap) > 2 * self._live + 16:
            self._heap = [entry for entry in self._heap if not entry[2].meta.get(_GONE)]
            heapq.heapify(self._heap)

    def _count_out(self, item: QueueItem) -> None:
        self._live -= 1
        self.byte_size -= item.byte_size

    def items(self) -> Iterator[QueueItem]:
        """The live items, in no particular order."""
        return (entry[2] for entry in self._heap if not entry[2].meta.get(_GONE))


class Band:
    """The flows of one priority, with the band's totals and its fairness state."""

    __slots__ = ("byte_size", "config", "flows", "requests", "state")

    def __init__(self, config: BandConfig) -> None:
        self.config = config
        self.flows: dict[str, FlowQueue] = {}
        self.state: Any = config.fairness.new_state()
        self.requests = 0
        self.byte_size = 0

    @property
    def priority(self) -> int:
        return self.config.priority

    def fits(self, byte_size: int) -> str | None:
        """Why one more request of `byte_size` bytes does not fit (None: it does)."""
        c = self.config
        if self.requests + 1 > c.max_requests:
            return f"priority band {c.priority} holds its maximum of {c.max_requests} requests"
        if self.byte_size + byte_size > c.max_bytes:
            return f"priority band {c.priority} would exceed its maximum of {c.max_bytes} bytes"
        return None

    def push(self, item: QueueItem) -> None:
        flow = self.flows.get(item.flow_id)
        if flow is None:
            flow = self.flows[item.flow_id] = FlowQueue(item.flow_id, self.config.ordering)
        flow.push(item)
        self.requests += 1
        self.byte_size += item.byte_size

    def remove(self, item: QueueItem) -> None:
        flow = self.flows[item.flow_id]
        flow.remove(item)
        self._count_out(flow, item)

    def pop(self, flow: FlowQueue) -> QueueItem:
        item = flow.pop()
        self._count_out(flow, item)
        return item

    def _count_out(self, flow: FlowQueue, item: QueueItem) -> None:
        self.requests -= 1
        self.byte_size -= item.byte_size
        if not flow:
            del self.flows[flow.flow_id]

    def longest_flow(self) -> FlowQueue | None:
        """The flow holding the most requests (ties: the one that came first)."""
        return max(self.flows.values(), key=len, default=None)

    def active_flows(self) -> list[FlowQueue]:
        """The non-empty flows, sorted by flow id (what fairness policies get)."""
        return [self.flows[k] for k in sorted(self.flows)]
