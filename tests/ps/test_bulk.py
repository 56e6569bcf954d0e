"""The server's handshake (ps.bulk.BulkEndpoint) with real transport channels."""

from __future__ import annotations

import pytest

from protos import pstrain_pb2 as pb
from protos.transport import Choice, available
from ps.bulk import BulkEndpoint

UCX_OK, UCX_WHY = available("ucx")
needs_ucx = pytest.mark.skipif(not UCX_OK, reason=f"ucx is not available here: {UCX_WHY}")
if UCX_OK:
    from protos.transport import ucx


def request_from(client: ucx.Client, forced: str = "") -> pb.HandshakeRequest:
    """A client on another host (no shm in common) that has UCX."""
    return pb.HandshakeRequest(worker=4, forced=forced, offers=[
        pb.TransportOffer(name="shm", available=False, reason="not offered in this test"),
        client.offer(),
        pb.TransportOffer(name="grpc", available=True),
    ])


@needs_ucx
@pytest.mark.parametrize(("server", "client_forced", "chosen"), [
    ("auto", "", "grpc"),   # UCX over TCP only: auto keeps gRPC, saying why
    ("auto", "ucx", "ucx"),  # a worker forcing ucx gets it over TCP anyway
    ("ucx", "", "ucx"),      # so does a server forcing it
])
def test_auto_takes_ucx_only_where_it_beats_grpc(monkeypatch: pytest.MonkeyPatch, server: str,
                                       client_forced: str, chosen: str) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp")
    endpoint = BulkEndpoint(Choice(server), shard=0)
    client = ucx.Client()
    try:
        answer = endpoint.handshake(request_from(client, client_forced))
        assert answer.transport == chosen
        if chosen == "grpc":
            assert "UCX would run over tcp/" in answer.note
            assert "only, no faster than gRPC" in answer.note
            assert "force --transport ucx" in answer.note
            channel = endpoint.channel("ucx")
            assert isinstance(channel, ucx.Server) and channel.sessions() == 0
        else:
            assert answer.session
    finally:
        client.close()
        endpoint.close()


@needs_ucx
def test_auto_decline_rule() -> None:
    for lanes in (["rc_mlx5/mlx5_0:1"], ["tcp/eth0", "rc_verbs/mlx5_0:1"], ["posix/memory"]):
        assert ucx.auto_declines(lanes) == "", lanes
    for lanes in (["tcp/eth0"], ["tcp/eth0", "tcp/ib0"], []):
        assert "no faster than gRPC" in ucx.auto_declines(lanes), lanes
