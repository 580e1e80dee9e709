"""`edf-ordering-policy`: llm-d's earliest-deadline-first ordering within a flow.

A request's deadline is its arrival plus its TTL (`defaultRequestTTL`); the one
closest to it goes first, ties broken first come, first served. A request without
a TTL (`defaultRequestTTL: 0s`) has no deadline and goes after every request that
has one. With one TTL for every request, as today, EDF orders as FCFS does; it
differs once requests carry TTLs of their own. Takes no parameters."""

from __future__ import annotations

from epp.flowcontrol.interfaces import QueueItem
from epp.scheduling import PluginContext


class EdfOrderingPolicy:
    def __init__(self, params: object, context: PluginContext) -> None:
        pass

    def order_key(self, item: QueueItem) -> tuple[float, ...]:
        return (item.deadline, item.enqueued_at, item.seq)
