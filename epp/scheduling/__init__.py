"""The scheduling framework: what a plugin author imports.

from epp.scheduling import Scorer, CycleState, PluginContext, ...
"""

from epp.datastore import Endpoint, EndpointMetrics
from epp.requests import InferenceRequest
from epp.scheduling.interfaces import (
    METRICS,
    Admitter,
    Background,
    DataExtractor,
    DataProducer,
    DataSource,
    Filter,
    NoParameters,
    Picker,
    PickerParameters,
    PluginContext,
    PostResponse,
    PreRequest,
    ProfileHandler,
    SaturationDetector,
    Scorer,
    ServerSettings,
)
from epp.scheduling.types import (
    EXPLAIN_NOTES,
    PRIORITY,
    CycleState,
    ProfileResult,
    ResponseInfo,
    SchedulingResult,
    ScoredEndpoint,
    StateKey,
    Usage,
    explain_note,
)

__all__ = [
    "EXPLAIN_NOTES",
    "METRICS",
    "PRIORITY",
    "Admitter",
    "Background",
    "CycleState",
    "DataExtractor",
    "DataProducer",
    "DataSource",
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
    "SaturationDetector",
    "SchedulingResult",
    "ScoredEndpoint",
    "Scorer",
    "ServerSettings",
    "StateKey",
    "Usage",
    "explain_note",
]
