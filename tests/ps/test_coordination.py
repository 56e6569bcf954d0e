"""A server's checkpoint entries in Redis, signed with the job's secret: written by a real
server, altered in a real Redis, and skipped by `find_checkpoint` and a restarting server;
and how a server writes its snapshots, full or delta (`write_snapshot`)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from procs import Procs, wait_until

from ps.checkpoint import (
    CheckpointError,
    CheckpointLinkError,
    CheckpointUnsignedError,
    mark_bad,
    read_checkpoint,
    read_manifest,
)
from ps.coordination import find_checkpoint, write_snapshot
from ps.shard import Exchange, Pull, Shard, ShardConfig
from ps.tables import TableSpec
from scheduler.recovery import entry_signed
from scheduler.spec import JobSpec
from scheduler.store import JobStore

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
    return found[0].checkpoint_id


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
    state, on_disk = found
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
    state, entries = found
    assert state.checkpoint_id == "c3" and state.kind == "full"
    assert sorted(state.tables[0].tensors["keys"].tolist()) == [0, 1, 2, 3]
    assert (entries[0]["kind"], entries[0]["base"], entries[0]["chain"]) == (
        "delta", "c2", ["c0", "c1", "c2"])
    mark_bad(tmp_path, JOB, "c1", "shard 0: damaged")
    found = find_checkpoint(None, spec, 0, 1, JOB, str(tmp_path), from_disk=False)
    assert found is not None and found[0].checkpoint_id == "c0"
