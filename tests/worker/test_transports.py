"""Bulk transports between real processes: choice per peer, errors, cleanup and fallback."""

from __future__ import annotations

import logging
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from procs import REPO, Procs, wait_ready, wait_until

from protos import pstrain_pb2 as pb
from protos.transport import available
from worker.bulk import TransportChoiceError
from worker.client import PSClient
from worker.errors import PSClientError

UCX_OK, UCX_WHY = available("ucx")
if UCX_OK:
    from protos.transport import ucx
needs_ucx = pytest.mark.skipif(not UCX_OK, reason=f"ucx is not available here: {UCX_WHY}")
# The transports a bulk channel can break on: (transport, UCX_TLS or "").
BREAKABLE = [
    pytest.param(("shm", ""), id="shm"),
    pytest.param(("ucx", "tcp"), id="ucx-tcp", marks=needs_ucx),
    pytest.param(("ucx", "posix,self"), id="ucx-shm", marks=needs_ucx),
]


def shm_names() -> set[str]:
    """Shared-memory segments named in /dev/shm. POSIX semaphores (`sem.*`, which Python's
    multiprocessing in unrelated programs on a shared machine creates and removes) are not
    segments, and pstrain creates none, so they are left out."""
    if not os.path.isdir("/dev/shm"):
        return set()
    return {n for n in os.listdir("/dev/shm") if not n.startswith("sem.")}


def memfd_maps(pid: int) -> list[str]:
    """The pstrain segments process `pid` has mapped now."""
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return []
    return [line for line in text.splitlines() if "/memfd:pstrain-" in line]


def test_forced_but_unavailable_transport_is_a_clear_error(procs: Procs, tmp_path: Path
                                                           ) -> None:
    # Processes that cannot load UCX (here or not: a stub makes importing ucxx fail).
    env = without_ucx(tmp_path)
    server = procs.server()
    client = procs.spawn([sys.executable, "-c", textwrap.dedent(f"""
        from worker.bulk import TransportChoiceError
        from worker.client import PSClient
        try:
            PSClient([{server.address!r}], transport="ucx")
        except TransportChoiceError as exc:
            print("refused:", exc)
    """)], "client-no-ucx", env)
    assert client.popen.wait(timeout=60) == 0, client.log()
    assert "refused: transport 'ucx' is forced" in client.log()
    assert "no UCX on this host (test stub)" in client.log()
    # A server forced to a transport it lacks refuses to start, naming it.
    bad = procs.spawn([sys.executable, "-m", "ps", "--bind", "127.0.0.1:0", "--transport",
                       "ucx"], "server-ucx", env)
    assert bad.popen.wait(timeout=60) == 2
    assert "--transport ucx is forced but not available on this server" in bad.log()
    assert "no UCX on this host (test stub)" in bad.log()


def test_unknown_transport_name_is_refused(procs: Procs) -> None:
    server = procs.server()
    with pytest.raises(PSClientError, match="unknown transport 'rdma'"):
        PSClient([server.address], transport="rdma")
    bad = procs.spawn([sys.executable, "-m", "ps", "--bind", "127.0.0.1:0", "--transport",
                       "rdma"], "server-rdma")
    assert bad.popen.wait(timeout=60) == 2
    assert "unknown transport 'rdma'" in bad.log()


def test_client_forcing_what_the_server_does_not_offer_is_refused(procs: Procs) -> None:
    server = procs.server(extra=["--transport", "grpc"])
    with pytest.raises(TransportChoiceError) as err:
        PSClient([server.address], transport="shm")
    text = str(err.value)
    assert "the client forces transport 'shm' but the server forces 'grpc'" in text


def test_mixed_capabilities_degrade_per_peer(procs: Procs) -> None:
    # Shard 0 offers only gRPC (as a server without shared memory would), shard 1 all.
    servers = [procs.server(0, 2, extra=["--transport", "grpc"]), procs.server(1, 2)]
    with PSClient([s.address for s in servers], worker=0, transport="auto") as client:
        assert client.transports() == ["grpc", "shm"]
        client.declare_dense("w", (1000, 64), optimizer="sgd", lr=1.0, init=("uniform", -1, 1))
        client.declare_sparse("e", 8, optimizer="sgd", lr=1.0, seed=2)
        keys = np.arange(2000, dtype=np.int64)
        w0, e0 = client.pull_dense("w"), client.pull_sparse("e", keys)
        g, ge = torch.randn(1000, 64), torch.randn(2000, 8)
        for _ in range(3):
            client.push_dense("w", g)
            client.push_sparse("e", keys, ge)
        torch.testing.assert_close(client.pull_dense("w"), w0 - 3 * g, atol=1e-5, rtol=0)
        torch.testing.assert_close(client.pull_sparse("e", keys), e0 - 3 * ge, atol=1e-5,
                                   rtol=0)
        stats = client.stats()
        assert stats[0].bytes_received > 0 and stats[1].bytes_received > 0
    # A client that forces gRPC gets it from a server offering more.
    with PSClient([s.address for s in servers], worker=1, transport="grpc") as client:
        assert client.transports() == ["grpc", "grpc"]


def without_ucx(tmp_path: Path) -> dict[str, str]:
    """The environment of a process on a host without UCX: importing ucxx fails there."""
    stub = tmp_path / "no-ucx" / "ucxx"
    stub.mkdir(parents=True)
    (stub / "__init__.py").write_text('raise ImportError("no UCX on this host (test stub)")\n')
    return {"PYTHONPATH": os.pathsep.join([str(stub.parent), str(REPO)])}


@needs_ucx
def test_peer_without_ucx_talks_to_one_with_it(procs: Procs, tmp_path: Path) -> None:
    env = without_ucx(tmp_path)
    # A server without UCX: it says why, a worker forcing ucx is told so, auto works.
    ready = tmp_path / "plain.ready"
    plain = procs.spawn([sys.executable, "-m", "ps", "--bind", "127.0.0.1:0",
                         "--ready-file", str(ready)], "server-no-ucx", env)
    plain.address = str(wait_ready(plain, ready, 60)["address"])
    assert "transport ucx not available: importing ucxx failed" in plain.log()
    with pytest.raises(TransportChoiceError, match="no UCX on this host"):
        PSClient([plain.address], worker=0, transport="ucx")
    with PSClient([plain.address], worker=0) as client:
        assert client.transports() == ["shm"]
        client.declare_dense("b", (4,), optimizer="sgd", lr=1.0, init=("zeros", 0, 0))
        client.push_dense("b", torch.ones(4))
        torch.testing.assert_close(client.pull_dense("b"), -torch.ones(4))
    # A server with UCX serves a worker without it and one over UCX at the same time.
    server = procs.server()
    other = procs.spawn([sys.executable, str(REPO / "tests" / "transport_worker.py"),
                         server.address, "auto"], "worker-no-ucx", env)
    wait_until(lambda: "looping" in other.log() or other.popen.poll() is not None, 60,
               "the worker without UCX's first round trip")
    assert "['shm']" in other.log(), other.log()
    with PSClient([server.address], worker=1, transport="ucx") as client:
        assert client.transports() == ["ucx"]
        client.declare_dense("c", (256, 64), optimizer="sgd", lr=1.0, init=("zeros", 0, 0))
        for _ in range(3):
            client.push_dense("c", torch.ones(256, 64))
        torch.testing.assert_close(client.pull_dense("c"), -3 * torch.ones(256, 64))
        client.declare_dense("loop", (1024, 1024), optimizer="sgd", lr=1e-6)
        assert client.pull_dense("loop").shape == (1024, 1024)  # the other worker's table
    assert other.popen.poll() is None, other.log()
    procs.kill(other)


def test_killed_client_mid_transfer_leaves_no_segment(procs: Procs) -> None:
    before = shm_names()
    server = procs.server()
    worker = procs.spawn([sys.executable, str(REPO / "tests" / "transport_worker.py"),
                          server.address, "shm"], "transport-worker")
    wait_until(lambda: "looping" in worker.log() or worker.popen.poll() is not None, 60,
               "the worker's first round trip")
    assert "['shm']" in worker.log(), worker.log()
    wait_until(lambda: memfd_maps(server.pid), 10, "the server to map the worker's segments")
    procs.kill(worker, signal.SIGKILL)
    # The server drops the dead client's mappings by itself; nothing ever was in /dev/shm.
    wait_until(lambda: not memfd_maps(server.pid), 20,
               "the server to unmap the killed worker's segments")
    assert shm_names() - before == set()
    with PSClient([server.address], worker=6, transport="shm") as client:  # still serving
        client.declare_dense("loop", (1024, 1024), optimizer="sgd", lr=1e-6)
        assert client.pull_dense("loop").shape == (1024, 1024)


def test_killed_server_mid_transfer_leaves_no_segment(procs: Procs) -> None:
    before = shm_names()
    server = procs.server()
    worker = procs.spawn([sys.executable, str(REPO / "tests" / "transport_worker.py"),
                          server.address, "shm"], "transport-worker")
    wait_until(lambda: "looping" in worker.log() or worker.popen.poll() is not None, 60,
               "the worker's first round trip")
    assert memfd_maps(worker.pid)
    procs.kill(server, signal.SIGKILL)
    procs.kill(worker, signal.SIGKILL)
    assert shm_names() - before == set()
    assert not memfd_maps(worker.pid)


@pytest.mark.parametrize("first", ["push", "pull"])
@pytest.mark.parametrize("setup", BREAKABLE)
def test_broken_channel_falls_back_to_grpc_without_losing_or_repeating_a_push(
    procs: Procs, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
    setup: tuple[str, str], first: str,
) -> None:
    name, tls = setup
    if tls:
        monkeypatch.setenv("UCX_TLS", tls)
    server = procs.server(extra=["--transport", name])
    with PSClient([server.address], worker=0, transport=name) as client:
        client.declare_sparse("e", 16, optimizer="sgd", lr=1.0, init=("zeros", 0, 0))
        client.declare_dense("w", (256, 64), optimizer="sgd", lr=1.0, init=("zeros", 0, 0))
        keys = np.arange(500, dtype=np.int64)
        g, gw = torch.ones(500, 16), torch.ones(256, 64)
        for _ in range(3):
            client.push_sparse("e", keys, g)
            client.push_dense("w", gw)
        # The server forgets this client's session, as after losing its state: the next
        # bulk request, a push or a pull, finds its region (or endpoint) unusable.
        peer = client.links[0].peer
        channel = grpc.insecure_channel(server.address)
        end = pb.HandshakeRequest(worker=0, end_session=peer.session).SerializeToString()
        channel.unary_unary("/pstrain.v1.ParameterServer/Handshake")(end, timeout=10)
        channel.close()
        with caplog.at_level(logging.WARNING, logger="worker.bulk"):
            if first == "push":
                client.push_sparse("e", keys, g)
            else:
                torch.testing.assert_close(client.pull_dense("w"), -3 * gw, atol=0, rtol=0)
                client.push_sparse("e", keys, g)
        assert client.transports() == ["grpc"]
        assert any(f"transport {name} to shard 0 failed" in r.getMessage()
                   for r in caplog.records)
        for _ in range(2):
            client.push_sparse("e", keys, g)
            client.push_dense("w", gw)
        client.push_dense("w", gw)
        torch.testing.assert_close(client.pull_sparse("e", keys), -6 * g, atol=0, rtol=0)
        torch.testing.assert_close(client.pull_dense("w"), -6 * gw, atol=0, rtol=0)
        tables = {t.name: t for t in client.stats()[0].tables}
        assert tables["e"].pushes_applied == 6 and tables["w"].pushes_applied == 6
        assert tables["e"].pushes_duplicate == 0 and tables["w"].pushes_duplicate == 0


def _applied(client: PSClient, table: str) -> int:
    (stats,) = client.stats()
    return next(t.pushes_applied for t in stats.tables if t.name == table)


@pytest.mark.parametrize("tls", [pytest.param("tcp", id="ucx-tcp"),
                                 pytest.param("posix,self", id="ucx-shm")])
@needs_ucx
def test_killed_ucx_worker_mid_transfer_leaves_the_server_serving(
    procs: Procs, monkeypatch: pytest.MonkeyPatch, tls: str,
) -> None:
    monkeypatch.setenv("UCX_TLS", tls)
    server = procs.server(extra=["--transport", "ucx"])
    worker = procs.spawn([sys.executable, str(REPO / "tests" / "transport_worker.py"),
                          server.address, "ucx"], "transport-worker")
    wait_until(lambda: "looping" in worker.log() or worker.popen.poll() is not None, 60,
               "the worker's first round trip")
    assert "['ucx']" in worker.log(), worker.log()
    procs.kill(worker, signal.SIGKILL)
    with PSClient([server.address], worker=6, transport="ucx") as client:
        assert client.transports() == ["ucx"]
        client.declare_dense("loop", (1024, 1024), optimizer="sgd", lr=1e-6)
        before = _applied(client, "loop")
        for _ in range(3):
            assert client.pull_dense("loop").shape == (1024, 1024)
            client.push_dense("loop", torch.ones(1024, 1024))
        # Each push applied exactly once, whichever way it travelled.
        assert _applied(client, "loop") == before + 3
        if tls == "tcp":
            assert client.transports() == ["ucx"]
        else:
            # Over shared memory UCX cannot detect the dead peer, and a peer killed inside
            # a transfer can leave the server's UCX worker unable to finish the next one
            # (seen in one loaded CI run): the documented fallback to gRPC then holds.
            assert client.transports() in (["ucx"], ["grpc"])
    # The server still stops cleanly (no UCX worker left waiting on the dead peer).
    start = time.monotonic()
    procs.kill(server, signal.SIGTERM)
    assert server.popen.returncode == 0, server.log()
    assert time.monotonic() - start < 10


@pytest.mark.parametrize(("tls", "lane"), [pytest.param("tcp", "tcp/", id="ucx-tcp"),
                                           pytest.param("posix,self", "posix/", id="ucx-shm")])
@needs_ucx
def test_the_ucx_transports_in_use_are_reported(
    procs: Procs, monkeypatch: pytest.MonkeyPatch, tls: str, lane: str,
) -> None:
    monkeypatch.setenv("UCX_TLS", tls)
    server = procs.server(extra=["--transport", "ucx"])
    with PSClient([server.address], worker=0, transport="ucx") as client:
        (detail,) = client.transport_details()
        assert detail.startswith(f"ucx ({lane}"), detail
        lanes = detail[len("ucx (") : -1].split(", ")
        assert not any(ucx.is_rdma(n) for n in lanes)  # no RDMA hardware in CI
    wait_until(lambda: "runs over UCX transports" in server.log(), 10, "the server's log line")
    line = next(x for x in server.log().splitlines() if "runs over UCX transports" in x)
    assert f"transports {lane}" in line, line
