"""The scheduler: profiles of filters -> weighted scorers -> picker, chosen by a
profile handler. Pure: it reads endpoint state and the cycle state and changes
nothing else, which is what lets /debug/explain run it as is."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from epp.datastore import Endpoint
from epp.errors import InternalError
from epp.requests import InferenceRequest
from epp.scheduling.interfaces import Filter, Picker, ProfileHandler, Scorer
from epp.scheduling.types import CycleState, ProfileResult, SchedulingResult, ScoredEndpoint

P = TypeVar("P")


def _ignore_duration(seconds: float) -> None:
    pass


@dataclass(frozen=True, slots=True)
class Slot(Generic[P]):
    """A plugin in one extension point of the running configuration."""

    name: str
    type_name: str
    plugin: P
    # Records how long one call took (a Prometheus histogram child, bound up front so
    # the hot path does no label lookup).
    observe: Callable[[float], None] = _ignore_duration


@dataclass(frozen=True, slots=True)
class WeightedScorer:
    slot: Slot[Scorer]
    weight: float


@dataclass(frozen=True, slots=True)
class SchedulerProfile:
    name: str
    filters: tuple[Slot[Filter], ...]
    scorers: tuple[WeightedScorer, ...]
    picker: Slot[Picker]

    @property
    def weight_sum(self) -> float:
        return sum(s.weight for s in self.scorers)


def _clamp(value: float) -> float:
    if value != value:  # NaN
        return 0.0
    return 0.0 if value < 0.0 else 1.0 if value > 1.0 else float(value)


def run_profile(
    profile: SchedulerProfile,
    request: InferenceRequest,
    cycle: CycleState,
    endpoints: Sequence[Endpoint],
) -> ProfileResult:
    clock = time.perf_counter
    filtered_out: dict[str, tuple[Endpoint, ...]] = {}
    for slot in profile.filters:
        started = clock()
        kept = slot.plugin.filter(request, cycle, endpoints)
        slot.observe(clock() - started)
        if len(kept) != len(endpoints):
            keep = set(kept)
            filtered_out[slot.name] = tuple(e for e in endpoints if e not in keep)
        endpoints = kept
        if not endpoints:
            return ProfileResult(profile.name, (), (), {}, filtered_out)

    totals = dict.fromkeys(endpoints, 0.0)
    scores: dict[str, Mapping[Endpoint, float]] = {}
    for weighted in profile.scorers:
        slot_s = weighted.slot
        started = clock()
        raw = slot_s.plugin.score(request, cycle, endpoints)
        slot_s.observe(clock() - started)
        clamped: dict[Endpoint, float] = {}
        weight = weighted.weight
        for endpoint in totals:  # `endpoints` once each, in their order
            value = raw.get(endpoint, 0.0)
            # A float within [0, 1] (most scores) is `_clamp`'s answer already: no call.
            if not (type(value) is float and 0.0 <= value <= 1.0):
                value = _clamp(value)
            clamped[endpoint] = value
            totals[endpoint] += weight * value
        scores[slot_s.name] = clamped
    weight_sum = profile.weight_sum
    if weight_sum > 0:
        scored = tuple([ScoredEndpoint(e, totals[e] / weight_sum) for e in endpoints])
    else:
        scored = tuple([ScoredEndpoint(e, 0.0) for e in endpoints])

    started = clock()
    targets = tuple(profile.picker.plugin.pick(cycle, scored))
    profile.picker.observe(clock() - started)
    return ProfileResult(profile.name, targets, scored, scores, filtered_out)


class Scheduler:
    def __init__(
        self,
        profiles: Mapping[str, SchedulerProfile],
        handler: Slot[ProfileHandler],
    ) -> None:
        self.profiles = dict(profiles)
        self.handler = handler
        self._names = tuple(self.profiles)

    def schedule(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> SchedulingResult:
        """Run the profiles the handler selects over `endpoints` (non-empty).

        The result's `targets` are empty when the primary profile could pick nothing
        (every endpoint filtered out); the caller decides what that means."""
        clock = time.perf_counter
        handler = self.handler.plugin
        results: dict[str, ProfileResult] = {}
        while True:
            started = clock()
            names = handler.select_profiles(request, cycle, self._names, results)
            self.handler.observe(clock() - started)
            if not names:
                break
            for name in names:
                profile = self.profiles.get(name)
                if profile is None or name in results:
                    raise InternalError(
                        f"profile handler {self.handler.name!r} selected profile {name!r}"
                        + (" twice" if name in results else ", which does not exist")
                    )
                results[name] = run_profile(profile, request, cycle, endpoints)
        started = clock()
        result = handler.process_results(request, cycle, results)
        self.handler.observe(clock() - started)
        if result.primary_profile not in result.profiles:
            raise InternalError(
                f"profile handler {self.handler.name!r} named primary profile"
                f" {result.primary_profile!r}, which did not run"
            )
        return result
