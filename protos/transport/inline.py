"""The `grpc` transport: bulk payloads travel inline in the gRPC messages.

It has no regions: a client leases none (the caller sends chunks as it always did) and a
server is never asked to read or write one. It is always available.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

from protos import pstrain_pb2 as pb
from protos.transport.base import ChannelBrokenError, LaneCheck, Region


def probe() -> tuple[bool, str]:
    return True, ""


class Client:
    """Client side of inline gRPC: nothing to set up. Thread-safe."""

    name = "grpc"

    def offer(self) -> pb.TransportOffer:
        return pb.TransportOffer(name=self.name, available=True)

    def token(self) -> str:
        return ""

    def connect(self, session: int, peer: pb.TransportOffer, timeout_s: float) -> None:
        return None

    def lease(self, nbytes: int, session: int) -> Region | None:
        return None

    def describe(self, session: int) -> str:
        return ""

    def end(self, session: int) -> None:
        return None

    def close(self) -> None:
        return None


class Server:
    """Server side of inline gRPC: sessions are not tracked. Thread-safe."""

    name = "grpc"

    def offer(self) -> pb.TransportOffer:
        return pb.TransportOffer(name=self.name, available=True)

    def accept(self, request: pb.HandshakeRequest, peer: pb.TransportOffer) -> int:
        return 0

    def read(self, ref: pb.BulkRef, timeout_s: float) -> AbstractContextManager[memoryview]:
        raise ChannelBrokenError("this session uses inline gRPC; it has no bulk regions")

    def write(self, ref: pb.BulkRef, nbytes: int, fill: Callable[[memoryview], None],
              timeout_s: float) -> None:
        raise ChannelBrokenError("this session uses inline gRPC; it has no bulk regions")

    def lane_check(self) -> LaneCheck | None:
        return None

    def declines(self, session: int) -> str:
        return ""

    def discard(self, ref: pb.BulkRef) -> None:
        return None

    def end(self, session: int) -> None:
        return None

    def close(self) -> None:
        return None
