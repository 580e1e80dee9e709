"""EndpointMetrics' freshness rules: `stale` spells out `age` for speed, `known`
spells out `stale`, and `all_known` reads the age once for several facts; each
must say what its definition says, in every state a snapshot can be in."""

from __future__ import annotations

import math

import pytest

from epp.datastore import RUNNING, WAITING, EndpointMetrics

NOW = 100.0

SNAPSHOTS = {
    "never scraped": EndpointMetrics(),
    "fresh": EndpointMetrics(updated_at=NOW - 1.0, staleness_s=2.0),
    "exactly at the threshold": EndpointMetrics(updated_at=NOW - 2.0, staleness_s=2.0),
    "just past the threshold": EndpointMetrics(updated_at=NOW - 2.001, staleness_s=2.0),
    "fresh but unreachable": EndpointMetrics(
        updated_at=NOW - 0.5, staleness_s=2.0, unreachable=True
    ),
    "fresh, waiting missing": EndpointMetrics(
        updated_at=NOW - 0.5, staleness_s=2.0, missing={WAITING: "not on the page"}
    ),
    "stale, running missing": EndpointMetrics(
        updated_at=NOW - 5.0, staleness_s=2.0, missing={RUNNING: "NaN"}
    ),
    "from the future (another clock)": EndpointMetrics(updated_at=NOW + 3.0, staleness_s=2.0),
    "never scraped, no threshold": EndpointMetrics(staleness_s=math.inf),
}


@pytest.mark.parametrize("name", list(SNAPSHOTS))
@pytest.mark.parametrize("fact", [WAITING, RUNNING])
def test_known_is_a_reported_fact_of_a_snapshot_not_stale(name: str, fact: str) -> None:
    metrics = SNAPSHOTS[name]
    expected = fact not in metrics.missing and not metrics.stale(NOW)
    assert metrics.known(fact, NOW) is expected


@pytest.mark.parametrize("name", list(SNAPSHOTS))
@pytest.mark.parametrize("facts", [(WAITING,), (RUNNING,), (RUNNING, WAITING), ()])
def test_all_known_agrees_with_known_fact_by_fact(name: str, facts: tuple[str, ...]) -> None:
    metrics = SNAPSHOTS[name]
    expected = all(metrics.known(f, NOW) for f in facts) and not metrics.stale(NOW)
    assert metrics.all_known(facts, NOW) is expected


def test_all_known_answers_for_each_state() -> None:
    assert not SNAPSHOTS["never scraped"].all_known((WAITING,), NOW)
    assert SNAPSHOTS["never scraped, no threshold"].all_known((WAITING,), NOW)
    assert SNAPSHOTS["fresh"].all_known((RUNNING, WAITING), NOW)
    assert SNAPSHOTS["exactly at the threshold"].all_known((WAITING,), NOW)
    assert not SNAPSHOTS["just past the threshold"].all_known((WAITING,), NOW)
    assert not SNAPSHOTS["fresh but unreachable"].all_known((WAITING,), NOW)
    assert not SNAPSHOTS["fresh, waiting missing"].all_known((RUNNING, WAITING), NOW)
    assert SNAPSHOTS["fresh, waiting missing"].all_known((RUNNING,), NOW)


@pytest.mark.parametrize("name", list(SNAPSHOTS))
def test_stale_is_unreachable_or_older_than_the_threshold(name: str) -> None:
    metrics = SNAPSHOTS[name]
    assert metrics.stale(NOW) is (metrics.unreachable or metrics.age(NOW) > metrics.staleness_s)
