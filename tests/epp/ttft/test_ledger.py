"""A pod's prefill queue as the EPP sent it: drained by time, re-anchored by first tokens."""

from __future__ import annotations

import pytest

from epp.ttft.ledger import PodLedger


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
