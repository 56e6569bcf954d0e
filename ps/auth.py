"""Who may call what on a server: the rule (pure) and the gRPC interceptor that applies it.

Roles come from the caller's TLS certificate (protos/security.py). The data service
(`ParameterServer`) is for workers and the admin role; the admin service
(`ParameterServerAdmin`: membership and restore) for the admin role only; the health service
for any certificate of the job. With a job secret, every call must also carry the job's
token. Without TLS there are no certificates, so a job secret alone admits its holders to
every service: roles need TLS.

Bulk transports and request lanes carry exchanges of sessions opened by the Handshake call,
which this interceptor has already checked, so they serve the identity that opened them.
"""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from protos import rpc
from protos.security import TOKEN_KEY, Role, Security, peer_role, token_matches

log = logging.getLogger(__name__)

HEALTH_SERVICE = "grpc.health.v1.Health"
_ANY_ROLE = frozenset(Role)
# Which roles may call each service; a service not listed is refused to every role.
ALLOWED: Mapping[str, frozenset[Role]] = {
    rpc.SERVICE: frozenset({Role.WORKER, Role.ADMIN}),
    rpc.ADMIN_SERVICE: frozenset({Role.ADMIN}),
    HEALTH_SERVICE: _ANY_ROLE,
}


class Verdict(enum.Enum):
    UNAUTHENTICATED = "unauthenticated"  # who the caller is could not be established
    PERMISSION_DENIED = "permission_denied"  # known, but not allowed this call


@dataclass(frozen=True)
class Refusal:
    verdict: Verdict
    message: str


@dataclass(frozen=True)
class Caller:
    """What a call showed of its caller: the role its certificate names (None: no
    certificate, or one naming no role) and whether its token was the job's (None: the
    server has no secret, so none was asked for)."""

    role: Role | None
    token_ok: bool | None


def decide(method: str, caller: Caller, tls: bool) -> Refusal | None:
    """None when `caller` may call `method` ("/service/Name"); the refusal otherwise. Pure."""
    if caller.token_ok is False:
        return Refusal(Verdict.UNAUTHENTICATED,
                       f"{method}: the call carries no job token, or not this job's: give "
                       "the process the job's secret (--secret-file or PSTRAIN_SECRET_FILE)")
    if not tls:
        return None
    if caller.role is None:
        return Refusal(Verdict.UNAUTHENTICATED,
                       f"{method}: the client certificate names no pstrain role (its common "
                       f"name must be one of {', '.join(r.value for r in Role)}); use a "
                       "certificate made by pstrain certs for the job")
    service = method.split("/")[1] if method.count("/") == 2 else method
    allowed = ALLOWED.get(service, frozenset())
    if caller.role not in allowed:
        who = ", ".join(sorted(r.value for r in allowed)) or "no role"
        return Refusal(Verdict.PERMISSION_DENIED,
                       f"{method}: the {caller.role.value} role may not call {service} "
                       f"(allowed: {who})")
    return None


# A refused caller may call again at once: its refusals are logged at most this often.
LOG_EVERY_S = 10.0


class _Throttled:
    """A warning logged at most once per `every_s`, saying how many were left out. Thread-safe."""

    def __init__(self, every_s: float, clock: Callable[[], float]) -> None:
        self._every_s = every_s
        self._clock = clock
        # Guards _next_s and _left_out.
        self._lock = threading.Lock()
        self._next_s = -math.inf
        self._left_out = 0

    def warning(self, message: str, *args: Any) -> None:
        with self._lock:
            now = self._clock()
            if now < self._next_s:
                self._left_out += 1
                return
            left_out, self._left_out = self._left_out, 0
            self._next_s = now + self._every_s
        if left_out:
            message += " (and %d more refusals in the last %.0f s)"
            args = (*args, left_out, self._every_s)
        log.warning(message, *args)


_CODES = {Verdict.UNAUTHENTICATED: grpc.StatusCode.UNAUTHENTICATED,
          Verdict.PERMISSION_DENIED: grpc.StatusCode.PERMISSION_DENIED}
_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


class Gatekeeper(grpc.ServerInterceptor):  # type: ignore[misc]  # grpc ships no stubs
    """Applies `decide` to every call before its handler runs. Thread-safe."""

    def __init__(self, security: Security, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self._tls = security.tls
        self._token = security.token()
        self._log = _Throttled(LOG_EVERY_S, clock)

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method = str(details.method)
        token_ok: bool | None = None
        if self._token:
            presented = next((str(value) for key, value in details.invocation_metadata
                              if key == TOKEN_KEY), "")
            token_ok = token_matches(presented, self._token)
        kind = next(k for k in _KINDS if getattr(handler, k) is not None)
        behaviour = getattr(handler, kind)
        tls = self._tls

        # The certificate is only readable from the call's context, so the check runs as
        # the first step of the handler, before the request is read.
        def checked(request: Any, context: grpc.ServicerContext) -> Any:
            role = peer_role(context.auth_context()) if tls else None
            refusal = decide(method, Caller(role, token_ok), tls)
            if refusal is not None:
                self._log.warning("refused %s from %s: %s", method, context.peer(),
                                  refusal.message)
                context.abort(_CODES[refusal.verdict], refusal.message)
            return behaviour(request, context)

        return handler._replace(**{kind: checked})
