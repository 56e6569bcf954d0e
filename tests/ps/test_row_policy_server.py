"""Admission and eviction as served: real server processes, a real Redis, a checkpoint
written by the server and restored by its successor."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from procs import Procs, wait_until

from ps.initializers import InitSpec, init_rows
from scheduler.spec import JobSpec
from scheduler.store import JobStore
from worker.client import PSClient
from worker.errors import PSClientError

JOB = "budget"
INIT = ("uniform", -1.0, 1.0)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def table_stats(client: PSClient, name: str) -> Any:
    return next(t for s in client.stats() for t in s.tables if t.name == name)


def initial(keys: np.ndarray, dim: int, seed: int) -> torch.Tensor:
    return init_rows(keys, dim, InitSpec(*INIT), seed, torch.float32)


@pytest.fixture(scope="module")
def client(module_procs: Procs) -> Iterator[PSClient]:
    server = module_procs.server()
    with PSClient([server.address]) as c:
        yield c


def status(redis: str) -> str:
    done = subprocess.run([sys.executable, "-m", "scheduler.cli", "status", "--redis", redis,
                           "--job", JOB], capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0, done.stderr
    return done.stdout


def declare(client: PSClient) -> None:
    client.declare_sparse("clicks", 4, admit="count:3", admit_default=0.5, init=INIT, seed=1)
    client.declare_sparse("lru", 4, max_rows=3, init=INIT, seed=2, optimizer="sgd", lr=1.0)


def test_admission_counts_and_eviction_survive_a_restart_from_a_checkpoint(
        procs: Procs) -> None:
    redis = procs.redis().address
    store = JobStore.connect(redis, JOB)
    store.create_job(JobSpec(job=JOB, servers=1, heartbeat_interval_s=0.1, mode="async",
                             checkpoint_dir=str(procs.workdir / "ckpt")), adopt=False)
    server = procs.server(extra=["--redis", redis, "--job", JOB])
    seven, lru = np.array([7], dtype=np.int64), np.arange(1, 6, dtype=np.int64)
    with PSClient([server.address]) as client:
        declare(client)
        for _ in range(2):  # two sights of 7: no row yet, the default row
            assert torch.equal(client.pull_sparse("clicks", seven), torch.full((1, 4), 0.5))
        for key in lru:  # one push per exchange: 1 and 2 are evicted, 3, 4, 5 are left
            client.push_sparse("lru", key.reshape(1), torch.ones(1, 4))
        stats = table_stats(client, "clicks")
        assert (stats.rows, stats.admitted, stats.refused_by_admission) == (0, 0, 2)
        assert stats.metadata_bytes >= 4 << 20  # the sketch
        stats = table_stats(client, "lru")
        assert (stats.rows, stats.admitted, stats.evicted) == (3, 5, 2)
        # `pstrain status` shows them, from the server's heartbeat.
        wait_until(lambda: "lru" in status(redis), 10, "the tables in pstrain status")
        line = next(x for x in status(redis).splitlines() if " lru " in x)
        assert line.split()[1:3] + line.split()[5:] == ["lru", "3", "5", "0", "2", "0"], line
        store.request_checkpoint("c1", -1)
        wait_until(lambda: store.checkpoint("c1"), 30, "checkpoint c1")
    procs.kill(server)

    server = procs.server(extra=["--redis", redis, "--job", JOB])
    with PSClient([server.address]) as client:
        declare(client)  # the same specs: the restored tables stay
        # The third sight admits 7: the restored sketch kept the first two.
        got = client.pull_sparse("clicks", seven)
        torch.testing.assert_close(got, initial(seven, 4, 1))
        assert table_stats(client, "clicks").rows == 1
        # The checkpoint held the rows left; the evicted ones start again from their seed.
        rows = client.pull_sparse("lru", lru)
        torch.testing.assert_close(rows[2:], initial(lru[2:], 4, 2) - 1.0)
        torch.testing.assert_close(rows[:2], initial(lru[:2], 4, 2))
        stats = table_stats(client, "lru")
        assert (stats.rows, stats.readmitted) == (3, 2)
    procs.kill(server)


@pytest.mark.parametrize(
    ("options", "named"),
    [({"admit": "count:0"}, "admit 'count:0' is not a valid count"),
     ({"admit": "maybe"}, "admit 'maybe' is not an admission rule"),
     ({"max_rows": -1}, "max_rows must be >= 0 (0: no limit), got -1"),
     ({"ttl_s": -2.0}, "ttl_s must be finite and >= 0 (0: off), got -2.0")],
)
def test_bad_options_are_refused_naming_the_value(
        client: PSClient, options: dict[str, object], named: str) -> None:
    with pytest.raises(PSClientError, match="INVALID_ARGUMENT") as err:
        client.declare_sparse("bad", 4, **options)  # type: ignore[arg-type]
    assert named in str(err.value)


def test_evicted_slots_are_reused_so_server_memory_stays_flat(
        client: PSClient, module_procs: Procs) -> None:
    dim, rows = 64, 4000
    client.declare_sparse("churn", dim, max_rows=rows, optimizer="adagrad", lr=0.1)
    pid = module_procs.started[0].pid
    grads = torch.ones(rows, dim)

    def cycle(k: int) -> None:
        keys = np.arange(k * rows, (k + 1) * rows, dtype=np.int64)
        client.pull_sparse("churn", keys)
        client.push_sparse("churn", keys, grads)

    # Warm-up: by the end of it every server thread that may answer has its buffers.
    for k in range(10):
        cycle(k)
    before = rss_bytes(pid)
    for k in range(10, 30):
        cycle(k)
    grown = rss_bytes(pid) - before
    stats = table_stats(client, "churn")
    assert (stats.rows, stats.evicted) == (rows, 29 * rows)
    # 20 cycles of new rows without reuse: 20 * 4000 * 64 * 8 bytes (values and Adagrad
    # state) = 41 MB.
    assert grown < 4 << 20, f"server RSS grew {grown / 2**20:.1f} MiB"



