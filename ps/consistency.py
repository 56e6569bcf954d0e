"""Consistency policies: when a push is applied and when a pull may be served.

A policy is a small pure object. Given a frozen view of the shard's clocks it answers
SERVE, WAIT or DROP; it never sleeps, locks or does I/O. The shard's executor does the
waiting and the applying. Policies are registered by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from ps.errors import InvalidArgumentError


class Decision(Enum):
    SERVE = "serve"  # apply the push now / answer the pull now
    WAIT = "wait"  # not yet: ask again when the clocks move
    DROP = "drop"  # discard the push (acknowledged, counted, not applied)


@dataclass(frozen=True)
class ClockView:
    """What a policy may look at: the requesting worker's clock and the live workers' clocks."""

    worker: int
    clock: int


class Policy(Protocol):
    name: str

    def on_push(self, view: ClockView) -> Decision:
        """Whether a push reported at view.clock is applied now, later, or dropped."""
        ...

    def on_pull(self, view: ClockView) -> Decision:
        """Whether a pull at view.clock may be served now."""
        ...


class AsyncPolicy:
    """Hogwild: pushes apply at once, pulls never wait."""

    name = "async"

    def on_push(self, view: ClockView) -> Decision:
        return Decision.SERVE

    def on_pull(self, view: ClockView) -> Decision:
        return Decision.SERVE


POLICIES: dict[str, type[AsyncPolicy]] = {"async": AsyncPolicy}


def make_policy(name: str) -> Policy:
    """The policy registered under `name`; InvalidArgumentError listing the known ones."""
    try:
        return POLICIES[name]()
    except KeyError:
        raise InvalidArgumentError(
            f"unknown consistency mode {name!r}; choose one of {sorted(POLICIES)}"
        ) from None
