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
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


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
