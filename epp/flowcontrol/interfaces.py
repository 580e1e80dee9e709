"""The flow-control policy interfaces: what a fairness, ordering or usage-limit
policy plugin implements (llm-d's three policy tiers).

A request that flow control holds is a `QueueItem` in the queue of its flow (its
fairness id) inside the band of its priority. At each dispatch opportunity:

1. band: the highest priority band with waiting requests, unless the usage-limit
   policy's ceiling for it is at or under the pool's saturation (then nothing is
   dispatched: lower bands never overtake a gated higher one);
2. flow: the band's `FairnessPolicy` picks one of its non-empty flows;
3. item: that flow's head, in the order of the band's `OrderingPolicy`.

Policies are plugins like any other (`PluginClass(parameters, context)`), named in
the config's `plugins:` and referenced from its `flowControl:` section. Their
contract:
- They run on the event loop, inside a dispatch pass: quick, no I/O, no awaits.
- They read the queues and never change them: the controller alone adds and
  removes items. A fairness policy keeps its per-band state (a cursor) in the
  object `new_state()` gave, never in itself, since one instance may serve
  several bands.
- Time comes from the `now` they are handed (the controller's clock), never from
  the time module.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from epp.datastore import Endpoint


@dataclass(eq=False, slots=True)
class QueueItem:
    """One request waiting in flow control; what the policies see of it. Compared
    by identity."""

    request_id: str
    flow_id: str  # the fairness id
    priority: int
    byte_size: int  # the request body's size: what the bands' maxBytes count
    enqueued_at: float  # the controller's clock at arrival
    seq: int  # arrival order, the tie-break of every ordering
    # Queue-wait budget in seconds from `enqueued_at`; 0: none (waits until
    # dispatched or the client goes away).
    ttl_s: float = 0.0
    # The controller's own bookkeeping (its state machine and the waiter's future).
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def deadline(self) -> float:
        """When the item's budget runs out; infinity without one."""
        return self.enqueued_at + self.ttl_s if self.ttl_s > 0 else math.inf


class FlowView(Protocol):
    """A non-empty flow of a band, as a fairness policy sees it."""

    @property
    def flow_id(self) -> str: ...

    def __len__(self) -> int: ...

    @property
    def byte_size(self) -> int: ...

    def head(self) -> QueueItem:
        """The item the flow would dispatch next."""

    def head_key(self) -> tuple[float, ...]:
        """The ordering policy's key of `head()`: smaller goes first."""


@runtime_checkable
class OrderingPolicy(Protocol):
    """Orders the requests within one flow (llm-d's OrderingPolicy). `order_key`
    gives a sort key: the smallest key is dispatched first. It must depend only on
    the item (its enqueue time, deadline, sequence), so that it can be computed
    once, when the item is queued."""

    def order_key(self, item: QueueItem) -> tuple[float, ...]: ...


@runtime_checkable
class FairnessPolicy(Protocol):
    """Chooses which flow of a band dispatches next (llm-d's FairnessPolicy).

    `new_state()` is called once per band the policy governs; the object it returns
    is handed back at every `pick_flow` for that band. `pick_flow` gets the band's
    non-empty flows sorted by flow id (never an empty sequence) and returns one of
    them; returning None lets the controller take the first."""

    def new_state(self) -> Any: ...

    def pick_flow(self, flows: Sequence[FlowView], state: Any, now: float) -> FlowView | None: ...


@runtime_checkable
class UsageLimitPolicy(Protocol):
    """Gives each priority band its dispatch ceiling (llm-d's UsageLimitPolicy).

    `priorities` are the bands flow control knows, highest first. The result holds
    one ceiling per priority, in the same order: a band is gated (nothing of it is
    dispatched on this pass) while the pool's saturation is at or above its
    ceiling. Missing entries count as 1.0 (fail open). Ceilings should not rise as
    priority falls: the controller stops at the first gated band."""

    def compute_limits(self, saturation: float, priorities: Sequence[int]) -> Sequence[float]: ...


@runtime_checkable
class DispatchSaturation(Protocol):
    """A saturation detector that has a reading meant for dispatch decisions: one
    that never stays at 1.0 merely because its data is old. The flow controller
    asks this in place of `SaturationDetector.saturation` when the detector offers
    it, since holding requests on a stale reading would freeze the pool for as long
    as the scrape outage lasts (`utilization-detector` falls back to the EPP's own
    in-flight counts there)."""

    def dispatch_saturation(self, endpoints: Sequence[Endpoint]) -> float: ...


FLOW_CONTROL_POINTS: tuple[tuple[str, type], ...] = (
    ("fairness_policy", FairnessPolicy),
    ("ordering_policy", OrderingPolicy),
    ("usage_limit_policy", UsageLimitPolicy),
)
"""The flow-control extension points, beside the scheduling ones
(`epp.scheduling.interfaces.EXTENSION_POINTS`)."""
