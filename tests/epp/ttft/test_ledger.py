"""A pod's prefill queue as the EPP sent it: drained by time, re-anchored by first tokens."""

from __future__ import annotations

import pytest

from epp.ttft.ledger import DEPARTURE_HORIZON_S, MAX_LEFT, PodLedger


def test_the_backlog_drains_one_second_per_second_and_never_below_zero() -> None:
    ledger = PodLedger()
    ledger.charge("a", 0.3, now=10.0)
    ledger.charge("b", 0.2, now=10.0)
    assert ledger.backlog(10.0) == pytest.approx(0.5)
    assert ledger.backlog(10.1) == pytest.approx(0.4)
    assert ledger.backlog(11.0) == 0.0
    assert ledger.queued == 2  # still waiting for their first tokens


def test_a_first_token_means_everything_charged_before_it_is_done() -> None:
    ledger = PodLedger()
    for key, work in (("a", 0.4), ("b", 0.3), ("c", 0.2)):
        ledger.charge(key, work, now=0.0)
    # b's first token at 0.1 s: the pod was faster than predicted; only c is left.
    ledger.started("b", now=0.1)
    assert ledger.backlog(0.1) == pytest.approx(0.2)
    assert ledger.decoding == 1
    assert ledger.queued == 2  # a's own first chunk has not arrived yet
    # A slower pod: c's first token comes late, nothing after it is queued.
    ledger.started("c", now=2.0)
    assert ledger.backlog(2.0) == 0.0
    assert ledger.decoding == 2


def test_a_late_first_token_never_raises_the_backlog() -> None:
    ledger = PodLedger()
    ledger.charge("a", 0.1, now=0.0)
    ledger.charge("b", 0.5, now=0.0)
    ledger.started("a", now=0.5)  # drained to 0.1, and at most b's 0.5 is left
    assert ledger.backlog(0.5) == pytest.approx(0.1)


def test_release_takes_back_an_aborted_request_and_a_decoding_one() -> None:
    ledger = PodLedger()
    ledger.charge("queued", 0.3, now=0.0)
    ledger.charge("decoding", 0.1, now=0.0)
    ledger.started("decoding", now=0.05)
    # Aborted before its first token: its work leaves the queue.
    ledger.release("queued", was_decoding=False, now=0.05)
    assert ledger.backlog(0.05) == 0.0
    assert ledger.queued == 0
    ledger.release("decoding", was_decoding=True, now=1.0)
    assert ledger.decoding == 0
    # Released twice, or never charged: nothing goes below zero.
    ledger.release("decoding", was_decoding=True, now=1.0)
    ledger.release("unknown", was_decoding=False, now=1.0)
    assert (ledger.decoding, ledger.queued, ledger.backlog(1.0)) == (0, 0, 0.0)


def test_a_first_token_for_a_request_not_queued_changes_nothing() -> None:
    ledger = PodLedger()
    ledger.charge("a", 0.3, now=0.0)
    ledger.started("other", now=0.0)
    ledger.started("a", now=0.0)
    ledger.started("a", now=0.0)  # reported twice
    assert ledger.decoding == 1
    assert ledger.backlog(0.0) == 0.0


def test_expected_at_counts_the_requests_queued_and_not_yet_due_at_an_instant() -> None:
    ledger = PodLedger(horizon_s=DEPARTURE_HORIZON_S)
    ledger.charge("a", 0.1, now=1.0, due=3.0)
    ledger.charge("b", 0.1, now=2.0, due=5.0)
    ledger.charge("c", 0.1, now=3.0, due=3.2)
    ledger.started("a", now=2.5)
    ledger.release("b", was_decoding=False, now=3.5)  # aborted before its first token
    # Charged by then, not started or released yet, and not overdue: c, still
    # queued after 3.2, was expected to have its first token by then.
    expected = {0.5: 0, 1.0: 1, 2.2: 2, 2.5: 1, 3.1: 2, 3.3: 1, 4.0: 0}
    assert {t: ledger.expected_at(t) for t in expected} == expected
    ledger.release("c", was_decoding=False, now=5.0)
    assert ledger.expected_at(3.1) == 2  # what was expected then has not changed


def test_a_request_is_due_when_the_backlog_is_done_unless_told_otherwise() -> None:
    ledger = PodLedger()
    ledger.charge("x", 0.1, now=0.0)  # due at 0.1
    ledger.charge("y", 0.2, now=0.0)  # behind x: due at 0.3
    assert [ledger.expected_at(t) for t in (0.05, 0.2, 0.35)] == [2, 1, 0]


def test_expected_at_forgets_departures_beyond_its_horizon() -> None:
    ledger = PodLedger(horizon_s=1.0)
    ledger.charge("a", 0.1, now=0.0, due=10.0)
    ledger.started("a", now=0.5)
    assert ledger.expected_at(0.2) == 1
    # A departure 2 s later: the first one is older than the horizon, forgotten (a
    # snapshot that old is stale and never read).
    ledger.charge("b", 0.1, now=2.0, due=10.0)
    ledger.started("b", now=2.5)
    assert ledger.expected_at(0.2) == 0
    assert ledger.expected_at(2.2) == 1


def test_expected_at_keeps_at_most_max_left_departures() -> None:
    ledger = PodLedger(horizon_s=DEPARTURE_HORIZON_S)
    for i in range(MAX_LEFT + 10):
        ledger.charge(i, 0.0, now=0.0, due=1.0)
        ledger.started(i, now=0.001)
    # All left within the horizon, but only the latest MAX_LEFT are remembered.
    assert ledger.expected_at(0.0) == MAX_LEFT


def test_without_a_horizon_no_departure_is_kept() -> None:
    """The default: nothing reads them, so only the requests still queued count."""
    ledger = PodLedger()
    ledger.charge("gone", 0.1, now=0.0, due=10.0)
    ledger.charge("queued", 0.1, now=0.0, due=10.0)
    ledger.started("gone", now=0.5)
    assert ledger.expected_at(0.2) == 1


def test_overdue_counts_the_queued_requests_past_their_predicted_first_token() -> None:
    ledger = PodLedger()
    ledger.charge("a", 0.1, now=0.0, due=0.2)
    ledger.charge("b", 0.1, now=0.0, due=0.5)
    ledger.charge("c", 0.1, now=0.0)  # due when the backlog, its own work with it, is done
    assert ledger.overdue(0.1) == 0
    assert ledger.overdue(0.35) == 2  # a and c (due at 0.3); the backlog reads 0 by then
    assert ledger.backlog(0.35) == 0.0
    ledger.started("a", 0.4)
    assert ledger.overdue(0.6) == 2  # b and c; a left the queue
    ledger.release("b", was_decoding=False, now=0.6)
    assert ledger.overdue(0.6) == 1


def test_rescale_revalues_the_work_still_queued_and_keeps_what_was_drained() -> None:
    ledger = PodLedger()
    ledger.charge("a", 0.4, now=0.0)
    ledger.charge("b", 0.2, now=0.0)
    ledger.rescale(0.5, now=0.2)  # 0.4 left at 0.2 s, predicted twice too long
    assert ledger.backlog(0.2) == pytest.approx(0.2)
    # Each request's share is re-valued too: a's first token leaves b's, halved.
    ledger.started("a", now=0.2)
    assert ledger.backlog(0.2) == pytest.approx(0.1)
    # An aborted request takes back its re-valued work, not what it was charged.
    ledger.charge("c", 0.3, now=0.2)
    ledger.rescale(2.0, now=0.2)
    ledger.release("c", was_decoding=False, now=0.2)
    assert ledger.backlog(0.2) == pytest.approx(0.2)
