"""`single-profile-handler`: runs the one profile once and makes it primary."""

from __future__ import annotations

import pytest
from epp.plugins.single_profile_handler import SingleProfileHandler

from epp.scheduling import CycleState, ProfileResult
from tests.plugins.helpers import context, make_endpoints, make_request


def handler() -> SingleProfileHandler:
    return SingleProfileHandler(None, context("single-profile-handler"))


def test_check_profiles_accepts_exactly_one() -> None:
    handler().check_profiles(["default"])


@pytest.mark.parametrize("profiles", [[], ["a", "b"]])
def test_check_profiles_rejects_zero_or_several(profiles: list[str]) -> None:
    with pytest.raises(ValueError, match=f"exactly one scheduling profile, got {len(profiles)}"):
        handler().check_profiles(profiles)


def test_selects_the_profile_once_and_makes_it_primary() -> None:
    plugin = handler()
    request, cycle = make_request(), CycleState()
    assert list(plugin.select_profiles(request, cycle, ["default"], {})) == ["default"]
    (endpoint,) = make_endpoints(1)
    results = {"default": ProfileResult("default", (endpoint,), ())}
    assert list(plugin.select_profiles(request, cycle, ["default"], results)) == []
    result = plugin.process_results(request, cycle, results)
    assert result.primary_profile == "default"
    assert result.targets == (endpoint,)
