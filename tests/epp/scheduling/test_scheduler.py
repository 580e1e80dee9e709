"""The scheduler: filters -> weighted scorers -> picker per profile, chosen by a handler."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import pytest

from epp.datastore import Endpoint, EndpointSpec
from epp.errors import InternalError
from epp.requests import Api, InferenceRequest
from epp.scheduling.scheduler import (
    Scheduler,
    SchedulerProfile,
    Slot,
    WeightedScorer,
    run_profile,
)
from epp.scheduling.types import (
    CycleState,
    ProfileResult,
    SchedulingResult,
    ScoredEndpoint,
    StateKey,
)

SEEN: StateKey[list[str]] = StateKey("seen")


def make_endpoints(*names: str) -> list[Endpoint]:
    return [Endpoint(EndpointSpec(n, f"10.0.0.{i + 1}:8000")) for i, n in enumerate(names)]


def make_request() -> InferenceRequest:
    return InferenceRequest(
        request_id="r", path="/v1/completions", method="POST", api=Api.COMPLETIONS, model="m"
    )


class DropFilter:
    """Removes endpoints by name and records, in the cycle, that it ran."""

    def __init__(self, label: str, drop: set[str]) -> None:
        self.label = label
        self.drop = drop
        self.inputs: list[list[str]] = []

    def filter(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Sequence[Endpoint]:
        self.inputs.append([e.name for e in endpoints])
        seen = cycle.get(SEEN)
        if seen is None:
            seen = []
            cycle.put(SEEN, seen)
        seen.append(self.label)
        return [e for e in endpoints if e.name not in self.drop]


class TableScorer:
    """Returns a fixed score per endpoint name; names not in the table are left out."""

    def __init__(self, table: Mapping[str, float]) -> None:
        self.table = table
        self.calls = 0

    def score(
        self, request: InferenceRequest, cycle: CycleState, endpoints: Sequence[Endpoint]
    ) -> Mapping[Endpoint, float]:
        self.calls += 1
        return {e: self.table[e.name] for e in endpoints if e.name in self.table}


class FirstPicker:
    """Takes every endpoint, highest total first (stable), and remembers its input."""

    def __init__(self) -> None:
        self.seen: list[tuple[ScoredEndpoint, ...]] = []

    def pick(self, cycle: CycleState, scored: Sequence[ScoredEndpoint]) -> Sequence[Endpoint]:
        self.seen.append(tuple(scored))
        return [s.endpoint for s in sorted(scored, key=lambda s: -s.score)]


class ScriptedHandler:
    """Selects profiles from a script, one batch per call; names a fixed primary."""

    def __init__(self, batches: list[list[str]], primary: str) -> None:
        self.batches = batches
        self.primary = primary
        self.results_seen: list[list[str]] = []

    def check_profiles(self, profiles: Sequence[str]) -> None:
        pass

    def select_profiles(
        self,
        request: InferenceRequest,
        cycle: CycleState,
        profiles: Sequence[str],
        results: Mapping[str, ProfileResult],
    ) -> Sequence[str]:
        self.results_seen.append(list(results))
        step = len(self.results_seen) - 1
        return self.batches[step] if step < len(self.batches) else []

    def process_results(
        self, request: InferenceRequest, cycle: CycleState, results: Mapping[str, ProfileResult]
    ) -> SchedulingResult:
        return SchedulingResult(primary_profile=self.primary, profiles=dict(results))


def profile(
    name: str = "p",
    filters: Sequence[tuple[str, DropFilter]] = (),
    scorers: Sequence[tuple[str, TableScorer, float]] = (),
    picker: FirstPicker | None = None,
    observe: Callable[[float], None] | None = None,
) -> SchedulerProfile:
    def slot(slot_name: str, plugin: object) -> Slot[object]:
        if observe is None:
            return Slot(slot_name, "test", plugin)
        return Slot(slot_name, "test", plugin, observe)

    return SchedulerProfile(
        name,
        tuple(slot(n, f) for n, f in filters),  # type: ignore[misc]
        tuple(WeightedScorer(slot(n, s), w) for n, s, w in scorers),  # type: ignore[arg-type]
        slot("picker", picker or FirstPicker()),  # type: ignore[arg-type]
    )


def scheduler(profiles: Sequence[SchedulerProfile], handler: ScriptedHandler) -> Scheduler:
    return Scheduler({p.name: p for p in profiles}, Slot("handler", "test", handler))


# ---------------------------------------------------------------------------
# Filters


def test_filters_run_in_order_and_record_removals() -> None:
    a, b, c, d = make_endpoints("a", "b", "c", "d")
    first = DropFilter("first", {"b"})
    second = DropFilter("second", {"d"})
    keep_all = DropFilter("third", set())
    cycle = CycleState()
    result = run_profile(
        profile(filters=[("f1", first), ("f2", second), ("f3", keep_all)]),
        make_request(),
        cycle,
        [a, b, c, d],
    )
    assert cycle.get(SEEN) == ["first", "second", "third"]
    assert first.inputs == [["a", "b", "c", "d"]]
    assert second.inputs == [["a", "c", "d"]]  # sees the first filter's output
    assert keep_all.inputs == [["a", "c"]]
    assert dict(result.filtered_out) == {"f1": (b,), "f2": (d,)}  # f3 removed nothing
    assert [s.endpoint for s in result.scored] == [a, c]
    assert result.targets == (a, c)


def test_empty_filter_result_gives_empty_targets() -> None:
    a, b = make_endpoints("a", "b")
    later = DropFilter("later", set())
    scorer = TableScorer({"a": 1.0})
    picker = FirstPicker()
    result = run_profile(
        profile(
            filters=[("all", DropFilter("all", {"a", "b"})), ("later", later)],
            scorers=[("s", scorer, 1.0)],
            picker=picker,
        ),
        make_request(),
        CycleState(),
        [a, b],
    )
    assert result.targets == ()
    assert result.scored == ()
    assert dict(result.filtered_out) == {"all": (a, b)}
    # Nothing after the emptying filter runs.
    assert later.inputs == []
    assert scorer.calls == 0
    assert picker.seen == []


# ---------------------------------------------------------------------------
# Scores


def test_scores_are_clamped_nan_is_zero_missing_is_zero() -> None:
    eps = make_endpoints("high", "neg", "nan", "missing", "inf", "mid", "ninf")
    table = {
        "high": 2.5,
        "neg": -0.5,
        "nan": math.nan,
        "inf": math.inf,
        "mid": 0.25,
        "ninf": -math.inf,
    }
    result = run_profile(
        profile(scorers=[("s", TableScorer(table), 1.0)]), make_request(), CycleState(), eps
    )
    by_name = {e.name: v for e, v in result.scores["s"].items()}
    assert by_name == {
        "high": 1.0,
        "neg": 0.0,
        "nan": 0.0,
        "missing": 0.0,
        "inf": 1.0,
        "mid": 0.25,
        "ninf": 0.0,
    }
    totals = {s.endpoint.name: s.score for s in result.scored}
    assert totals == by_name


def test_scores_within_range_are_kept_and_the_others_made_floats() -> None:
    """A float in [0, 1] is the clamped score as it is (-0.0 included); an int, a
    bool or a float subclass is turned into a float, in range or not."""

    class Share(float):
        pass

    eps = make_endpoints("int", "bool", "share", "big", "zero", "negzero", "one")
    table = {
        "int": 1,
        "bool": True,
        "share": Share(0.5),
        "big": 7,
        "zero": 0.0,
        "negzero": -0.0,
        "one": 1.0,
    }
    result = run_profile(
        profile(scorers=[("s", TableScorer(table), 1.0)]), make_request(), CycleState(), eps
    )
    clamped = {e.name: v for e, v in result.scores["s"].items()}
    assert clamped == {
        "int": 1.0,
        "bool": 1.0,
        "share": 0.5,
        "big": 1.0,
        "zero": 0.0,
        "negzero": 0.0,
        "one": 1.0,
    }
    assert all(type(v) is float for v in clamped.values())
    assert math.copysign(1.0, clamped["negzero"]) == -1.0


def test_totals_add_the_weighted_scores_in_the_scorers_order() -> None:
    eps = make_endpoints("a", "b")
    s1 = TableScorer({"a": 0.1, "b": 0.7})
    s2 = TableScorer({"a": 0.2, "b": 0.3})
    s3 = TableScorer({"a": 0.3})
    result = run_profile(
        profile(scorers=[("s1", s1, 0.7), ("s2", s2, 0.1), ("s3", s3, 0.2)]),
        make_request(),
        CycleState(),
        eps,
    )
    weight_sum = 0.7 + 0.1 + 0.2
    totals = [s.score for s in result.scored]
    assert totals == [
        (0.0 + 0.7 * 0.1 + 0.1 * 0.2 + 0.2 * 0.3) / weight_sum,
        (0.0 + 0.7 * 0.7 + 0.1 * 0.3 + 0.2 * 0.0) / weight_sum,
    ]


def test_weighted_mean_of_scores() -> None:
    eps = make_endpoints("a", "b", "c")
    s1 = TableScorer({"a": 1.0, "b": 0.5, "c": 0.0})
    s2 = TableScorer({"a": 0.0, "b": 0.5, "c": 1.0})
    s3 = TableScorer({"a": 0.2, "b": 0.9})
    result = run_profile(
        profile(scorers=[("s1", s1, 3.0), ("s2", s2, 1.0), ("s3", s3, 0.5)]),
        make_request(),
        CycleState(),
        eps,
    )
    totals = {s.endpoint.name: s.score for s in result.scored}
    assert totals["a"] == pytest.approx((3 * 1.0 + 1 * 0.0 + 0.5 * 0.2) / 4.5)
    assert totals["b"] == pytest.approx((3 * 0.5 + 1 * 0.5 + 0.5 * 0.9) / 4.5)
    assert totals["c"] == pytest.approx((3 * 0.0 + 1 * 1.0 + 0.5 * 0.0) / 4.5)
    # Scores per scorer are kept for /debug/explain.
    assert set(result.scores) == {"s1", "s2", "s3"}
    assert result.scores["s3"][eps[2]] == 0.0
    # The picker receives the totals in the endpoints' order.
    assert [s.endpoint for s in result.scored] == eps


def test_zero_total_weight_scores_zero() -> None:
    eps = make_endpoints("a", "b")
    picker = FirstPicker()
    result = run_profile(
        profile(scorers=[("s", TableScorer({"a": 1.0, "b": 0.5}), 0.0)], picker=picker),
        make_request(),
        CycleState(),
        eps,
    )
    assert [s.score for s in result.scored] == [0.0, 0.0]
    assert result.scores["s"][eps[0]] == 1.0  # the scorer still ran
    assert len(picker.seen) == 1


def test_no_scorers_scores_zero() -> None:
    eps = make_endpoints("a", "b")
    result = run_profile(profile(), make_request(), CycleState(), eps)
    assert [s.score for s in result.scored] == [0.0, 0.0]
    assert result.targets == tuple(eps)
    assert dict(result.scores) == {}


def test_observe_records_each_call() -> None:
    durations: list[float] = []
    eps = make_endpoints("a", "b")
    run_profile(
        profile(
            filters=[("f", DropFilter("f", set()))],
            scorers=[("s", TableScorer({}), 1.0)],
            observe=durations.append,
        ),
        make_request(),
        CycleState(),
        eps,
    )
    assert len(durations) == 3  # filter, scorer, picker
    assert all(d >= 0.0 for d in durations)


# ---------------------------------------------------------------------------
# Scheduler and profile handler


def test_single_profile() -> None:
    eps = make_endpoints("a", "b")
    handler = ScriptedHandler([["p"]], primary="p")
    sched = scheduler([profile(scorers=[("s", TableScorer({"b": 1.0}), 1.0)])], handler)
    result = sched.schedule(make_request(), CycleState(), eps)
    assert result.primary_profile == "p"
    assert result.targets == (eps[1], eps[0])
    assert handler.results_seen == [[], ["p"]]


def test_several_profiles_in_rounds() -> None:
    eps = make_endpoints("a", "b", "c")
    handler = ScriptedHandler([["x", "y"], ["z"]], primary="z")
    sched = scheduler(
        [
            profile("x", scorers=[("s", TableScorer({"a": 1.0}), 1.0)]),
            profile("y", filters=[("f", DropFilter("f", {"a"}))]),
            profile("z", scorers=[("s", TableScorer({"c": 1.0}), 1.0)]),
        ],
        handler,
    )
    result = sched.schedule(make_request(), CycleState(), eps)
    assert handler.results_seen == [[], ["x", "y"], ["x", "y", "z"]]
    assert set(result.profiles) == {"x", "y", "z"}
    assert result.profiles["x"].targets[0] is eps[0]
    assert eps[0] not in result.profiles["y"].targets
    assert result.targets[0] is eps[2]


def test_primary_with_empty_targets() -> None:
    eps = make_endpoints("a")
    handler = ScriptedHandler([["p"]], primary="p")
    sched = scheduler([profile(filters=[("none", DropFilter("none", {"a"}))])], handler)
    result = sched.schedule(make_request(), CycleState(), eps)
    assert result.targets == ()
    assert dict(result.profiles["p"].filtered_out) == {"none": (eps[0],)}


def test_handler_selecting_an_unknown_profile() -> None:
    sched = scheduler([profile("p")], ScriptedHandler([["q"]], primary="q"))
    with pytest.raises(InternalError, match="'q', which does not exist"):
        sched.schedule(make_request(), CycleState(), make_endpoints("a"))


def test_handler_selecting_a_profile_twice_in_one_batch() -> None:
    sched = scheduler([profile("p")], ScriptedHandler([["p", "p"]], primary="p"))
    with pytest.raises(InternalError, match="'p' twice"):
        sched.schedule(make_request(), CycleState(), make_endpoints("a"))


def test_handler_selecting_a_profile_again_later() -> None:
    # A handler that never stops selecting would loop forever without this check.
    sched = scheduler([profile("p")], ScriptedHandler([["p"]] * 100, primary="p"))
    with pytest.raises(InternalError, match="twice"):
        sched.schedule(make_request(), CycleState(), make_endpoints("a"))


def test_primary_profile_that_did_not_run() -> None:
    sched = scheduler([profile("p"), profile("q")], ScriptedHandler([["p"]], primary="q"))
    with pytest.raises(InternalError, match="primary profile 'q', which did not run"):
        sched.schedule(make_request(), CycleState(), make_endpoints("a"))


def test_handler_selecting_nothing() -> None:
    sched = scheduler([profile("p")], ScriptedHandler([], primary="p"))
    with pytest.raises(InternalError, match="did not run"):
        sched.schedule(make_request(), CycleState(), make_endpoints("a"))


def test_internal_error_is_a_500() -> None:
    sched = scheduler([profile("p")], ScriptedHandler([["nope"]], primary="p"))
    with pytest.raises(InternalError) as info:
        sched.schedule(make_request(), CycleState(), make_endpoints("a"))
    assert info.value.status == 500
    assert "'handler'" in info.value.message


def test_profile_weight_sum() -> None:
    p = profile(scorers=[("a", TableScorer({}), 2.0), ("b", TableScorer({}), 0.5)])
    assert p.weight_sum == 2.5
    assert profile().weight_sum == 0


# ---------------------------------------------------------------------------
# CycleState and result types


def test_cycle_state_typed_keys() -> None:
    tokens: StateKey[list[int]] = StateKey("tokens")
    same_name: StateKey[list[int]] = StateKey("tokens")
    other_tokens: StateKey[list[int]] = StateKey("other-tokens")
    cycle = CycleState()
    assert cycle.get(tokens) is None
    assert tokens not in cycle
    value = [1, 2, 3]
    cycle.put(tokens, value)
    assert tokens in cycle
    assert cycle.get(tokens) is value
    # Keys are names: a producer and its readers meet on one (prefix_match_key).
    assert cycle.get(same_name) is value
    assert other_tokens not in cycle
    assert cycle.get(other_tokens) is None
    cycle.put(tokens, [4])
    assert cycle.get(tokens) == [4]
    assert repr(tokens) == "StateKey('tokens')"


def test_cycle_state_stores_none() -> None:
    key: StateKey[int | None] = StateKey("maybe")
    cycle = CycleState()
    cycle.put(key, None)
    assert key in cycle
    assert cycle.get(key) is None


def test_scheduling_result_targets() -> None:
    a, b = make_endpoints("a", "b")
    result = SchedulingResult(
        primary_profile="q",
        profiles={
            "p": ProfileResult("p", (a,), ()),
            "q": ProfileResult("q", (b, a), ()),
        },
    )
    assert result.targets == (b, a)


def test_endpoints_are_compared_by_identity() -> None:
    spec = EndpointSpec("a", "10.0.0.1:8000")
    one, two = Endpoint(spec), Endpoint(spec)
    assert one != two
    assert len({one, two}) == 2
    assert one.name == "a"
    assert one.address == "10.0.0.1:8000"
