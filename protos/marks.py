"""Trailing-metadata keys a server sets on a refusal, so the client can tell what to do next
(part of the wire contract, like the messages in pstrain.proto). Each is sent with value "1".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

# A pull or push waited out its clock limit: asking again would only wait again; no retry.
CLOCK_WAIT = "pstrain-clock-wait"
# A bulk transport failed: the client retries the request over gRPC.
BULK_FAILED = "pstrain-bulk-failed"
# The worker joined before the job's last rollback: it must restart; no retry.
ROLLED_BACK = "pstrain-rolled-back"
# The server's data-call threads were all busy: nothing was done; try again after a backoff.
BUSY = "pstrain-busy"
# A Restore named a checkpoint this server cannot read or verify: roll back to another one.
CHECKPOINT_UNREADABLE = "pstrain-checkpoint-unreadable"


def marks_of(trailing_metadata: Iterable[tuple[str, Any]] | None) -> frozenset[str]:
    """The keys of a gRPC error's trailing metadata (None: none)."""
    return frozenset(k for k, _ in (trailing_metadata or ()))
