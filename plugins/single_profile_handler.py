"""`single-profile-handler`: runs the one scheduling profile, once."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from epp.requests import InferenceRequest
from epp.scheduling import CycleState, PluginContext, ProfileResult, SchedulingResult


class SingleProfileHandler:
    def __init__(self, params: object, context: PluginContext) -> None:
        pass

    def check_profiles(self, profiles: Sequence[str]) -> None:
        if len(profiles) != 1:
            raise ValueError(f"needs exactly one scheduling profile, got {len(profiles)}")

    def select_profiles(
        self,
        request: InferenceRequest,
        cycle: CycleState,
        profiles: Sequence[str],
        results: Mapping[str, ProfileResult],
    ) -> Sequence[str]:
        return () if results else profiles[:1]

    def process_results(
        self, request: InferenceRequest, cycle: CycleState, results: Mapping[str, ProfileResult]
    ) -> SchedulingResult:
        (name,) = results
        return SchedulingResult(primary_profile=name, profiles=results)
