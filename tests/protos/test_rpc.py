"""protos/rpc.py: the one table of RPC methods agrees with the proto's service descriptor."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from protos import pstrain_pb2 as pb
from protos import rpc


def _declared(method: rpc.Rpc[object, object]) -> object:
    service = pb.DESCRIPTOR.services_by_name[method.service.rpartition(".")[2]]
    return service.methods_by_name[method.name]


def test_every_method_of_both_services_has_exactly_one_entry() -> None:
    declared = sorted((service.full_name, m.name)
                      for service in pb.DESCRIPTOR.services_by_name.values()
                      for m in service.methods)
    assert sorted((m.service, m.name) for m in rpc.METHODS) == declared
    assert sorted(rpc.SERVICES) == sorted(s.full_name
                                          for s in pb.DESCRIPTOR.services_by_name.values())
    constants = [v for k, v in vars(rpc).items() if k.isupper() and isinstance(v, rpc.Rpc)]
    assert sorted(c.name for c in constants) == sorted(m.name for m in rpc.METHODS)


@pytest.mark.parametrize("method", rpc.METHODS, ids=lambda m: m.name)
def test_each_entry_has_the_descriptors_shape_and_messages(method: rpc.Rpc[object, object]
                                                           ) -> None:
    declared: Any = _declared(method)
    assert method.path == f"/{method.service}/{method.name}"
    assert (method.streams_in, method.streams_out) == (declared.client_streaming,
                                                       declared.server_streaming)
    assert method.request.DESCRIPTOR.full_name == declared.input_type.full_name
    assert method.response.DESCRIPTOR.full_name == declared.output_type.full_name


@pytest.mark.parametrize(
    ("name", "request_type", "response_type", "match"),
    [
        ("NoSuchMethod", pb.JoinRequest, pb.JoinResponse, "has no method 'NoSuchMethod'"),
        ("Restore", pb.RestoreRequest, pb.RestoreResponse, "has no method 'Restore'"),
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


def test_membership_and_restore_are_the_admin_service_and_nothing_else_is() -> None:
    admin = sorted(m.name for m in rpc.METHODS if m.service == rpc.ADMIN_SERVICE)
    assert admin == ["Restore", "SetMembership"]
    assert rpc.SET_MEMBERSHIP.path == "/pstrain.v1.ParameterServerAdmin/SetMembership"
