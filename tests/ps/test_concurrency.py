"""ps/concurrency.py: data calls in flight, per client and in all. The rule as a table, the
gate's counting, the turn, then a real server whose data threads are held by waiting pulls."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from procs import Procs

from protos import marks, rpc
from protos import pstrain_pb2 as pb
from protos.rpc import Stubs
from ps.concurrency import RESERVED_THREADS, CallGate, CallLimits, Turn, refusal
from ps.errors import InvalidArgumentError, ResourceExhaustedError, ServerBusyError
from worker.client import PSClient

LIMITS = CallLimits(max_calls=4, max_client_calls=2)


@pytest.mark.parametrize(
    ("in_flight", "own", "refused"),
    [
        (0, 0, None),
        (3, 1, None),
        (1, 2, ResourceExhaustedError),  # the client's own limit, whatever the server's load
        (4, 2, ResourceExhaustedError),
        (4, 0, ServerBusyError),  # the server's limit: busy, try again
        (5, 1, ServerBusyError),
    ],
)
def test_the_rule(in_flight: int, own: int, refused: type | None) -> None:
    got = refusal(in_flight, own, LIMITS, "ipv4:10.0.0.7:5000")
    assert type(got) is refused if refused else got is None
    if isinstance(got, ServerBusyError):
        assert "the server is busy: " in str(got) and "try again" in str(got)
    elif got is not None:
        assert "client ipv4:10.0.0.7:5000 already has" in str(got)
        assert "--max-client-calls 2" in str(got)


def test_limits_leave_threads_for_health_and_admin_calls() -> None:
    assert CallLimits.for_threads(16, 8) == CallLimits(16 - RESERVED_THREADS, 8)
    with pytest.raises(InvalidArgumentError, match="--grpc-threads must leave"):
        CallLimits.for_threads(RESERVED_THREADS, 8)
    with pytest.raises(InvalidArgumentError, match="--max-client-calls must be >= 1, got 0"):
        CallLimits(4, 0)


def test_the_gate_counts_per_client_and_forgets_what_left() -> None:
    gate = CallGate(LIMITS)
    gate.enter("a")
    gate.enter("a")
    with pytest.raises(ResourceExhaustedError):
        gate.enter("a")
    gate.enter("b")
    gate.enter("c")
    with pytest.raises(ServerBusyError):
        gate.enter("d")
    assert gate.in_flight() == 4  # refusals counted nothing
    for client in ("a", "a", "b", "c"):
        gate.leave(client)
    assert gate.in_flight() == 0
    for _ in range(2):
        gate.enter("a")  # its old count is gone with its calls


# ---- the turn ---------------------------------------------------------------------------------

BOUND_S = 5.0  # the longest a turn test waits for a thread, in real time


class Taker:
    """A thread that takes the turn, gives it up at once if asked, and ends when told."""

    def __init__(self, turn: Turn, give_up: bool = False) -> None:
        self._entered, self._leave = threading.Event(), threading.Event()

        def run() -> None:
            with turn.taken():
                self._entered.set()
                if give_up:
                    turn.give_up()
                self._leave.wait(BOUND_S)

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def inside(self, within_s: float = BOUND_S) -> bool:
        """Whether it has entered its turn (waiting up to `within_s`)."""
        return self._entered.wait(within_s)

    def end(self) -> None:
        self._leave.set()
        self.thread.join(BOUND_S)


def held_back_until(waiting: Taker, release: Callable[[], None], why: str) -> None:
    """`waiting` stays out of its turn until `release()`, then enters it."""
    assert not waiting.inside(0.2), why
    release()
    assert waiting.inside(), "the turn did not pass on"


def test_the_turn_lets_one_call_in_until_it_ends() -> None:
    turn = Turn(wait_s=BOUND_S)
    first = Taker(turn)
    assert first.inside()
    second = Taker(turn)
    held_back_until(second, first.end, "a second call ran while the first held the turn")
    second.end()


def test_a_call_that_gives_up_its_turn_lets_the_next_in_and_goes_on() -> None:
    turn = Turn(wait_s=BOUND_S)
    first = Taker(turn, give_up=True)
    assert first.inside()
    second = Taker(turn)
    assert second.inside(), "the turn given up did not let the next call in"
    assert first.thread.is_alive()  # still running, without the turn
    first.end()
    third = Taker(turn)
    held_back_until(third, second.end, "a call ending without its turn released another's")
    third.end()


def test_giving_up_a_turn_not_held_changes_nothing() -> None:
    turn = Turn(wait_s=BOUND_S)
    turn.give_up()  # nobody holds it: a no-op
    holder = Taker(turn)
    assert holder.inside()
    turn.give_up()  # this thread does not hold it: the holder keeps it
    held_back_until(Taker(turn), holder.end, "a thread gave up a turn it did not hold")


def test_a_turn_taken_inside_its_own_turn_neither_waits_nor_gives_it_away() -> None:
    turn = Turn(wait_s=BOUND_S)
    with turn.taken():
        start = time.monotonic()
        with turn.taken():
            pass
        assert time.monotonic() - start < BOUND_S / 2, "the inner block waited for its own turn"
        other = Taker(turn)
        assert not other.inside(0.2), "the inner block's end gave the turn away"
    assert other.inside(), "the outer block's end did not pass the turn on"
    other.end()


def test_a_call_runs_without_the_turn_after_its_wait() -> None:
    turn = Turn(wait_s=0.1)
    holder = Taker(turn)
    assert holder.inside()
    start = time.monotonic()
    with turn.taken():
        waited = time.monotonic() - start
    assert 0.05 < waited < BOUND_S
    holder.end()  # the holder's turn is still its own to give back
    with turn.taken():  # and it did
        pass


# ---- a real server -----------------------------------------------------------------------

WAIT = pb.ExchangeRequest(worker=1, incarnation=1, pull_clock=5, wait_ms=60_000)
WAIT.pulls.add(table="w", dense=True)


@pytest.fixture
def held_server(procs: Procs) -> Iterator[str]:
    """A sync server with 4 handler threads (2 for data calls), each client allowed 1 data
    call in flight, and a table whose pulls for clock 5 wait (no worker reaches it)."""
    server = procs.server(extra=["--mode", "sync", "--workers", "2", "--grpc-threads", "4",
                                 "--max-client-calls", "1", "--max-wait-s", "60"])
    with PSClient([server.address], worker=0) as client:
        client.declare_dense("w", (4,), optimizer="sgd", lr=1.0)
    yield server.address
    assert "Traceback" not in server.log()


def _client(address: str) -> grpc.Channel:
    """A channel of its own connection: a client, as the server counts them (channels of one
    process to one server otherwise share a connection)."""
    return grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def _later(channel: grpc.Channel, request: pb.ExchangeRequest) -> grpc.Future:
    """An exchange sent now, answered (or refused) later."""
    future: grpc.Future = channel.unary_unary(rpc.EXCHANGE.path).future(
        request.SerializeToString(), timeout=60)
    return future


def _refusal(stubs: Stubs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        stubs.unary(rpc.EXCHANGE, WAIT.SerializeToString(), 5.0)
    return refused.value


@pytest.mark.timeout(120)
def test_a_client_past_its_limit_and_a_busy_server_refuse_at_once_and_health_answers(
    held_server: str,
) -> None:
    channels = [_client(held_server) for _ in range(3)]
    stubs = [Stubs(c) for c in channels]
    waits: list[grpc.Future] = []
    try:
        # Client 0 holds its one call; its second is refused at once, not queued.
        waits.append(_later(channels[0], WAIT))
        time.sleep(0.5)
        start = time.monotonic()
        own = _refusal(stubs[0])
        assert own.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "already has 1 calls in flight" in own.details()
        assert marks.BUSY not in marks.marks_of(own.trailing_metadata())
        # Client 1 takes the second data thread; client 2 finds the server busy.
        waits.append(_later(channels[1], WAIT))
        time.sleep(0.5)
        busy = _refusal(stubs[2])
        assert busy.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "the server is busy: 2 data calls in flight" in busy.details()
        assert marks.BUSY in marks.marks_of(busy.trailing_metadata())
        assert time.monotonic() - start < 3
        # Health and admin calls still find a thread.
        health = health_pb2_grpc.HealthStub(channels[2]).Check(
            health_pb2.HealthCheckRequest(), timeout=2)
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        answer = stubs[2].unary(rpc.SET_MEMBERSHIP, pb.MembershipRequest(
            live_workers=[0, 1]).SerializeToString(), 2.0)
        assert answer.msg.open_clock == 0
    finally:
        for wait in waits:
            wait.cancel()
    # Once the waits are gone, their threads are free again.
    time.sleep(0.5)
    assert stubs[2].unary(rpc.GET_SERVER_INFO, b"", 5.0).msg.shard == 0
    for channel in channels:
        channel.close()


@pytest.mark.timeout(120)
def test_a_worker_waits_out_a_busy_server_instead_of_failing(held_server: str) -> None:
    """Both data threads held for a second: a worker's pull is refused as busy, tried again
    after its backoff, and answered once a thread is free."""
    channels = [_client(held_server) for _ in range(2)]
    short = pb.ExchangeRequest()
    short.CopyFrom(WAIT)
    short.wait_ms = 1000
    with PSClient([held_server], worker=0) as client:
        client.declare_dense("w", (4,), optimizer="sgd", lr=1.0)
        waits = [_later(c, short) for c in channels]
        time.sleep(0.3)
        start = time.monotonic()
        pulled = client.pull_dense("w", clock=0)
        took = time.monotonic() - start
    assert pulled.tolist() == [0.0] * 4
    assert 0.3 < took < 10, took  # it waited for a thread, then got one
    for wait in waits:
        assert wait.exception() is not None  # each waited out its second
    for channel in channels:
        channel.close()
