"""Which processes are alive: a pure rule over observed heartbeats, and its transitions.

The scheduler observes, for each registered member, its heartbeat (present, with an
incarnation) or its death (its heartbeat lapsed and the failure detector, scheduler/detector.py,
confirmed it). The tracker turns successive observations into events; it does no I/O and keeps
no time. An incarnation the caller fences (the scheduler fences each worker it declares dead)
never joins again: a worker paused past its death would otherwise come back at a later clock
and silently change a sync job's result; its process must restart as a new incarnation, which
joins like any restarted process.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

# Records of worker changes a job keeps (Redis's list, and a scheduler's memory of it).
MEMBERSHIP_KEPT = 1000


@dataclass(frozen=True)
class Transition:
    # "joined", "dead", "restored" (a new incarnation replaced a live one) or "refused" (a
    # fenced incarnation beats again: it stays dead and must restart)
    kind: str
    member: int
    incarnation: int
    previous: int = 0  # the incarnation it replaced, for "restored"


@dataclass
class MembershipTracker:
    """Members seen alive, with the incarnation last seen. Not thread-safe.

    `fenced` holds, per member, the newest incarnation fenced (declared dead for good): that
    incarnation, or an older one, never rejoins. Nothing is fenced unless `fence` is called:
    not every end of a heartbeat is a death (a worker that finished, one restarting after a
    rollback, a paused server, which keeps its state).
    """

    alive: dict[int, int] = field(default_factory=dict)
    dead: set[int] = field(default_factory=set)
    fenced: dict[int, int] = field(default_factory=dict)
    # The fenced incarnation last refused per member, so each is announced once.
    _refused: dict[int, int] = field(default_factory=dict)

    def fence(self, member: int, incarnation: int) -> bool:
        """Fences `incarnation` of `member` (and older ones); True when that is news."""
        if incarnation <= self.fenced.get(member, -1):
            return False
        self.fenced[member] = incarnation
        return True

    def update(self, observed: dict[int, int | None]) -> list[Transition]:
        """Applies one observation: member -> incarnation, or None where it is dead.

        A member never seen alive is pending, not dead: a job that is still starting does
        not lose its quorum.
        """
        out = []
        for member, incarnation in sorted(observed.items()):
            known = self.alive.get(member)
            if incarnation is None:
                if known is not None:
                    del self.alive[member]
                    self.dead.add(member)
                    out.append(Transition("dead", member, known))
            elif incarnation <= self.fenced.get(member, -1):
                if known is not None:
                    # Fenced while it was alive (a new leader read the fence): dead now.
                    del self.alive[member]
                    self.dead.add(member)
                    out.append(Transition("dead", member, known))
                if self._refused.get(member) != incarnation:
                    self._refused[member] = incarnation
                    out.append(Transition("refused", member, incarnation))
            elif known is None:
                self.alive[member] = incarnation
                self.dead.discard(member)
                out.append(Transition("joined", member, incarnation))
            elif incarnation != known:
                self.alive[member] = incarnation
                out.append(Transition("restored", member, incarnation, known))
        return out


def describe_change(change: Mapping[str, Any]) -> str:
    """One recorded change of the job's workers, in words (`pstrain up`, `pstrain status`)."""
    rank, clock = change.get("worker"), change.get("clock")
    kind = change.get("change")
    if kind == "dead":
        return f"worker {rank} left (dead) at clock {clock}"
    if kind == "undone":
        return (f"worker {rank}'s steps from clock {change.get('checkpoint')} to {clock} were "
                "undone by a rollback after it had finished and left")
    return f"worker {rank} joined at clock {clock}"


def merged_changes(known: list[dict[str, Any]], more: Iterable[dict[str, Any]],
                   kept: int = MEMBERSHIP_KEPT) -> list[dict[str, Any]]:
    """The records of worker changes in `known` and `more`, each once, oldest first (by
    their time), the newest `kept` of them: what a scheduler remembered and what Redis
    lists, which may each lack some of the other's (Redis came back without its data, or
    an earlier leader wrote them)."""
    seen: dict[str, dict[str, Any]] = {}
    for change in (*known, *more):
        seen.setdefault(json.dumps(change, sort_keys=True), change)
    return sorted(seen.values(), key=lambda c: float(c.get("time", 0.0)))[-kept:]
