"""Request lanes (shm declares one): exchanges over a Unix socket instead of gRPC calls.

Real server processes serve the lane; the lane module's framing, refusals, deadlines,
failures, thread use and draining are also tested against an in-process LaneServer with
small handlers.
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
import torch
from procs import Procs

from protos import marks
from protos import pstrain_pb2 as pb
from protos.transport import ChannelBrokenError, available, lane
from protos.transport.lane import (
    LINGER_MAX_S,
    LINGER_MIN_S,
    LaneClient,
    LaneContext,
    LaneError,
    LaneServer,
    linger_s,
    next_gap,
)
from scheduler.admin import ServerAdmin
from worker.bulk import ENV_LANES, TransportChoiceError, TransportSettings
from worker.client import PSClient, Pull, Push
from worker.errors import RemoteError, RolledBackError
from worker.link import RECHECK_S

SHM_OK, SHM_WHY = available("shm")
pytestmark = pytest.mark.skipif(not SHM_OK, reason=f"shm is not available here: {SHM_WHY}")


def steps(client: PSClient, n: int) -> list[torch.Tensor]:
    """`n` exchanges of a sparse and a dense push, ending iterations; the last pulls."""
    keys = np.array([3, 1_000_000_007, -5, 42], dtype=np.int64)
    out: list[torch.Tensor] = []
    for step in range(n):
        g = torch.full((4, 8), float(step + 1))
        out = client.exchange([Push("e", g, keys), Push("w", torch.ones(6, 3))],
                              end_iteration=True, pulls=[Pull("e", keys), Pull("w")])
    return out


def declare(client: PSClient) -> None:
    client.declare_sparse("e", 8, optimizer="adagrad", lr=0.1)
    client.declare_dense("w", (6, 3), optimizer="sgd", lr=0.5, init=("zeros", 0, 0))


def test_exchanges_take_the_lane_and_answer_as_over_grpc(procs: Procs) -> None:
    a, b = procs.server(), procs.server()
    with PSClient([a.address], worker=0) as laned, \
            PSClient([b.address], worker=0, lanes=False) as plain:
        for client in (laned, plain):
            declare(client)
        got_lane, got_plain = steps(laned, 5), steps(plain, 5)
        lane = laned.links[0].peer.lane
        assert lane is not None and lane.calls == 5
        assert plain.links[0].peer.lane is None
        assert laned.transports() == plain.transports() == ["shm"]
    for x, y in zip(got_lane, got_plain, strict=True):
        torch.testing.assert_close(x, y, atol=0, rtol=0)
    torch.testing.assert_close(got_lane[1], torch.full((6, 3), -2.5))


def test_a_refusal_on_the_lane_is_the_rpcs_and_changes_nothing(procs: Procs) -> None:
    server = procs.server()
    with PSClient([server.address], worker=0) as client:
        declare(client)
        before = steps(client, 1)
        keys = np.array([3, 7], dtype=np.int64)
        bad = torch.ones(2, 8)
        bad[1, 5] = float("nan")
        with pytest.raises(RemoteError) as err:
            client.exchange([Push("e", bad, keys)], end_iteration=True, pulls=[Pull("w")])
        assert err.value.code.name == "INVALID_ARGUMENT"
        assert "non-finite value (nan)" in err.value.details and "'e'" in err.value.details
        lane = client.links[0].peer.lane
        assert lane is not None and lane.calls == 2
        # Nothing applied, no iteration ended; the same connection serves the next call.
        (rows,) = client.exchange(pulls=[Pull("e", [3, 1_000_000_007, -5, 42])])
        torch.testing.assert_close(rows, before[0], atol=0, rtol=0)
        assert client.stats()[0].tables[0].pushes_rejected == 1
        assert lane.calls == 3 and client.transports() == ["shm"]


def test_a_worker_from_before_a_rollback_is_told_on_the_lane(procs: Procs) -> None:
    server = procs.server()
    with PSClient([server.address], worker=0) as client:
        declare(client)
        steps(client, 1)
        told: list[int] = []
        client.on_rolled_back = lambda: told.append(1)
        admin = ServerAdmin()
        try:
            admin.restore(server.address, "", "", generation=1)
        finally:
            admin.close()
        with pytest.raises(RolledBackError) as err:
            steps(client, 1)
        assert "must restart" in err.value.details and told == [1]
        lane = client.links[0].peer.lane
        assert lane is not None and lane.calls == 2  # refused on the lane, not retried


@pytest.mark.parametrize("lanes", [True, False], ids=["lane", "grpc"])
def test_a_push_waiting_for_its_clock_is_refused_when_a_rollback_restores_the_server(
        procs: Procs, lanes: bool) -> None:
    # A sync push for a clock not open yet waits at the server; a rollback restores the
    # server under it. The push belongs to the run the rollback ended: refused at once, it
    # can never count in the new run's clock (over the lane, whose connection outlives the
    # worker's interest in it, as over gRPC).
    server = procs.server(extra=["--mode", "sync", "--workers", "2"])
    with PSClient([server.address], worker=0, lanes=lanes) as client, \
            PSClient([server.address], worker=1, lanes=lanes) as other:
        declare(client)
        declare(other)
        client.exchange([Push("w", torch.ones(6, 3))], end_iteration=True)  # clock 0
        waiting: list[BaseException] = []

        def push_at_clock_1() -> None:
            try:
                client.exchange([Push("w", torch.ones(6, 3))], end_iteration=True)
            except BaseException as exc:  # what the call ended with
                waiting.append(exc)

        thread = threading.Thread(target=push_at_clock_1, daemon=True)
        thread.start()
        thread.join(1.0)
        assert thread.is_alive(), waiting  # clock 0 is still open: worker 1 has not ended it
        admin = ServerAdmin()
        try:
            admin.restore(server.address, "", "", generation=1)
            restored = time.monotonic()
        finally:
            admin.close()
        thread.join(10.0)
        assert not thread.is_alive(), "the push still waits after the restore"
        assert time.monotonic() - restored < 5.0
        (refused,) = waiting
        assert isinstance(refused, RolledBackError), refused
        assert "restored from the empty state (generation 1)" in refused.details
        assert (client.links[0].peer.lane is not None) is lanes
    with PSClient([server.address], worker=0) as fresh:
        assert fresh.stats()[0].tables == []  # nothing of the old run came back


def zero_rows(client: PSClient) -> tuple[np.ndarray, torch.Tensor]:
    """Declares sparse table "e" (SGD at lr 1, rows from zeros); 100 keys, a gradient of 1s."""
    client.declare_sparse("e", 8, optimizer="sgd", lr=1.0, init=("zeros", 0, 0))
    return np.arange(100, dtype=np.int64), torch.ones(100, 8)


def test_a_lost_session_falls_back_to_grpc_without_repeating_a_push(
    procs: Procs, caplog: pytest.LogCaptureFixture
) -> None:
    server = procs.server()
    with PSClient([server.address], worker=0) as client:
        keys, g = zero_rows(client)
        for _ in range(2):
            client.exchange([Push("e", g, keys)])
        # The server forgets the session (as after losing its state): the next exchange
        # is refused on the lane as a failed bulk transfer and sent again over gRPC.
        peer = client.links[0].peer
        lane = peer.lane
        assert lane is not None
        channel = grpc.insecure_channel(server.address)
        end = pb.HandshakeRequest(worker=0, end_session=peer.session).SerializeToString()
        channel.unary_unary("/pstrain.v1.ParameterServer/Handshake")(end, timeout=10)
        channel.close()
        with caplog.at_level(logging.WARNING, logger="worker.bulk"):
            (rows,) = client.exchange([Push("e", g, keys)], pulls=[Pull("e", keys)])
        assert any("transport shm to shard 0 failed" in r.getMessage() for r in caplog.records)
        assert client.transports() == ["grpc"] and peer.lane is None
        torch.testing.assert_close(rows, -3 * g, atol=0, rtol=0)
        (table,) = client.stats()[0].tables
        assert table.pushes_applied == 3 and table.pushes_duplicate == 0
        # The same server process: the link asks after a while, and stays on gRPC.
        time.sleep(RECHECK_S[0] + 0.1)
        client.exchange([Push("e", g, keys)])
        assert client.transports() == ["grpc"] and client.links[0].peer is peer


def test_a_server_restarted_at_the_same_address_gets_a_new_session(
    procs: Procs, caplog: pytest.LogCaptureFixture
) -> None:
    server = procs.server()
    with PSClient([server.address], worker=0) as client:
        keys, g = zero_rows(client)
        client.exchange([Push("e", g, keys)])
        assert client.transports() == ["shm"]
        procs.kill(server)
        again = procs.server(extra=["--bind", server.address])
        assert again.address == server.address
        with caplog.at_level(logging.WARNING):
            # The lane's connection died with the process: this one goes over gRPC (and
            # declares the table again on the new process)...
            client.exchange([Push("e", g, keys)])
            assert client.transports() == ["grpc"]
            time.sleep(RECHECK_S[0] + 0.1)
            # ...and once the link has asked, the new process gets a session of its own.
            (rows,) = client.exchange([Push("e", g, keys)], pulls=[Pull("e", keys)])
        assert any("shard 0 restarted at" in r.getMessage() for r in caplog.records)
        lane = client.links[0].peer.lane
        assert client.transports() == ["shm"] and lane is not None and lane.calls == 1
        torch.testing.assert_close(rows, -2 * g, atol=0, rtol=0)
        (table,) = client.stats()[0].tables
        assert table.pushes_applied == 2 and table.pushes_duplicate == 0


def test_the_lane_refuses_strangers(procs: Procs) -> None:
    server = procs.server()
    with PSClient([server.address], worker=0) as client:
        peer = client.links[0].peer
        assert peer.lane is not None
        token = client._reach.bulk.channel("shm").token()  # type: ignore[union-attr]
        with pytest.raises(ChannelBrokenError, match="does not match"):
            LaneClient(peer.lane.address, peer.session, "0" * 24).check(5.0)
        with pytest.raises(ChannelBrokenError, match="not an open shm session"):
            LaneClient(peer.lane.address, peer.session + 1, token).check(5.0)
        # The right session and token, from another process: SO_PEERCRED tells them apart.
        other = procs.spawn([sys.executable, "-c", textwrap.dedent(f"""
            from protos.transport import ChannelBrokenError
            from protos.transport.lane import LaneClient
            try:
                LaneClient({peer.lane.address!r}, {peer.session}, {token!r}).check(5.0)
            except ChannelBrokenError as exc:
                print("refused:", exc)
        """)], "stranger")
        assert other.popen.wait(timeout=60) == 0, other.log()
        assert f"belongs to process {os.getpid()}" in other.log()
        # The worker's own lane still works.
        client.declare_dense("w", (2,), optimizer="sgd", lr=1.0)
        client.exchange([Push("w", torch.ones(2))], pulls=[Pull("w")])
        assert peer.lane.calls == 1


def test_the_lane_setting_is_read_from_the_environment_and_a_bad_one_named() -> None:
    assert TransportSettings.from_env({}) == TransportSettings("auto", True)
    assert TransportSettings.from_env({ENV_LANES: "0", "PSTRAIN_TRANSPORT": "shm"}) == \
        TransportSettings("shm", False)
    with pytest.raises(TransportChoiceError, match=f"{ENV_LANES} must be 0 or 1, got 'yes'"):
        TransportSettings.from_env({ENV_LANES: "yes"})
    with pytest.raises(TransportChoiceError, match=f"now called {ENV_LANES}.*{ENV_LANES}=0"):
        TransportSettings.from_env({"PSTRAIN_SHM_LANE": "0"})


# ---- the lane module against an in-process server -------------------------------------------


def handle(data: bytes, context: LaneContext) -> bytes:
    """Echoes reversed; b"slow" sleeps first, b"refuse" aborts, b"bug" raises, b"who"
    answers its thread's name."""
    if data == b"slow":
        time.sleep(1.0)
    if data == b"who":
        return threading.current_thread().name.encode()
    if data == b"refuse":
        context.set_trailing_metadata(((marks.CLOCK_WAIT, "1"),))
        context.abort(grpc.StatusCode.ABORTED, "waited out")
    if data == b"bug":
        raise KeyError("oops")
    return data[::-1]


@pytest.fixture
def calls() -> Iterator[ThreadPoolExecutor]:
    """The executor a server runs its calls on (two threads, as a small --grpc-threads)."""
    pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="calls")
    yield pool
    pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture
def lane_server(calls: ThreadPoolExecutor) -> Iterator[tuple[LaneServer, LaneClient]]:
    server = LaneServer(handle, lambda session, token, pid: "" if token == "t" else "no",
                        max_frame_bytes=1 << 20, run=calls, threads=2)
    client = LaneClient(server.address, 1, "t")
    try:
        yield server, client
    finally:
        client.close()
        server.close()


def test_lane_calls_answer_in_order_from_many_threads(
    lane_server: tuple[LaneServer, LaneClient]
) -> None:
    server, client = lane_server
    answers: dict[int, bytes] = {}

    def run(i: int) -> None:
        for k in range(50):
            answers[i * 100 + k] = client.call(f"{i}-{k}".encode(), 5.0)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert len(answers) == 200 and client.calls == 200
    assert all(v == f"{k // 100}-{k % 100}".encode()[::-1] for k, v in answers.items())
    assert 1 <= server.connections() <= 4  # one per call in flight, kept for the next


def test_no_call_is_left_waiting_when_answers_end_together(
    lane_server: tuple[LaneServer, LaneClient], request: pytest.FixtureRequest
) -> None:
    """Two calls at a time, in rounds: their connections go back to the watcher at nearly
    the same moment, and each must be watched again at once (a wake-up read for one must
    not hide the other's), or its call waits out its deadline while the other waits for it."""
    _, client = lane_server
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # threads interleave often, as on a loaded server
    request.addfinalizer(lambda: sys.setswitchinterval(switch))
    rounds = threading.Barrier(2)
    late: list[str] = []

    def run(i: int) -> None:
        for k in range(4000):
            try:
                client.call(b"%d" % k, 1.0)
            except LaneError as exc:
                late.append(f"call {k} of thread {i}: {exc}")
                rounds.abort()
                return
            rounds.wait(timeout=5)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not late and client.calls == 8000


def test_lane_refusals_deadlines_and_bugs(lane_server: tuple[LaneServer, LaneClient]) -> None:
    server, client = lane_server
    with pytest.raises(LaneError) as err:
        client.call(b"refuse", 5.0)
    assert err.value.code() == grpc.StatusCode.ABORTED and err.value.details() == "waited out"
    assert marks.marks_of(err.value.trailing_metadata()) == {marks.CLOCK_WAIT}
    with pytest.raises(LaneError) as err:
        client.call(b"slow", 0.2)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(LaneError) as err:
        client.call(b"bug", 5.0)
    assert err.value.code() == grpc.StatusCode.UNKNOWN and "KeyError" in err.value.details()
    assert client.call(b"abc", 5.0) == b"cba"
    with pytest.raises(ChannelBrokenError, match="refused"):
        LaneClient(server.address, 1, "wrong").check(5.0)


def test_a_call_sees_its_client_wait_and_then_hang_up(calls: ThreadPoolExecutor) -> None:
    # A handler that waits (a sync push for a later clock) ends once its client has gone,
    # not at its own limit: its thread is free, and what it would have done is not done.
    seen: list[tuple[float, bool]] = []
    ended = threading.Event()

    def wait_for_hang_up(data: bytes, context: LaneContext) -> bytes:
        start = time.monotonic()
        while context.is_active() and time.monotonic() - start < 5.0:
            seen.append((time.monotonic() - start, True))
            time.sleep(0.01)
        seen.append((time.monotonic() - start, context.is_active()))
        ended.set()
        return b""

    server = LaneServer(wait_for_hang_up, lambda session, token, pid: "", 1 << 20, calls, 2)
    client = LaneClient(server.address, 1, "t")
    try:
        with pytest.raises(LaneError) as err:
            client.call(b"x", 0.3)  # gives up: its connection closes
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert ended.wait(5.0)
        waited, active = seen[-1]
        assert not active and 0.25 <= waited < 0.3 + 1.0, seen[-1]
        assert all(a for t, a in seen[:-1]) and seen[-2][0] >= 0.2  # active while it waited
    finally:
        client.close()
        server.close()


def test_a_closed_lane_breaks_the_channel(lane_server: tuple[LaneServer, LaneClient]) -> None:
    server, client = lane_server
    assert client.call(b"x", 5.0) == b"x"
    server.close()
    with pytest.raises(ChannelBrokenError):
        client.call(b"y", 5.0)
    with pytest.raises(ChannelBrokenError):
        LaneClient(server.address, 1, "t").check(1.0)


def test_lane_calls_run_on_the_servers_executor_within_its_thread_limit(
    lane_server: tuple[LaneServer, LaneClient]
) -> None:
    _, client = lane_server
    assert client.call(b"who", 5.0).startswith(b"calls")
    # Three slow calls at once on two threads: the third waits for a free one.
    started = time.monotonic()
    threads = [threading.Thread(target=client.call, args=(b"slow", 10.0)) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert time.monotonic() - started >= 1.9


@pytest.mark.parametrize(("gap_s", "wait_s"), [
    (None, LINGER_MIN_S),  # nothing seen yet
    (0.0001, LINGER_MIN_S),  # a fast loop: the shortest linger catches it
    (0.01, 0.02),  # twice the gap
    (LINGER_MAX_S / 2, LINGER_MAX_S),
    (LINGER_MAX_S, LINGER_MIN_S),  # too slow to wait for: hand it back soon
    (10.0, LINGER_MIN_S),
])
def test_a_task_lingers_twice_the_connections_gap_within_bounds(
    gap_s: float | None, wait_s: float
) -> None:
    assert linger_s(gap_s) == pytest.approx(wait_s)


def test_the_gap_estimate_follows_the_gaps_seen() -> None:
    assert next_gap(None, 0.02) == 0.02
    estimate: float | None = None
    for gap in [0.001] * 3 + [0.02] * 20:
        estimate = next_gap(estimate, gap)
    assert estimate == pytest.approx(0.02, rel=0.01)
    assert 0.001 < next_gap(0.001, 0.1) < 0.1  # one slow step moves it only part way


def test_a_thread_that_others_need_does_not_linger() -> None:
    """At most half the executor's threads linger, none on a one-thread server: a second
    client is not kept waiting by the first one's quiet connection, even after the first
    one's steady calls taught the lane to wait long for its next."""
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="one")
    server = LaneServer(handle, lambda session, token, pid: "", max_frame_bytes=1 << 20,
                        run=pool, threads=1)
    first, second = LaneClient(server.address, 1, "t"), LaneClient(server.address, 1, "t")
    gap = LINGER_MAX_S / 4  # the first connection's linger: about LINGER_MAX_S / 2
    try:
        first.check(5.0)
        second.check(5.0)
        waits = []
        for _ in range(8):
            assert first.call(b"ab", 5.0) == b"ba"
            time.sleep(gap)
            assert first.call(b"ab", 5.0) == b"ba"
            started = time.monotonic()
            assert second.call(b"cd", 5.0) == b"dc"
            waits.append(time.monotonic() - started)
            time.sleep(gap)
        assert sorted(waits)[len(waits) // 2] < LINGER_MAX_S / 5, waits
    finally:
        first.close()
        second.close()
        server.close()
        pool.shutdown(wait=True)


def test_open_connections_hold_no_thread_each(
    lane_server: tuple[LaneServer, LaneClient], calls: ThreadPoolExecutor
) -> None:
    server, _ = lane_server
    before = threading.active_count()
    clients = [LaneClient(server.address, 1, "t") for _ in range(16)]
    try:
        for c in clients:
            c.check(5.0)
        assert server.connections() == 16
        assert all(c.call(b"ab", 5.0) == b"ba" for c in clients)
        # At most the executor's two threads were started; no thread per connection.
        assert threading.active_count() <= before + 2
    finally:
        for c in clients:
            c.close()


def test_closing_answers_the_calls_in_progress_within_the_grace(
    lane_server: tuple[LaneServer, LaneClient]
) -> None:
    server, client = lane_server
    assert client.call(b"x", 5.0) == b"x"
    answer: list[bytes] = []
    call = threading.Thread(target=lambda: answer.append(client.call(b"slow", 10.0)))
    call.start()
    time.sleep(0.3)  # the call is in the handler
    started = time.monotonic()
    server.close(grace_s=5.0)
    call.join(timeout=10)
    assert answer == [b"wols"] and 0.4 < time.monotonic() - started < 3.0
    with pytest.raises(ChannelBrokenError):
        client.call(b"y", 5.0)


def test_closing_without_grace_ends_a_call_in_progress(
    lane_server: tuple[LaneServer, LaneClient]
) -> None:
    server, client = lane_server
    errors: list[BaseException] = []

    def call() -> None:
        try:
            client.call(b"slow", 10.0)
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    time.sleep(0.3)
    server.close()
    thread.join(timeout=10)
    assert len(errors) == 1 and isinstance(errors[0], ChannelBrokenError)


# ---- the framing, over a socket pair ------------------------------------------------------


def test_a_frame_arriving_in_pieces_is_read_whole() -> None:
    """The first receive may hold a header's first bytes only, or a body's first part (a
    frame past the read-ahead): the rest is read until the frame is complete."""
    big = bytes(range(256)) * 1024  # 256 KiB: past one receive's read-ahead
    a, b = socket.socketpair()
    with a, b:
        for body in (b"", b"abc", big):
            data = struct.pack("<IB", len(body), lane.ANSWER) + body

            def send(data: bytes = data) -> None:
                for cut in (2, 7, 70_000):
                    a.sendall(data[:cut])
                    data = data[cut:]
                    time.sleep(0.01)
                a.sendall(data)

            sender = threading.Thread(target=send)
            sender.start()
            assert lane.read_frame(b, 1 << 20) == (lane.ANSWER, body)
            sender.join(timeout=5)


def test_bytes_past_a_frame_and_a_frame_cut_short_break_the_framing() -> None:
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack("<IB", 3, lane.REQUEST) + b"abcd")
        with pytest.raises(lane.LaneProtocolError, match="1 bytes arrived past the end"):
            lane.read_frame(b, 1 << 20)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack("<IB", 10, lane.REQUEST) + b"abc")
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(lane.LaneProtocolError, match=r"inside a frame \(8 of 15\)"):
            lane.read_frame(b, 1 << 20)
    a, b = socket.socketpair()
    with a, b:
        a.sendall(struct.pack("<IB", 10, lane.REQUEST))
        with pytest.raises(lane.LaneProtocolError, match="over the limit of 9"):
            lane.read_frame(b, 9)
        a.shutdown(socket.SHUT_WR)
        b.recv(100)
        assert lane.read_frame(b, 9) is None  # closed between frames: no error
