"""Flow control (llm-d's, behind the `flowControl` feature gate): under overload,
requests wait in the EPP in priority bands, with fairness between flows (fairness
ids) within a band, and are dispatched to the scheduler as capacity frees.

    interfaces.py  the policy contracts (fairness, ordering, usage limit) and QueueItem
    queue.py       a flow's queue and a priority band
    controller.py  the controller: admission, dispatch passes, TTLs, cancellation
    headers.py     a request's objective and fairness id
    errors.py      the answers to shed requests (429/503 with Retry-After)
    metrics.py     its Prometheus metrics

The configuration (`featureGates`, `flowControl:`) is read by epp/config; the
director waits on the controller before it picks (late binding). The policies are
plugins (plugins/*_policy.py, program_aware_fairness.py). docs/flow-control.md
tells the semantics and the trade-offs.
"""

from epp.flowcontrol.controller import (
    BandTemplate,
    FlowController,
    FlowControlSettings,
    ItemState,
)
from epp.flowcontrol.errors import (
    FlowControlRejected,
    QueueFull,
    QueueTimeout,
    QueueTimeoutNoEndpoints,
)
from epp.flowcontrol.headers import (
    DEFAULT_FLOW_ID,
    fairness_id_of,
    objective_of,
)
from epp.flowcontrol.interfaces import (
    FLOW_CONTROL_POINTS,
    DispatchSaturation,
    FairnessPolicy,
    FlowView,
    OrderingPolicy,
    QueueItem,
    UsageLimitPolicy,
)
from epp.flowcontrol.metrics import FlowControlMetrics
from epp.flowcontrol.queue import Band, BandConfig, FlowQueue

__all__ = [
    "DEFAULT_FLOW_ID",
    "FLOW_CONTROL_POINTS",
    "Band",
    "BandConfig",
    "BandTemplate",
    "DispatchSaturation",
    "FairnessPolicy",
    "FlowControlMetrics",
    "FlowControlRejected",
    "FlowControlSettings",
    "FlowController",
    "FlowQueue",
    "FlowView",
    "ItemState",
    "OrderingPolicy",
    "QueueFull",
    "QueueItem",
    "QueueTimeout",
    "QueueTimeoutNoEndpoints",
    "UsageLimitPolicy",
    "fairness_id_of",
    "objective_of",
]
