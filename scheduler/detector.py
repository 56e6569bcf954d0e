"""The failure detector: tells a slow process from a dead one. Pure rules; no I/O, no clock.

Every process heartbeats every `heartbeat_interval_s` into a Redis key that lives
`heartbeat_ttl_s` (`heartbeat_misses` beats). A lapsed key makes its process *suspect*, not
dead: a process starved of CPU, paused by a long call that holds the GIL, swapped out or
SIGSTOPped is as silent as a dead one. A suspect is declared dead when either

- its Redis connection has closed. Each beat names the connection it went through
  (`connection_name`), and a process that exited, was killed or crashed loses its sockets at
  once, while a paused one keeps them open. This is the usual case, seen at the first poll
  after the lapse, so a `kill -9` is still noticed within about a heartbeat's life; or
- it has stayed silent for `suspect_timeout_s` more. A host that lost power or its network
  closes no connection, and a process silent that long is as good as dead to its job. This
  is the only rule left where Redis does not say which clients are connected (CLIENT LIST
  refused by an ACL, or a proxy in front of Redis).

While a process is suspect nothing changes: a sync quorum keeps waiting for it, so a pause
shorter than the timeout leaves the job's result as it was (`--suspect-timeout-s` is the
deadline a sync job waits for a suspect worker; 0 declares a lapsed process dead at once).

The default timeout (10 s) was chosen from pauses measured on 2 cores: under a CPU hog
(2 or 8 busy loops beside a 2-server, 2-worker sync job) beats arrived at most 0.54 s apart
(interval 0.5 s), so load alone never lapses a key; what lapses one is the process itself
stopping (a long call holding the GIL while a worker loads its data, a SIGSTOP, swap). The
timeout covers such a pause of up to TTL + 10 s = 11.5 s, seven times the TTL, while a host
lost without a closed connection still stops a sync job for only about 12 s.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field


class Health(enum.Enum):
    ALIVE = "alive"
    SUSPECT = "suspect"
    DEAD = "dead"


def connection_name(job: str, role: str, ident: int, incarnation: int) -> str:
    """The Redis client name of a process's connections (job names hold no ':' or space)."""
    return f"pstrain:{job}:{role}:{ident}:{incarnation}"


@dataclass(frozen=True)
class FailureDetector:
    """The rule: a member's health from how long it has been silent and whether its process
    still holds a Redis connection. Thread-safe (immutable)."""

    suspect_timeout_s: float

    def health(self, silent_s: float | None, connected: bool | None) -> Health:
        """`silent_s`: seconds since its lapse was first seen (None: it beats);
        `connected`: whether a connection of its incarnation is open (None: not known)."""
        if silent_s is None:
            return Health.ALIVE
        if connected is False or silent_s >= self.suspect_timeout_s:
            return Health.DEAD
        return Health.SUSPECT


@dataclass(frozen=True)
class Notice:
    """A change of suspicion: "suspect" (its heartbeat lapsed; it keeps its place) or
    "cleared" (it beats again, after `silent_s` seconds as a suspect)."""

    kind: str
    member: int
    incarnation: int
    silent_s: float = 0.0


@dataclass
class Suspicions:
    """Which members of one role are suspect, since when, under which incarnation; turns each
    poll into what the membership tracker should believe. Not thread-safe; keeps no clock
    (the caller gives `now`)."""

    detector: FailureDetector
    # member -> (when its lapse was first seen, the incarnation that went silent)
    since: dict[int, tuple[float, int]] = field(default_factory=dict)

    @staticmethod
    def to_probe(observed: Mapping[int, int | None], alive: Mapping[int, int]) -> dict[int, int]:
        """Members whose connections the caller should look for: lapsed in this poll and
        alive to the tracker (member -> incarnation). Empty in a healthy job, so the probe
        costs nothing then."""
        return {m: alive[m] for m, inc in observed.items() if inc is None and m in alive}

    def judge(
        self, observed: Mapping[int, int | None], alive: Mapping[int, int], now: float,
        connected: Mapping[int, bool | None],
    ) -> tuple[dict[int, int | None], list[Notice]]:
        """One poll. `observed`: member -> incarnation, None where the heartbeat lapsed;
        `alive`: the tracker's live members; `connected`: the probe of `to_probe`'s members.

        Returns the observation for the tracker (a suspect is left out: the tracker keeps it
        as it was; None only for the dead) and the suspicions begun or cleared.
        """
        out: dict[int, int | None] = {}
        notices: list[Notice] = []
        for member, incarnation in sorted(observed.items()):
            held = self.since.get(member)
            if incarnation is not None:
                if held is not None:
                    del self.since[member]
                    if held[1] == incarnation:
                        notices.append(Notice("cleared", member, incarnation, now - held[0]))
                out[member] = incarnation
                continue
            known = alive.get(member)
            if known is None:
                # Never seen alive (pending) or dead already: nothing to suspect.
                self.since.pop(member, None)
                out[member] = None
                continue
            if held is None or held[1] != known:
                held, first = (now, known), True
                self.since[member] = held
            else:
                first = False
            health = self.detector.health(now - held[0], connected.get(member))
            if health is Health.DEAD:
                del self.since[member]
                out[member] = None
            elif first:
                notices.append(Notice("suspect", member, known))
        return out, notices

    def reset(self) -> None:
        """Forgets every suspicion: lapses are not believed now (Redis was down or came back
        empty), so silences are counted again from when they are."""
        self.since.clear()
