"""protos/rpc.py: the one table of RPC methods agrees with the proto's service descriptor."""

from __future__ import annotations

import grpc
import pytest

from protos import pstrain_pb2 as pb
from protos import rpc


def test_every_method_of_the_service_has_exactly_one_entry() -> None:
    service = pb.DESCRIPTOR.services_by_name["ParameterServer"]
    assert sorted(m.name for m in rpc.METHODS) == sorted(m.name for m in service.methods)
    constants = [v for k, v in vars(rpc).items() if k.isupper() and isinstance(v, rpc.Rpc)]
    assert sorted(c.name for c in constants) == sorted(m.name for m in rpc.METHODS)


@pytest.mark.parametrize("method", rpc.METHODS, ids=lambda m: m.name)
def test_each_entry_has_the_descriptors_shape_and_messages(method: rpc.Rpc[object, object]
                                                           ) -> None:
    declared = pb.DESCRIPTOR.services_by_name["ParameterServer"].methods_by_name[method.name]
    assert method.path == f"/pstrain.v1.ParameterServer/{method.name}"
    assert (method.streams_in, method.streams_out) == (declared.client_streaming,
                                                       declared.server_streaming)
    assert method.request.DESCRIPTOR.full_name == declared.input_type.full_name
    assert method.response.DESCRIPTOR.full_name == declared.output_type.full_name


@pytest.mark.parametrize(
    ("name", "request_type", "response_type", "match"),
    [
        ("NoSuchMethod", pb.JoinRequest, pb.JoinResponse, "has no method 'NoSuchMethod'"),
        ("Join", pb.StatsRequest, pb.JoinResponse, "takes and returns"),
        ("Join", pb.JoinRequest, pb.StatsResponse, "takes and returns"),
    ],
)
def test_an_entry_that_disagrees_with_the_proto_is_refused(
    name: str, request_type: type, response_type: type, match: str
) -> None:
    with pytest.raises(ImportError, match=match):
        rpc._rpc(name, request_type, response_type)


def test_a_call_of_the_wrong_shape_is_refused_before_it_is_sent() -> None:
    with grpc.insecure_channel("127.0.0.1:1") as channel:
        stubs = rpc.Stubs(channel)
        with pytest.raises(TypeError, match="Exchange is a unary_unary call"):
            stubs.stream(rpc.EXCHANGE, iter([b""]), 0.1)
        with pytest.raises(TypeError, match="ExchangeStream is a stream_stream call"):
            stubs.unary(rpc.EXCHANGE_STREAM, b"", 0.1)
