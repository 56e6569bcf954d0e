"""The registry of bulk transports by name, and the rule that picks one per peer.

Transports are imported only when asked for, so a host without UCX never loads it. The rule
(`select`) is pure: given what both sides offer, the first transport in `PREFERENCE` that
both can use wins; a forced transport is the only candidate, and its absence is an error.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from protos import pstrain_pb2 as pb
from protos.transport.base import (
    ClientChannel,
    HandshakeError,
    ServerChannel,
    TransportError,
    TransportUnavailableError,
)

# Fastest first. gRPC comes last and always works.
PREFERENCE: tuple[str, ...] = ("shm", "ucx", "grpc")
NAMES: tuple[str, ...] = ("auto", *PREFERENCE)
ENV_VAR = "PSTRAIN_TRANSPORT"

# name -> module with `probe()`, `Client` and `Server`; imported on first use.
_MODULES: dict[str, str] = {
    "grpc": "protos.transport.inline",
    "shm": "protos.transport.shm",
    "ucx": "protos.transport.ucx",
}


@dataclass(frozen=True)
class Choice:
    """The transport a process asks for: "auto" (the fastest both peers share) or a name."""

    name: str = "auto"

    def __post_init__(self) -> None:
        if self.name not in NAMES:
            raise TransportError(
                f"unknown transport {self.name!r}; use one of {', '.join(NAMES)}"
            )

    @property
    def forced(self) -> str:
        """The forced transport's name, or "" for auto."""
        return "" if self.name == "auto" else self.name


def parse_choice(value: str | None) -> Choice:
    """A Choice from a flag or environment value; empty means auto. TransportError names a
    bad value."""
    return Choice((value or "auto").strip().lower())


def _module(name: str) -> Any:
    if name not in _MODULES:
        raise TransportError(f"unknown transport {name!r}; use one of {', '.join(PREFERENCE)}")
    return importlib.import_module(_MODULES[name])


def available(name: str) -> tuple[bool, str]:
    """(whether transport `name` can work in this process, why not). Imports it lazily;
    never raises for a missing optional package. Blocks briefly (may load a library)."""
    try:
        module = _module(name)
    except ImportError as exc:  # pragma: no cover - our own modules always import
        return False, f"cannot import the {name} transport: {exc}"
    ok, reason = module.probe()
    return bool(ok), str(reason)


def client_channel(name: str, **options: Any) -> ClientChannel:
    """A new client side of transport `name`; TransportUnavailableError (with the reason)
    when it cannot work here."""
    ok, reason = available(name)
    if not ok:
        raise TransportUnavailableError(f"transport {name!r} is not available here: {reason}")
    channel: ClientChannel = _module(name).Client(**options)
    return channel


def server_channel(name: str, **options: Any) -> ServerChannel:
    """A new server side of transport `name`; TransportUnavailableError when it cannot
    work here."""
    ok, reason = available(name)
    if not ok:
        raise TransportUnavailableError(f"transport {name!r} is not available here: {reason}")
    channel: ServerChannel = _module(name).Server(**options)
    return channel


def unavailable_offer(name: str, reason: str) -> pb.TransportOffer:
    return pb.TransportOffer(name=name, available=False, reason=reason)


def select(
    client: Sequence[pb.TransportOffer], server: Sequence[pb.TransportOffer],
    client_forced: str = "", server_forced: str = "",
) -> tuple[str, str]:
    """(the transport to use, a note on what was passed over and why). Pure.

    The first name in PREFERENCE that both sides offer as available and can use together
    (shm also needs one host) is chosen. A side that forces a transport makes it the only
    candidate; HandshakeError, naming both sides' reasons, when the other side lacks it.
    """
    if client_forced and server_forced and client_forced != server_forced:
        raise HandshakeError(
            f"the client forces transport {client_forced!r} but the server forces "
            f"{server_forced!r}; force the same one on both, or use auto on one side"
        )
    forced = client_forced or server_forced
    candidates = (forced,) if forced else PREFERENCE
    mine = {o.name: o for o in client}
    theirs = {o.name: o for o in server}
    passed: list[str] = []
    for name in candidates:
        reason = _why_not(name, mine.get(name), theirs.get(name))
        if not reason:
            return name, "; ".join(passed)
        passed.append(f"{name}: {reason}")
    who = "the client" if client_forced else "the server"
    raise HandshakeError(
        f"{who} forces transport {forced!r}, which cannot be used between these peers "
        f"({'; '.join(passed)}); use --transport auto (or another transport), or run both "
        "where it is available"
    )


def _why_not(name: str, client: pb.TransportOffer | None, server: pb.TransportOffer | None
             ) -> str:
    if name == "grpc":
        return ""
    if client is None or not client.available:
        return f"client lacks it ({client.reason if client else 'not offered'})"
    if server is None or not server.available:
        return f"server lacks it ({server.reason if server else 'not offered'})"
    if name == "shm" and (not client.host or client.host != server.host):
        return "client and server are on different hosts"
    return ""
