"""The ucx transport's two sides in one process, talking through real UCX workers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from procs import run_in_threads

from protos import pstrain_pb2 as pb
from protos.transport import ChannelBrokenError, TransportUnavailableError, available

REPO = Path(__file__).resolve().parents[2]
UCX_OK, UCX_WHY = available("ucx")
pytestmark = pytest.mark.skipif(not UCX_OK, reason=f"ucx is not available here: {UCX_WHY}")

if UCX_OK:
    from protos.transport import ucx


def test_rdma_lane_names() -> None:
    assert [ucx.is_rdma(n) for n in ("rc_mlx5/mlx5_0:1", "dc_mlx5/mlx5_0:1", "ud_verbs/mlx5_1:1",
                                 "rc_verbs/mlx5_0:1", "tcp/eth0", "posix/memory",
                                 "sysv/memory", "cma/memory", "self/memory")] == [
        True, True, True, True, False, False, False, False, False]


@pytest.fixture(params=[("tcp", "tcp/"), ("posix,self", "posix/")], ids=["tcp", "shm"])
def pair(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
         ) -> Iterator[tuple[ucx.Client, ucx.Server, int]]:
    """A client and a server with one session, over the UCX transports UCX_TLS names."""
    tls, lane = request.param
    monkeypatch.setenv("UCX_TLS", tls)
    server = ucx.Server()
    client = ucx.Client(capacity_bytes=64 << 20)
    try:
        session = server.accept(pb.HandshakeRequest(worker=3), client.offer())
        client.connect(session, server.offer(), timeout_s=10)
        # Both ends run over what UCX_TLS allows, and say so.
        assert client.lanes(session) and all(n.startswith(lane) for n in client.lanes(session))
        assert server.lanes(session) and all(n.startswith(lane) for n in server.lanes(session))
        assert client.describe(session) == ", ".join(client.lanes(session))
        yield client, server, session
    finally:
        client.close()
        server.close()


def _pattern(n: int, seed: int) -> bytes:
    return bytes((i * 31 + seed) % 251 for i in range(min(n, 4096))) * (n // 4096 + 1)


@pytest.mark.parametrize("nbytes", [1, 100, 8192, 70_000, 3 << 20])
def test_push_and_pull_move_the_exact_bytes(pair: tuple[ucx.Client, ucx.Server, int],
                                            nbytes: int) -> None:
    client, server, session = pair
    data = _pattern(nbytes, 7)[:nbytes]
    region = client.lease(nbytes, session)
    assert region is not None
    region.view[:nbytes] = data
    ref = region.send_ref(0, nbytes)
    assert ref.length == nbytes and ref.tag
    with server.read(ref, timeout_s=10) as got:
        assert bytes(got) == data
    region.complete(10)
    region.release()

    answer = _pattern(nbytes, 11)[:nbytes]
    region = client.lease(nbytes + 16, session)
    assert region is not None
    ref = region.recv_ref(16, nbytes)

    def fill(view: memoryview) -> None:
        view[:] = answer

    server.write(ref, nbytes, fill, timeout_s=10)
    region.complete(10)
    assert bytes(region.view[16 : 16 + nbytes]) == answer
    region.release()
    assert client.held_bytes() == 0 and server.held_bytes() == 0


def test_empty_refs_move_nothing(pair: tuple[ucx.Client, ucx.Server, int]) -> None:
    client, server, session = pair
    region = client.lease(0, session)
    assert region is not None
    send, recv = region.send_ref(0, 0), region.recv_ref(0, 0)
    with server.read(send, timeout_s=1) as got:
        assert got.nbytes == 0
    calls: list[int] = []
    server.write(recv, 0, lambda view: calls.append(view.nbytes), timeout_s=1)
    region.complete(1)
    region.release()
    assert calls == [0]


def test_requests_from_many_threads_do_not_mix(pair: tuple[ucx.Client, ucx.Server, int]
                                               ) -> None:
    client, server, session = pair

    def run(seed: int) -> None:
        for i in range(15):
            nbytes = (100, 20_000, 600_000)[(seed + i) % 3]
            data = _pattern(nbytes, seed * 100 + i)[:nbytes]
            region = client.lease(2 * nbytes, session)
            assert region is not None
            region.view[:nbytes] = data
            push, pull = region.send_ref(0, nbytes), region.recv_ref(nbytes, nbytes)
            with server.read(push, timeout_s=10) as got:
                echoed = bytes(got)

            def fill(view: memoryview, echoed: bytes = echoed) -> None:
                view[:] = echoed

            server.write(pull, nbytes, fill, timeout_s=10)
            region.complete(10)
            assert bytes(region.view[nbytes : 2 * nbytes]) == data
            region.release()

    run_in_threads(run, 4)


def test_an_unanswered_receive_is_settled_by_abort(pair: tuple[ucx.Client, ucx.Server, int]
                                                   ) -> None:
    client, _, session = pair
    region = client.lease(1 << 20, session)
    assert region is not None
    region.recv_ref(0, 1 << 20)
    with pytest.raises(ChannelBrokenError, match="did not finish within"):
        region.complete(0.2)
    region.abort()
    region.release()
    # The receive completed on this side's own message, so the buffer is reusable.
    deadline = time.monotonic() + 5
    while client.held_bytes() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert client.held_bytes() == 0


def test_a_payload_that_never_comes_breaks_the_channel_in_time(
    pair: tuple[ucx.Client, ucx.Server, int],
) -> None:
    _, server, session = pair
    ref = pb.BulkRef(session=session, length=50_000, tag=12345)
    start = time.monotonic()
    with pytest.raises(ChannelBrokenError, match="did not finish within"), \
            server.read(ref, timeout_s=0.3):
        pass
    assert time.monotonic() - start < 3
    assert server.held_bytes() == 0


def test_a_session_the_server_ended_breaks_the_next_request(
    pair: tuple[ucx.Client, ucx.Server, int],
) -> None:
    client, server, session = pair
    server.end(session)
    region = client.lease(100_000, session)
    assert region is not None
    ref = region.send_ref(0, 100_000)
    with pytest.raises(ChannelBrokenError, match="unknown ucx session"), \
            server.read(ref, timeout_s=1):
        pass
    region.abort()
    # The server took the refused payload and dropped it, so the client's send ended.
    region.complete(5)
    region.release()
    assert client.held_bytes() == 0
    client.end(session)
    assert client.lease(10, session) is None  # no endpoint any more: inline


def test_a_send_nobody_takes_is_never_reused_nor_blocks_exit(tmp_path: Path) -> None:
    # ucxx cannot cancel a send, and its worker destructor waits for it forever: the buffer
    # must stay set aside, and closing must not destroy that worker.
    script = tmp_path / "orphan.py"
    script.write_text(textwrap.dedent("""
        import logging, sys
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
        from protos import pstrain_pb2 as pb
        from protos.transport import ucx
        server, client = ucx.Server(), ucx.Client(capacity_bytes=1 << 20)
        session = server.accept(pb.HandshakeRequest(worker=1), client.offer())
        client.connect(session, server.offer(), timeout_s=10)
        region = client.lease(300_000, session)
        held = region._buffer
        region.send_ref(0, 300_000)  # the server never reads this ref
        region.abort()
        region.release()
        assert client.held_bytes() == held.size, client.held_bytes()
        again = client.lease(300_000, session)
        assert again is not None and again._buffer is not held
        again.release()
        client.close()
        server.close()
        print("closed", flush=True)
    """))
    done = subprocess.run([sys.executable, str(script)], check=False, cwd=REPO,
                          capture_output=True,
                          text=True, timeout=60, env={**os.environ, "UCX_TLS": "tcp"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "closed" in done.stdout
    assert "transfers that never ended are left; keeping this UCX worker" in done.stdout


def test_an_answer_larger_than_the_receive_is_refused(
    pair: tuple[ucx.Client, ucx.Server, int],
) -> None:
    client, server, session = pair
    region = client.lease(1000, session)
    assert region is not None
    ref = region.recv_ref(0, 1000)
    with pytest.raises(ChannelBrokenError, match="do not fit"):
        server.write(ref, 1001, lambda view: None, timeout_s=1)
    region.abort()
    region.release()


def test_a_bad_ucx_tls_makes_the_transport_unavailable(monkeypatch: pytest.MonkeyPatch
                                                       ) -> None:
    monkeypatch.setenv("UCX_TLS", "no_such_transport")
    with pytest.raises(TransportUnavailableError, match="UCX_TLS"):
        ucx.Client()
