"""Exactly-once admission, table-driven."""

from __future__ import annotations

import json
import threading

import pytest

from ps.errors import DeadlineExceededError, FailedPreconditionError
from ps.ledger import Admission, PushLedger


def _applied(ledger: PushLedger, worker: int, inc: int, seq: int) -> Admission:
    admission = ledger.admit(worker, inc, seq, timeout_s=1)
    if admission is Admission.NEW:
        ledger.done(worker, inc, seq)
    return admission


@pytest.mark.parametrize(
    ("pushes", "expected"),
    [
        ([(0, 1, 1), (0, 1, 1)], ["new", "duplicate"]),
        ([(0, 1, 2), (0, 1, 1), (0, 1, 2)], ["new", "new", "duplicate"]),
        ([(0, 1, 1), (1, 1, 1)], ["new", "new"]),
        ([(0, 1, 1), (0, 2, 1)], ["new", "new"]),  # new incarnation restarts numbering
    ],
)
def test_admission(pushes: list[tuple[int, int, int]], expected: list[str]) -> None:
    ledger = PushLedger()
    assert [_applied(ledger, *p).value for p in pushes] == expected


def test_stale_incarnation_refused() -> None:
    ledger = PushLedger()
    _applied(ledger, 0, 2, 1)
    with pytest.raises(FailedPreconditionError, match="incarnation 2 has since joined"):
        ledger.admit(0, 1, 5, timeout_s=1)


def test_abandoned_push_can_be_applied_by_its_retry() -> None:
    ledger = PushLedger()
    assert ledger.admit(0, 1, 1, timeout_s=1) is Admission.NEW
    ledger.abandon(0, 1, 1)
    assert _applied(ledger, 0, 1, 1) is Admission.NEW


def test_too_old_numbers_are_refused_not_reapplied() -> None:
    ledger = PushLedger(window=4)
    for seq in range(1, 20):
        _applied(ledger, 0, 1, seq)
    with pytest.raises(FailedPreconditionError, match="older than the last 4 pushes"):
        ledger.admit(0, 1, 2, timeout_s=1)
    assert _applied(ledger, 0, 1, 19) is Admission.DUPLICATE


def test_retry_waits_for_in_flight_twin() -> None:
    ledger = PushLedger()
    assert ledger.admit(0, 1, 1, timeout_s=1) is Admission.NEW
    result: list[Admission] = []
    t = threading.Thread(target=lambda: result.append(ledger.admit(0, 1, 1, timeout_s=5)))
    t.start()
    ledger.done(0, 1, 1)
    t.join(timeout=5)
    assert result == [Admission.DUPLICATE]
    assert ledger.admit(0, 1, 2, timeout_s=1) is Admission.NEW
    with pytest.raises(DeadlineExceededError):
        ledger.admit(0, 1, 2, timeout_s=0.05)


def test_a_retry_gives_up_its_turn_before_it_waits_for_its_twin() -> None:
    waits: list[int] = []
    ledger = PushLedger(before_wait=lambda: waits.append(1))
    assert ledger.admit(0, 1, 1, timeout_s=1) is Admission.NEW
    assert ledger.admit(0, 1, 2, timeout_s=1) is Admission.NEW
    assert waits == []  # no twin in flight: no wait
    ledger.done(0, 1, 2)
    assert ledger.admit(0, 1, 2, timeout_s=1) is Admission.DUPLICATE
    assert waits == []
    with pytest.raises(DeadlineExceededError):
        ledger.admit(0, 1, 1, timeout_s=0.05)
    assert waits, "the ledger waited for a twin without giving up its caller's turn"


def test_entries_round_trip() -> None:
    ledger = PushLedger()
    for seq in (1, 2, 5):
        _applied(ledger, 3, 1, seq)
    copy = PushLedger()
    copy.restore(ledger.entries())
    assert copy.admit(3, 1, 5, timeout_s=1) is Admission.DUPLICATE
    assert copy.admit(3, 1, 4, timeout_s=1) is Admission.NEW


def test_checkpoint_form_round_trips_through_json() -> None:
    ledger = PushLedger()
    for seq in (1, 2, 5):
        _applied(ledger, 3, 7, seq)
    meta = json.loads(json.dumps(ledger.to_meta()))
    assert meta == [[3, 7, 0, [1, 2, 5]]]
    copy = PushLedger()
    copy.restore_meta(meta)
    assert copy.admit(3, 7, 5, timeout_s=1) is Admission.DUPLICATE
    assert copy.admit(3, 7, 4, timeout_s=1) is Admission.NEW
    with pytest.raises(FailedPreconditionError):
        copy.admit(3, 6, 9, timeout_s=1)  # the restored incarnation is the newest known
