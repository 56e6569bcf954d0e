"""Consistency policies: when a push is applied and when a pull may be served.

A policy is a small pure object. Given a frozen view of the shard's clocks it answers
SERVE, WAIT or DROP; it never sleeps, locks or does I/O. The shard's executor does the
waiting, aggregating and applying. Policies are registered by mode kind (protos.modes.Kind).

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


class Policy(Protocol):
    name: str
    aggregates: bool  # pushes are summed per clock and applied when the clock closes

    @property
    def mode(self) -> Mode:
        """The mode this policy implements, its staleness bound filled in."""
        ...  # pushes are summed per clock and applied when the clock closes

    def on_push(self, view: ClockView) -> Decision:
        """Whether a push reported at view.clock is taken now, later, or dropped."""
        ...

    def on_pull(self, view: ClockView) -> Decision:
        """Whether a pull at view.clock may be served now."""
        ...


class AsyncPolicy:
    """Hogwild: pushes apply at once, pulls never wait."""

    name = "async"
    mode = Mode(Kind.ASYNC)
    aggregates = False

    def on_push(self, view: ClockView) -> Decision:
        return Decision.SERVE

    def on_pull(self, view: ClockView) -> Decision:
        return Decision.SERVE


@dataclass(frozen=True)
class SSPPolicy:
    """Bounded staleness: pushes apply at once; a pull at clock c waits until every live
    worker has reached clock c - staleness. Staleness 0 is lock-step without aggregation."""

    staleness: int
    name = "ssp"
    aggregates = False

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


class SyncPolicy:
    """Bulk-synchronous with backup workers.

    The gradients of clock t are summed; when `quorum` workers count for t and all of them
    have finished it, their mean is applied once and t closes. The first `quorum` workers to
    push (or finish) a clock count for it; gradients of others for that clock are dropped.
    A pull at clock c waits until clock c - 1 has closed.
    """

    name = "sync"
    mode = Mode(Kind.SYNC)
    aggregates = True

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

    @staticmethod
    def closes(contributors: int, finished: int, quorum: int) -> bool:
        """Whether the open clock closes: a full quorum, every one of them finished."""
        return contributors >= quorum and finished >= contributors


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
