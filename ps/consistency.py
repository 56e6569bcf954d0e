"""Consistency policies: when a push is applied and when a pull may be served.

A policy is a small pure object. Given a frozen view of the shard's clocks it answers
SERVE, WAIT or DROP, and it says what the executor must do around those answers: whether
pulls ever wait, whether pushes are summed per clock, whether updates skip the table lock,
and, when a wait runs out, what it was waiting for. It never sleeps, locks or does I/O; the
shard's executor does the waiting, aggregating and applying, and never asks which policy it
holds. Policies are registered by mode kind (protos.modes.Kind).

Clocks count iterations: a worker at clock c is working on iteration c, and its tick for
iteration c moves it to c + 1. A pull at clock c asks for the parameters iteration c may use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from protos.modes import Kind, Mode, ModeError
from ps.errors import InvalidArgumentError


class Decision(Enum):
    SERVE = "serve"  # apply (or, under sync, aggregate) the push now / answer the pull now
    WAIT = "wait"  # not yet: ask again when the clocks move
    DROP = "drop"  # discard the push: acknowledged and counted, not applied


@dataclass(frozen=True)
class ClockView:
    """What a policy may look at, frozen at the moment of the question."""

    worker: int
    clock: int  # the clock the request carries
    min_live_clock: int  # the slowest live worker's clock
    open_clock: int  # sync: the oldest clock not yet closed
    contributors: int  # sync: workers whose gradients count for the open clock
    quorum: int  # sync: contributors needed to close a clock
    is_contributor: bool  # sync: this worker already counts for the open clock


@dataclass(frozen=True)
class Waiters:
    """Who a wait may be waiting for, frozen when it ran out: each live worker's clock and
    the workers that finished the open clock. Only explanations look at it."""

    clocks: tuple[tuple[int, int], ...]  # (worker, clock) of every live worker, by worker
    finished: frozenset[int]  # live or not, the contributors that ticked the open clock

    def unfinished(self) -> list[tuple[int, int]]:
        """(worker, clock) of live workers the open clock still waits for."""
        return [(w, c) for w, c in self.clocks if w not in self.finished]

    def behind(self, clock: int) -> list[tuple[int, int]]:
        """(worker, clock) of live workers whose clock is below `clock`."""
        return [(w, c) for w, c in self.clocks if c < clock]


class Policy(Protocol):
    """What the shard's executor asks a table's policy. Implementations are immutable."""

    @property
    def mode(self) -> Mode:
        """The mode this policy implements, its staleness bound filled in."""
        ...

    @property
    def aggregates(self) -> bool:
        """Pushes are summed per clock and applied once, when the clock closes (the executor
        keeps a sum per table and checks the pusher is live); else each applies at once."""
        ...

    @property
    def pull_waits(self) -> bool:
        """A pull may ever have to wait (the executor then takes the clocks to ask
        `on_pull`); when False, pulls are served without looking at the clocks."""
        ...

    @property
    def hogwild(self) -> bool:
        """Updates may run without the table's lock (racing updates of a row may interleave)."""
        ...

    @property
    def records_pulls(self) -> bool:
        """Served pulls go to the shard's pull log, with the slowest clock each one saw, so
        the staleness bound can be checked from outside."""
        ...

    def on_push(self, view: ClockView) -> Decision:
        """Whether a push reported at view.clock is taken now, later, or dropped."""
        ...

    def on_pull(self, view: ClockView) -> Decision:
        """Whether a pull at view.clock may be served now."""
        ...

    def closes(self, contributors: int, finished: int, quorum: int) -> bool:
        """Whether the shard's open clock closes, given who counts for it, how many of them
        finished it, and the quorum."""
        ...

    def explain_pull_wait(self, table: str, view: ClockView, waiters: Waiters) -> str:
        """Why a pull that got WAIT at `view` still waits: what it needs, and from whom."""
        ...

    def explain_push_wait(self, table: str, view: ClockView, waiters: Waiters) -> str:
        """Why a push that got WAIT at `view` still waits: what it needs, and from whom."""
        ...


def _workers(pairs: list[tuple[int, int]]) -> str:
    if not pairs:
        return "none (the quorum is waiting on ticks in flight)"
    return ", ".join(f"{w} (clock {c})" for w, c in pairs)


class _QuorumClock:
    """What every mode shares: the shard keeps one record of iterations for all its tables,
    and a clock closes once a full quorum counts for it and every one of them finished it.
    Aggregating policies apply their sums at that moment; for the others it only moves the
    open clock (checkpoint cuts, the clock a tick reports)."""

    @staticmethod
    def closes(contributors: int, finished: int, quorum: int) -> bool:
        """Whether the open clock closes: a full quorum, every one of them finished."""
        return contributors >= quorum and finished >= contributors

    def explain_push_wait(self, table: str, view: ClockView, waiters: Waiters) -> str:
        # Only a policy whose on_push may say WAIT overrides this.
        return (
            f"push to table {table!r} by worker {view.worker} at clock {view.clock} "
            "waited, though its mode never holds pushes back"
        )


class AsyncPolicy(_QuorumClock):
    """Hogwild: pushes apply at once without the table lock, pulls never wait."""

    mode = Mode(Kind.ASYNC)
    aggregates = False
    pull_waits = False
    hogwild = True
    records_pulls = False

    def on_push(self, view: ClockView) -> Decision:
        return Decision.SERVE

    def on_pull(self, view: ClockView) -> Decision:
        return Decision.SERVE

    def explain_pull_wait(self, table: str, view: ClockView, waiters: Waiters) -> str:
        return (
            f"pull of async table {table!r} by worker {view.worker} at clock {view.clock} "
            "waited, though async pulls never wait"
        )


@dataclass(frozen=True)
class SSPPolicy(_QuorumClock):
    """Bounded staleness: pushes apply at once; a pull at clock c waits until every live
    worker has reached clock c - staleness. Staleness 0 is lock-step without aggregation."""

    staleness: int
    aggregates = False
    pull_waits = True
    hogwild = False
    records_pulls = True

    def __post_init__(self) -> None:
        if self.staleness < 0:
            raise InvalidArgumentError(f"staleness must be >= 0, got {self.staleness}")

    @property
    def mode(self) -> Mode:
        return Mode(Kind.SSP, self.staleness)

    def on_push(self, view: ClockView) -> Decision:
        return Decision.SERVE

    def on_pull(self, view: ClockView) -> Decision:
        if view.min_live_clock >= view.clock - self.staleness:
            return Decision.SERVE
        return Decision.WAIT

    def explain_pull_wait(self, table: str, view: ClockView, waiters: Waiters) -> str:
        bound = view.clock - self.staleness
        return (
            f"pull of ssp table {table!r} by worker {view.worker} at clock {view.clock} "
            f"needs every live worker at clock >= {bound} (staleness {self.staleness}); "
            f"waiting for workers {_workers(waiters.behind(bound))}"
        )


class SyncPolicy(_QuorumClock):
    """Bulk-synchronous with backup workers.

    The gradients of clock t are summed; when `quorum` workers count for t and all of them
    have finished it, their mean is applied once and t closes. The first `quorum` workers to
    push (or finish) a clock count for it; gradients of others for that clock are dropped.
    A pull at clock c waits until clock c - 1 has closed.
    """

    mode = Mode(Kind.SYNC)
    aggregates = True
    pull_waits = True
    hogwild = False
    records_pulls = False

    def on_push(self, view: ClockView) -> Decision:
        if view.clock < view.open_clock:
            return Decision.DROP  # its clock closed without it
        if view.clock > view.open_clock:
            return Decision.WAIT  # an earlier clock is still open
        if view.is_contributor or view.contributors < view.quorum:
            return Decision.SERVE
        return Decision.DROP  # the quorum of this clock is full: a backup's gradient

    def on_pull(self, view: ClockView) -> Decision:
        return Decision.SERVE if view.open_clock >= view.clock else Decision.WAIT

    def explain_pull_wait(self, table: str, view: ClockView, waiters: Waiters) -> str:
        return (
            f"pull of sync table {table!r} by worker {view.worker} at clock {view.clock} "
            f"needs clock {view.clock - 1} closed, but clock {view.open_clock} is open "
            f"({view.contributors} of quorum {view.quorum} counted); waiting for workers "
            f"{_workers(waiters.unfinished())}"
        )

    def explain_push_wait(self, table: str, view: ClockView, waiters: Waiters) -> str:
        return (
            f"push to sync table {table!r} by worker {view.worker} for clock {view.clock} "
            f"needs clock {view.open_clock} closed first; waiting for workers "
            f"{_workers(waiters.unfinished())}"
        )


def _ssp(mode: Mode) -> SSPPolicy:
    # make_policy has filled the bound in; None cannot reach here.
    return SSPPolicy(0 if mode.staleness is None else mode.staleness)


# The policy of each kind, given a mode whose bound is filled in.
_POLICIES: dict[Kind, Callable[[Mode], Policy]] = {
    Kind.ASYNC: lambda mode: AsyncPolicy(),
    Kind.SSP: _ssp,
    Kind.SYNC: lambda mode: SyncPolicy(),
}


def make_policy(mode: Mode, default_staleness: int = 0) -> Policy:
    """The policy for `mode`; an ssp mode without a bound gets `default_staleness`.

    InvalidArgumentError for a negative default bound. Pure and thread-safe.
    """
    try:
        resolved = mode.with_default(default_staleness)
    except ModeError as exc:
        raise InvalidArgumentError(str(exc)) from exc
    return _POLICIES[resolved.kind](resolved)
