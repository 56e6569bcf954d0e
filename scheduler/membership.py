"""Which processes are alive: a pure rule over observed heartbeats, and its transitions.

The scheduler observes, for each registered member, its heartbeat (present, with an
incarnation) or its absence (the key expired: `heartbeat_misses` beats were missed). The
tracker turns successive observations into events; it does no I/O and keeps no time.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Transition:
    kind: str  # "joined", "dead" or "restored" (a new incarnation replaced a live one)
    member: int
    incarnation: int
    previous: int = 0  # the incarnation it replaced, for "restored"


@dataclass
class MembershipTracker:
    """Members seen alive, with the incarnation last seen. Not thread-safe."""

    alive: dict[int, int] = field(default_factory=dict)
    dead: set[int] = field(default_factory=set)

    def update(self, observed: dict[int, int | None]) -> list[Transition]:
        """Applies one observation: member -> incarnation, or None where the beat lapsed.

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
            elif known is None:
                self.alive[member] = incarnation
                self.dead.discard(member)
                out.append(Transition("joined", member, incarnation))
            elif incarnation != known:
                self.alive[member] = incarnation
                out.append(Transition("restored", member, incarnation, known))
        return out
