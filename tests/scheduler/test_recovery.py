"""The scheduler's pure recovery rules, as tables of cases with a fake clock."""

from __future__ import annotations

import hashlib
import hmac
import json
from pathlib import Path
from typing import Any

import pytest

from protos.security import Security
from scheduler.recovery import (
    RedisWatch,
    RollbackChoice,
    built_on_bad,
    chain_of,
    choose_rollback,
    entry_mac,
    entry_signed,
    next_generation,
    restarted,
    rollback_target,
    sign_entry,
)


def watch() -> RedisWatch:
    return RedisWatch(settle_s=2.0, max_call_s=0.5)


# (what happens, at time, how long the call took) ... then: is a lapse believed at time t?
@pytest.mark.parametrize(("events", "at", "believed"), [
    ([], 10.0, False),  # never reached Redis
    ([("ok", 0.0, 0.01)], 1.9, False),  # not yet settled
    ([("ok", 0.0, 0.01), ("ok", 1.0, 0.01)], 2.0, True),  # settled
    ([("ok", 0.0, 0.01), ("failed", 1.0, 0.0)], 5.0, False),  # down
    ([("ok", 0.0, 0.01), ("failed", 1.0, 0.0), ("ok", 6.0, 0.01)], 7.9, False),  # just back
    ([("ok", 0.0, 0.01), ("failed", 1.0, 0.0), ("ok", 6.0, 0.01)], 8.0, True),
    ([("ok", 0.0, 0.01), ("ok", 5.0, 1.9)], 6.0, False),  # a call stalled: Redis was stopped
    ([("ok", 0.0, 0.01), ("ok", 5.0, 1.9)], 7.0, True),
    ([("ok", 0.0, 0.01), ("emptied", 5.0, 0.0)], 6.0, False),  # came back empty
    ([("ok", 0.0, 0.01), ("emptied", 5.0, 0.0), ("ok", 5.1, 0.01)], 7.0, True),
])
def test_lapses_are_believed_only_after_redis_settled(
        events: list[tuple[str, float, float]], at: float, believed: bool) -> None:
    w = watch()
    for kind, now, took in events:
        if kind == "ok":
            w.ok(now, took)
        elif kind == "failed":
            w.failed()
        else:
            w.emptied(now)
    assert w.trusts_lapses(at) is believed


def test_an_outage_is_reported_once_each_way() -> None:
    w = watch()
    assert w.ok(0.0, 0.01) is False
    assert [w.failed() for _ in range(50)] == [True] + [False] * 49
    assert w.ok(9.0, 0.01) is True
    assert w.ok(9.1, 0.01) is False


@pytest.mark.parametrize(("last_seen", "incarnation", "expected"), [
    (None, 5, False),  # first sight
    (5, 5, False),  # registered again (outage, empty Redis, new lease): not a restart
    (5, 6, True),  # a new process
])
def test_restarted(last_seen: int | None, incarnation: int, expected: bool) -> None:
    assert restarted(last_seen, incarnation) is expected


@pytest.mark.parametrize(("known", "expected"), [
    ([], 1),
    ([0, 0], 1),
    ([3, 0, 0], 4),  # Redis's count
    ([0, 3, 3], 4),  # Redis was wiped: the servers still hold generation 3
    ([0, 0, 5, 2], 6),  # this scheduler published 5 before the wipe
])
def test_next_generation_never_repeats(known: list[int], expected: int) -> None:
    assert next_generation(known) == expected


@pytest.mark.parametrize(("restored", "complete", "expected"), [
    ("", [], ""),  # nothing written yet: the initial state
    ("", [("clock-40", 40)], "clock-40"),  # the restarted one started empty, a checkpoint exists
    ("clock-40", [("clock-60", 60), ("clock-40", 40)], "clock-60"),  # the newest
    ("clock-40", [("clock-40", 40), ("clock-60", 60)], "clock-60"),  # relisted out of order
    ("clock-40", [], None),  # Redis came back empty: wait for it to be listed again
    ("clock-40", [("clock-20", 20)], None),
])
def test_rollback_target(restored: str, complete: list[tuple[str, int]],
                         expected: str | None) -> None:
    assert rollback_target(restored, complete) == expected


C60, C40, C20 = ("clock-60", 60), ("clock-40", 40), ("clock-20", 20)


@pytest.mark.parametrize(("restored", "complete", "bad", "expected"), [
    # Nothing bad: as rollback_target.
    ("", [], {}, RollbackChoice(checkpoint="")),
    ("clock-40", [C60, C40], {}, RollbackChoice(checkpoint="clock-60")),
    ("clock-40", [], {}, RollbackChoice(wait=True)),
    # The newest is bad (on any shard): the newest that is not, for every shard together.
    ("clock-60", [C60, C40, C20], {"clock-60": "shard 1: sha256"},
     RollbackChoice(checkpoint="clock-40")),
    ("", [C60, C40, C20], {"clock-60": "x", "clock-40": "y"},
     RollbackChoice(checkpoint="clock-20")),
    # The restarted server's own checkpoint is bad: no waiting for it to be listed.
    ("clock-60", [C40], {"clock-60": "x"}, RollbackChoice(checkpoint="clock-40")),
    # A bad mark of a checkpoint no longer listed changes nothing about the others.
    ("clock-40", [C40], {"clock-60": "x"}, RollbackChoice(checkpoint="clock-40")),
])
def test_choose_rollback_takes_the_newest_checkpoint_not_marked_bad(
    restored: str, complete: list[tuple[str, int]], bad: dict[str, str],
    expected: RollbackChoice,
) -> None:
    assert choose_rollback(restored, complete, bad) == expected


@pytest.mark.parametrize(("restored", "complete", "bad"), [
    ("clock-60", [C60, C40], {"clock-60": "shard 0: truncated", "clock-40": "shard 1: sha"}),
    ("", [C40], {"clock-40": "shard 1: sha"}),
    ("", [], {"clock-40": "shard 1: sha"}),  # marked, and no longer listed
])
def test_choose_rollback_stops_when_no_checkpoint_verifies(
    restored: str, complete: list[tuple[str, int]], bad: dict[str, str],
) -> None:
    choice = choose_rollback(restored, complete, bad)
    assert choice.stop and choice.checkpoint is None and not choice.wait
    assert choice.reason.startswith("recovery has no way back: none of the job's")
    for checkpoint_id, reason in bad.items():
        assert f"{checkpoint_id}: {reason}" in choice.reason


@pytest.mark.parametrize(("complete", "bad", "chains", "expected"), [
    # clock-60 builds on clock-40, which failed: both are passed over
    ([C60, C40, C20], {"clock-40": "sha"}, {"clock-60": ["clock-20", "clock-40"]},
     RollbackChoice(checkpoint="clock-20")),
    # ... though built on a full checkpoint that did not fail, it is fine
    ([C60, C40, C20], {"clock-40": "sha"}, {"clock-60": ["clock-20"]},
     RollbackChoice(checkpoint="clock-60")),
    # and a chain naming a checkpoint no longer listed is no reason to pass one over
    ([C60], {}, {"clock-60": ["clock-0"]}, RollbackChoice(checkpoint="clock-60")),
])
def test_choose_rollback_passes_over_the_deltas_built_on_a_bad_checkpoint(
    complete: list[tuple[str, int]], bad: dict[str, str], chains: dict[str, list[str]],
    expected: RollbackChoice,
) -> None:
    assert choose_rollback("", complete, bad, chains) == expected


def test_a_delta_built_on_a_checkpoint_with_an_unsigned_entry_is_used() -> None:
    # Someone changed the older checkpoint's entry in Redis: it is passed over, but the
    # delta's own signed entry and file vouch for the chain it needs.
    choice = choose_rollback("", [C60, C40], {"clock-40": "an entry is not signed"},
                             {"clock-60": ["clock-40"]}, unsigned={"clock-40"})
    assert choice == RollbackChoice(checkpoint="clock-60")


def test_when_only_deltas_of_a_bad_checkpoint_are_left_the_job_stops_naming_why() -> None:
    choice = choose_rollback("", [C60, C40], {"clock-40": "shard 0: sha256 mismatch"},
                             {"clock-60": ["clock-40"]})
    assert choice.stop
    assert ("clock-60: builds on checkpoint clock-40, which failed: shard 0: sha256 mismatch"
            in choice.reason)


def test_chain_of_and_built_on_bad() -> None:
    entries = {0: {"chain": ["c1", "c2"]}, 1: {"chain": ["c2"]}, 2: {"sha256": "x"}}
    assert chain_of(entries) == {"c1", "c2"}
    assert chain_of({0: {"chain": "c1"}, 1: {}}) == set()  # malformed: no chain
    assert built_on_bad({"c1": "why"}, {"c3": {"c1", "c2"}, "c4": {"c2"}, "c1": set()}) == {
        "c3": "builds on checkpoint c1, which failed: why"}


# ---- checkpoint entries signed with the job's secret -----------------------------------------

SECRET = b"0123456789abcdef0123456789abcdef"
SHA = "ab" * 32
ENTRY = {"path": "/ckpt/j/c2/shard-1-of-2.safetensors", "sha256": SHA, "nbytes": 1234,
         "clock": 40}
# (job, checkpoint id, shard, num_shards) the entry is signed for.
WHERE = ("j", "c2", 1, 2)


def signed(**changes: Any) -> dict[str, Any]:
    return {**sign_entry(SECRET, *WHERE, ENTRY), **changes}


def test_a_signed_entry_verifies_and_survives_json() -> None:
    entry = signed()
    assert set(entry) == {*ENTRY, "mac"}
    assert entry_signed(SECRET, *WHERE, entry)
    assert entry_signed(SECRET, *WHERE, json.loads(json.dumps(entry)))
    # Signing again (as a relisting server might) changes nothing.
    assert sign_entry(SECRET, *WHERE, entry) == entry


@pytest.mark.parametrize("changed", [
    {"sha256": "cd" * 32},  # another checkpoint's file
    {"sha256": SHA.upper()},
    {"nbytes": 1235},
    {"nbytes": "1234"},  # the same number as text
    {"clock": 400},  # a higher clock, to be chosen for a rollback
    {"clock": 40.0},
    {"clock": True},
    {"mac": ""},
    {"mac": "00" * 32},
    {"mac": "é" * 64},  # not ASCII: compared as bytes, not refused with TypeError
    {"mac": 7},
    {"mac": None},
])
def test_a_changed_field_fails(changed: dict[str, Any]) -> None:
    assert not entry_signed(SECRET, *WHERE, signed(**changed))


@pytest.mark.parametrize("where", [
    ("k", "c2", 1, 2),  # another job
    ("j", "c1", 1, 2),  # another checkpoint: an old entry listed under a newer id
    ("j", "c2", 0, 2),  # another shard's entry
    ("j", "c2", 1, 3),  # another shard count
])
def test_an_entry_signed_for_another_place_fails(where: tuple[str, str, int, int]) -> None:
    assert not entry_signed(SECRET, *where, signed())


@pytest.mark.parametrize("entry", [
    dict(ENTRY),  # written without a secret
    sign_entry(b"another secret of 32 bytes......", *WHERE, ENTRY),
    "not an object",
    None,
    [SHA, 1234, 40],
])
def test_an_unsigned_or_foreign_entry_fails(entry: object) -> None:
    assert not entry_signed(SECRET, *WHERE, entry)


def test_without_a_secret_nothing_is_signed_or_checked() -> None:
    assert sign_entry(b"", *WHERE, ENTRY) == ENTRY
    assert entry_signed(b"", *WHERE, ENTRY)
    assert entry_signed(b"", *WHERE, {**ENTRY, "clock": 400, "mac": "junk"})


def test_the_path_is_not_signed() -> None:
    # No reader uses it (the file is found by id), so a moved directory still verifies.
    assert entry_signed(SECRET, *WHERE, signed(path="/elsewhere/shard-1-of-2.safetensors"))


def test_the_mac_is_keyed_by_a_key_of_its_own_over_a_json_array() -> None:
    # Pinned: a change here makes every entry already in Redis fail to verify.
    key = hmac.new(SECRET, b"pstrain checkpoint entry v1", hashlib.sha256).digest()
    message = b'["j","c2",1,2,"' + SHA.encode() + b'",1234,40]'
    assert entry_mac(SECRET, *WHERE, ENTRY) == hmac.new(key, message, hashlib.sha256).hexdigest()


def test_the_call_token_is_no_signature(tmp_path: Path) -> None:
    (tmp_path / "secret").write_bytes(SECRET)
    token = Security(secret_path=str(tmp_path / "secret")).token()
    assert entry_mac(SECRET, *WHERE, ENTRY) != token
    assert not entry_signed(SECRET, *WHERE, signed(mac=token))
