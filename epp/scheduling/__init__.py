"""The scheduling framework: what a plugin author imports.

from epp.scheduling import Scorer, CycleState, PluginContext, ...
"""

from epp.datastore import Endpoint, EndpointMetrics
from epp.requests import InferenceRequest
from epp.scheduling.interfaces import (
    Background,
    DataProducer,
    Filter,
    NoParameters,
    Picker,
    PickerParameters,
    PluginContext,
    PostResponse,
    PreRequest,
    ProfileHandler,
    Scorer,
)
from epp.scheduling.types import (
    CycleState,
    ProfileResult,
    ResponseInfo,
    SchedulingResult,
    ScoredEndpoint,
    StateKey,
    Usage,
)

__all__ = [
    "Background",
    "CycleState",
    "DataProducer",
    "Endpoint",
    "EndpointMetrics",
    "Filter",
    "InferenceRequest",
    "NoParameters",
    "Picker",
    "PickerParameters",
    "PluginContext",
    "PostResponse",
    "PreRequest",
    "ProfileHandler",
    "ProfileResult",
    "ResponseInfo",
    "SchedulingResult",
    "ScoredEndpoint",
    "Scorer",
    "StateKey",
    "Usage",
]
