"""Consistency policies: when a push is applied and when a pull may be served.

A policy is a small pure object. Given a frozen view of the shard's clocks it answers
SERVE, WAIT or DROP; it never sleeps, locks or does I/O. The shard's executor does the
waiting, aggregating and applying. Policies are registered by name.

Clocks count iterations: a worker at clock c is working on iteration c, and its tick for
iteration c moves it to c + 1. A pull at clock c asks for the parameters iteration c may use.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol

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

    def on_push(self, view: ClockView) -> Decision:
        """Whether a push reported at view.clock is taken now, later, or dropped."""
        ...

    def on_pull(self, view: ClockView) -> Decision:
        """Whether a pull at view.clock may be served now."""
        ...


class AsyncPolicy:
    """Hogwild: pushes apply at once, pulls never wait."""

    name = "async"
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


MODES = ("sync", "ssp", "async")


def make_policy(mode: str, default_staleness: int = 0) -> Policy:
    """The policy for a mode string: "sync", "async", "ssp" or "ssp:S" (staleness S).

    InvalidArgumentError naming the mode and the valid choices.
    """
    name, _, arg = mode.partition(":")
    if name == "async" and not arg:
        return AsyncPolicy()
    if name == "sync" and not arg:
        return SyncPolicy()
    if name == "ssp":
        if not arg:
            return SSPPolicy(default_staleness)
        if arg.isdigit():
            return SSPPolicy(int(arg))
    raise InvalidArgumentError(
        f"unknown consistency mode {mode!r}; choose sync, async, ssp or ssp:S (S >= 0 the "
        "staleness bound, e.g. ssp:3)"
    )
