"""Write-behind applies: answered pushes apply after the answer, and every read waits for them."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from procs import Procs

from protos import modes
from ps.behind import WriteBehind
from ps.errors import ApplyFailedError
from ps.shard import PushMeta, Shard, ShardConfig
from ps.tables import DenseTable, InitSpec, OptimizerConfig, TableSpec
from worker.client import PSClient

ROWS, COLS = 8, 4


# ---- the queue alone -------------------------------------------------------------------------


def test_applies_run_in_the_order_they_were_queued_across_tables() -> None:
    behind = WriteBehind("t")
    ran: list[tuple[str, int]] = []
    for i in range(20):
        table = "ab"[i % 2]
        behind.settle(table)
        behind.submit(table, lambda table=table, i=i: ran.append((table, i)))  # type: ignore[misc]
    behind.settle_all()
    assert ran == [("ab"[i % 2], i) for i in range(20)]
    assert behind.pending() == 0


def test_settle_waits_for_the_queued_apply_of_its_table_only() -> None:
    behind = WriteBehind("t")
    release = threading.Event()
    behind.submit("slow", release.wait)
    behind.settle("other")  # nothing queued for it: returns at once
    settled = threading.Event()
    waiter = threading.Thread(target=lambda: (behind.settle("slow"), settled.set()))
    waiter.start()
    assert not settled.wait(0.2)
    release.set()
    assert settled.wait(5)
    waiter.join()


def test_a_failed_apply_poisons_its_table_until_forgotten() -> None:
    behind = WriteBehind("t")

    def boom() -> None:
        raise MemoryError("no room for the optimizer state")

    behind.submit("bad", boom)
    behind.submit("good", lambda: None)
    for _ in range(2):  # every later access fails, not only the first
        with pytest.raises(ApplyFailedError, match=r"table 'bad' failed to apply.*no room"):
            behind.settle("bad")
    with pytest.raises(ApplyFailedError):
        behind.settle_all()
    behind.settle("good")
    behind.forget()
    behind.settle("bad")
    assert behind.pending() == 0


# ---- in a shard ------------------------------------------------------------------------------


def _shard(mode: str = "async", write_behind: bool = True) -> Shard:
    shard = Shard(ShardConfig(shard=0, num_shards=1, mode=modes.parse(mode),
                              write_behind=write_behind))
    shard.declare([TableSpec("w", "dense", torch.float32, shape=(ROWS, COLS),
                             init=InitSpec("constant", 1.0),
                             optimizer=OptimizerConfig("sgd", (("lr", 1.0),)))])
    return shard


def _parts(grad: torch.Tensor) -> Iterator[tuple[int, torch.Tensor]]:
    yield 0, grad.reshape(-1)


class _Gate:
    """Holds every apply of a dense table until released, counting them."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open = threading.Event()
        self.started = threading.Event()
        self.applied = 0
        real = DenseTable.apply

        def gated(table: DenseTable, *args: Any) -> None:
            self.started.set()
            assert self.open.wait(10)
            real(table, *args)
            self.applied += 1

        monkeypatch.setattr(DenseTable, "apply", gated)


def _push(shard: Shard, seq: int, grad: torch.Tensor, owned: bool = True) -> None:
    shard.push_dense("w", PushMeta(worker=0, incarnation=1, seq=seq), torch.float32,
                     (ROWS, COLS), _parts(grad), owned=owned)


def _in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    thread = threading.Thread(target=lambda: out.append(fn()))
    thread.start()
    return thread, out


def test_a_push_is_answered_before_its_apply_and_a_pull_waits_for_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shard = _shard()
    gate = _Gate(monkeypatch)
    _push(shard, 1, torch.full((ROWS, COLS), 0.25))  # returns while the apply is held
    assert gate.started.wait(5) and gate.applied == 0
    puller, pulled = _in_thread(lambda: shard.pull_dense("w", 0, 0).clone())
    time.sleep(0.2)
    assert puller.is_alive() and not pulled
    gate.open.set()
    puller.join(5)
    assert torch.equal(pulled[0], torch.full((ROWS, COLS), 0.75))


def test_pushes_to_one_table_apply_in_order_and_snapshots_include_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shard = _shard()
    gate = _Gate(monkeypatch)
    _push(shard, 1, torch.full((ROWS, COLS), 0.25))
    # The second push waits for the first one's apply before queueing its own.
    second, _ = _in_thread(lambda: _push(shard, 2, torch.full((ROWS, COLS), 0.5)))
    time.sleep(0.2)
    assert second.is_alive()
    gate.open.set()
    second.join(5)
    state = shard.snapshot("now")
    assert gate.applied == 2
    assert torch.equal(state.tables[0].tensors["value"], torch.full((ROWS, COLS), 0.25))
    assert [s.counters.pushes_applied for s, _ in shard.stats()] == [2]


def test_sync_tables_and_borrowed_buffers_apply_before_the_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gate = _Gate(monkeypatch)
    gate.open.set()
    for shard, owned in ((_shard(write_behind=False), True), (_shard(), False)):
        before = gate.applied
        _push(shard, 1, torch.full((ROWS, COLS), 0.25), owned=owned)
        assert gate.applied == before + 1
    # Sync sums pushes and applies when the clock closes: nothing goes behind.
    shard = _shard(mode="sync")
    shard.set_live([0])
    _push(shard, 1, torch.full((ROWS, COLS), 0.25))
    assert shard._behind.pending() == 0


def test_a_failed_apply_fails_every_later_access_until_a_restore(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    shard = _shard()
    state = shard.snapshot("before")

    def broken(table: DenseTable, *args: Any) -> None:
        raise RuntimeError("optimizer bug")

    monkeypatch.setattr(DenseTable, "apply", broken)
    _push(shard, 1, torch.full((ROWS, COLS), 0.25))  # acknowledged: the failure comes later
    with pytest.raises(ApplyFailedError, match=r"table 'w' failed to apply.*optimizer bug"):
        shard.pull_dense("w", 0, 0)
    with pytest.raises(ApplyFailedError):
        _push(shard, 2, torch.full((ROWS, COLS), 0.25))
    with pytest.raises(ApplyFailedError):
        shard.snapshot("after")
    monkeypatch.undo()
    shard.restore(state)
    assert torch.equal(shard.pull_dense("w", 0, 0), torch.ones(ROWS, COLS))


def test_stats_wait_for_queued_applies_and_never_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    """Heartbeats and metrics read stats; a poisoned table must not stop them."""
    shard = _shard()

    def broken(table: DenseTable, *args: Any) -> None:
        raise RuntimeError("optimizer bug")

    monkeypatch.setattr(DenseTable, "apply", broken)
    _push(shard, 1, torch.full((ROWS, COLS), 0.25))
    assert [s.name for s, _ in shard.stats()] == ["w"]
    with pytest.raises(ApplyFailedError):
        shard.pull_dense("w", 0, 0)


# ---- real processes --------------------------------------------------------------------------


def test_a_pull_from_another_client_sees_every_answered_push(procs: Procs) -> None:
    """End to end on a real server: every answered push applied once, in order, as
    torch.optim.Adam would, seen by a pull from another client sent the moment the push
    returns, and counted in stats. (Whether that pull overlaps the apply depends on timing;
    the gated tests above make the overlap certain.)"""
    server = procs.server(extra=["--transport", "grpc"])
    rows, cols = 4096, 1024
    with PSClient([server.address], transport="grpc") as pusher, \
            PSClient([server.address], transport="grpc") as puller:
        for client in (pusher, puller):
            client.declare_dense("big", (rows, cols), optimizer="adam", lr=0.5)
        reference = torch.zeros(rows, cols, requires_grad=True)
        optim = torch.optim.Adam([reference], lr=0.5)
        for step in range(6):
            grad = torch.full((rows, cols), float(step + 1)) * torch.linspace(-1, 1, cols)
            pusher.push_dense("big", grad)
            reference.grad = grad
            optim.step()
            assert torch.allclose(puller.pull_dense("big"), reference.detach(), atol=1e-6), step
        stats = {t.name: t for t in puller.stats()[0].tables}
        assert stats["big"].pushes_applied == 6
