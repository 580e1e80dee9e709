"""Plugins the ext_proc tests load by import path (`tests.epp.extproc.sample_plugins:X`),
exactly as a user's custom plugin is loaded."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from epp.scheduling import (
    CycleState,
    Endpoint,
    InferenceRequest,
    PluginContext,
    ResponseInfo,
    SchedulingResult,
)

MODULE = "tests.epp.extproc.sample_plugins"
SCORER_SECRET = "scorer-secret-7f3a: do not show this to clients"


class Recorder:
    """A first-chunk and post-response plugin that keeps what it was told about each
    request."""

    def __init__(self, params: object, context: PluginContext) -> None:
        self.records: list[tuple[InferenceRequest, ResponseInfo]] = []
        self.first_chunks: list[tuple[str, float]] = []  # (request id, seconds from pick)
        self.events: list[tuple[str, str]] = []  # (hook, request id), in the order called

    def response_first_chunk(
        self,
        request: InferenceRequest,
        cycle: CycleState,
        result: SchedulingResult,
        elapsed_s: float,
    ) -> None:
        self.first_chunks.append((request.request_id, elapsed_s))
        self.events.append(("first_chunk", request.request_id))

    def post_response(
        self,
        request: InferenceRequest,
        cycle: CycleState,
        result: SchedulingResult,
        response: ResponseInfo,
    ) -> None:
        self.records.append((request, response))
        self.events.append(("post_response", request.request_id))

    def for_request(self, request_id: str) -> list[ResponseInfo]:
        return [response for request, response in self.records if request.request_id == request_id]


class RejectAll:
    """A filter that rules every endpoint out."""

    def __init__(self, params: object, context: PluginContext) -> None:
        pass

    def filter(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Sequence[Endpoint]:
        return []


class ExplodingScorer:
    """A scorer with a bug: it raises on requests for the model `explode`."""

    def __init__(self, params: object, context: PluginContext) -> None:
        pass

    def score(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Mapping[Endpoint, float]:
        if request.model == "explode":
            raise RuntimeError(SCORER_SECRET)
        return dict.fromkeys(endpoints, 0.5)


def config(*plugins: tuple[str, str]) -> str:
    """An EndpointPickerConfig with the given (name, type) plugins of this module
    added to the default one: filters and scorers in its profile, hooks beside it."""
    lines = [
        "apiVersion: inference.networking.x-k8s.io/v1alpha1",
        "kind: EndpointPickerConfig",
        "plugins:",
        "- type: max-score-picker",
    ]
    lines += [f"- {{name: {name}, type: '{type_}'}}" for name, type_ in plugins]
    lines += [
        "schedulingProfiles:",
        "- name: default",
        "  plugins:",
        "  - pluginRef: max-score-picker",
    ]
    for name, type_ in plugins:
        plugin_class = globals()[type_.rsplit(":", 1)[1]]
        if hasattr(plugin_class, "filter") or hasattr(plugin_class, "score"):
            lines.append(f"  - pluginRef: {name}")
    return "\n".join(lines) + "\n"
