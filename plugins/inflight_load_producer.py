"""`inflight-load-producer`: the requests and prompt tokens this EPP has in flight
on each endpoint (llm-d's data producer of the same name), for `token-load-scorer`
and the TTFT load gate of `prefix-cache-affinity-filter`.

A DataProducer, a PreRequest, a ResponseFirstChunk and a PostResponse hook. For
each request it leaves an `InFlightLoadInfo` under its name (`in_flight_load_key`),
which tells consumers:

- `load(endpoint)`: the requests and tokens in flight there (llm-d's InFlightLoad),
  read when asked, so it is as current as the counters;
- `request_tokens(endpoint)`: what this request would add there (llm-d's
  UncachedRequestTokens): its prompt tokens minus the prefix the endpoint already
  holds, plus the output estimate when `addEstimatedOutputTokens` is on.

When a request is routed (pre_request), the primary target of every profile that
picked one (a P/D pick: prefill and decode) is charged one request and the
request's tokens for that endpoint; when it ends (post_response, completed or
aborted) exactly that charge is taken back. The charge of a target of a profile
other than the primary one (the prefill endpoint of a disaggregated pick) is taken
back earlier, at the response's first chunk: the decode endpoint's first token
comes only after the prefill endpoint has finished its part and handed over the KV
cache, so its work for the request is over by then; and it is charged the prompt
only, never the output estimate. Counters never go below
zero, and an endpoint that leaves the pool takes its counters with it: a request
still running there releases into the old counters, never into those of a new
endpoint of the same name.

Token counts:
- input: the prompt's tokens, estimated as characters / `charsPerToken` (this
  EPP's, 4.0) for text and counted exactly for a prompt of token ids; a batch of
  completion prompts counts all of them;
- prefix discount: with the `PrefixMatchInfo` of `prefixMatchInfoProducerName`
  (default `approx-prefix-cache-producer`), the endpoint's m matched blocks of
  `blockSizeTokens` each are taken off: `max(0, input - m * blockSizeTokens)`;
  without it the whole prompt counts;
- output, only with `addEstimatedOutputTokens` (false): `round(input *
  outputRatio)` (1.5, >= 0, from the whole prompt), capped by the request's own
  `max_tokens` / `max_completion_tokens` / `max_output_tokens` and by
  `maxEstimatedOutputTokens` (no cap by default, >= 0).

`syncCrossReplicaState` (true) is accepted for llm-d configs: this EPP has no
cross-replica state syncer, so the counts are this replica's own, as llm-d's are
without one.

Known differences from llm-d:
- Tokens on the primary target are released when the response ends. llm-d
  releases a streamed request's prompt tokens at its first response chunk (prefill
  is done by then; with `addEstimatedOutputTokens` only the prefill profile's
  share): here a request's prompt tokens count on the endpoint it went to until
  its last chunk, and the load reads as prompt-plus-decode work rather than queued
  prefill work. Only a disaggregated pick's prefill endpoint is released at the
  first chunk.
- Prompt tokens are estimated from the text (no tokenizer); llm-d reads them from
  its token-producer.
- The discount is exact to the token (`input - m * blockSizeTokens`); llm-d counts
  whole unmatched blocks, so its figure is up to one block larger.
- llm-d creates this producer by itself when a consumer needs it; here it is
  declared in the config (without it, consumers see no load and say so in the log).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Final

import msgspec

from epp.approxindex import DEFAULT_CHARS_PER_TOKEN, prompt_units
from epp.datastore import Endpoint
from epp.requests import CompletionPrompt, InferenceRequest
from epp.scheduling import (
    CycleState,
    PluginContext,
    ResponseInfo,
    SchedulingResult,
    StateKey,
    prefix_match_key,
)

DEFAULT_PRODUCER: Final = "inflight-load-producer"
DEFAULT_PREFIX_PRODUCER: Final = "approx-prefix-cache-producer"


@dataclass(frozen=True, slots=True)
class InFlightLoad:
    """Requests and tokens in flight on one endpoint (llm-d's InFlightLoad)."""

    requests: int = 0
    tokens: int = 0


def count_prompt_tokens(request: InferenceRequest, chars_per_token: float) -> int:
    """The request's prompt tokens: characters / `chars_per_token` for text, exact for
    token ids, every prompt of a batch; 0 without a prompt."""
    prompt = request.prompt
    if isinstance(prompt, CompletionPrompt):
        return sum(_units(p, chars_per_token) for p in prompt.prompts)
    units = prompt_units(request)
    return 0 if units is None else _units(units, chars_per_token)


def _units(units: str | Sequence[int], chars_per_token: float) -> int:
    if isinstance(units, str):
        return math.ceil(len(units) / chars_per_token)
    return len(units)


def in_flight_load_key(producer: str) -> StateKey[InFlightLoadInfo]:
    """Where the producer named `producer` leaves a request's `InFlightLoadInfo`
    (llm-d's data key `InFlightLoad/<producer>`)."""
    return StateKey(f"InFlightLoad/{producer}")


class _Counter:
    """One endpoint's live counts. Held by the requests charged to it, so a release
    always lands on the counter it was charged to."""

    __slots__ = ("requests", "tokens")

    def __init__(self) -> None:
        self.requests = 0
        self.tokens = 0


@dataclass(frozen=True, slots=True)
class _Charge:
    counter: _Counter
    tokens: int
    # Taken back at the first response chunk: a prefill endpoint's part ends there.
    at_first_chunk: bool = False


class _Caps(msgspec.Struct):
    """The client's own output limits, whichever its API names."""

    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    max_output_tokens: int | None = None


class InFlightLoadInfo:
    """What `inflight-load-producer` leaves for one request. Computed when asked,
    not when left: the counts are then current, and the prefix discount sees the
    prefix producer's match even when that producer runs after this one (producers
    run in the file's order, and llm-d's optimized-baseline guide lists this one
    first)."""

    __slots__ = ("_cycle", "_producer", "_request")

    def __init__(
        self, producer: InFlightLoadProducer, request: InferenceRequest, cycle: CycleState
    ) -> None:
        self._producer = producer
        self._request = request
        self._cycle = cycle

    def load(self, endpoint: Endpoint) -> InFlightLoad:
        """What is in flight on `endpoint` now."""
        return self._producer.load(endpoint)

    def request_tokens(self, endpoint: Endpoint) -> int:
        """The tokens this request would add on `endpoint`."""
        return self._producer.request_tokens(self._request, self._cycle, endpoint)


class InFlightLoadProducer:
    class Parameters(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
        add_estimated_output_tokens: bool = False
        output_ratio: Annotated[float, msgspec.Meta(ge=0.0)] = 1.5
        max_estimated_output_tokens: Annotated[int, msgspec.Meta(ge=0)] | None = None
        prefix_match_info_producer_name: str = ""
        sync_cross_replica_state: bool = True
        # This EPP's: characters per token when a prompt is text.
        chars_per_token: Annotated[float, msgspec.Meta(gt=0.0)] = DEFAULT_CHARS_PER_TOKEN

    def __init__(self, params: Parameters, context: PluginContext) -> None:
        if not math.isfinite(params.output_ratio):
            raise ValueError(f"outputRatio must be a finite number >= 0, got {params.output_ratio}")
        if not math.isfinite(params.chars_per_token):
            raise ValueError(
                f"charsPerToken must be a finite number > 0, got {params.chars_per_token}"
            )
        self.name = context.name
        self.key = in_flight_load_key(context.name)
        self.add_output = params.add_estimated_output_tokens
        self.output_ratio = params.output_ratio
        self.max_output = params.max_estimated_output_tokens
        self.chars_per_token = params.chars_per_token
        self.prefix_key = prefix_match_key(
            params.prefix_match_info_producer_name or DEFAULT_PREFIX_PRODUCER
        )
        self._counters: dict[Endpoint, _Counter] = {}
        self._tokens: StateKey[tuple[int, int]] = StateKey(f"inflight-load-tokens/{context.name}")
        self._charges: StateKey[list[_Charge]] = StateKey(f"inflight-load-charges/{context.name}")
        context.datastore.add_listener(self._membership)

    def _membership(self, added: list[Endpoint], removed: list[Endpoint]) -> None:
        for endpoint in removed:
            self._counters.pop(endpoint, None)

    # -- what consumers read -----------------------------------------------------

    def load(self, endpoint: Endpoint) -> InFlightLoad:
        counter = self._counters.get(endpoint)
        if counter is None:
            return InFlightLoad()
        return InFlightLoad(counter.requests, counter.tokens)

    def input_tokens(self, request: InferenceRequest, cycle: CycleState) -> int:
        """The request's prompt tokens."""
        return self._estimate(request, cycle)[0]

    def _estimate(self, request: InferenceRequest, cycle: CycleState) -> tuple[int, int]:
        """(prompt tokens, output estimate), computed once per request."""
        found = cycle.get(self._tokens)
        if found is None:
            prompt = self._count_input(request)
            output = self._output_estimate(request, prompt) if self.add_output else 0
            found = (prompt, output)
            cycle.put(self._tokens, found)
        return found

    def _count_input(self, request: InferenceRequest) -> int:
        return count_prompt_tokens(request, self.chars_per_token)

    def request_tokens(
        self, request: InferenceRequest, cycle: CycleState, endpoint: Endpoint
    ) -> int:
        """What `request` adds on `endpoint`: its uncached prompt tokens there, plus
        the output estimate when enabled."""
        prompt, output = self._estimate(request, cycle)
        tokens = prompt
        info = cycle.get(self.prefix_key)
        if info is not None and info.block_size_tokens > 0:
            cached = round(info.matched.get(endpoint, 0.0) * info.block_size_tokens)
            tokens = max(0, prompt - cached)
        return tokens + output

    def _output_estimate(self, request: InferenceRequest, prompt: int) -> int:
        if prompt <= 0:
            return 0
        estimate = round(prompt * self.output_ratio)
        caps = [self.max_output] if self.max_output is not None else []
        try:
            client = msgspec.json.decode(request.body, type=_Caps)
        except msgspec.DecodeError:
            client = _Caps()
        asked = (client.max_tokens, client.max_completion_tokens, client.max_output_tokens)
        caps += [c for c in asked if c is not None and c >= 0]
        return min([estimate, *caps])

    # -- extension points ------------------------------------------------------------

    async def prepare(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> None:
        cycle.put(self.key, InFlightLoadInfo(self, request, cycle))

    def pre_request(
        self, request: InferenceRequest, cycle: CycleState, result: SchedulingResult
    ) -> None:
        charges = cycle.get(self._charges)
        if charges is None:
            charges = []
            cycle.put(self._charges, charges)
        for name, profile in result.profiles.items():
            if not profile.targets:
                continue
            endpoint = profile.targets[0]
            tokens = self.request_tokens(request, cycle, endpoint)
            early = name != result.primary_profile
            if early:
                # A prefill endpoint computes the prompt, not the answer.
                tokens -= self._estimate(request, cycle)[1]
            counter = self._counters.get(endpoint)
            if counter is None:
                counter = self._counters[endpoint] = _Counter()
            counter.requests += 1
            counter.tokens += tokens
            charges.append(_Charge(counter, tokens, early))

    def response_first_chunk(
        self,
        request: InferenceRequest,
        cycle: CycleState,
        result: SchedulingResult,
        elapsed_s: float,
    ) -> None:
        charges = cycle.get(self._charges)
        # Only a disaggregated pick has an early charge: nothing to do for the rest.
        if not charges or not any(c.at_first_chunk for c in charges):
            return
        _release(c for c in charges if c.at_first_chunk)
        charges[:] = [c for c in charges if not c.at_first_chunk]

    def post_response(
        self,
        request: InferenceRequest,
        cycle: CycleState,
        result: SchedulingResult,
        response: ResponseInfo,
    ) -> None:
        charges = cycle.get(self._charges)
        if not charges:
            return
        _release(charges)
        charges.clear()  # released once, however often the end is reported

    def describe_endpoint(self, endpoint: Endpoint) -> Mapping[str, object]:
        load = self.load(endpoint)
        return {"inFlightLoad": {"requests": load.requests, "tokens": load.tokens}}


def _release(charges: Iterable[_Charge]) -> None:
    for charge in charges:
        counter = charge.counter
        counter.requests = max(0, counter.requests - 1)
        counter.tokens = max(0, counter.tokens - charge.tokens)
