"""`session-affinity-scorer`: sends the requests of one session to the endpoint that
served the session before (llm-d's scorer of the same name), where its KV cache
most likely still is.

Strategies (`strategy`):
- `session_id`: the client names the session; the scorer remembers which endpoint
  the session's last request went to. The id comes from the first of
  `sessionIdConfig.sources` that is set: `{header: x-session-id}` (the default) or,
  this EPP's addition, `{bodyField: user}` (a top-level string field of the JSON
  body). A binding lives `evictionTtlSeconds` (300) after its last use, and at most
  `maxSessions` (100,000, this EPP's addition: the memory bound) are kept, the
  least recently used going first. The binding is made or refreshed in
  `pre_request`, with the endpoint the request was actually routed to (of profile
  `profileName`, else the primary one), so /debug/explain changes nothing.
- `encoded_endpoint_header` (llm-d's default): the request header
  `encodedEndpointHeaderConfig.header` (`x-session-token`) holds the base64 of
  `namespace/name` (or `name`) of the endpoint to stick to. This EPP reads it but
  does not yet write it on responses, so it only works for clients or gateways that
  set it themselves; prefer `session_id`.

Formula: 1.0 for the endpoint the session is bound to (if it is a candidate), 0.0
for every other; a request without a session, or whose endpoint is gone, scores
0.0 everywhere (no preference). Never stale. `evictionSweepSeconds` is accepted
and not needed: expired bindings are dropped as they are met.
"""

from __future__ import annotations

import base64
import binascii
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal

import msgspec

from epp.datastore import Endpoint
from epp.requests import InferenceRequest
from epp.scheduling import CycleState, PluginContext, SchedulingResult, StateKey

log = logging.getLogger(__name__)


class EncodedEndpointHeaderConfig(msgspec.Struct, forbid_unknown_fields=True):
    header: str = "x-session-token"


class SessionSource(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    header: str | None = None
    attribute: str | None = None
    body_field: str | None = None


def _default_sources() -> list[SessionSource]:
    return [SessionSource(header="x-session-id")]


class SessionIdConfig(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    sources: list[SessionSource] = msgspec.field(default_factory=_default_sources)
    eviction_ttl_seconds: Annotated[float, msgspec.Meta(gt=0)] = 300.0
    eviction_sweep_seconds: Annotated[float, msgspec.Meta(gt=0)] = 10.0
    max_sessions: Annotated[int, msgspec.Meta(ge=1)] = 100_000


class SessionAffinityScorer:
    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        strategy: Literal["encoded_endpoint_header", "session_id"] = "encoded_endpoint_header"
        profile_name: str = ""
        encoded_endpoint_header_config: EncodedEndpointHeaderConfig = msgspec.field(
            default_factory=EncodedEndpointHeaderConfig
        )
        session_id_config: SessionIdConfig = msgspec.field(default_factory=SessionIdConfig)

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        self.clock = context.clock
        self.strategy = params.strategy
        self.profile_name = params.profile_name
        self.token_header = params.encoded_endpoint_header_config.header.lower()
        config = params.session_id_config
        self.ttl_s = config.eviction_ttl_seconds
        self.max_sessions = config.max_sessions
        self._sources: list[tuple[str, Any]] = []
        for i, source in enumerate(config.sources):
            given = [
                (kind, value)
                for kind, value in (
                    ("header", source.header),
                    ("attribute", source.attribute),
                    ("bodyField", source.body_field),
                )
                if value
            ]
            if len(given) != 1:
                raise ValueError(
                    f"sessionIdConfig.sources[{i}]: set exactly one of header, bodyField"
                )
            kind, value = given[0]
            if kind == "attribute":
                raise ValueError(
                    f"sessionIdConfig.sources[{i}]: request attributes are not supported here;"
                    " read the session id from a header or a bodyField"
                )
            if kind == "header":
                self._sources.append(("header", value.lower()))
            else:
                body_type = msgspec.defstruct(
                    "SessionBody", [("value", str | None, None)], rename={"value": value}
                )
                self._sources.append(("body", msgspec.json.Decoder(body_type)))
        if self.strategy == "encoded_endpoint_header":
            log.warning(
                "%s: strategy encoded_endpoint_header reads %s but this EPP does not write it"
                " on responses; use strategy session_id for stickiness clients need not manage",
                context.name,
                self.token_header,
            )
        # session id -> (endpoint name, expiry on the monotonic clock), least
        # recently used first.
        self._bindings: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._state_key: StateKey[str | None] = StateKey(f"session-affinity:{context.name}")

    def __len__(self) -> int:
        return len(self._bindings)

    def session_id(self, request: InferenceRequest) -> str | None:
        for kind, source in self._sources:
            if kind == "header":
                value = request.headers.get(source)
                if value:
                    return str(value)
                continue
            if not request.body:
                continue
            try:
                found = source.decode(request.body).value
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if found:
                return str(found)
        return None

    def _bound_endpoint(self, request: InferenceRequest, cycle: CycleState) -> str | None:
        if self.strategy == "encoded_endpoint_header":
            token = request.headers.get(self.token_header)
            if not token:
                return None
            try:
                decoded = base64.b64decode(token, validate=True).decode("utf-8")
            except (binascii.Error, UnicodeDecodeError):
                return None
            return decoded.rsplit("/", 1)[-1]
        session = self.session_id(request)
        cycle.put(self._state_key, session)
        if session is None:
            return None
        binding = self._bindings.get(session)
        if binding is None or binding[1] < self.clock():
            return None
        return binding[0]

    def score(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Mapping[Endpoint, float]:
        bound = self._bound_endpoint(request, cycle)
        return {e: 1.0 if bound is not None and e.name == bound else 0.0 for e in endpoints}

    def pre_request(
        self, request: InferenceRequest, cycle: CycleState, result: SchedulingResult
    ) -> None:
        if self.strategy != "session_id":
            return
        session = (
            cycle.get(self._state_key) if self._state_key in cycle else self.session_id(request)
        )
        if session is None:
            return
        profile = result.profiles.get(self.profile_name or result.primary_profile)
        if profile is None or not profile.targets:
            return
        now = self.clock()
        self._bindings[session] = (profile.targets[0].name, now + self.ttl_s)
        self._bindings.move_to_end(session)
        # Least recently used first: expired bindings and those over the bound are
        # at the front.
        while self._bindings:
            oldest_session, (_, expires) = next(iter(self._bindings.items()))
            if expires >= now and len(self._bindings) <= self.max_sessions:
                break
            del self._bindings[oldest_session]
