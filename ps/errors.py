"""Errors raised by the server's domain objects.

One base class, one subclass per cause. The servicer maps each subclass to one gRPC status
code; nothing below the servicer knows about gRPC.
"""

from __future__ import annotations

import errno


class PSError(Exception):
    """Base of every error the parameter server reports to a client."""


class InvalidArgumentError(PSError):
    """The request is malformed: wrong dtype, shape, dim, key encoding, or a non-finite gradient."""


class NotFoundError(PSError):
    """The request names a table this shard does not hold."""


class FailedPreconditionError(PSError):
    """The request is well formed but the server's state forbids it (stale incarnation...)."""


class RolledBackError(FailedPreconditionError):
    """The worker joined before the job's last rollback: its progress past the checkpoint is
    void, so it must restart and rejoin (the servicer marks the answer for the client)."""


class FencedError(RolledBackError):
    """The worker's incarnation was declared dead: it may never take part again as itself (a
    sync job has gone on without it). Marked like a rollback, so the process exits to be
    restarted, and its new incarnation joins at the open clock."""


class PermissionDeniedError(PSError):
    """The caller is known but may not make this request (a worker acting as another rank)."""


class ResourceExhaustedError(PSError):
    """The request is over a size limit, or its client over its limit of calls."""


class ServerBusyError(ResourceExhaustedError):
    """Every handler thread that data calls may take is busy. Nothing was done; the client
    tries again after a backoff (the servicer marks the answer for it)."""


class DeadlineExceededError(PSError):
    """A wait inside the server outlasted its deadline."""


class ClockWaitTimeoutError(DeadlineExceededError):
    """A pull or push waited out its limit for other workers' clocks. Asking again would only
    wait again, so clients do not retry it (the servicer marks it for them)."""


class StreamEndedError(PSError):
    """A streamed request ended before all of it arrived; nothing of it was applied."""


class CallEndedError(PSError):
    """The caller ended its call (cancelled, past its deadline, gone) while the server waited
    for the clocks on its behalf; nothing of the wait's request was applied after that."""


def out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` is the OS refusing memory: MemoryError, an OSError with ENOMEM (a
    mapping), or torch's CPU allocator failing (a RuntimeError that says so). Pure."""
    if isinstance(exc, MemoryError):
        return True
    if isinstance(exc, OSError):
        return exc.errno == errno.ENOMEM
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)
