"""The RPC surface of the wire contract: one typed table, checked against the proto.

Each method of the `ParameterServer` service is one `Rpc` constant below. Its path, its
streaming shape and its message classes come from the service descriptor in
`pstrain_pb2`; the constant adds only the static types. Importing this module fails when the
two disagree (a method renamed, retyped or missing), and `tests/protos/test_rpc.py` fails
when the proto has a method with no constant here. The worker's stubs (`Stubs`), the
server's handlers (`Rpc.handler`) and the admin calls are all made from these constants,
so the method list is written once.

Requests travel as bytes the caller encoded (the codec appends bulk fields without a
copy); answers come back as `codec.Frame`s whose bulk fields are views of the received
buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import grpc
from google.protobuf.message import Message

from protos import frames as codec
from protos import pstrain_pb2 as pb
from protos.frames import Frame

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)

_DESCRIPTOR = pb.DESCRIPTOR.services_by_name["ParameterServer"]
SERVICE: str = _DESCRIPTOR.full_name


@dataclass(frozen=True)
class Rpc(Generic[Req, Resp]):
    """One method of the service. Immutable; thread-safe."""

    name: str
    request: type[Req]
    response: type[Resp]
    streams_in: bool  # the client sends a stream of requests
    streams_out: bool  # the server answers with a stream

    @property
    def path(self) -> str:
        return f"/{SERVICE}/{self.name}"

    @property
    def shape(self) -> str:
        """gRPC's name of the call's shape: "unary_unary", "stream_unary", ..."""
        return "_".join("stream" if streams else "unary"
                        for streams in (self.streams_in, self.streams_out))

    def bind(self, channel: grpc.Channel) -> Any:
        """gRPC's multi-callable for this method on `channel`: bytes in, Frames out."""
        response = self.response
        factory = getattr(channel, self.shape)
        return factory(self.path, request_serializer=None,
                       response_deserializer=lambda data: codec.decode(response, data))

    def handler(self, behaviour: Callable[..., Any]) -> grpc.RpcMethodHandler:
        """A server handler running `behaviour` with each request decoded to a Frame (the
        behaviour returns encoded answers)."""
        request = self.request
        factory = getattr(grpc, f"{self.shape}_rpc_method_handler")
        handler: grpc.RpcMethodHandler = factory(
            behaviour, request_deserializer=lambda data: codec.decode(request, data)
        )
        return handler


def _rpc(name: str, request: type[Req], response: type[Resp]) -> Rpc[Req, Resp]:
    method = _DESCRIPTOR.methods_by_name.get(name)
    if method is None:
        raise ImportError(f"the proto's {SERVICE} has no method {name!r}")
    declared = (method.input_type.full_name, method.output_type.full_name)
    given = (request.DESCRIPTOR.full_name, response.DESCRIPTOR.full_name)
    if declared != given:
        raise ImportError(f"{SERVICE}.{name} takes and returns {declared}, not {given}")
    return Rpc(name, request, response, method.client_streaming, method.server_streaming)


GET_SERVER_INFO = _rpc("GetServerInfo", pb.ServerInfoRequest, pb.ServerInfo)
DECLARE_TABLES = _rpc("DeclareTables", pb.DeclareTablesRequest, pb.DeclareTablesResponse)
GET_STATS = _rpc("GetStats", pb.StatsRequest, pb.StatsResponse)
PULL_DENSE = _rpc("PullDense", pb.PullDenseRequest, pb.DenseChunk)
PUSH_DENSE = _rpc("PushDense", pb.PushDenseChunk, pb.PushResponse)
PULL_SPARSE = _rpc("PullSparse", pb.PullSparseRequest, pb.SparseChunk)
PUSH_SPARSE = _rpc("PushSparse", pb.PushSparseChunk, pb.PushResponse)
TICK = _rpc("Tick", pb.TickRequest, pb.TickResponse)
JOIN = _rpc("Join", pb.JoinRequest, pb.JoinResponse)
SET_MEMBERSHIP = _rpc("SetMembership", pb.MembershipRequest, pb.MembershipResponse)
RESTORE = _rpc("Restore", pb.RestoreRequest, pb.RestoreResponse)
HANDSHAKE = _rpc("Handshake", pb.HandshakeRequest, pb.HandshakeResponse)
EXCHANGE = _rpc("Exchange", pb.ExchangeRequest, pb.ExchangeResponse)

METHODS: tuple[Rpc[Any, Any], ...] = (
    GET_SERVER_INFO, DECLARE_TABLES, GET_STATS, PULL_DENSE, PUSH_DENSE, PULL_SPARSE,
    PUSH_SPARSE, TICK, JOIN, SET_MEMBERSHIP, RESTORE, HANDSHAKE, EXCHANGE,
)


class Stubs:
    """Every method of the service bound to one channel, with typed calls.

    Each call blocks until the answer (or, for `stream_out`, each answer) arrives or
    `timeout` seconds pass, and raises grpc.RpcError on failure. Thread-safe, as gRPC's
    multi-callables are.
    """

    def __init__(self, channel: grpc.Channel) -> None:
        self._bound = {rpc.name: rpc.bind(channel) for rpc in METHODS}

    def _method(self, rpc: Rpc[Any, Any], streams_in: bool, streams_out: bool) -> Any:
        if (rpc.streams_in, rpc.streams_out) != (streams_in, streams_out):
            raise TypeError(f"{rpc.name} is a {rpc.shape} call")
        return self._bound[rpc.name]

    def unary(self, rpc: Rpc[Any, Resp], request: bytes, timeout: float,
              **options: Any) -> Frame[Resp]:
        """One request, one answer. `options` go to gRPC (e.g. wait_for_ready)."""
        frame: Frame[Resp] = self._method(rpc, False, False)(request, timeout=timeout,
                                                               **options)
        return frame

    def stream_out(self, rpc: Rpc[Any, Resp], request: bytes,
                   timeout: float) -> Iterator[Frame[Resp]]:
        """One request, a stream of answers."""
        frames: Iterator[Frame[Resp]] = self._method(rpc, False, True)(request, timeout=timeout)
        return frames

    def stream_in(self, rpc: Rpc[Any, Resp], requests: Iterator[bytes],
                  timeout: float) -> Frame[Resp]:
        """A stream of requests, one answer."""
        frame: Frame[Resp] = self._method(rpc, True, False)(requests, timeout=timeout)
        return frame
