"""`fcfs-ordering-policy`: llm-d's default ordering within a flow: first come,
first served, by the time the request reached flow control (then arrival order).
Takes no parameters."""

from __future__ import annotations

from epp.flowcontrol.interfaces import QueueItem
from epp.scheduling import PluginContext


class FcfsOrderingPolicy:
    def __init__(self, params: object, context: PluginContext) -> None:
        pass

    def order_key(self, item: QueueItem) -> tuple[float, ...]:
        return (item.enqueued_at, item.seq)
