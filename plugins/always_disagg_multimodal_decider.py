"""`always-disagg-multimodal-decider`: send a request's encoding to encode
endpoints whenever it carries media (llm-d's encode decider of the same name).

Named by `disagg-profile-handler` as `deciders.encode`. Says yes for a chat
completion whose messages have a content part of type `image_url`, `video_url` or
`input_audio` (the parts an encoder computes embeddings for), no for anything
else: a text-only request has nothing to encode. The endpoint it is asked about
does not matter. No parameters.
"""

from __future__ import annotations

from typing import Final

from epp.datastore import Endpoint
from epp.requests import ChatPrompt, InferenceRequest
from epp.scheduling import CycleState, DisaggDecision, PluginContext

MEDIA_PART_TYPES: Final = frozenset({"image_url", "video_url", "input_audio"})


def media_parts(request: InferenceRequest) -> dict[str, int]:
    """The request's media content parts, counted by type."""
    counts: dict[str, int] = {}
    prompt = request.prompt
    if not isinstance(prompt, ChatPrompt):
        return counts
    for message in prompt.messages:
        if isinstance(message.content, tuple):
            for part in message.content:
                if part.type in MEDIA_PART_TYPES:
                    counts[part.type] = counts.get(part.type, 0) + 1
    return counts


class AlwaysDisaggMultimodalDecider:
    def __init__(self, params: object, context: PluginContext) -> None:
        pass

    def disaggregate(
        self, request: InferenceRequest, cycle: CycleState, decode: Endpoint | None
    ) -> DisaggDecision:
        parts = media_parts(request)
        if parts:
            return DisaggDecision(True, "the request carries media", {"mediaParts": parts})
        return DisaggDecision(False, "no media to encode")
