"""Bulk transports: how large payloads travel between a worker and a server.

Control messages (headers, acks, errors) travel on gRPC; the one exception is the exchange
lane of `shm` (`lane`), which carries a training step's Exchange request and answer over a
Unix socket on one host. Bulk payloads (dense blocks, sparse keys and rows) go through the
transport chosen per peer when a client first meets a server (see `registry.select`): `shm`
(shared memory between processes on one host), `ucx` (UCX: RDMA where the host's UCX and
hardware have it, else TCP or shared memory), or `grpc` (inline in the gRPC messages; always
available).

A transport is a narrow pair of interfaces (`base.ClientChannel`, `base.ServerChannel`), a
factory, and a registry by name with lazy imports (`registry`). Both sides of the wire use
this package, so it lives beside the wire contract and imports nothing else of pstrain's.
"""

from protos.transport.base import (
    ChannelBrokenError,
    ClientChannel,
    HandshakeError,
    Region,
    ServerChannel,
    TransportError,
    TransportUnavailableError,
)
from protos.transport.registry import (
    ENV_VAR,
    NAMES,
    PREFERENCE,
    Choice,
    available,
    client_channel,
    parse_choice,
    select,
    server_channel,
)

__all__ = [
    "ENV_VAR",
    "NAMES",
    "PREFERENCE",
    "ChannelBrokenError",
    "Choice",
    "ClientChannel",
    "HandshakeError",
    "Region",
    "ServerChannel",
    "TransportError",
    "TransportUnavailableError",
    "available",
    "client_channel",
    "parse_choice",
    "select",
    "server_channel",
]
