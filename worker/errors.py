"""Errors raised on the worker side."""

from __future__ import annotations

import grpc


class PSClientError(Exception):
    """Base of every error PSClient raises."""


class RemoteError(PSClientError):
    """A server refused or failed a request; `code` is its gRPC status, the text its reason."""

    def __init__(self, code: grpc.StatusCode, message: str, shard: int, address: str) -> None:
        super().__init__(f"shard {shard} ({address}) answered {code.name}: {message}")
        self.code = code
        self.details = message
        self.shard = shard
        self.address = address


class RolledBackError(RemoteError):
    """The job rolled back to a checkpoint after this process joined (its progress past the
    checkpoint is void), or the scheduler declared this incarnation dead (the job went on
    without it): it must restart and rejoin as a new incarnation. Never retried."""


class ClusterMismatchError(PSClientError):
    """The servers reached are not the shards the client expects (wrong order or count)."""


class UnknownTableError(PSClientError):
    """The client was asked to use a table it has not declared."""


class PSModuleError(PSClientError):
    """A PS module or PSOptimizer was built or used in a way it cannot work (message says why)."""


class FinishTimeoutError(PSClientError):
    """`ctx.finish()` ran out of time before every server had taken the worker out of the
    job's live set (is the job's scheduler running?)."""


class BarrierTimeoutError(PSClientError):
    """`ctx.barrier()` ran out of time; the message names the workers that had not come."""
