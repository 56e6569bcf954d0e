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

    def restore(
        self, address: str, checkpoint_id: str, path: str, sha256: str, generation: int
    ) -> int:
        """Has the server at `address` load its file of a checkpoint; returns its clock."""
        call = self._channel(address).unary_unary(
            _SERVICE + "Restore",
            request_serializer=pb.RestoreRequest.SerializeToString,
            response_deserializer=pb.RestoreResponse.FromString,
        )
        response: pb.RestoreResponse = call(
            pb.RestoreRequest(checkpoint_id=checkpoint_id, path=path, sha256=sha256,
                              generation=generation),
            timeout=max(self.timeout_s, 300.0),  # a large shard takes a while to read
        )
        return int(response.clock)

    def close(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()
