"""What the scheduler concludes after a Redis outage or a server restart: pure rules, no I/O.

- `RedisWatch` says when a lapsed heartbeat may be believed: only once Redis has been seen
  without a break, and without losing its data, for a heartbeat's life. A heartbeat that
  expired while Redis was stopped, or that vanished with an emptied Redis, says nothing
  about its process.
- `restarted` tells a restarted server (a new incarnation) from one that merely registered
  again (the same incarnation, after Redis came back or a new leader took over).
- `next_generation` never repeats a rollback generation, even after Redis lost its count.
- `rollback_target` picks the newest checkpoint every shard has, or says to wait for the
  one the restarted server restored to be listed again.
- `choose_rollback` does the same over the checkpoints not marked bad (nor built on one:
  `built_on_bad`), and says to stop the job when there were checkpoints and none of them
  verifies.
- `sign_entry` and `entry_signed` sign a checkpoint's entry in Redis with the job's secret
  and check it, so that a restarting server and a rollback use only entries a holder of the
  secret wrote (here, not in `ps`, because the scheduler checks them too and may not import
  `ps`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# The entry field that holds the signature.
MAC_FIELD = "mac"
# Derives the signing key from the job secret: a key of its own, so that nothing else
# derived from the secret (the call token is HMAC(secret, b"pstrain call token v1")) can
# ever pass for an entry's signature, nor one for the other.
_ENTRY_KEY_CONTEXT = b"pstrain checkpoint entry v1"


@dataclass
class RedisWatch:
    """The scheduler's view of Redis's availability, driven by its calls' outcomes.

    `settle_s` is how long Redis must have answered without a break before a missing
    heartbeat counts as a death (a heartbeat's life and a beat). A call that took longer
    than `max_call_s` to answer breaks the run too: Redis stalled (stopped, swapping,
    loading) and the heartbeats may have lapsed meanwhile. Not thread-safe; keeps no clock.
    """

    settle_s: float
    max_call_s: float
    up_since: float | None = None  # start of the current unbroken run; None while down
    down: bool = False  # a call failed and none has answered since

    def ok(self, now: float, took_s: float) -> bool:
        """Records a call that answered at `now` after `took_s`; True when Redis is back
        after a failed call."""
        back = self.down
        if back or self.up_since is None or took_s > self.max_call_s:
            self.up_since = now
        self.down = False
        return back

    def emptied(self, now: float) -> None:
        """Records that Redis answers but lost its data (the job's spec or this scheduler's
        lease vanished): the heartbeats went with it, so the run starts again at `now`."""
        if self.up_since is not None:
            self.up_since = now

    def failed(self) -> bool:
        """Records a failed call; True for the first failure of an outage."""
        first = not self.down
        self.down = True
        self.up_since = None
        return first

    def trusts_lapses(self, now: float) -> bool:
        """Whether a heartbeat missing at `now` means its process is dead."""
        return self.up_since is not None and now - self.up_since >= self.settle_s


def restarted(last_seen: int | None, incarnation: int) -> bool:
    """True when a server beating under `incarnation` is a new process: this scheduler saw
    it before under another incarnation. The same incarnation coming back (after an outage,
    an emptied Redis, or a change of leader) is a re-registration, not a restart."""
    return last_seen is not None and incarnation != last_seen


def next_generation(known: Iterable[int]) -> int:
    """One more than the highest generation `known` anywhere (Redis, the live servers, this
    scheduler's memory), so a Redis that lost its count never brings an old one back."""
    return max(known, default=0) + 1


def rollback_target(restored: str, complete: list[tuple[str, int]]) -> str | None:
    """The checkpoint a sync job rolls back to when a server restarted.

    `restored` is the checkpoint the restarted server loaded ("" if it started empty);
    `complete` lists (id, clock) of the checkpoints every shard has written, newest listed
    first. Returns the one with the highest clock ("" when there is none: the initial
    state), or None while `restored` is not among them (Redis came back empty and the
    restarted server has not listed it again yet): the caller asks again later.
    """
    if restored and restored not in {c for c, _ in complete}:
        return None
    if not complete:
        return ""
    best_id, best_clock = complete[0]
    for checkpoint_id, clock in complete[1:]:
        if clock > best_clock:
            best_id, best_clock = checkpoint_id, clock
    return best_id


@dataclass(frozen=True)
class RollbackChoice:
    """What a sync rollback does: go to `checkpoint` ("" the initial state: the job never
    checkpointed), `wait` for the restarted server's checkpoint to be listed, or `stop` the
    job (every checkpoint failed verification), `reason` naming them and what failed."""

    checkpoint: str | None = None
    wait: bool = False
    stop: bool = False
    reason: str = ""


def choose_rollback(restored: str, complete: list[tuple[str, int]],
                    bad: Mapping[str, str],
                    chains: Mapping[str, Iterable[object]] | None = None,
                    unsigned: Collection[str] = ()) -> RollbackChoice:
    """The checkpoint a sync job rolls back to. Pure.

    `complete` lists (id, clock) of the checkpoints every shard has written, newest listed
    first; `bad` maps the ids not to use to why: they failed verification (on any shard),
    or, for those also in `unsigned`, an entry in Redis is not signed. `chains` maps a delta
    checkpoint's id to the ids it builds on (its entries' chains): one that builds on a
    checkpoint that failed verification counts as bad too (`built_on_bad`); one built on a
    checkpoint with an unsigned entry does not (its own signed entry and its file vouch for
    its chain). The newest that is not bad wins; with none, and some checkpoint written, the
    job stops (going back to the initial state would silently throw the training away); with
    none written at all it goes back to the initial state. A `restored` checkpoint not listed
    (Redis came back empty) is waited for, unless it is bad.
    """
    verified_bad = {c: reason for c, reason in bad.items() if c not in unsigned}
    bad = {**bad, **built_on_bad(verified_bad, chains or {})}
    usable = [(c, clock) for c, clock in complete if c not in bad]
    if restored and restored not in bad and restored not in {c for c, _ in usable}:
        return RollbackChoice(wait=True)
    target = rollback_target("", usable)
    if usable or not (complete or bad):
        return RollbackChoice(checkpoint=target)
    failed = sorted(set(bad) | {c for c, _ in complete})
    return RollbackChoice(stop=True, reason=no_checkpoint_verifies(
        {c: bad.get(c, "not verified") for c in failed}))


def built_on_bad(bad: Mapping[str, str], chains: Mapping[str, Iterable[object]]
                 ) -> dict[str, str]:
    """The checkpoints of `chains` (id -> the ids of the checkpoints it builds on, as its
    entries list them) that build on one in `bad` (id -> what failed in it), each with why:
    a delta is no better than the checkpoints it needs. Pure."""
    out: dict[str, str] = {}
    for checkpoint_id, chain in chains.items():
        if checkpoint_id in bad:
            continue
        on_bad = sorted(str(c) for c in chain if str(c) in bad)
        if on_bad:
            out[checkpoint_id] = f"builds on checkpoint {on_bad[0]}, which failed: {bad[on_bad[0]]}"
    return out


def chain_of(entries: Mapping[int, Mapping[str, Any]]) -> set[str]:
    """The ids every shard's entry of a checkpoint says it builds on (none for a full one).
    Pure; tolerates entries without the field (full checkpoints, older writers)."""
    out: set[str] = set()
    for entry in entries.values():
        chain = entry.get("chain") if isinstance(entry, Mapping) else None
        if isinstance(chain, list):
            out.update(c for c in chain if isinstance(c, str))
    return out


def no_checkpoint_verifies(bad: Mapping[str, str]) -> str:
    """The one message that stops a job: every checkpoint and what failed in it. Pure."""
    listed = "; ".join(f"{c}: {reason}" for c, reason in sorted(bad.items()))
    return (f"recovery has no way back: none of the job's {len(bad)} checkpoint(s) verifies "
            f"({listed}). Restore the files from a backup and start the job with --resume, "
            "or start it afresh")


def entry_mac(secret: bytes, job: str, checkpoint_id: str, shard: int, num_shards: int,
              entry: Mapping[str, Any]) -> str:
    """The hex HMAC-SHA256 that signs shard `shard`'s entry ({path, sha256, nbytes, clock})
    of checkpoint `checkpoint_id` of `job`, a job of `num_shards` shards. Pure.

    It covers the job, the id, the shard, the shard count, and the entry's sha256, nbytes
    and clock as JSON gives them (so "5" is not 5), never the path, which no reader uses.
    """
    key = hmac.new(secret, _ENTRY_KEY_CONTEXT, hashlib.sha256).digest()
    # A JSON array: each part is delimited and typed, so no two tuples encode alike.
    message = json.dumps(
        [job, checkpoint_id, shard, num_shards, entry.get("sha256"), entry.get("nbytes"),
         entry.get("clock")], separators=(",", ":"), ensure_ascii=True).encode("ascii")
    return hmac.new(key, message, hashlib.sha256).hexdigest()


def sign_entry(secret: bytes, job: str, checkpoint_id: str, shard: int, num_shards: int,
               entry: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `entry` with its `mac` (see `entry_mac`); without a secret, a plain copy
    (the job does not sign). Pure."""
    signed = {k: v for k, v in entry.items() if k != MAC_FIELD}
    if secret:
        signed[MAC_FIELD] = entry_mac(secret, job, checkpoint_id, shard, num_shards, signed)
    return signed


def entry_signed(secret: bytes, job: str, checkpoint_id: str, shard: int, num_shards: int,
                 entry: object) -> bool:
    """Whether `entry`, read from Redis as shard `shard`'s of checkpoint `checkpoint_id`,
    carries the `mac` the job's secret gives it (compared in constant time). Always true
    without a secret (the job does not sign); false for an entry that is not a JSON object
    or has no mac. Pure."""
    if not secret:
        return True
    if not isinstance(entry, Mapping) or not isinstance(entry.get(MAC_FIELD), str):
        return False
    expected = entry_mac(secret, job, checkpoint_id, shard, num_shards, entry)
    # Bytes: compare_digest refuses a str with characters outside ASCII.
    return hmac.compare_digest(str(entry[MAC_FIELD]).encode("utf-8", "replace"),
                               expected.encode("ascii"))
