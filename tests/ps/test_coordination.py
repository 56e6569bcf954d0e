"""A server's checkpoint entries in Redis, signed with the job's secret: written by a real
server, altered in a real Redis, and skipped by `find_checkpoint` and a restarting server;
and how a server writes its snapshots, full or delta (`write_snapshot`)."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from procs import Procs, wait_until

from protos.partition import dense_placement, shard_of_keys
from ps import coordination
from ps.checkpoint import (
    CheckpointError,
    CheckpointLinkError,
    CheckpointUnsignedError,
    ShardState,
    TableState,
    list_checkpoints,
    mark_bad,
    read_checkpoint,
    read_manifest,
    read_shard,
    write_manifest,
    write_shard,
)
from ps.coordination import find_checkpoint, resharded_id, write_resharded, write_snapshot
from ps.reshard import reshard
from ps.shard import Exchange, Pull, Shard, ShardConfig
from ps.tables import DenseTable, OptimizerConfig, SparseTable, TableSpec
from scheduler.recovery import entry_signed
from scheduler.spec import JobSpec
from scheduler.store import JobStore
from worker.client import PSClient

JOB = "signed"


@dataclass(frozen=True)
class Job:
    """A one-shard job whose server (stopped by now) wrote checkpoints c1, then c2."""

    redis: str
    store: JobStore
    spec: JobSpec
    secret_file: Path
    secret: bytes
    directory: str


@pytest.fixture(scope="module")
def job(module_procs: Procs) -> Job:
    redis = module_procs.redis().address
    store = JobStore.connect(redis, JOB)
    directory = str(module_procs.workdir / "ckpt")
    spec = store.create_job(JobSpec(job=JOB, servers=1, heartbeat_interval_s=0.1,
                                    checkpoint_dir=directory), adopt=False)
    secret_file = module_procs.workdir / "secret"
    secret_file.write_text(os.urandom(32).hex())
    server = module_procs.server(extra=["--redis", redis, "--job", JOB, "--secret-file",
                                        str(secret_file)])
    # A request already pending when the server joins its job is an earlier run's: ask once
    # it has joined (its ready file comes first).
    wait_until(lambda: 0 in store.members("server"), 30, "the server to join its job")
    for checkpoint_id in ("c1", "c2"):
        store.request_checkpoint(checkpoint_id, -1)
        wait_until(listed(store, checkpoint_id), 30, f"checkpoint {checkpoint_id}")
    module_procs.kill(server)  # so that nothing relists an entry a test changes
    return Job(redis, store, spec, secret_file, secret_file.read_bytes().strip(), directory)


def listed(store: JobStore, checkpoint_id: str) -> Callable[[], object]:
    return lambda: store.checkpoint(checkpoint_id)


@pytest.fixture
def entries(job: Job) -> Iterator[dict[str, dict[str, Any]]]:
    """Shard 0's entry of c1 and c2 as the server wrote them; put back after the test."""
    written = {c: job.store.checkpoint(c)[0] for c in ("c1", "c2")}
    try:
        yield written
    finally:
        for checkpoint_id, entry in written.items():
            job.store.record_checkpoint(checkpoint_id, 0, entry)


def find(job: Job, secret: bytes | None = None) -> str:
    found = find_checkpoint(job.store, job.spec, 0, 1, JOB, job.directory, from_disk=False,
                            secret=job.secret if secret is None else secret)
    assert found is not None
    return found.state.checkpoint_id


def unsigned_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING
            and "not signed with the job's secret" in r.getMessage()]


def test_a_server_with_a_secret_signs_its_entries(job: Job,
                                                  entries: dict[str, dict[str, Any]]) -> None:
    for checkpoint_id, entry in entries.items():
        assert entry_signed(job.secret, JOB, checkpoint_id, 0, 1, entry), entry
        assert not entry_signed(b"x" * 32, JOB, checkpoint_id, 0, 1, entry)


Alter = Callable[[dict[str, dict[str, Any]]], dict[str, Any]]
ALTERATIONS: dict[str, Alter] = {
    "mac removed": lambda e: {k: v for k, v in e["c2"].items() if k != "mac"},
    "sha256 of c1": lambda e: {**e["c2"], "sha256": e["c1"]["sha256"]},
    "c1's entry": lambda e: e["c1"],
    "clock raised": lambda e: {**e["c2"], "clock": e["c2"]["clock"] + 1000},
    "mac of c1": lambda e: {**e["c2"], "mac": e["c1"]["mac"]},
}


@pytest.mark.parametrize("alter", ALTERATIONS.values(), ids=ALTERATIONS.keys())
def test_an_altered_entry_is_skipped_for_the_older_signed_one(
    job: Job, entries: dict[str, dict[str, Any]], alter: Alter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert find(job) == "c2"
    job.store.record_checkpoint("c2", 0, alter(entries))
    with caplog.at_level(logging.WARNING, logger="ps.coordination"):
        assert find(job) == "c1"
    warned = unsigned_warnings(caplog)
    assert len(warned) == 1, caplog.text
    assert "checkpoint 'c2'" in warned[0] and "shard 0" in warned[0], warned


def test_without_a_secret_entries_are_not_checked(job: Job,
                                                  entries: dict[str, dict[str, Any]]) -> None:
    job.store.record_checkpoint("c2", 0, ALTERATIONS["mac removed"](entries))
    assert find(job, secret=b"") == "c2"


def test_when_no_entry_is_signed_the_newest_one_s_error_is_raised(
        job: Job, entries: dict[str, dict[str, Any]]) -> None:
    for checkpoint_id, entry in entries.items():
        job.store.record_checkpoint(checkpoint_id, 0, {**entry, "mac": "0" * 64})
    with pytest.raises(CheckpointUnsignedError, match="shard 0 of checkpoint 'c2'"):
        find(job)


def test_entries_found_on_disk_are_signed_for_relisting(
        job: Job, entries: dict[str, dict[str, Any]]) -> None:
    # No store: what a server finds when Redis lists nothing (it came back empty).
    found = find_checkpoint(None, job.spec, 0, 1, JOB, job.directory, from_disk=False,
                            secret=job.secret)
    assert found is not None
    state, on_disk = found.state, found.entries
    assert state.checkpoint_id == "c2"
    assert entry_signed(job.secret, JOB, "c2", 0, 1, on_disk[0]), on_disk
    assert on_disk[0]["sha256"] == entries["c2"]["sha256"]


def restarted_beat(store: JobStore, pid: int) -> dict[str, Any] | None:
    beat = store.heartbeats("server", [0]).get(0)
    return beat if beat is not None and beat["pid"] == pid else None


def test_a_restarting_server_skips_an_entry_without_its_mac(
        procs: Procs, job: Job, entries: dict[str, dict[str, Any]]) -> None:
    job.store.record_checkpoint("c2", 0, ALTERATIONS["mac removed"](entries))
    server = procs.server(extra=["--redis", job.redis, "--job", JOB, "--secret-file",
                                 str(job.secret_file)])
    try:
        beat = wait_until(lambda: restarted_beat(job.store, server.pid), 30,
                          "the restarted server's heartbeat")
        assert beat["restored"] == "c1", beat  # type: ignore[index]
        warned = [line for line in server.log().splitlines()
                  if "WARNING" in line and "not signed with the job's secret" in line]
        assert len(warned) == 1, server.log()
        assert "checkpoint 'c2'" in warned[0] and "shard 0" in warned[0], warned
    finally:
        procs.kill(server)


# ---- a checkpoint of another shard count, found on disk ------------------------------------

ADAM = OptimizerConfig("adam", (("lr", 0.1),))
RESHARD_SPECS = [TableSpec("emb", "sparse", torch.float32, dim=4, optimizer=ADAM),
                 TableSpec("w", "dense", torch.float32, shape=(999, 20), optimizer=ADAM)]


def write_checkpoint(directory: Path, num_shards: int, checkpoint_id: str = "c7") -> None:
    """Checkpoint `checkpoint_id` of a trained job of `num_shards` servers, on disk."""
    keys = np.arange(0, 5000, 7, dtype=np.int64)
    for shard in range(num_shards):
        sparse = SparseTable(RESHARD_SPECS[0], shard, num_shards)
        mine = keys[shard_of_keys(keys, num_shards) == shard]
        sparse.pull(mine)
        sparse.apply(mine, torch.from_numpy(mine % 13).float()[:, None].expand(-1, 4),
                     assign=False)
        spec = RESHARD_SPECS[1]
        dense = DenseTable(spec, dense_placement("w", spec.shape, 4, num_shards)[shard])
        dense.apply([(0, torch.ones(dense.value.numel()))], assign=False)
        state = ShardState(JOB, shard, num_shards, checkpoint_id, 7, {
            "mode": "async", "open_clock": 7, "clocks": {"0": 7}, "live": [0], "ledger": []},
            [TableState("emb", RESHARD_SPECS[0].to_dict(), sparse.snapshot()),
             TableState("w", spec.to_dict(), dense.snapshot())])
        written = write_shard(directory, state)
        write_manifest(directory, checkpoint_id, JOB, 7, {shard: written}, num_shards)


def rows(states: list[ShardState]) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for state in states:
        table = next(t for t in state.tables if t.name == "emb").tensors
        for key, value, avg in zip(table["keys"].tolist(), table["value"].tolist(),
                                   table["state.exp_avg"].tolist(), strict=True):
            out[key] = value + avg
    return out


def test_a_server_of_another_count_restores_its_share_of_a_checkpoint_on_disk(
        tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 2)
    old = [read_shard(tmp_path / JOB / "c7" / f"shard-{k}-of-2.safetensors") for k in range(2)]
    spec = JobSpec(job=JOB, servers=3, checkpoint_dir=str(tmp_path), run_id="run-2")
    found = [find_checkpoint(None, spec, k, 3, JOB, str(tmp_path), from_disk=True)
             for k in range(3)]
    assert all(f is not None and f.resharded_from == 2 and not f.entries for f in found)
    shares = [f.state for f in found if f is not None]
    assert [(s.shard, s.num_shards, s.checkpoint_id) for s in shares] == [
        (k, 3, "c7") for k in range(3)]
    assert rows(shares) == rows(old)
    # Each writes its share under the job's count: a complete checkpoint once all three have.
    written = [write_resharded(str(tmp_path), f, spec, b"") for f in found if f is not None]
    assert {w.state.checkpoint_id for w in written} == {resharded_id("c7", 3)} == {"c7.on-3"}
    newest = list_checkpoints(tmp_path, JOB)[-1]
    assert (newest.checkpoint_id, newest.num_shards, newest.complete, newest.run) == (
        "c7.on-3", 3, True, "run-2")
    assert [w.entries[w.state.shard]["sha256"] for w in written] == [
        newest.shards[k].sha256 for k in range(3)]
    # Written again (a server restarted before all were), the same bytes.
    again = write_resharded(str(tmp_path), found[1], spec, b"")  # type: ignore[arg-type]
    assert again.entries[1]["sha256"] == newest.shards[1].sha256
    # Now a restart finds the checkpoint of its own count.
    restart = find_checkpoint(None, spec, 1, 3, JOB, str(tmp_path), from_disk=True)
    assert restart is not None and restart.resharded_from == 0
    assert restart.state.checkpoint_id == "c7.on-3"


@pytest.mark.parametrize("cores", [1, 8])  # old files read one at a time, or side by side
@pytest.mark.parametrize(("old", "new", "reads"), [
    (2, 3, [[0], [0, 1], [1]]), (3, 2, [[0, 1], [1, 2]]), (1, 2, [[0], [0]])])
def test_a_server_reads_only_the_old_shard_files_that_hold_its_rows(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, old: int, new: int,
        reads: list[list[int]], cores: int) -> None:
    write_checkpoint(tmp_path, old)
    monkeypatch.setattr(coordination, "_cores", lambda: cores)
    loaded: list[int] = []
    threads: set[str] = set()
    original = coordination.load_checkpoint

    def load(*args: Any) -> ShardState:
        loaded.append(args[3])  # (directory, job, checkpoint_id, shard, ...)
        threads.add(threading.current_thread().name)
        time.sleep(0.05)  # long enough that a second reader, if any, starts meanwhile
        return original(*args)

    spec = JobSpec(job=JOB, servers=new, checkpoint_dir=str(tmp_path))
    shares = []
    for k in range(new):
        loaded.clear()
        with monkeypatch.context() as m:
            m.setattr(coordination, "load_checkpoint", load)
            found = find_checkpoint(None, spec, k, new, JOB, str(tmp_path), from_disk=True)
        assert found is not None and found.resharded_from == old
        assert sorted(loaded) == reads[k]  # read side by side: in any order
        shares.append(found.state)
    assert len(threads) == (2 if cores == 8 and old > 1 else 1)
    old_states = [read_shard(tmp_path / JOB / "c7" / f"shard-{k}-of-{old}.safetensors")
                  for k in range(old)]
    assert rows(shares) == rows(old_states)
    # Reading only the rows that route here gives what cutting the whole files gives, to
    # the byte and in the same order.
    for k, share in enumerate(shares):
        whole = reshard(old_states, k, new)
        assert share.meta == whole.meta
        assert [t.name for t in share.tables] == [t.name for t in whole.tables]
        for mine, theirs in zip(share.tables, whole.tables, strict=True):
            assert mine.tensors.keys() == theirs.tensors.keys()
            for name, tensor in mine.tensors.items():
                assert tensor.dtype == theirs.tensors[name].dtype
                assert torch.equal(tensor, theirs.tensors[name]), (k, mine.name, name)


def test_a_missing_file_of_the_old_checkpoint_is_named_and_every_server_passes_it_over(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    write_checkpoint(tmp_path, 3, "c6")
    write_checkpoint(tmp_path, 3, "c7")
    (tmp_path / JOB / "c7" / "shard-2-of-3.safetensors").unlink()
    spec = JobSpec(job=JOB, servers=2, checkpoint_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="ps.checkpoint"):
        found = [find_checkpoint(None, spec, k, 2, JOB, str(tmp_path), from_disk=True)
                 for k in range(2)]
    # Shard 0 of 2 would not read that file, but it too restores the older one: the servers
    # of a job restore one cut.
    assert [f.state.checkpoint_id if f else None for f in found] == ["c6", "c6"]
    assert "skipping corrupt checkpoint c7" in caplog.text
    assert "shard-2-of-3.safetensors is missing" in caplog.text


def test_a_directory_with_only_this_server_s_entries_says_what_is_missing(
        tmp_path: Path) -> None:
    # What a server sees in a checkpoint directory of its own, not shared: its own entries.
    write_checkpoint(tmp_path, 2)
    (tmp_path / JOB / "c7" / "shard-1.json").unlink()
    spec = JobSpec(job=JOB, servers=3, checkpoint_dir=str(tmp_path))
    with pytest.raises(CheckpointError, match=r"lacks shard-1\.json\. Resharding needs one "
                                              r"checkpoint directory shared by all servers"):
        find_checkpoint(None, spec, 0, 3, JOB, str(tmp_path), from_disk=True)


# ---- writing snapshots: full or delta ----------------------------------------------------------


def _delta_shard(full_every: int = 10) -> Shard:
    shard = Shard(ShardConfig(shard=0, num_shards=1, job=JOB,
                              checkpoint_full_every=full_every))
    shard.declare([TableSpec("emb", "sparse", torch.float32, dim=2)])
    return shard


def _touch(shard: Shard, *keys: int) -> None:
    shard.exchange(Exchange(worker=0, incarnation=1, generation=0, push_clock=0, pushes=[],
                            end_iteration=False, pull_clock=0,
                            pulls=[Pull("emb", np.array(keys, dtype=np.int64))]))


def test_a_failed_write_makes_the_next_snapshot_full(tmp_path: Path) -> None:
    shard = _delta_shard()
    write_snapshot(shard, str(tmp_path), shard.snapshot("c1"))
    _touch(shard, 1)
    (tmp_path / JOB / "c2").write_text("a file where the checkpoint's directory goes")
    failing = shard.snapshot("c2")
    assert failing.kind == "delta"
    with pytest.raises(CheckpointError, match="c2"):
        write_snapshot(shard, str(tmp_path), failing)
    _touch(shard, 2)
    after = shard.snapshot("c3")
    assert (after.kind, after.base) == ("full", "")  # the rows of c2 are in it
    write_snapshot(shard, str(tmp_path), after)
    keys = read_checkpoint(tmp_path, JOB, "c3", 0, 1,
                           read_manifest(tmp_path / JOB / "c3").shards[0].sha256
                           ).tables[0].tensors["keys"]
    assert sorted(keys.tolist()) == [1, 2]


def test_without_hard_links_every_later_snapshot_is_full(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shard = _delta_shard()
    write_snapshot(shard, str(tmp_path), shard.snapshot("c1"))

    def no_links(src: object, dst: object) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    with pytest.raises(CheckpointLinkError, match="--checkpoint-full-every 1"):
        write_snapshot(shard, str(tmp_path), shard.snapshot("c2"))
    for checkpoint_id in ("c3", "c4"):
        state = shard.snapshot(checkpoint_id)
        assert state.kind == "full"
        write_snapshot(shard, str(tmp_path), state)


def test_a_server_passes_over_deltas_built_on_a_checkpoint_marked_bad(tmp_path: Path) -> None:
    shard = _delta_shard()
    for i in range(4):  # c0 full, c1..c3 deltas
        _touch(shard, i)
        write_snapshot(shard, str(tmp_path), shard.snapshot(f"c{i}"), run="r")
    spec = JobSpec(job=JOB, checkpoint_dir=str(tmp_path), run_id="r")
    found = find_checkpoint(None, spec, 0, 1, JOB, str(tmp_path), from_disk=False)
    assert found is not None
    state, entries, _ = found
    assert state.checkpoint_id == "c3" and state.kind == "full"
    assert sorted(state.tables[0].tensors["keys"].tolist()) == [0, 1, 2, 3]
    assert (entries[0]["kind"], entries[0]["base"], entries[0]["chain"]) == (
        "delta", "c2", ["c0", "c1", "c2"])
    mark_bad(tmp_path, JOB, "c1", "shard 0: damaged")
    found = find_checkpoint(None, spec, 0, 1, JOB, str(tmp_path), from_disk=False)
    assert found is not None and found[0].checkpoint_id == "c0"


def test_a_checkpoint_asked_while_one_is_written_is_cut_after_that_write(
        procs: Procs) -> None:
    """A server keeps one copy of its tables waiting for a (paced) write at a time: a
    checkpoint asked meanwhile is cut once the write ends, so it holds what came after."""
    redis = procs.redis().address
    store = JobStore.connect(redis, "paced")
    directory = str(procs.workdir / "ckpt")
    store.create_job(JobSpec(job="paced", servers=1, heartbeat_interval_s=0.1, mode="async",
                             checkpoint_dir=directory, checkpoint_full_every=1,
                             checkpoint_write_mb_s=1.0), adopt=False)
    server = procs.server(extra=["--redis", redis, "--job", "paced"])
    wait_until(lambda: 0 in store.members("server"), 30, "the server to join its job")
    with PSClient([server.address]) as client:
        client.declare_dense("w", [500_000], optimizer="sgd", lr=1.0)  # 2 MB: 2 s at 1 MB/s
        store.request_checkpoint("c1", -1)
        wait_until(lambda: list(Path(directory).glob("paced/c1/.shard-*.tmp-*")), 10,
                   "the write of c1 to begin")
        store.request_checkpoint("c2", -1)
        time.sleep(0.5)  # five heartbeats: a server that cut at once has cut c2 by now
        client.push_dense("w", torch.ones(500_000))
        assert not store.checkpoint("c1")  # still being written
        wait_until(lambda: store.checkpoint("c2"), 30, "checkpoint c2")
    procs.kill(server)

    def value(checkpoint_id: str) -> torch.Tensor:
        entry = store.checkpoint(checkpoint_id)[0]
        state = read_checkpoint(directory, "paced", checkpoint_id, 0, 1, entry["sha256"])
        return next(t for t in state.tables if t.name == "w").tensors["value"]

    assert torch.equal(value("c1"), torch.zeros(500_000))
    assert torch.equal(value("c2"), torch.full((500_000,), -1.0))


def test_a_server_told_to_stop_finishes_the_checkpoint_it_is_writing(procs: Procs) -> None:
    """SIGTERM during a (paced) checkpoint write: the server lets the write finish and lists
    it before it exits, as at the end of a job, rather than leave half a directory."""
    redis = procs.redis().address
    store = JobStore.connect(redis, "drained")
    directory = str(procs.workdir / "ckpt")
    store.create_job(JobSpec(job="drained", servers=1, heartbeat_interval_s=0.1, mode="async",
                             checkpoint_dir=directory, checkpoint_write_mb_s=1.0), adopt=False)
    server = procs.server(extra=["--redis", redis, "--job", "drained"])
    wait_until(lambda: 0 in store.members("server"), 30, "the server to join its job")
    with PSClient([server.address]) as client:
        client.declare_dense("w", [500_000], optimizer="sgd", lr=1.0)  # 2 MB: 2 s at 1 MB/s
        client.push_dense("w", torch.ones(500_000))
    store.request_checkpoint("last", -1)
    wait_until(lambda: list(Path(directory).glob("drained/last/.shard-*.tmp-*")), 10,
               "the write to begin")
    os.kill(server.pid, signal.SIGTERM)
    assert server.popen.wait(timeout=30) == 0, server.log()[-3000:]
    entry = store.checkpoint("last")[0]
    state = read_checkpoint(directory, "drained", "last", 0, 1, entry["sha256"])
    assert torch.equal(next(t for t in state.tables if t.name == "w").tensors["value"],
                       torch.full((500_000,), -1.0))
    assert read_manifest(Path(directory) / "drained" / "last").complete
    assert not list(Path(directory).glob("drained/last/.shard-*.tmp-*"))
