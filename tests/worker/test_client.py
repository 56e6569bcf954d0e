"""PSClient against real server processes on loopback: values, exactly-once, routing.

Every test runs once per bulk transport (the `transport` fixture forces it on both sides).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from procs import Procs, wait_until

from protos import codec, rpc
from protos import pstrain_pb2 as pb
from protos.modes import Kind, Mode
from protos.partition import shard_of_keys
from protos.parts import cut
from scheduler.admin import ServerAdmin
from scheduler.spec import JobSpec
from scheduler.store import JobStore
from worker.client import PSClient, Pull, Push
from worker.errors import ClusterMismatchError, PSClientError, RemoteError, RolledBackError

pytestmark = pytest.mark.usefixtures("transport")


@pytest.fixture
def two_shards(procs: Procs, transport: str) -> Iterator[PSClient]:
    servers = procs.servers(2)
    with PSClient([s.address for s in servers], worker=0, transport=transport) as client:
        assert client.transports() == [transport, transport]
        yield client


def test_dense_pull_after_n_pushes_is_initial_minus_n_g(two_shards: PSClient) -> None:
    client = two_shards
    # 1000 x 64 float32 = 256 KiB: split by rows across both shards.
    client.declare_dense("w", (1000, 64), optimizer="sgd", lr=1.0, init=("uniform", -1, 1))
    initial = client.pull_dense("w")
    g = torch.randn(1000, 64, generator=torch.Generator().manual_seed(1))
    n = 7
    for _ in range(n):
        client.push_dense("w", g)
    expected = initial.clone()
    for _ in range(n):
        expected -= g
    torch.testing.assert_close(client.pull_dense("w"), expected, atol=1e-6, rtol=0)
    placements = [t for s in client.stats() for t in s.tables if t.name == "w"]
    assert sorted((t.row_start, t.row_end) for t in placements) == [(0, 500), (500, 1000)]
    assert all(t.pushes_applied == n for t in placements)


def test_sparse_pull_after_n_pushes_is_initial_minus_n_g(two_shards: PSClient) -> None:
    client = two_shards
    client.declare_sparse("emb", 16, optimizer="sgd", lr=1.0, seed=3)
    keys = np.arange(1000, dtype=np.int64) * 7919 - 3000
    initial = client.pull_sparse("emb", keys)
    g = torch.randn(1000, 16, generator=torch.Generator().manual_seed(2))
    n = 5
    for _ in range(n):
        client.push_sparse("emb", keys, g)
    expected = initial.clone()
    for _ in range(n):
        expected -= g
    torch.testing.assert_close(client.pull_sparse("emb", keys), expected, atol=1e-6, rtol=0)
    rows = [t.rows for s in client.stats() for t in s.tables if t.name == "emb"]
    assert all(r > 300 for r in rows) and sum(rows) == 1000


def test_sparse_rows_are_deterministic_from_seed_and_key(procs: Procs, transport: str) -> None:
    # Two separate clusters, one and two shards: the same seed gives the same rows.
    one = procs.servers(1)
    keys = np.array([5, -1, 2**62, 123456789], dtype=np.int64)
    with PSClient([one[0].address], transport=transport) as a:
        a.declare_sparse("e", 8, seed=11)
        rows_a = a.pull_sparse("e", keys)
    two = [procs.server(k, 2) for k in range(2)]
    with PSClient([s.address for s in two], transport=transport) as b:
        b.declare_sparse("e", 8, seed=11)
        rows_b = b.pull_sparse("e", keys[::-1].copy())
    torch.testing.assert_close(rows_a, rows_b.flip(0), atol=0, rtol=0)


def test_pull_sparse_returns_caller_order_with_repeats(two_shards: PSClient) -> None:
    client = two_shards
    client.declare_sparse("e", 4, seed=1)
    keys = np.array([9, 3, 9, 100, 3, 3], dtype=np.int64)
    rows = client.pull_sparse("e", keys)
    single = {int(k): client.pull_sparse("e", np.array([k]))[0] for k in set(keys.tolist())}
    for i, k in enumerate(keys.tolist()):
        torch.testing.assert_close(rows[i], single[k], atol=0, rtol=0)


def test_push_sparse_sums_repeated_keys(two_shards: PSClient) -> None:
    client = two_shards
    client.declare_sparse("e", 2, optimizer="sgd", lr=1.0, init=("zeros", 0, 0))
    keys = np.array([1, 2, 1, 1], dtype=np.int64)
    grads = torch.tensor([[1.0, 0.0], [0.0, 2.0], [1.0, 0.0], [1.0, 1.0]])
    client.push_sparse("e", keys, grads)
    rows = client.pull_sparse("e", np.array([1, 2]))
    torch.testing.assert_close(rows, torch.tensor([[-3.0, -1.0], [0.0, -2.0]]))


def test_routing_agrees_and_no_key_is_lost_or_duplicated(two_shards: PSClient) -> None:
    client = two_shards
    client.declare_sparse("e", 4)
    keys = np.arange(10_000, dtype=np.int64)  # consecutive ids must still spread evenly
    client.pull_sparse("e", keys)
    owners = shard_of_keys(keys, 2)
    per_shard = {
        s.info.shard: next(t.rows for t in s.tables if t.name == "e") for s in client.stats()
    }
    assert per_shard == {0: int((owners == 0).sum()), 1: int((owners == 1).sum())}
    assert 4500 < per_shard[0] < 5500
    # A key sent to the wrong shard is refused and not created.
    wrong = keys[owners == 1][:3]
    msg = pb.ExchangeRequest(worker=0)
    payload = codec.Payload()
    msg.pulls.append(pb.ExchangePull(table="e", keys=payload.add(codec.keys_bytes(wrong))))
    request = codec.encode(msg, {"payload": payload.parts})
    with pytest.raises(Exception) as err:
        client.links[0].unary(rpc.EXCHANGE, request)
    assert "belongs to shard 1" in str(err.value)
    assert next(t.rows for t in client.stats()[0].tables if t.name == "e") == per_shard[0]


def test_retried_streamed_push_with_same_seq_is_applied_once(two_shards: PSClient) -> None:
    client = two_shards
    client.declare_sparse("e", 4, optimizer="sgd", lr=1.0, init=("zeros", 0, 0))
    keys = np.arange(1000, dtype=np.int64) * 2
    keys = keys[shard_of_keys(keys, 2) == 0]
    link = client.links[0]
    msg = pb.ExchangeRequest(worker=7, incarnation=1)
    payload = codec.Payload()
    msg.pushes.append(pb.ExchangePush(
        table="e", seq=1, dtype=pb.FLOAT32, dim=4, keys=payload.add(codec.keys_bytes(keys)),
        values=payload.add(codec.tensor_bytes(torch.ones(len(keys), 4))),
    ))

    def send() -> pb.ExchangeResponse:
        parts = cut(pb.ExchangePart, msg, payload.parts, payload.nbytes, 1000)
        answers = list(link._stubs().stream(rpc.EXCHANGE_STREAM, parts, 10))
        assert len(answers) == 1
        return answers[0].msg.response

    assert payload.nbytes > 5000  # several parts
    first, again = send(), send()
    assert not first.pushes[0].duplicate and again.pushes[0].duplicate
    torch.testing.assert_close(client.pull_sparse("e", keys), -torch.ones(len(keys), 4))
    stats = next(t for t in client.stats()[0].tables if t.name == "e")
    assert (stats.pushes_applied, stats.pushes_duplicate) == (1, 1)


def test_stale_incarnation_is_refused(two_shards: PSClient, transport: str) -> None:
    client = two_shards
    client.declare_dense("b", (4,), optimizer="sgd", lr=1.0)
    with PSClient([s.address for s in client.links], worker=3, incarnation=2,
                  transport=transport) as new:
        new.declare_dense("b", (4,), optimizer="sgd", lr=1.0)
        new.push_dense("b", torch.ones(4))
    with PSClient([s.address for s in client.links], worker=3, incarnation=1,
                  transport=transport) as old:
        old.declare_dense("b", (4,), optimizer="sgd", lr=1.0)
        with pytest.raises(RemoteError) as err:
            old.push_dense("b", torch.ones(4))
    assert err.value.code.name == "FAILED_PRECONDITION"
    assert "incarnation 2 has since joined" in err.value.details
    torch.testing.assert_close(client.pull_dense("b"), -torch.ones(4))


def test_a_worker_from_before_a_rollback_is_told_to_restart(two_shards: PSClient) -> None:
    client = two_shards
    client.declare_dense("r", (4,), optimizer="sgd", lr=1.0)
    client.push_dense("r", torch.ones(4))
    told: list[int] = []
    client.on_rolled_back = lambda: told.append(client.clock)
    admin = ServerAdmin()
    try:  # The job rolls back to an empty checkpoint: generation 1.
        for shard in client.links:
            admin.restore(shard.address, "", "", generation=1)
    finally:
        admin.close()
    with pytest.raises(RolledBackError) as err:
        client.push_dense("r", torch.ones(4))
    assert err.value.code.name == "FAILED_PRECONDITION" and "must restart" in err.value.details
    assert told == [0]  # told once, before the error, and not retried
    client.generation = 1  # a process that joined after the rollback is served
    client.push_dense("r", torch.ones(4))


def test_a_declared_mode_is_parsed_by_the_client(procs: Procs, transport: str) -> None:
    server = procs.server()
    with PSClient([server.address], transport=transport) as c:
        with pytest.raises(PSClientError, match="unknown consistency mode 'ssp:two'; choose"):
            c.declare_sparse("m", 2, mode="ssp:two")
        c.declare_sparse("m", 2, mode="ssp:2")
        c.declare_sparse("m", 2, mode=Mode(Kind.SSP, 2))  # the same spec: a no-op
        c.declare_dense("d", (2,))
        tables = {t.name: (t.consistency, t.staleness) for t in c.stats()[0].tables}
    assert tables == {"m": (pb.SSP, 2), "d": (pb.ASYNC, 0)}  # d: the server's default


def test_servers_listed_out_of_order_are_refused(procs: Procs, transport: str) -> None:
    servers = procs.servers(2)
    with pytest.raises(ClusterMismatchError, match="shard order"):
        PSClient([servers[1].address, servers[0].address], transport=transport)


def test_large_dense_tensor_streams_in_chunks(two_shards: PSClient) -> None:
    client = two_shards
    # 2 x 5 MiB blocks: several 2 MiB chunks per shard in both directions.
    client.declare_dense("big", (2560, 1024), optimizer="sgd", lr=0.5, init=("zeros", 0, 0))
    g = torch.arange(2560 * 1024, dtype=torch.float32).reshape(2560, 1024) / 1e6
    client.push_dense("big", g)
    torch.testing.assert_close(client.pull_dense("big"), -0.5 * g, atol=1e-7, rtol=0)


def test_large_sparse_push_streams_in_chunks(two_shards: PSClient) -> None:
    client = two_shards
    client.declare_sparse("e", 64, optimizer="sgd", lr=1.0, init=("zeros", 0, 0))
    keys = np.arange(40_000, dtype=np.int64)  # 10 MiB of values
    g = torch.randn(40_000, 64, generator=torch.Generator().manual_seed(0))
    client.push_sparse("e", keys, g, assume_unique=True)
    torch.testing.assert_close(client.pull_sparse("e", keys), -g, atol=0, rtol=0)


def test_exchange_equals_the_separate_calls_in_order(two_shards: PSClient) -> None:
    """Pushes, then the end of the iteration, then pulls: the pulls see the pushes, rows
    come back in the caller's order with repeats, and the clock moves on once."""
    client = two_shards
    client.declare_sparse("e", 4, optimizer="sgd", lr=1.0, init=("uniform", -1, 1))
    client.declare_dense("d", (300, 3), optimizer="sgd", lr=1.0, init=("uniform", -1, 1))
    keys = np.array([5, 2**40, 5, -7, 123, 2**40], dtype=np.int64)
    rows, dense = client.pull_sparse("e", keys), client.pull_dense("d")
    g = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    gd = torch.randn(300, 3, generator=torch.Generator().manual_seed(0))
    pulled_rows, pulled_dense = client.exchange(
        [Push("e", g, keys), Push("d", gd)], end_iteration=True,
        pulls=[Pull("e", keys), Pull("d")],
    )
    expected = rows.clone()
    for i, k in enumerate(keys.tolist()):
        expected[i] -= g[keys == k].sum(0)
    torch.testing.assert_close(pulled_rows, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(pulled_dense, dense - gd, atol=1e-6, rtol=0)
    torch.testing.assert_close(client.pull_sparse("e", keys), expected, atol=0, rtol=0)
    assert client.clock == 1
    assert all({(c.worker, c.clock) for c in s.clocks} == {(0, 1)} for s in client.stats())


def test_assign_dense_if_absent_says_whether_every_shard_took_the_values(
    two_shards: PSClient,
) -> None:
    client = two_shards
    for name in ("w", "v"):  # 256 KiB each: split by rows across both shards
        client.declare_dense(name, (1000, 64), optimizer="sgd", lr=1.0, init=("uniform", -1, 1))
    ones, twos = torch.ones(1000, 64), torch.full((1000, 64), 2.0)
    assert client.assign_dense("w", ones, if_absent=True)
    assert not client.assign_dense("w", twos, if_absent=True)
    torch.testing.assert_close(client.pull_dense("w"), ones, atol=0, rtol=0)
    assert client.assign_dense("w", twos)  # a plain assign overwrites
    torch.testing.assert_close(client.pull_dense("w"), twos, atol=0, rtol=0)
    # A gradient on shard 0's rows alone: shard 0 keeps its values, shard 1 takes the new.
    initial = client.pull_dense("v")
    msg = pb.ExchangeRequest(worker=7, incarnation=1)
    payload = codec.Payload()
    msg.pushes.append(pb.ExchangePush(
        table="v", seq=1, dtype=pb.FLOAT32, dense=True, shape=[500, 64],
        values=payload.add(codec.tensor_bytes(torch.ones(500, 64))),
    ))
    client.links[0].unary(rpc.EXCHANGE, codec.encode(msg, {"payload": payload.parts}))
    assert not client.assign_dense("v", twos, if_absent=True)
    held = client.pull_dense("v")
    torch.testing.assert_close(held[:500], initial[:500] - 1, atol=1e-6, rtol=0)
    torch.testing.assert_close(held[500:], twos[500:], atol=0, rtol=0)
    # Sparse tables refuse it.
    client.declare_sparse("e", 4)
    with pytest.raises(RemoteError, match="if_absent applies to dense tables only") as err:
        client.exchange([Push("e", torch.ones(1, 4), [3], assign=True, if_absent=True)])
    assert err.value.code.name == "INVALID_ARGUMENT"


def test_retried_exchange_applies_its_pushes_once(two_shards: PSClient) -> None:
    client = two_shards
    client.declare_sparse("e", 4, optimizer="sgd", lr=1.0, init=("zeros", 0, 0))
    keys = np.array([42], dtype=np.int64)
    link = client.links[int(shard_of_keys(keys, 2)[0])]
    msg = pb.ExchangeRequest(worker=7, incarnation=1, end_iteration=True)
    payload = codec.Payload()
    msg.pushes.append(pb.ExchangePush(
        table="e", seq=1, dtype=pb.FLOAT32, dim=4, keys=payload.add(codec.keys_bytes(keys)),
        values=payload.add(codec.tensor_bytes(torch.ones(1, 4))),
    ))
    request = codec.encode(msg, {"payload": payload.parts})
    first = link.unary(rpc.EXCHANGE, request)
    again = link.unary(rpc.EXCHANGE, request)
    assert not first.msg.pushes[0].duplicate and again.msg.pushes[0].duplicate
    torch.testing.assert_close(client.pull_sparse("e", keys), -torch.ones(1, 4))


def test_exchange_too_large_for_one_message_travels_streamed(
    two_shards: PSClient,
) -> None:
    client = two_shards
    # 2 x 5 MiB blocks: past one message, so the exchange streams them (or sends them through
    # the bulk transport).
    client.declare_dense("big", (2560, 1024), optimizer="sgd", lr=1.0, init=("zeros", 0, 0))
    g = torch.ones(2560, 1024)
    (pulled,) = client.exchange([Push("big", g)], end_iteration=True, pulls=[Pull("big")])
    torch.testing.assert_close(pulled, -g, atol=0, rtol=0)
    assert client.clock == 1
    stats = [t for s in client.stats() for t in s.tables if t.name == "big"]
    assert [t.pushes_applied for t in stats] == [1, 1]


def test_an_exchange_refused_before_it_leaves_is_not_counted_as_waiting(
    two_shards: PSClient,
) -> None:
    # A waiting exchange makes the client ask every shard for cuts each second: one that
    # failed while it was being laid out must not stay counted as waiting.
    client = two_shards
    client.cuts.probe_s = 0.05
    with pytest.raises(PSClientError, match="nope"):
        client.pull_sparse("nope", np.array([1], dtype=np.int64))
    time.sleep(0.1)
    assert not client.cuts.due()


def test_a_worker_waiting_for_a_slower_one_marks_the_cut_that_holds_the_slower_one(
    procs: Procs, transport: str,
) -> None:
    """ssp, staleness 0: worker 1, three clocks ahead, waits in a pull for worker 0 when a
    checkpoint's cut begins. Worker 0 learns of the cut, marks it, and is held at its cut
    clock until worker 1 marks it too; worker 1 learns of it only from an answer, and its
    own exchange waits for worker 0. It must mark the cut while that exchange waits, or each
    waits for the other until the server's limits end the cut (a minute)."""
    redis = procs.redis().address
    store = JobStore.connect(redis, "cutwait")
    store.create_job(JobSpec(job="cutwait", servers=1, workers=2, heartbeat_interval_s=0.1,
                             mode="ssp", staleness=0,
                             checkpoint_dir=str(procs.workdir / "ckpt")), adopt=False)
    server = procs.server(extra=["--redis", redis, "--job", "cutwait"])
    wait_until(lambda: 0 in store.members("server"), 30, "the server to join its job")
    ServerAdmin().set_membership(server.address, [0, 1])
    with (PSClient([server.address], worker=0, transport=transport) as slow,
          PSClient([server.address], worker=1, transport=transport) as fast,
          ThreadPoolExecutor(2) as pool):
        for client in (slow, fast):
            client.declare_dense("w", [4], optimizer="sgd", lr=1.0, init=("zeros", 0, 0))
        for clock in range(3):
            fast.exchange([Push("w", torch.ones(4))], end_iteration=True, push_clock=clock)
        ahead = pool.submit(fast.exchange, pulls=[Pull("w")], pull_clock=3)
        store.request_checkpoint("c1", -1)
        wait_until(lambda: "cut c1 begins" in server.log(), 10, "the cut to begin")
        assert not ahead.done()  # waits for worker 0 at clock 3
        # Worker 0 is told of the cut by this answer and marks it on its next exchange.
        slow.exchange([Push("w", torch.ones(4))], end_iteration=True, push_clock=0)
        behind = pool.submit(lambda: [slow.exchange([Push("w", torch.ones(4))],
                                                    end_iteration=True, push_clock=c)
                                      for c in (1, 2)])
        (pulled,) = ahead.result(timeout=20)
        behind.result(timeout=5)
    assert torch.equal(pulled, torch.full((4,), -6.0))
    wait_until(lambda: store.checkpoint("c1"), 10, "checkpoint c1")
    assert "gave up its cut" not in server.log()
