"""Admin calls from the scheduler to parameter servers, over gRPC (the wire contract only)."""

from __future__ import annotations

import grpc

from protos import pstrain_pb2 as pb

_SERVICE = "/pstrain.v1.ParameterServer/"


class ServerAdmin:
    """One channel per server address; calls block up to `timeout_s`. Not thread-safe."""

    def __init__(self, timeout_s: float = 5.0) -> None:
        self.timeout_s = timeout_s
        self._channels: dict[str, grpc.Channel] = {}

    def _channel(self, address: str) -> grpc.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = grpc.insecure_channel(address)
            self._channels[address] = channel
        return channel

    def set_membership(self, address: str, live: list[int]) -> pb.MembershipResponse:
        call = self._channel(address).unary_unary(
            _SERVICE + "SetMembership",
            request_serializer=pb.MembershipRequest.SerializeToString,
            response_deserializer=pb.MembershipResponse.FromString,
        )
        response: pb.MembershipResponse = call(
            pb.MembershipRequest(live_workers=live), timeout=self.timeout_s
        )
        return response

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
