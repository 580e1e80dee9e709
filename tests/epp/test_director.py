"""The director's candidates: ready endpoints, less those whose server is down by
its metrics scrapes (refused the latest, or answered none for longer than the
staleness threshold), for every config; all of them when every one is down."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Collection

from epp.config import load_config
from epp.config.defaults import DEFAULT_CONFIG
from epp.datastore import Datastore, EndpointMetrics, EndpointSpec
from epp.director import Director
from epp.requests import InferenceRequest, parse_request
from epp.scheduling.registry import PluginRegistry
from epp.scheduling.types import ResponseInfo
from epp.telemetry import Telemetry

PODS = ("pod-0", "pod-1", "pod-2")


def director(
    unreachable: Collection[str] = (),
    stale: Collection[str] = (),
    unanswered: Collection[str] = (),
    http_error: Collection[str] = (),
) -> Director:
    """Three pods scraped just now but for the `stale` ones (a minute ago, then
    failing: no answer, or an HTTP error); the `unreachable` ones refused the last
    scrape."""
    datastore = Datastore()
    datastore.replace_all(EndpointSpec(name, f"10.0.0.{i + 1}:8000") for i, name in enumerate(PODS))
    now = time.monotonic()
    for name in PODS:
        error = None
        if name in unreachable:
            error = "ClientConnectorError: connection refused"
        elif name in unanswered:
            error = "no answer within 1s"
        elif name in http_error:
            error = "HTTP 500"
        datastore.set_metrics(
            name,
            EndpointMetrics(
                updated_at=now - 60.0 if name in stale else now,
                unreachable=name in unreachable,
                unanswered=name in unanswered,
                error=error,
            ),
        )
    config = load_config(DEFAULT_CONFIG, PluginRegistry.from_entry_points(), datastore=datastore)
    return Director(datastore, config, Telemetry(datastore))


def request(n: int) -> InferenceRequest:
    body = f'{{"model": "m", "prompt": "question {n} that no pod has seen"}}'.encode()
    return parse_request(
        request_id=f"r{n}", method="POST", path="/v1/completions", headers={}, body=body
    )


def picks(d: Director, count: int, subset: list[str] | None = None) -> Counter[str]:
    """Where `count` requests go, each finished at once (so none stays in flight)."""
    names = {e.address: e.name for e in d.datastore.ready_endpoints()}
    seen: Counter[str] = Counter()
    for n in range(count):
        decision = asyncio.run(d.pick_endpoint(request(n), subset))
        seen[names[decision.destinations]] += 1
        d.finish(decision, ResponseInfo(completed=True))
    return seen


def test_an_unreachable_endpoint_is_no_candidate_whatever_the_config() -> None:
    d = director(unreachable={"pod-1"})
    assert [e.name for e in d.candidates(None)] == ["pod-0", "pod-2"]
    assert set(picks(d, 30)) == {"pod-0", "pod-2"}
    explained = asyncio.run(d.explain(request(99)))
    assert explained["down"] == ["pod-1"]
    assert sorted(c["name"] for c in explained["candidates"]) == ["pod-0", "pod-2"]


def test_a_server_silent_past_the_staleness_threshold_is_no_candidate() -> None:
    # Hung: its scrapes time out, and its last answer is older than the threshold.
    d = director(stale={"pod-1"}, unanswered={"pod-1"})
    assert set(picks(d, 30)) == {"pod-0", "pod-2"}
    assert asyncio.run(d.explain(request(99)))["down"] == ["pod-1"]


def test_a_silence_within_the_threshold_or_an_answer_leaves_an_endpoint_a_candidate() -> None:
    # One scrape without an answer: an overloaded server is slow too.
    assert [e.name for e in director(unanswered={"pod-1"}).candidates(None)] == list(PODS)
    # Old numbers, or a server that answers badly, are the stale-metrics filter's
    # business where a config has it: nothing says the server is gone.
    for d in (director(stale={"pod-1"}), director(stale={"pod-1"}, http_error={"pod-1"})):
        assert [e.name for e in d.candidates(None)] == list(PODS)
        assert asyncio.run(d.explain(request(0)))["down"] == []


def test_when_every_endpoint_is_unreachable_all_stay_candidates() -> None:
    # Then the scraping is the likelier fault: refusing everything would be an outage.
    d = director(unreachable=set(PODS))
    assert [e.name for e in d.candidates(None)] == list(PODS)
    assert len(picks(d, 30)) >= 2
    assert asyncio.run(d.explain(request(0)))["down"] == []


def test_within_a_subset_hint_the_same_rule_holds() -> None:
    d = director(unreachable={"pod-1"})
    # A hint of pod-1 alone: all its candidates are unreachable, so it stays.
    assert picks(d, 3, ["10.0.0.2:8000"]) == Counter({"pod-1": 3})
    # A hint of pod-1 and pod-2: pod-1 is left out.
    assert picks(d, 10, ["10.0.0.2:8000", "10.0.0.3:8000"]) == Counter({"pod-2": 10})
