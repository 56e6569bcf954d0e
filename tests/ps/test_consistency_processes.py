"""Consistency modes with real server and worker processes on loopback."""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from procs import REPO, Procs

from protos import pstrain_pb2 as pb
from worker.client import PSClient
from worker.errors import RemoteError

WORKER = str(REPO / "tests" / "consistency_worker.py")


def run_workers(procs: Procs, servers: str, n: int, steps: int,
                sleep_ms: dict[int, float] | None = None,
                jitter_ms: float = 0.0) -> list[dict[str, Any]]:
    outs = [procs.workdir / f"worker{r}.json" for r in range(n)]
    started = [
        procs.spawn(
            [sys.executable, WORKER, "--servers", servers, "--rank", str(r), "--steps",
             str(steps), "--out", str(outs[r]),
             "--sleep-ms", str((sleep_ms or {}).get(r, 0.0)), "--jitter-ms", str(jitter_ms)],
            f"worker{r}",
        )
        for r in range(n)
    ]
    for proc in started:
        assert proc.popen.wait(timeout=120) == 0, proc.log()
    return [json.loads(Path(o).read_text()) for o in outs]


def addresses(servers: list) -> str:  # type: ignore[type-arg]
    return ",".join(s.address for s in servers)


def test_sync_applies_the_mean_of_every_clock_exactly(procs: Procs) -> None:
    servers = procs.servers(2, ["--mode", "sync", "--workers", "3"])
    steps = 6
    results = run_workers(procs, addresses(servers), 3, steps, {1: 30.0})
    # Clock t applies mean over r of (r + 1)(t + 1) = 2 (t + 1) to every element.
    expected = [100.0 - sum(2 * (u + 1) for u in range(t)) for t in range(steps + 1)]
    for r in results:
        # Each pull saw exactly the clocks closed before it, at every clock.
        assert r["pulled"] == [[t, expected[t]] for t in range(steps)], r
        assert r["final"] == expected[steps]
    with PSClient([s.address for s in servers]) as c:
        stats = c.stats()
    assert all(s.clocks_closed == steps for s in stats)
    table = next(t for t in stats[0].tables if t.name == "w")
    assert (table.gradients_aggregated, table.pushes_dropped) == (3 * steps, 0)


def test_sync_with_a_backup_uses_three_gradients_and_drops_one(procs: Procs) -> None:
    servers = procs.servers(1, ["--mode", "sync", "--workers", "4", "--backups", "1"])
    steps = 6
    # Equal workers with random delays: whoever is last at a clock is the one dropped.
    results = run_workers(procs, addresses(servers), 4, steps, jitter_ms=60.0)
    with PSClient([servers[0].address]) as c:
        stats = c.stats(history=True)[0]
    table = next(t for t in stats.tables if t.name == "w")
    assert stats.clocks_closed == steps
    # Who pushed at which clock, from the workers' own records. A worker that falls two
    # clocks behind jumps to the open one and pushes nothing for the clock it skipped.
    pushers = {t: sum(1 for r in results for c, _ in r["pulled"] if c == t) for t in range(steps)}
    history = {h.clock: (h.workers, h.dropped) for h in stats.history}
    assert history == {t: (3, pushers[t] - 3) for t in range(steps)}
    assert sum(1 for t in range(steps) if pushers[t] == 4) >= 1  # a clock with all four
    total = sum(pushers.values())
    assert (table.gradients_aggregated, table.pushes_dropped) == (3 * steps, total - 3 * steps)
    assert sum(r["dropped"] for r in results) == total - 3 * steps
    # Every worker, the straggler included, carries on from the same closed parameters.
    finals = {r["final"] for r in results}
    assert len(finals) == 1


def test_ssp_never_serves_a_pull_past_the_staleness_bound(procs: Procs) -> None:
    servers = procs.servers(1, ["--mode", "ssp", "--staleness", "2", "--workers", "3"])
    steps = 10
    run_workers(procs, addresses(servers), 3, steps, {2: 60.0})
    with PSClient([servers[0].address]) as c:
        log = c.stats(pull_log=True)[0].pull_log
    assert len(log) == 3 * (steps + 1)  # every pull, the final ones included
    for record in log:
        assert record.min_live_clock >= record.clock - 2, record
    # The held-back worker really held the others back: some pulls waited at the bound.
    assert any(r.worker != 2 and r.min_live_clock == r.clock - 2 for r in log)


def test_async_pull_returns_while_every_other_worker_is_stalled(procs: Procs) -> None:
    servers = procs.servers(1, ["--mode", "async", "--workers", "3"])
    with PSClient([servers[0].address], worker=0) as c:
        c.declare_dense("w", (4,), optimizer="sgd", lr=1.0)
        for _ in range(5):
            c.push_dense("w", torch.ones(4))
            c.end_iteration()
        start = time.monotonic()
        value = c.pull_dense("w")  # workers 1 and 2 never started: clock 0
        assert time.monotonic() - start < 2.0
    assert value.tolist() == [-5.0] * 4


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_removing_a_stalled_worker_unblocks_within_one_call(procs: Procs, mode: str) -> None:
    servers = procs.servers(1, ["--mode", mode, "--workers", "3", "--staleness", "0"])
    address = [servers[0].address]
    clients = [PSClient(address, worker=r) for r in range(3)]
    for c in clients:
        c.declare_dense("w", (2,), optimizer="sgd", lr=1.0)
    for r in (0, 1):  # worker 2 stalls at clock 0
        clients[r].push_dense("w", torch.full((2,), float(r + 1)))
        clients[r].end_iteration()
    got: list[torch.Tensor] = []
    waiter = threading.Thread(target=lambda: got.append(clients[0].pull_dense("w")))
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive()  # blocked on worker 2
    clients[1].set_membership([0, 1])
    waiter.join(timeout=5)
    assert not waiter.is_alive() and got
    # sync: the clock closed with the mean of the two live workers' gradients.
    expected = -1.5 if mode == "sync" else -3.0
    assert got[0].tolist() == [expected, expected]
    with pytest.raises(RemoteError, match="not a live member") if mode == "sync" else _null():
        clients[2].push_dense("w", torch.ones(2))
    for c in clients:
        c.close()


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_deadline_error_names_the_slow_worker(procs: Procs, mode: str) -> None:
    servers = procs.servers(1, ["--mode", mode, "--workers", "3"])
    address = [servers[0].address]
    fast = [PSClient(address, worker=r, timeout_s=1.5) for r in (0, 1)]
    for c in fast:
        c.declare_dense("w", (2,), optimizer="sgd", lr=1.0)
        c.push_dense("w", torch.ones(2))
        c.end_iteration()
    start = time.monotonic()
    with pytest.raises(RemoteError) as err:
        fast[0].pull_dense("w")
    assert err.value.code.name == "DEADLINE_EXCEEDED"
    assert "waiting for workers 2 (clock 0)" in err.value.details
    assert time.monotonic() - start < 5  # not retried
    for c in fast:
        c.close()


def test_per_table_modes_hold_on_their_own(procs: Procs) -> None:
    servers = procs.servers(1, ["--mode", "sync", "--workers", "2"])
    address = [servers[0].address]
    a, b = PSClient(address, worker=0), PSClient(address, worker=1)
    for c in (a, b):
        c.declare_dense("dense", (2,), optimizer="sgd", lr=1.0)
        c.declare_sparse("emb", 2, optimizer="sgd", lr=1.0, init=("zeros", 0, 0), mode="async")
    a.push_sparse("emb", np.array([1]), torch.ones(1, 2))
    a.push_dense("dense", torch.ones(2))
    a.end_iteration()
    # The async table serves at clock 1 at once; the sync one waits for worker 1.
    assert a.pull_sparse("emb", np.array([1])).tolist() == [[-1.0, -1.0]]
    got: list[torch.Tensor] = []
    waiter = threading.Thread(target=lambda: got.append(a.pull_dense("dense")))
    waiter.start()
    time.sleep(0.3)
    assert waiter.is_alive()
    b.push_dense("dense", torch.full((2,), 3.0))
    b.end_iteration()
    waiter.join(timeout=5)
    assert got and got[0].tolist() == [-2.0, -2.0]
    a.close()
    b.close()


def test_modes_travel_as_enum_and_bound_and_the_bound_holds(procs: Procs) -> None:
    # The server's default, in the user's grammar: ssp with bound 3.
    servers = procs.servers(1, ["--mode", "ssp:3", "--workers", "2"])
    with PSClient([servers[0].address], worker=0, timeout_s=1.5) as c:
        declared = {"default": "", "ssp": "ssp", "ssp1": "ssp:1", "ssp0": "ssp:0",
                    "sync": "sync", "async": "async"}
        for name, mode in declared.items():
            c.declare_sparse(name, 2, optimizer="sgd", lr=1.0, mode=mode)
        stats = c.stats()[0]
        assert (stats.info.consistency, stats.info.staleness) == (pb.SSP, 3)
        assert {t.name: (pb.Mode.Name(t.consistency), t.staleness) for t in stats.tables} == {
            "default": ("SSP", 3), "ssp": ("SSP", 3), "ssp1": ("SSP", 1), "ssp0": ("SSP", 0),
            "sync": ("SYNC", 0), "async": ("ASYNC", 0)}
        # Worker 0 reaches clock 2; worker 1 never starts, and at clock 0 it holds back
        # pulls at clock 2 only where the bound is below 2.
        c.end_iteration()
        c.end_iteration()
        assert c.clock == 2
        for name in ("default", "ssp", "async"):
            assert c.pull_sparse(name, np.array([1])).shape == (1, 2)
        for name, bound in (("ssp1", 1), ("ssp0", 0)):
            with pytest.raises(RemoteError) as err:
                c.pull_sparse(name, np.array([1]))
            assert err.value.code.name == "DEADLINE_EXCEEDED"
            assert f"clock >= {2 - bound} (staleness {bound}); waiting for workers 1 (clock 0)" \
                in err.value.details


def test_an_abandoned_wait_frees_its_thread(procs: Procs) -> None:
    """Pulls for a clock that will not come, whose callers give up after 0.3 s: each frees
    its server thread at once (the wait looks whether its caller is still there) instead of
    holding it for --max-wait-s, so a server with 2 threads for data calls still answers
    afterwards."""
    server = procs.server(extra=["--mode", "sync", "--workers", "2", "--grpc-threads", "4",
                                 "--max-wait-s", "300"])
    with PSClient([server.address], worker=0) as client:
        client.declare_dense("w", (4,), optimizer="sgd", lr=1.0)
        request = pb.ExchangeRequest(worker=1, incarnation=1, pull_clock=5, wait_ms=300_000)
        request.pulls.add(table="w", dense=True)
        channel = grpc.insecure_channel(server.address)
        call = channel.unary_unary("/pstrain.v1.ParameterServer/Exchange")
        for _ in range(4):
            with pytest.raises(grpc.RpcError) as err:
                call(request.SerializeToString(), timeout=0.3)
            assert err.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        start = time.monotonic()
        time.sleep(0.5)  # ALIVE_POLL_S and a margin: the last wait has seen its caller go
        assert client.stats()[0].info.shard == 0
        assert time.monotonic() - start < 3
        channel.close()
    assert "Traceback" not in server.log()
