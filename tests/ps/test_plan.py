"""`pstrain plan`: table declarations in, memory per server out, against a measured run."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from procs import Procs

from ps.errors import InvalidArgumentError
from ps.plan import main as plan_main
from ps.plan import parse_table, plan_table
from ps.tables import SparseTable
from worker.client import PSClient


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


@pytest.mark.parametrize(
    ("text", "message"),
    [("t:ids=5", "give NAME:dim=D,ids=N"),
     ("t:dim=4,ids=5,colour=red", "unknown colour"),
     ("t:dim=4,ids=5,dtype=int8x", "a value is not valid"),
     ("t:dim=4,ids=many", "a value is not valid"),
     ("t:dim=4,ids=5,admit=count:0", "admit 'count:0' is not a valid count"),
     ("t:dim=4,ids", "'ids' is not key=value")],
)
def test_a_bad_table_is_refused_quoting_it(text: str, message: str) -> None:
    with pytest.raises(InvalidArgumentError, match=message):
        parse_table(text)


def test_the_plan_counts_what_the_server_counts() -> None:
    spec, ids = parse_table("u:dim=8,ids=1e6,dtype=float16,optimizer=adagrad,max_rows=200000,"
                            "admit=prob:0.5")
    plan = plan_table(spec, ids, 4)
    assert plan.rows == 200_000  # the fullest server's share, capped by max_rows
    # Values, Adagrad's state, the change mark, the stamps (an int32 clock and float32
    # seconds) and the share of the evicted keys a delta lists.
    assert plan.row_bytes == SparseTable.row_bytes(spec) == 8 * 2 + 8 * 4 + 1 + 4 + 4 + 1
    # Storage doubles up to max_rows, not to the next power of two (262,144): the table
    # evicts before it creates rows.
    assert plan.capacity == 200_000 and plan.index_slots == 524_288
    assert plan.memory_bytes == SparseTable.bytes_for(spec, 200_000, 524_288)
    even = plan_table(parse_table("v:dim=4,ids=400000")[0], 400_000, 4)
    assert 100_000 < even.rows < 100_000 + 4 * 300  # mean plus 4 sigma of a binomial


def test_pstrain_plan_prints_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "scheduler.cli", "plan", "--servers", "2",
         "--table", "user:dim=64,ids=1e7,dtype=bfloat16,optimizer=rowwise_adagrad"],
        capture_output=True, text=True, timeout=60, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "user" in done.stdout and "per server (the fullest of 2)" in done.stdout
    assert plan_main(["--table", "x:dim=0"]) == 2
    assert "give NAME:dim=D,ids=N" in capsys.readouterr().err


def test_the_plan_is_within_ten_percent_of_a_measured_run(procs: Procs) -> None:
    server = procs.server(extra=["--mode", "async"])
    ids, dim, batch = 300_000, 32, 8192
    spec, _ = parse_table(f"emb:dim={dim},ids={ids},optimizer=adagrad")
    plan = plan_table(spec, ids, 1)
    keys = np.arange(ids, dtype=np.int64) * 7919 + 3
    ones = torch.ones(batch, dim)
    with PSClient([server.address]) as client:
        # A first table takes what growing a table allocates besides its rows: request
        # buffers and the small early copies of storage that the heap keeps for reuse.
        client.declare_sparse("warm", dim, optimizer="adagrad", lr=0.1)
        for start in range(0, 8 * batch, batch):
            client.push_sparse("warm", -keys[start:start + batch], ones)
        before = rss_bytes(server.pid)
        client.declare_sparse("emb", dim, optimizer="adagrad", lr=0.1)
        for start in range(0, ids, batch):
            part = keys[start:start + batch]
            client.push_sparse("emb", part, ones[:len(part)])
        stats = next(t for t in client.stats()[0].tables if t.name == "emb")
    grown = rss_bytes(server.pid) - before
    assert stats.rows == plan.rows == ids
    assert abs(stats.memory_bytes - plan.memory_bytes) <= 0.1 * plan.memory_bytes, (
        stats.memory_bytes, plan)
    # Resident memory follows the rows written (spare capacity is never touched): the
    # plan's figure for storage sized to the rows.
    assert abs(grown - plan.budget_bytes) <= 0.1 * plan.budget_bytes, (grown, plan)
