"""The data that flows through a scheduling cycle."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar, cast

import msgspec

from epp.datastore import Endpoint

T = TypeVar("T")


class StateKey(Generic[T]):
    """A typed key into `CycleState`: `TOKENS = StateKey[list[int]]("tokens")`.
    Keys are equal when their names are: a producer and the plugins that read it
    agree on a name (`prefix_match_key`), not on an object."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"StateKey({self.name!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StateKey) and other.name == self.name

    def __hash__(self) -> int:
        return hash(self.name)


class CycleState:
    """Per-request scratch space shared by the plugins handling one request.

    It lives from the first plugin call of a request to its post-response hooks, so
    a plugin can leave data for a later extension point (a producer for a scorer,
    a pre-request hook for the post-response hook). Keys are `StateKey` objects, so
    two plugins only share an entry on purpose."""

    __slots__ = ("_data",)

    def __init__(self) -> None:
        self._data: dict[StateKey[Any], Any] = {}

    def put(self, key: StateKey[T], value: T) -> None:
        self._data[key] = value

    def get(self, key: StateKey[T]) -> T | None:
        return cast("T | None", self._data.get(key))

    def __contains__(self, key: StateKey[Any]) -> bool:
        return key in self._data


PRIORITY: StateKey[int] = StateKey("priority")
"""The request's priority, set by the director before admission: its objective's
(`x-gateway-inference-objective`, looked up in the config's `inferenceObjectives`),
0 without one. Negative priorities are sheddable."""


@dataclass(frozen=True, slots=True)
class TtftObservation:
    """A predicted time to first token, set beside the one observed (pick to the
    first response chunk, as the EPP saw it), for the routed endpoint."""

    endpoint: str
    predicted_s: float
    observed_s: float


TTFT_OBSERVED: StateKey[TtftObservation] = StateKey("ttft-observed")
"""Left by a plugin that predicts TTFT when the request's first response chunk
arrives: what it predicted at the pick and what it then saw. Read by whoever
studies the predictions (the routing lab); nothing in the pick depends on it."""


EXPLAIN_NOTES: StateKey[dict[str, dict[str, Any]]] = StateKey("explain-notes")
"""Facts a plugin wants /debug/explain to show about its part in a pick, by plugin
name (see `explain_note`)."""


UNEXPLAINED: StateKey[bool] = StateKey("unexplained")
"""Set by the director on the cycle of a routed request: nobody reads its notes
(/debug/explain runs a pick of its own), so `explain_note` keeps none."""


def explaining(cycle: CycleState) -> bool:
    """Whether notes left on `cycle` will be read: a plugin whose facts cost
    something to build (a dict per endpoint) asks before building them."""
    return cycle.get(UNEXPLAINED) is None


def explain_note(cycle: CycleState, plugin: str, facts: Mapping[str, Any]) -> None:
    """Leave `facts` (JSON values) for /debug/explain's `notes.<plugin>`: what the
    plugin considered, e.g. that only the first blocks of a long prompt were matched.
    Kept on an explained pick only (`explaining`); never request content, since
    /debug/explain must not echo prompts."""
    if not explaining(cycle):
        return
    notes = cycle.get(EXPLAIN_NOTES)
    if notes is None:
        notes = {}
        cycle.put(EXPLAIN_NOTES, notes)
    notes[plugin] = dict(facts)


class ScoredEndpoint(msgspec.Struct, frozen=True, gc=False):
    """An endpoint and the profile's weighted total for it. A msgspec struct: a pick
    makes one per candidate, and a frozen dataclass's `__init__` (through
    `object.__setattr__`) costs several times as much. Not tracked by the garbage
    collector (`gc=False`: it refers to an endpoint and a float, so it can be in
    no cycle): on 64 pods, 64 fewer objects a pick for its collections to visit."""

    endpoint: Endpoint
    score: float  # the profile's weighted total, in [0, 1]


@dataclass(frozen=True, slots=True)
class ProfileResult:
    """What one scheduling profile decided, and why (kept for /debug/explain)."""

    profile: str
    targets: tuple[Endpoint, ...]  # primary first, then fallbacks; empty: nothing picked
    scored: tuple[ScoredEndpoint, ...]  # every endpoint that survived the filters
    # scorer name -> clamped score per endpoint
    scores: Mapping[str, Mapping[Endpoint, float]] = field(default_factory=dict)
    # filter name -> endpoints it removed
    filtered_out: Mapping[str, tuple[Endpoint, ...]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class SchedulingResult:
    primary_profile: str
    # The profiles whose picks the request uses, by name (the primary among them).
    profiles: Mapping[str, ProfileResult]
    # Headers the EPP sets on the request it sends upstream, beside the destination
    # (a disaggregated pick's `x-prefiller-host-port`): chosen by the profile
    # handler, so /debug/explain shows them too. Names lower-case.
    request_headers: Mapping[str, str] = field(default_factory=dict)
    # The profile whose pick computes the prompt's KV for the primary target (a
    # disaggregated pick's prefill profile), when that is another endpoint.
    prefill_profile: str | None = None

    @property
    def targets(self) -> tuple[Endpoint, ...]:
        """The endpoints the request goes to: primary first, then fallbacks."""
        return self.profiles[self.primary_profile].targets

    @property
    def kv_holders(self) -> tuple[Endpoint, ...]:
        """The endpoints that hold the prompt's KV once the request is served: the
        primary target, and a disaggregated pick's prefill endpoint, which computed
        the blocks and keeps them in its prefix cache after the transfer (an encode
        endpoint holds none). Empty when nothing was picked."""
        targets = self.targets
        if not targets:
            return ()
        prefill = self.profiles.get(self.prefill_profile) if self.prefill_profile else None
        if prefill is None or not prefill.targets or prefill.targets[0] is targets[0]:
            return (targets[0],)
        return (targets[0], prefill.targets[0])


@dataclass(frozen=True, slots=True)
class Usage:
    """Token usage a model server reported in its response."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens


@dataclass(frozen=True, slots=True)
class DisaggDecision:
    """A disaggregation decider's answer (`DisaggregationDecider.disaggregate`)."""

    disaggregate: bool  # True: run this stage on an endpoint of its own
    reason: str  # why, in a few words, for /debug/explain (never request content)
    # The numbers behind it (JSON values), for /debug/explain: the prompt's and the
    # uncached tokens, the thresholds, say.
    facts: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class ResponseInfo:
    """How a routed request ended, handed to post-response plugins."""

    # False when the request ended before its response did (client gone, upstream
    # reset, Envoy closed the stream): plugins should release what they hold.
    completed: bool
    status: int | None = None  # HTTP status of the response; None if none was seen
    usage: Usage | None = None
    duration_s: float = 0.0  # from the pick to the end of the response


@dataclass(frozen=True, slots=True)
class PrefixMatchInfo:
    """What a prefix-cache producer found for one request (llm-d's
    PrefixCacheMatchInfo): the prompt's blocks, and for each candidate endpoint how
    many of its leading blocks the endpoint holds.

    `matched` may be fractional: the precise producer weights a block by the best
    medium it is held in (GPU 1.0, CPU 0.8, ...). An endpoint missing from it holds
    none. A request without a prompt has `total_blocks` 0."""

    total_blocks: int
    block_size_tokens: int
    matched: Mapping[Endpoint, float]
    # The prompt's blocks before the producer's cap (`total_blocks` counts only the
    # first ones, those it matched); None when it is `total_blocks`.
    prompt_blocks: int | None = None
    # The prompt is a whole earlier prompt plus more (a conversation's next turn):
    # its longest match ends where an earlier request's prompt ended. False when
    # the producer cannot tell.
    continues: bool = False
    # Where `matched` counts only what each endpoint is likely to hold still (an
    # approximate index's cache window), the longest prefix each was ever sent and
    # remembered: the pod a prompt group was sent to. None: the same as `matched`.
    remembered: Mapping[Endpoint, float] | None = None
    # The share of the producer's recent requests whose longest match ended on the
    # block this one's does (`epp.approxindex.PrefixDemand`); 0 where the producer
    # does not count it.
    demand: float = 0.0

    def prompt_tokens(self) -> int:
        """The prompt's length, in the producer's tokens, to the block."""
        blocks = self.total_blocks if self.prompt_blocks is None else self.prompt_blocks
        return blocks * self.block_size_tokens

    def ratio(self, endpoint: Endpoint) -> float:
        """The share of the prompt's blocks `endpoint` holds from the first, in [0, 1]."""
        if self.total_blocks <= 0:
            return 0.0
        return min(1.0, self.matched.get(endpoint, 0.0) / self.total_blocks)


def prefix_match_key(producer: str) -> StateKey[PrefixMatchInfo]:
    """Where the producer named `producer` leaves a request's `PrefixMatchInfo`
    (llm-d's data key `PrefixCacheMatchInfo/<producer>`)."""
    return StateKey(f"PrefixCacheMatchInfo/{producer}")


NEUTRAL_SCORE: Final = 0.5


def fewer_is_better(
    endpoints: Sequence[Endpoint], counts: Mapping[Endpoint, float]
) -> dict[Endpoint, float]:
    """Min-max scores for a load count where fewer is better (queue-scorer,
    running-requests-size-scorer): (max - c) / (max - min), 1.0 for all when every
    known count is the same. Endpoints missing from `counts` (stale metrics, or the
    count not reported) score NEUTRAL_SCORE and stay out of min and max, so they
    cannot distort the others' scale."""
    if not counts:
        return dict.fromkeys(endpoints, NEUTRAL_SCORE)
    low, high = min(counts.values()), max(counts.values())
    span = high - low
    return {
        e: NEUTRAL_SCORE if e not in counts else 1.0 if span == 0 else (high - counts[e]) / span
        for e in endpoints
    }
