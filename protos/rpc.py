"""The RPC surface of the wire contract: one typed table, checked against the proto.

Each method of the `ParameterServer` (data) and `ParameterServerAdmin` services is one `Rpc`
constant below. Its service, path, streaming shape and message classes come from the service
descriptors in `pstrain_pb2`; the constant adds only the static types. Importing this module
fails when the two disagree (a method renamed, retyped or missing), and
`tests/protos/test_rpc.py` fails when the proto has a method with no constant here. The
worker's stubs (`Stubs`), the server's handlers (`Rpc.handler`) and the admin calls are all
made from these constants, so the method list is written once.

Requests travel as bytes the caller encoded (the codec appends bulk fields without a
copy); answers come back as `codec.Frame`s whose bulk fields are views of the received
buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Generic, NoReturn, Protocol, TypeVar

import grpc
from google.protobuf.message import Message

from protos import frames as codec
from protos import pstrain_pb2 as pb
from protos.frames import Frame, WireError

Req = TypeVar("Req", bound=Message)
Resp = TypeVar("Resp", bound=Message)

SERVICE: str = pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name
# Membership and restore: only the admin role may call this service when roles are on.
ADMIN_SERVICE: str = pb.DESCRIPTOR.services_by_name["ParameterServerAdmin"].full_name
SERVICES: tuple[str, ...] = (SERVICE, ADMIN_SERVICE)


@dataclass(frozen=True)
class Rpc(Generic[Req, Resp]):
    """One method of the service. Immutable; thread-safe."""

    service: str  # its full name, e.g. "pstrain.v1.ParameterServer"
    name: str
    request: type[Req]
    response: type[Resp]
    streams_in: bool  # the client sends a stream of requests
    streams_out: bool  # the server answers with a stream

    @property
    def path(self) -> str:
        return f"/{self.service}/{self.name}"

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

    def handler(self, behaviour: Callable[..., Any],
                refuse: Callable[[Any, WireError], NoReturn]) -> grpc.RpcMethodHandler:
        """A server handler running `behaviour` with each request decoded to a Frame (the
        behaviour returns encoded answers). A request that does not decode goes to
        `refuse(context, error)`, whose message names this method; a streamed part that
        does not decode raises that WireError inside the behaviour's iterator instead.
        (gRPC's own deserializer hook would answer INTERNAL and log a traceback per call.)"""
        request, name = self.request, self.name

        def decode(data: bytes) -> Frame[Any]:
            try:
                return codec.decode(request, data)
            except WireError as exc:
                raise WireError(f"{name}: the request is not a valid {request.__name__} "
                                f"({exc})") from exc

        def run(data: Any, context: Any) -> Any:
            if self.streams_in:
                return behaviour((decode(part) for part in data), context)
            try:
                frame = decode(data)
            except WireError as exc:
                refuse(context, exc)
            return behaviour(frame, context)

        factory = getattr(grpc, f"{self.shape}_rpc_method_handler")
        handler: grpc.RpcMethodHandler = factory(run)
        return handler


def _rpc(name: str, request: type[Req], response: type[Resp],
         service: str = SERVICE) -> Rpc[Req, Resp]:
    descriptor = pb.DESCRIPTOR.services_by_name[service.rpartition(".")[2]]
    method = descriptor.methods_by_name.get(name)
    if method is None:
        raise ImportError(f"the proto's {service} has no method {name!r}")
    declared = (method.input_type.full_name, method.output_type.full_name)
    given = (request.DESCRIPTOR.full_name, response.DESCRIPTOR.full_name)
    if declared != given:
        raise ImportError(f"{service}.{name} takes and returns {declared}, not {given}")
    return Rpc(service, name, request, response, method.client_streaming,
               method.server_streaming)


GET_SERVER_INFO = _rpc("GetServerInfo", pb.ServerInfoRequest, pb.ServerInfo)
DECLARE_TABLES = _rpc("DeclareTables", pb.DeclareTablesRequest, pb.DeclareTablesResponse)
GET_STATS = _rpc("GetStats", pb.StatsRequest, pb.StatsResponse)
JOIN = _rpc("Join", pb.JoinRequest, pb.JoinResponse)
SET_MEMBERSHIP = _rpc("SetMembership", pb.MembershipRequest, pb.MembershipResponse,
                      ADMIN_SERVICE)
RESTORE = _rpc("Restore", pb.RestoreRequest, pb.RestoreResponse, ADMIN_SERVICE)
HANDSHAKE = _rpc("Handshake", pb.HandshakeRequest, pb.HandshakeResponse)
EXCHANGE = _rpc("Exchange", pb.ExchangeRequest, pb.ExchangeResponse)
EXCHANGE_STREAM = _rpc("ExchangeStream", pb.ExchangePart, pb.ExchangeAnswerPart)

METHODS: tuple[Rpc[Any, Any], ...] = (
    GET_SERVER_INFO, DECLARE_TABLES, GET_STATS, JOIN, SET_MEMBERSHIP, RESTORE, HANDSHAKE,
    EXCHANGE, EXCHANGE_STREAM,
)


class Stubs:
    """Every method of both services bound to one channel, with typed calls.

    Each call blocks until the answer (or, for `stream_out`, each answer) arrives or
    `timeout` seconds pass, and raises grpc.RpcError on failure. `metadata` goes with every
    call (the caller's job token, when the job has a secret). Thread-safe, as gRPC's
    multi-callables are.
    """

    def __init__(self, channel: grpc.Channel,
                 metadata: tuple[tuple[str, str], ...] = ()) -> None:
        self._bound = {rpc.name: rpc.bind(channel) for rpc in METHODS}
        self._metadata = metadata or None

    def _method(self, rpc: Rpc[Any, Any], streams_in: bool, streams_out: bool) -> Any:
        if (rpc.streams_in, rpc.streams_out) != (streams_in, streams_out):
            raise TypeError(f"{rpc.name} is a {rpc.shape} call")
        return self._bound[rpc.name]

    def unary(self, rpc: Rpc[Any, Resp], request: bytes, timeout: float,
              **options: Any) -> Frame[Resp]:
        """One request, one answer. `options` go to gRPC (e.g. wait_for_ready)."""
        frame: Frame[Resp] = self._method(rpc, False, False)(
            request, timeout=timeout, metadata=self._metadata, **options)
        return frame

    def stream(self, rpc: Rpc[Any, Resp], requests: Iterator[bytes],
               timeout: float) -> StreamCall[Resp]:
        """A stream of requests, a stream of answers. The call can be cancelled."""
        call: StreamCall[Resp] = self._method(rpc, True, True)(requests, timeout=timeout,
                                                              metadata=self._metadata)
        return call


class StreamCall(Protocol[Resp]):
    """A streamed call in flight: its answers, in order, and a way to abandon it."""

    def __iter__(self) -> Iterator[Frame[Resp]]: ...

    def __next__(self) -> Frame[Resp]: ...

    def cancel(self) -> bool: ...
