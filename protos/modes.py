"""Consistency modes: the one parser of the user's grammar, and its codec to the wire.

Users name a mode as "sync", "async", "ssp" (bounded staleness under the default bound) or
"ssp:S" (bound S >= 0). Server flags, worker modules, the client and the scheduler all parse
through `parse`; on the wire a mode is the `Mode` enum plus a staleness field, converted here
by `to_proto` and `from_proto`; `str(mode)` gives the grammar back. What each mode means for
pushes and pulls lives with the server's policies (ps/consistency.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from protos import pstrain_pb2 as pb

__all__ = [
    "ASYNC",
    "CHOICES",
    "KINDS",
    "SSP",
    "SYNC",
    "Kind",
    "Mode",
    "ModeError",
    "from_proto",
    "parse",
    "parse_optional",
    "to_proto",
]


class ModeError(ValueError):
    """A consistency mode that is not one of the choices; the message quotes it."""


class Kind(Enum):
    SYNC = "sync"
    SSP = "ssp"
    ASYNC = "async"


# The kinds by name, for places that keep the kind and the bound apart (a job spec's `mode`).
KINDS = tuple(k.value for k in Kind)
# What a user may write, for error messages and help texts.
CHOICES = "sync, async, ssp or ssp:S (S >= 0 the staleness bound, e.g. ssp:3)"


@dataclass(frozen=True)
class Mode:
    """A consistency mode: its kind and, for ssp, its staleness bound.

    `staleness` None (ssp only) means "the default bound", which whoever applies the mode
    fills in (a server's --staleness); see `with_default`. ModeError on a bound given to
    another kind or a negative one.
    """

    kind: Kind
    staleness: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.kind, Kind):
            raise ModeError(f"mode kind must be a Kind, got {self.kind!r}")
        if self.staleness is None:
            return
        if self.kind is not Kind.SSP:
            raise ModeError(
                f"only ssp takes a staleness bound, got {self.kind.value} with "
                f"{self.staleness!r}; choose {CHOICES}"
            )
        if isinstance(self.staleness, bool) or not isinstance(self.staleness, int) or (
            self.staleness < 0
        ):
            raise ModeError(
                f"the ssp staleness bound must be an int >= 0, got {self.staleness!r}"
            )

    def __str__(self) -> str:
        if self.staleness is None:
            return self.kind.value
        return f"{self.kind.value}:{self.staleness}"

    def with_default(self, staleness: int) -> Mode:
        """This mode with an ssp bound left to the default set to `staleness`."""
        if self.kind is Kind.SSP and self.staleness is None:
            return Mode(Kind.SSP, staleness)
        return self


SYNC = Mode(Kind.SYNC)
SSP = Mode(Kind.SSP)
ASYNC = Mode(Kind.ASYNC)


def parse(text: str) -> Mode:
    """The mode `text` names: "sync", "async", "ssp" or "ssp:S" (S a decimal int >= 0).

    ModeError quoting `text` and listing the choices otherwise. Pure and thread-safe.
    """
    if not isinstance(text, str):
        raise ModeError(f"a consistency mode is a string, got {text!r}; choose {CHOICES}")
    name, sep, arg = text.partition(":")
    try:
        kind = Kind(name)
    except ValueError:
        kind = None
    if kind is not None and not sep:
        return Mode(kind)
    # str.isdigit would take non-ASCII digits ("ssp:²") that int() then refuses.
    if kind is Kind.SSP and arg.isascii() and arg.isdigit():
        return Mode(Kind.SSP, int(arg))
    raise ModeError(f"unknown consistency mode {text!r}; choose {CHOICES}")


def parse_optional(text: str) -> Mode | None:
    """Like `parse`, but "" is None: no mode of its own (a table keeps the server's)."""
    return None if text == "" else parse(text)


_TO_WIRE: dict[Kind, pb.Mode] = {Kind.SYNC: pb.SYNC, Kind.SSP: pb.SSP, Kind.ASYNC: pb.ASYNC}
_FROM_WIRE: dict[int, Kind] = {wire: kind for kind, wire in _TO_WIRE.items()}


def to_proto(mode: Mode | None) -> tuple[pb.Mode, int | None]:
    """The (`consistency`, `staleness`) fields of a message for `mode`.

    None (no mode of its own) is MODE_UNSPECIFIED; a staleness of None leaves the optional
    field unset. Pure and thread-safe.
    """
    if mode is None:
        return pb.MODE_UNSPECIFIED, None
    return _TO_WIRE[mode.kind], mode.staleness


def from_proto(kind: int, staleness: int | None = None) -> Mode | None:
    """The mode of a message's `consistency` enum and its staleness (None when unset).

    MODE_UNSPECIFIED is None. ModeError for an enum value this build does not know, or a
    bound that does not fit the kind (as `Mode`). Pure and thread-safe.
    """
    if kind == pb.MODE_UNSPECIFIED:
        if staleness is not None:
            raise ModeError(
                f"a staleness bound ({staleness}) needs the mode SSP, but the mode is unset"
            )
        return None
    wire_kind = _FROM_WIRE.get(kind)
    if wire_kind is None:
        raise ModeError(
            f"unknown consistency mode {kind} on the wire (this build knows "
            f"{', '.join(f'{pb.Mode.Name(w)}={w}' for w in _FROM_WIRE)}); is the peer newer?"
        )
    return Mode(wire_kind, staleness)
