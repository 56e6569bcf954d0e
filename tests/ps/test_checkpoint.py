"""Shard checkpoint files and manifests: round trips, integrity, atomicity, concurrent writers."""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from protos import modes
from protos.modes import Kind, Mode
from protos.partition import route_hash, shard_of_keys
from ps import checkpoint as ckpt
from ps.checkpoint import (
    CheckpointCorruptError,
    CheckpointError,
    ShardFile,
    ShardState,
    TableState,
    bad_reason,
    latest_complete,
    list_checkpoints,
    load_checkpoint,
    read_checkpoint,
    read_manifest,
    read_shard,
    write_manifest,
    write_shard,
)
from ps.errors import InvalidArgumentError
from ps.shard import DensePush, Exchange, Pull, PushMeta, PushOutcome, Shard, ShardConfig
from ps.tables import TableSpec

REPO = Path(__file__).resolve().parents[2]
JOB = "job-1"


def _state(
    checkpoint_id: str = "c000001",
    shard: int = 0,
    num_shards: int = 1,
    tables: list[TableState] | None = None,
    meta: dict[str, object] | None = None,
) -> ShardState:
    if tables is None:
        tables = [TableState("emb", {"dim": 4}, {"value": torch.arange(12.0).reshape(3, 4)})]
    return ShardState(
        job=JOB, shard=shard, num_shards=num_shards, checkpoint_id=checkpoint_id, clock=42,
        meta=meta if meta is not None else {"mode": "sync"}, tables=tables,
    )


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (so NaNs and float8 compare too)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return bool(torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)))


def _every_dtype() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    out: dict[str, torch.Tensor] = {}
    for dtype in ckpt._DTYPE_TO_ST:
        raw = torch.randint(0, 256, (5, 3 * dtype.itemsize), dtype=torch.uint8, generator=gen)
        out[str(dtype)] = raw.view(dtype)  # every bit pattern, NaNs included
    out["empty_rows"] = torch.empty(0, 64, dtype=torch.float32)
    out["empty_1d"] = torch.empty(0, dtype=torch.int64)
    out["scalar_step"] = torch.tensor(7, dtype=torch.int64)
    out["scalar_bf16"] = torch.tensor(1.5, dtype=torch.bfloat16)
    out["transposed"] = torch.arange(6.0).reshape(2, 3).t()  # not contiguous
    return out


# ---- pacing ---------------------------------------------------------------------------------


class _FakeTime:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_a_pace_sleeps_only_when_the_writer_is_ahead_of_its_rate() -> None:
    fake = _FakeTime()
    pace = ckpt.Pace(1e6, clock=lambda: fake.now, sleep=fake.sleep)
    pace.wrote(500_000)  # 0.5 s of budget used at once: sleeps it out
    assert fake.slept == [pytest.approx(0.5)]
    fake.now += 2.0  # the writer was slow (a busy disk): it may catch up without sleeping
    pace.wrote(1_000_000)
    assert fake.slept == [pytest.approx(0.5)]
    pace.wrote(2_000_000)  # 3.5 MB by 2.5 s: 1 s ahead
    assert fake.slept[-1] == pytest.approx(1.0)
    assert fake.now == pytest.approx(3.5)


def test_a_pace_of_zero_never_sleeps_and_a_negative_one_is_refused() -> None:
    fake = _FakeTime()
    pace = ckpt.Pace(0.0, clock=lambda: fake.now, sleep=fake.sleep)
    pace.wrote(10**12)
    assert fake.slept == []
    with pytest.raises(CheckpointError, match=r"write rate must be >= 0 bytes/s .* got -1"):
        ckpt.Pace(-1.0)


def test_a_paced_write_takes_its_time_and_writes_the_same_file(tmp_path: Path) -> None:
    values = torch.arange(3 * 2**18, dtype=torch.float32).reshape(-1, 64)  # 3 MiB
    keys = torch.randperm(len(values), generator=torch.Generator().manual_seed(1))
    state = _state(tables=[  # the keyed table's rows are gathered in routing order
        TableState("emb", {"dim": 64}, {"value": values}),
        TableState("rows", {"dim": 64},
                   {"keys": keys, "value": keys[:, None].float().repeat(1, 64)})])
    fast = write_shard(tmp_path / "fast", state)
    started = time.monotonic()
    paced = write_shard(tmp_path / "paced", state, max_bytes_per_s=10e6)
    took = time.monotonic() - started
    assert took >= fast.nbytes / 10e6 * 0.95  # about 0.63 s: 6 MiB at 10 MB/s
    assert paced.sha256 == fast.sha256
    assert Path(paced.path).read_bytes() == Path(fast.path).read_bytes()
    rows = read_shard(paced.path, paced.sha256).tables[1].tensors
    assert torch.equal(rows["value"], rows["keys"][:, None].float().repeat(1, 64))
    assert not torch.equal(rows["keys"], keys)  # they were reordered


# ---- round trips ----------------------------------------------------------------------------


def test_round_trip_every_dtype_and_shape(tmp_path: Path) -> None:
    tensors = _every_dtype()
    written = write_shard(tmp_path, _state(tables=[TableState("t", {}, tensors)]))
    back = read_shard(written.path, written.sha256)
    assert list(back.tables[0].tensors) == list(tensors)  # order kept too
    for name, tensor in tensors.items():
        assert _same(back.tables[0].tensors[name], tensor.contiguous()), name


def test_round_trip_names_meta_and_specs(tmp_path: Path) -> None:
    names = ["a/b", "a%2Fb", "", "ünïcødé/表 ✓", "..", "x" * 300, "state.sum"]
    tables = [
        TableState(name, {"i": i, "name": name, "nested": {"l": [1, 2.5, None, True]}},
                   {name: torch.full((2,), float(i)), "state/exp_avg": torch.ones(1) * i})
        for i, name in enumerate(names)
    ]
    meta: dict[str, object] = {
        "worker_clocks": {"0": 41, "1": 42},
        "live": [0, 1],
        "ledger": [{"worker": 0, "incarnation": 2, "floor": 10, "applied": [11, 13]}],
        "big": 2**62,
        "text": "ü\n\"quoted\"",
        "ratio": 0.1,
        "none": None,
    }
    state = _state(tables=tables, meta=meta)
    written = write_shard(tmp_path, state)
    back = read_shard(written.path, written.sha256)
    assert (back.job, back.shard, back.num_shards, back.checkpoint_id, back.clock) == (
        JOB, 0, 1, "c000001", 42)
    assert back.meta == meta
    assert [t.name for t in back.tables] == names
    for i, table in enumerate(back.tables):
        assert table.spec == tables[i].spec
        assert list(table.tensors) == [names[i], "state/exp_avg"]
        assert torch.equal(table.tensors[names[i]], torch.full((2,), float(i)))
        assert torch.equal(table.tensors["state/exp_avg"], torch.ones(1) * i)


def test_empty_tensors_of_any_strides_are_written(tmp_path: Path) -> None:
    # An untouched sparse table's keys are an empty int64 tensor with stride 0.
    empty = {"keys": torch.empty(0, dtype=torch.int64).as_strided((0,), (0,)),
             "rows": torch.empty(0, 4).as_strided((0, 4), (0, 0))}
    written = write_shard(tmp_path, _state(tables=[TableState("t", {}, empty)]))
    back = read_shard(written.path, written.sha256).tables[0].tensors
    assert {k: (v.dtype, tuple(v.shape)) for k, v in back.items()} == {
        "keys": (torch.int64, (0,)), "rows": (torch.float32, (0, 4))}


def test_read_tensors_are_writable_and_owned(tmp_path: Path) -> None:
    written = write_shard(tmp_path, _state())
    first = read_shard(written.path).tables[0].tensors["value"]
    first.add_(100.0)  # must neither fail nor reach the file
    second = read_shard(written.path).tables[0].tensors["value"]
    assert torch.equal(second, torch.arange(12.0).reshape(3, 4))


def test_file_is_plain_safetensors_without_pickle(tmp_path: Path) -> None:
    tensors = _every_dtype()
    written = write_shard(tmp_path, _state(tables=[TableState("t/ü", {}, tensors)]))
    loaded = load_file(written.path)
    assert set(loaded) == {f"t%2F%C3%BC/{quote(n, safe='')}" for n in tensors}
    for name, tensor in tensors.items():
        assert _same(loaded[f"t%2F%C3%BC/{quote(name, safe='')}"], tensor.contiguous())
    with safe_open(written.path, framework="pt") as f:
        metadata = f.metadata()
    assert metadata["format"] == "pstrain.shard" and json.loads(metadata["meta"]) == {
        "mode": "sync"}
    # The file is exactly: header length, JSON header, the tensors' raw bytes back to back.
    # No room for anything else, so no pickle.
    data = Path(written.path).read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    assert data[8:9] == b"{" and b"\x80" not in data[8 : 8 + header_len]
    body = data[8 + header_len :]
    spans = sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and spans[-1][1] == len(body) == written.nbytes - 8 - header_len
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    for key, info in header.items():
        if key != "__metadata__":
            begin, end = info["data_offsets"]
            assert body[begin:end] == loaded[key].reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"meta": {"t": (1, 2)}}, "round-trip"),
        ({"meta": {1: "int key"}}, "round-trip"),
        ({"meta": {"x": float("nan")}}, "JSON"),
        ({"meta": {"x": object()}}, "JSON"),
        ({"tables": [TableState("a", {}, {}), TableState("a", {}, {})]}, "twice"),
        ({"tables": [TableState("a", {}, {"v": torch.zeros(2, dtype=torch.complex128)})]},
         "complex128"),
        ({"tables": [TableState("a", {}, {"v": torch.zeros(2, 2).to_sparse()})]}, "layout"),
        ({"tables": [TableState("a", {}, {"v": [1.0]})]}, "not a torch.Tensor"),  # type: ignore[dict-item]
        ({"job": "../etc"}, "'../etc'"),
        ({"checkpoint_id": ""}, "checkpoint_id"),
        ({"shard": 2, "num_shards": 2}, "shard 2"),
        ({"clock": "3"}, "clock"),
    ],
)
def test_bad_state_is_refused_and_nothing_written(
    tmp_path: Path, change: dict[str, Any], needle: str
) -> None:
    state = dataclasses.replace(_state(), **change)
    with pytest.raises(CheckpointError) as info:
        write_shard(tmp_path, state)
    assert needle in str(info.value)
    assert not list(tmp_path.rglob("*.safetensors"))


# ---- integrity ------------------------------------------------------------------------------


def test_checksum_mismatch_names_file_and_both_digests(tmp_path: Path) -> None:
    written = write_shard(tmp_path, _state())
    data = bytearray(Path(written.path).read_bytes())
    data[-1] ^= 0x01  # one bit of tensor data: the structure stays valid
    Path(written.path).write_bytes(data)
    with pytest.raises(CheckpointCorruptError) as info:
        read_shard(written.path, written.sha256)
    message = str(info.value)
    assert written.path in message and written.sha256 in message
    assert read_shard(written.path).tables  # without a digest the damage is not seen


@pytest.mark.parametrize("keep", [0, 5, 8, 20, -1])
def test_truncated_file_raises_checkpoint_error(tmp_path: Path, keep: int) -> None:
    written = write_shard(tmp_path, _state())
    path = Path(written.path)
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(CheckpointCorruptError, match=str(path)):
        read_shard(path)
    with pytest.raises(CheckpointCorruptError, match=str(path)):
        read_shard(path, written.sha256)


@pytest.mark.parametrize(
    "content",
    [
        b"\x10\x00\x00\x00\x00\x00\x00\x00" + b"not json at all!",
        struct.pack("<Q", 8) + b"[1,2,3] ",
        struct.pack("<Q", 2) + b"{}",  # valid JSON, no pstrain metadata
    ],
)
def test_garbage_file_raises_checkpoint_error(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "shard-0-of-1.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointCorruptError, match=str(path)):
        read_shard(path)


def test_missing_file_raises_checkpoint_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"nope\.safetensors"):
        read_shard(tmp_path / "nope.safetensors")


def test_a_file_that_is_not_regular_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "shard-0-of-1.safetensors"
    os.mkfifo(fifo)  # opened for reading with no writer, a blocking open would hang
    started = time.monotonic()
    with pytest.raises(CheckpointError, match="is not a regular file"):
        read_shard(fifo)
    assert time.monotonic() - started < 5


def test_a_garbage_file_s_error_names_none_of_its_bytes(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_bytes(b"hunter2!" + b"x" * 40)
    with pytest.raises(CheckpointCorruptError) as info:
        read_shard(path)
    said = str(info.value)
    assert str(path) in said
    said = said.replace(str(path), "<path>")  # the tmp path may hold any digits (pytest-48)
    assert str(int.from_bytes(b"hunter2!", "little")) not in said
    assert "48" not in said  # nor its size


# ---- finding a checkpoint by its id ---------------------------------------------------------


def test_a_checkpoint_is_read_by_id_inside_the_directory_and_checked(tmp_path: Path) -> None:
    written = write_shard(tmp_path, _state("c7"))
    state = read_checkpoint(tmp_path, JOB, "c7", 0, 1, written.sha256)
    assert state.checkpoint_id == "c7" and state.tables[0].name == "emb"
    with pytest.raises(CheckpointCorruptError, match="sha256"):
        read_checkpoint(tmp_path, JOB, "c7", 0, 1, "0" * 64)
    with pytest.raises(CheckpointError, match="cannot open"):
        read_checkpoint(tmp_path, JOB, "c8", 0, 1, written.sha256)  # no such checkpoint
    with pytest.raises(CheckpointError, match="cannot open"):
        read_checkpoint(tmp_path, JOB, "c7", 1, 2, written.sha256)  # nor such a shard


def test_a_restore_that_fails_verification_marks_the_checkpoint_bad_until_rewritten(
    tmp_path: Path,
) -> None:
    for checkpoint_id in ("c1", "c2"):
        written = write_shard(tmp_path, _state(checkpoint_id))
        write_manifest(tmp_path, checkpoint_id, JOB, 42, {0: written}, 1, run="r1")
    assert [m.run for m in list_checkpoints(tmp_path, JOB)] == ["r1", "r1"]
    with pytest.raises(CheckpointError, match="cannot open"):  # not a verification failure
        load_checkpoint(tmp_path, JOB, "c2", 1, 2, written.sha256)
    assert bad_reason(tmp_path, JOB, "c2") is None
    with pytest.raises(CheckpointCorruptError, match="sha256"):
        load_checkpoint(tmp_path, JOB, "c2", 0, 1, "0" * 64)
    reason = bad_reason(tmp_path, JOB, "c2")
    assert reason is not None and "shard 0" in reason and "shard-0-of-1.safetensors" in reason
    assert (tmp_path / JOB / "c2" / "BAD").is_file()
    assert [m.checkpoint_id for m in list_checkpoints(tmp_path, JOB)] == ["c1"]
    latest = latest_complete(tmp_path, JOB)
    assert latest is not None and latest.checkpoint_id == "c1"
    # The same id written again (a new run) is a new checkpoint: the mark goes.
    written = write_shard(tmp_path, _state("c2"))
    write_manifest(tmp_path, "c2", JOB, 43, {0: written}, 1, run="r2")
    assert bad_reason(tmp_path, JOB, "c2") is None
    assert [m.checkpoint_id for m in list_checkpoints(tmp_path, JOB)] == ["c1", "c2"]


@pytest.mark.parametrize(("directory", "job", "checkpoint_id", "sha256", "message"), [
    ("", JOB, "c7", "0" * 64, "has no checkpoint directory"),
    ("DIR", JOB, "../../etc", "0" * 64, "cannot name a directory"),
    ("DIR", JOB, "/etc/passwd", "0" * 64, "cannot name a directory"),
    ("DIR", "..", "c7", "0" * 64, "cannot name a directory"),
    ("DIR", JOB, "c7", "", "sha256 must be 64 lowercase hex digits"),
    ("DIR", JOB, "c7", "A" * 64, "sha256 must be 64 lowercase hex digits"),
])
def test_a_checkpoint_reference_that_could_leave_the_directory_is_refused(
    tmp_path: Path, directory: str, job: str, checkpoint_id: str, sha256: str, message: str
) -> None:
    with pytest.raises(CheckpointError, match=message):
        read_checkpoint(directory and tmp_path, job, checkpoint_id, 0, 1, sha256)


def test_a_file_of_another_checkpoint_under_the_right_name_is_refused(tmp_path: Path) -> None:
    written = write_shard(tmp_path, _state("c7"))
    moved = tmp_path / JOB / "c9"
    moved.mkdir()
    os.rename(written.path, moved / Path(written.path).name)
    with pytest.raises(CheckpointCorruptError, match="holds checkpoint 'c7'"):
        read_checkpoint(tmp_path, JOB, "c9", 0, 1, written.sha256)


# ---- manifests ------------------------------------------------------------------------------


class _Clock:
    """A fake wall clock for manifest timestamps."""

    def __init__(self, start_ns: int = 1_000) -> None:
        self.now_ns = start_ns

    def __call__(self) -> int:
        self.now_ns += 1_000
        return self.now_ns


def _checkpoint(
    root: Path, checkpoint_id: str, shards: list[int], num_shards: int, clock: _Clock
) -> dict[int, ShardFile]:
    files = {}
    for k in shards:
        written = write_shard(root, _state(checkpoint_id, k, num_shards))
        write_manifest(root, checkpoint_id, JOB, 42, {k: written}, num_shards, now_ns=clock)
        files[k] = written
    return files


def test_manifest_complete_only_with_every_shard(tmp_path: Path) -> None:
    clock = _Clock()
    files = _checkpoint(tmp_path, "c000001", [2, 0], 3, clock)
    manifest = read_manifest(tmp_path / JOB / "c000001")
    assert not manifest.complete and set(manifest.shards) == {0, 2}
    assert not (tmp_path / JOB / "c000001" / "manifest.json").exists()
    assert latest_complete(tmp_path, JOB) is None

    files |= _checkpoint(tmp_path, "c000001", [1], 3, clock)
    summary = tmp_path / JOB / "c000001" / "manifest.json"
    manifest = read_manifest(summary)
    assert manifest.complete and manifest.shards == files
    assert (manifest.job, manifest.checkpoint_id, manifest.clock, manifest.num_shards) == (
        JOB, "c000001", 42, 3)
    on_disk = json.loads(summary.read_text())
    assert on_disk["complete"] and on_disk["shards"]["1"]["sha256"] == files[1].sha256
    latest = latest_complete(tmp_path, JOB)
    assert latest is not None and latest.checkpoint_id == "c000001"
    for k, shard_file in latest.shards.items():
        assert read_shard(shard_file.path, shard_file.sha256).shard == k


def test_latest_complete_skips_incomplete_and_corrupt(tmp_path: Path) -> None:
    clock = _Clock()
    _checkpoint(tmp_path, "c000009", [0, 1], 2, clock)  # oldest, though its id sorts last
    _checkpoint(tmp_path, "t1000", [0, 1], 2, clock)  # the newest good one
    _checkpoint(tmp_path, "c000011", [0], 2, clock)  # incomplete
    truncated = _checkpoint(tmp_path, "c000012", [0, 1], 2, clock)
    with open(truncated[1].path, "r+b") as f:
        f.truncate(truncated[1].nbytes - 1)
    _checkpoint(tmp_path, "c000013", [0, 1], 2, clock)
    (tmp_path / JOB / "c000013" / "shard-1.json").write_text("{ half an entry")
    gone = _checkpoint(tmp_path, "c000014", [0, 1], 2, clock)
    os.unlink(gone[0].path)
    (tmp_path / JOB / "c000015").mkdir()  # no entries yet: a checkpoint being written
    (tmp_path / JOB / ".c000016.tmp-1-00000000").write_text("junk")

    latest = latest_complete(tmp_path, JOB)
    assert latest is not None and latest.checkpoint_id == "t1000"
    listed = [(m.checkpoint_id, m.complete) for m in list_checkpoints(tmp_path, JOB)]
    assert listed == [("c000009", True), ("t1000", True), ("c000011", False)]
    assert list_checkpoints(tmp_path, "other-job") == []


def test_a_checkpoint_pruned_while_it_is_listed_is_passed_over_as_gone_not_corrupt(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    # Every shard prunes the job's directory after its full checkpoint: one shard's listing
    # may read a checkpoint that another shard's retention renames away under it.
    clock = _Clock()
    _checkpoint(tmp_path, "c1", [0, 1], 2, clock)
    _checkpoint(tmp_path, "c2", [0, 1], 2, clock)
    truncated = _checkpoint(tmp_path, "c3", [0, 1], 2, clock)[1]
    with open(truncated.path, "r+b") as f:
        f.truncate(truncated.nbytes - 1)
    read_entry = ckpt._read_entry

    def pruned_midway(path: Path, shard: int) -> dict[str, Any]:
        if path.parent.name == "c1":  # its entries listed, then the directory renamed away
            path.parent.rename(tmp_path / JOB / ".c1.pruned-1-00000000")
        return read_entry(path, shard)

    monkeypatch.setattr(ckpt, "_read_entry", pruned_midway)
    with caplog.at_level("WARNING", logger="ps.checkpoint"):
        listed = [m.checkpoint_id for m in list_checkpoints(tmp_path, JOB)]
    assert listed == ["c2"]
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "skipping corrupt checkpoint c3" in warned[0], warned


def test_latest_complete_can_verify_checksums(tmp_path: Path) -> None:
    clock = _Clock()
    _checkpoint(tmp_path, "c1", [0], 1, clock)
    flipped = _checkpoint(tmp_path, "c2", [0], 1, clock)[0]
    data = bytearray(Path(flipped.path).read_bytes())
    data[-1] ^= 0x80  # same size: only a checksum sees it
    Path(flipped.path).write_bytes(data)
    newest = latest_complete(tmp_path, JOB)
    assert newest is not None and newest.checkpoint_id == "c2"
    verified = latest_complete(tmp_path, JOB, verify_checksums=True)
    assert verified is not None and verified.checkpoint_id == "c1"


def test_manifest_refuses_foreign_or_resized_files(tmp_path: Path) -> None:
    written = write_shard(tmp_path, _state("c1"))
    with pytest.raises(CheckpointError, match="not in checkpoint directory"):
        write_manifest(tmp_path, "c2", JOB, 42, {0: written}, 1)
    wrong_size = ShardFile(written.path, written.sha256, written.nbytes + 1)
    with pytest.raises(CheckpointError, match=str(written.nbytes + 1)):
        write_manifest(tmp_path, "c1", JOB, 42, {0: wrong_size}, 1)
    with pytest.raises(CheckpointError, match="num_shards 1"):
        write_manifest(tmp_path, "c1", JOB, 42, {1: written}, 1)


def test_entries_that_disagree_are_corrupt(tmp_path: Path) -> None:
    clock = _Clock()
    _checkpoint(tmp_path, "c1", [0], 2, clock)
    other = write_shard(tmp_path, _state("c1", 1, 3))
    with pytest.raises(CheckpointError, match="num_shards 2"):  # refused up front
        write_manifest(tmp_path, "c1", JOB, 42, {1: other}, 3, now_ns=clock)
    entry = tmp_path / JOB / "c1" / "shard-0.json"
    forged = json.loads(entry.read_text()) | {"shard": 1, "num_shards": 3}
    (tmp_path / JOB / "c1" / "shard-1.json").write_text(json.dumps(forged))
    with pytest.raises(CheckpointCorruptError, match="num_shards"):
        read_manifest(tmp_path / JOB / "c1")
    assert latest_complete(tmp_path, JOB) is None


# ---- atomicity ------------------------------------------------------------------------------


def test_failed_rename_leaves_no_file_and_keeps_previous(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = _Clock()
    _checkpoint(tmp_path, "c1", [0], 1, clock)

    def broken_replace(src: object, dst: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(CheckpointError, match="No space left"):
        write_shard(tmp_path, _state("c2"))
    c2 = tmp_path / JOB / "c2"
    assert sorted(p.name for p in c2.iterdir()) == []  # neither final nor temporary files
    monkeypatch.undo()

    written = write_shard(tmp_path, _state("c2"))
    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(CheckpointError, match=r"shard-0\.json"):
        write_manifest(tmp_path, "c2", JOB, 42, {0: written}, 1, now_ns=clock)
    monkeypatch.undo()
    assert sorted(p.name for p in c2.iterdir()) == ["shard-0-of-1.safetensors"]
    latest = latest_complete(tmp_path, JOB)
    assert latest is not None and latest.checkpoint_id == "c1"


_CRASH = """
import os, stat, sys, torch
from ps.checkpoint import ShardState, TableState, write_shard
real_fsync = os.fsync
def fsync(fd):
    if stat.S_ISREG(os.fstat(fd).st_mode):
        os._exit(3)  # die after the data is written, before the rename
    real_fsync(fd)
os.fsync = fsync
state = ShardState("job-1", 0, 1, "c2", 42, {}, [
    TableState("emb", {}, {"value": torch.ones(1 << 20)})])
write_shard(sys.argv[1], state)
"""


def test_crash_mid_write_leaves_only_an_ignored_temp_file(tmp_path: Path) -> None:
    clock = _Clock()
    _checkpoint(tmp_path, "c1", [0], 1, clock)
    proc = subprocess.run(
        [sys.executable, "-c", _CRASH, str(tmp_path)], cwd=REPO, capture_output=True,
        env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60, check=False,
    )
    assert proc.returncode == 3, proc.stderr.decode()
    c2 = tmp_path / JOB / "c2"
    leftovers = list(c2.iterdir())
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".shard-0-of-1.safetensors.tmp-")
    assert leftovers[0].stat().st_size > 1 << 20  # the data was written, just never renamed
    latest = latest_complete(tmp_path, JOB)
    assert latest is not None and latest.checkpoint_id == "c1"

    # A later write in that directory removes the leftover once it is old enough.
    old = time.time() - ckpt.STALE_TMP_AGE_S - 60
    os.utime(leftovers[0], (old, old))
    _checkpoint(tmp_path, "c2", [0], 1, clock)
    assert sorted(p.name for p in c2.iterdir()) == [
        "manifest.json", "shard-0-of-1.safetensors", "shard-0.json"]
    latest = latest_complete(tmp_path, JOB)
    assert latest is not None and latest.checkpoint_id == "c2"


# ---- concurrent manifest writers ------------------------------------------------------------

_WRITER = """
import os, sys, time
from ps.checkpoint import ShardState, TableState, write_manifest, write_shard
import torch
root, shard, num_shards, rounds, go = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
    int(sys.argv[4]), sys.argv[5]
open(go + ".ready", "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(go) and time.monotonic() < deadline:
    time.sleep(0.001)
for i in range(rounds):
    cid = f"c{i:06d}"
    state = ShardState("job-1", shard, num_shards, cid, i, {}, [
        TableState("emb", {}, {"value": torch.full((4,), float(shard))})])
    write_manifest(root, cid, "job-1", i, {shard: write_shard(root, state)}, num_shards)
"""


def test_concurrent_writers_of_one_manifest_lose_no_entry(tmp_path: Path) -> None:
    # Two processes record the two shards of each of `rounds` checkpoints at the same moment:
    # this test's process (shard 0) and a child (shard 1). One child is enough for two
    # writers and spares a second start of torch.
    num_shards, rounds = 2, 40
    go = tmp_path / "go"
    child = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(tmp_path), "1", str(num_shards), str(rounds),
         str(go)],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 60
        while not Path(f"{go}.ready").exists() and child.poll() is None:
            assert time.monotonic() < deadline, "the child writer never got ready"
            time.sleep(0.005)
        go.touch()  # both start together, so their manifest updates overlap
        for i in range(rounds):
            cid = f"c{i:06d}"
            state = ShardState(JOB, 0, num_shards, cid, i, {}, [
                TableState("emb", {}, {"value": torch.full((4,), 0.0)})])
            write_manifest(tmp_path, cid, JOB, i, {0: write_shard(tmp_path, state)}, num_shards)
        _, err = child.communicate(timeout=60)
        assert child.returncode == 0, err.decode()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)
    manifests = list_checkpoints(tmp_path, JOB)
    assert len(manifests) == rounds
    for manifest in manifests:
        assert manifest.complete and set(manifest.shards) == set(range(num_shards))
        summary = json.loads((manifest.directory / "manifest.json").read_text())
        assert sorted(summary["shards"]) == [str(k) for k in range(num_shards)]
        for k, shard_file in manifest.shards.items():
            tensors = read_shard(shard_file.path, shard_file.sha256).tables[0].tensors
            assert torch.equal(tensors["value"], torch.full((4,), float(k)))


# ---- table specs, as a shard's snapshot stores them -------------------------------------------

# A sparse table's spec as checkpoints have always stored it: the consistency mode in the
# user's grammar, "" for the server's default mode.
_STORED_SPEC: dict[str, Any] = {
    "name": "t", "kind": "sparse", "dtype": "float32", "shape": [], "dim": 2,
    "init": ["zeros", 0.0, 0.0], "seed": 0, "optimizer": ["sgd", [["lr", 1.0]]],
    "allow_non_finite": False, "mode": "",
}


@pytest.mark.parametrize(
    ("stored", "mode"),
    [("", None), ("sync", modes.SYNC), ("async", modes.ASYNC), ("ssp", modes.SSP),
     ("ssp:0", Mode(Kind.SSP, 0)), ("ssp:2", Mode(Kind.SSP, 2))],
)
def test_a_table_spec_keeps_the_stored_form_of_its_mode(stored: str, mode: Mode | None) -> None:
    spec = TableSpec.from_dict({**_STORED_SPEC, "mode": stored})
    assert spec.mode == mode
    assert spec.to_dict() == {**_STORED_SPEC, "mode": stored}
    assert json.loads(json.dumps(spec.to_dict())) == spec.to_dict()


@pytest.mark.parametrize("stored", ["bsp", "ssp:-1", "SYNC"])
def test_a_stored_mode_this_build_does_not_know_is_refused_by_name(stored: str) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        TableSpec.from_dict({**_STORED_SPEC, "mode": stored})
    assert f"table 't': the checkpointed spec has unknown consistency mode {stored!r}" in str(
        err.value
    )


def test_a_restored_shard_runs_each_table_under_its_mode(tmp_path: Path) -> None:
    declared = {"default": None, "sync": modes.SYNC, "async": modes.ASYNC, "ssp": modes.SSP,
                "ssp2": Mode(Kind.SSP, 2)}
    config = ShardConfig(shard=0, num_shards=1, mode=modes.SYNC, staleness=3)
    shard = Shard(config)
    shard.declare([TableSpec(name, "sparse", torch.float32, dim=2, mode=mode)
                   for name, mode in declared.items()])
    written = write_shard(tmp_path, shard.snapshot("c000001"))
    assert {t["spec"]["name"]: t["spec"]["mode"]
            for t in json.loads(safe_open(written.path, "pt").metadata()["tables"])} == {
        "default": "", "sync": "sync", "async": "async", "ssp": "ssp", "ssp2": "ssp:2"}
    back = Shard(config)
    back.restore(read_shard(written.path, written.sha256))
    assert {s.name: str(mode) for s, mode in back.stats()} == {
        "default": "sync", "sync": "sync", "async": "async", "ssp": "ssp:3", "ssp2": "ssp:2"}


def test_a_checkpoint_keeps_whether_each_dense_block_was_written(tmp_path: Path) -> None:
    """Through real files: a block written before the cut keeps its values against an
    assign if absent, one never written takes it, and a file from before the written state
    was saved counts as written."""
    config = ShardConfig(shard=0, num_shards=1, mode=modes.ASYNC)
    shard = Shard(config)
    shard.declare([TableSpec(name, "dense", torch.float32, shape=(3,))
                   for name in ("trained", "blank", "old")])
    for name in ("trained", "old"):
        push = DensePush(name, PushMeta(0, 1, len(name), assign=True), torch.float32, (3,),
                         [(0, torch.ones(3))])
        shard.exchange(Exchange(worker=0, incarnation=1, generation=0, push_clock=0,
                                pushes=[push], end_iteration=False, pull_clock=0, pulls=[]))
    state = shard.snapshot("c000002")
    for table in state.tables:
        if table.name == "old":  # as a build without the written state saved it
            del table.tensors["written"]
    written = write_shard(tmp_path, state)
    back = Shard(config)
    back.restore(read_shard(written.path, written.sha256))
    offers = [DensePush(name, PushMeta(1, 1, seq, assign=True, if_absent=True), torch.float32,
                        (3,), [(0, torch.full((3,), 7.0))])
              for seq, name in enumerate(("trained", "blank", "old"), 1)]
    result = back.exchange(Exchange(worker=1, incarnation=1, generation=0, push_clock=0,
                                    pushes=offers, end_iteration=False, pull_clock=0,
                                    pulls=[Pull("trained"), Pull("blank"), Pull("old")]))
    assert result.outcomes == [PushOutcome.KEPT, PushOutcome.APPLIED, PushOutcome.KEPT]
    assert [t.tolist() for t in result.pulled if isinstance(t, torch.Tensor)] == [
        [1.0] * 3, [7.0] * 3, [1.0] * 3]


# ---- deltas ---------------------------------------------------------------------------------

SPARSE_SPEC: dict[str, object] = {"kind": "sparse", "dim": 2}


def _rows(keys: list[int], *, dim: int = 2, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Rows whose values name their key (key * scale), with a step per row."""
    k = torch.tensor(keys, dtype=torch.int64)
    return {"keys": k, "value": (k.to(torch.float32) * scale)[:, None].repeat(1, dim),
            "step": k * 10}


def _by_key(table: TableState) -> dict[int, tuple[list[float], int]]:
    t = table.tensors
    return {int(k): (t["value"][i].tolist(), int(t["step"][i]))
            for i, k in enumerate(t["keys"].tolist())}


def _full(checkpoint_id: str, tables: list[TableState], clock: int = 1) -> ShardState:
    return ShardState(JOB, 0, 1, checkpoint_id, clock, {"at": checkpoint_id}, tables)


def _delta(checkpoint_id: str, base: str, tables: list[TableState], clock: int = 2
           ) -> ShardState:
    return ShardState(JOB, 0, 1, checkpoint_id, clock, {"at": checkpoint_id}, tables,
                      kind=ckpt.DELTA, base=base)


def test_a_delta_replaces_adds_and_evicts_rows_by_key_and_keeps_what_it_does_not_name() -> None:
    base = _full("c1", [
        TableState("emb", SPARSE_SPEC, {**_rows([1, 2, 3, 4]), "sketch": torch.zeros(3)}),
        TableState("w", {"kind": "dense"}, {"value": torch.zeros(2)}),
        TableState("still", {"kind": "dense"}, {"value": torch.ones(2)}),
    ])
    changed = _rows([2, 9, 4], scale=-1.0)
    delta = _delta("c2", "c1", [
        # 2 changed; 9 new; 3 evicted; 4 evicted, then created again; 7 created, then evicted
        TableState("emb", SPARSE_SPEC, {**changed, "evicted_keys": torch.tensor([3, 4, 7]),
                                        "sketch": torch.full((3,), 5.0)}, kind=ckpt.ROWS),
        TableState("w", {"kind": "dense"}, {"value": torch.full((2,), 3.0)}),
        TableState("new", SPARSE_SPEC, _rows([5])),  # declared since c1: whole
    ])
    merged = ckpt.apply_delta(base, delta)
    assert (merged.kind, merged.base, merged.checkpoint_id, merged.clock, merged.meta) == (
        ckpt.FULL, "", "c2", 2, {"at": "c2"})
    tables = {t.name: t for t in merged.tables}
    assert list(tables) == ["emb", "w", "still", "new"]
    assert _by_key(tables["emb"]) == {1: ([1.0, 1.0], 10), 2: ([-2.0, -2.0], 20),
                                      9: ([-9.0, -9.0], 90), 4: ([-4.0, -4.0], 40)}
    assert tables["emb"].tensors["sketch"].tolist() == [5.0] * 3
    assert tables["w"].tensors["value"].tolist() == [3.0, 3.0]
    assert tables["still"].tensors["value"].tolist() == [1.0, 1.0]
    assert _by_key(tables["new"]) == {5: ([5.0, 5.0], 50)}
    # The inputs are left as they were.
    assert _by_key(base.tables[0]) == {k: ([float(k)] * 2, 10 * k) for k in (1, 2, 3, 4)}
    assert base.tables[0].tensors["sketch"].tolist() == [0.0] * 3


def test_a_chain_applied_at_once_equals_one_delta_at_a_time() -> None:
    base = _full("c1", [TableState("emb", SPARSE_SPEC, _rows([1, 2, 3]))])
    d2 = _delta("c2", "c1", [TableState("emb", SPARSE_SPEC, {
        **_rows([2, 4], scale=2.0), "evicted_keys": torch.tensor([1])}, kind=ckpt.ROWS)])
    d3 = _delta("c3", "c2", [TableState("emb", SPARSE_SPEC, {
        **_rows([1, 4], scale=3.0), "evicted_keys": torch.tensor([2, 3])}, kind=ckpt.ROWS)],
        clock=3)
    at_once = ckpt.apply_deltas(base, [d2, d3])
    in_turn = ckpt.apply_delta(ckpt.apply_delta(base, d2), d3)
    expected = {1: ([3.0, 3.0], 10), 4: ([12.0, 12.0], 40)}
    assert _by_key(at_once.tables[0]) == _by_key(in_turn.tables[0]) == expected
    assert at_once.checkpoint_id == "c3" and at_once.clock == 3


@pytest.mark.parametrize(("deltas", "error", "message"), [
    (lambda: [_delta("c3", "c2", [])], CheckpointError, "does not build on 'c1'"),
    (lambda: [_delta("c2", "c1", []), _delta("c4", "c1", [])], CheckpointError,
     "does not build on 'c2'"),
    (lambda: [dataclasses.replace(_delta("c2", "c1", []), shard=1, num_shards=2)],
     CheckpointError, "is shard 1/2"),
    (lambda: [_delta("c2", "c1", [TableState("other", SPARSE_SPEC, _rows([1]),
                                             kind=ckpt.ROWS)])],
     CheckpointCorruptError, "table 'other' has a row delta .* but no whole copy"),
    (lambda: [_delta("c2", "c1", [TableState("emb", {"kind": "sparse", "dim": 3},
                                             _rows([1]), kind=ckpt.ROWS)])],
     CheckpointCorruptError, "with spec .* builds on one with spec"),
    (lambda: [_delta("c2", "c1", [TableState("emb", SPARSE_SPEC, {"keys": torch.tensor([1])},
                                             kind=ckpt.ROWS)])],
     CheckpointCorruptError, "do not fit the table's"),
])
def test_a_delta_that_does_not_fit_is_refused(deltas: Any, error: type[Exception],
                                              message: str) -> None:
    base = _full("c1", [TableState("emb", SPARSE_SPEC, _rows([1, 2]))])
    with pytest.raises(error, match=message):
        ckpt.apply_deltas(base, deltas())


def _sparse_push(name: str, seq: int, dim: int, keys: list[int]) -> Any:
    from ps.shard import SparsePush  # noqa: PLC0415
    gen = torch.Generator().manual_seed(seq)
    values = torch.randn(len(keys), dim, generator=gen)
    return SparsePush(name, PushMeta(0, 1, seq), torch.float32, dim,
                      torch.tensor(keys, dtype=torch.int64).numpy(),
                      memoryview(values.numpy()).cast("B"))


class _Trained:
    """A shard of every kind of table, trained a step at a time, its snapshots written by
    `write_snapshot` as a server writes them."""

    def __init__(self, root: Path, full_every: int) -> None:
        from ps.tables import OptimizerConfig  # noqa: PLC0415
        self.root = root
        self.shard = Shard(ShardConfig(shard=0, num_shards=1, job=JOB, mode=modes.ASYNC,
                                       checkpoint_full_every=full_every))
        self.shard.declare([
            TableSpec("w", "dense", torch.float32, shape=(4, 3),
                      optimizer=OptimizerConfig("adam", (("lr", 0.01),))),
            TableSpec("frozen", "dense", torch.float32, shape=(2,)),
            TableSpec("emb", "sparse", torch.float32, dim=4,
                      optimizer=OptimizerConfig("adagrad", (("lr", 0.1),))),
            TableSpec("hot", "sparse", torch.float32, dim=2, admit="count:2", max_rows=25,
                      optimizer=OptimizerConfig("adam", (("lr", 0.1),))),
        ])
        self.seq = 0
        self.clock = 0  # worker 0's: the shard's clock closes as it ends each iteration
        self.gen = torch.Generator().manual_seed(5)
        self.files: dict[str, ShardFile] = {}

    def step(self, dense: bool = True) -> None:
        """Pulls (creating rows, counting sights, stamping rows) and pushes gradients to
        random keys; some rows are only pulled, some only pushed."""
        emb = torch.randperm(200, generator=self.gen)[:12].tolist()
        hot = torch.randperm(60, generator=self.gen)[:15].tolist()
        self.seq += 1
        read_only = [1000 + 2 * self.seq, 1001 + 2 * self.seq]  # rows pulls create
        self.shard.exchange(Exchange(
            worker=0, incarnation=1, generation=0, push_clock=self.clock, pushes=[],
            end_iteration=False, pull_clock=self.clock,
            pulls=[Pull("hot", torch.tensor(hot).numpy()),
                   Pull("emb", torch.tensor(emb[:4] + read_only).numpy())]))
        pushes: list[Any] = [_sparse_push("emb", self.seq * 10 + 1, 4, emb),
                             _sparse_push("hot", self.seq * 10 + 2, 2, hot[:10])]
        if dense:
            pushes.append(DensePush("w", PushMeta(0, 1, self.seq * 10 + 3), torch.float32,
                                    (4, 3), [(0, torch.randn(12, generator=self.gen))]))
        self.shard.exchange(Exchange(
            worker=0, incarnation=1, generation=0, push_clock=self.clock, pushes=pushes,
            end_iteration=True, pull_clock=self.clock + 1, pulls=[]))
        self.clock += 1

    def checkpoint(self, checkpoint_id: str, full: bool = False) -> ShardState:
        from ps.coordination import write_snapshot  # noqa: PLC0415
        if full:
            self.shard.snapshots.ask_full(checkpoint_id)
        state = self.shard.snapshot(checkpoint_id)
        self.files[checkpoint_id] = write_snapshot(self.shard, str(self.root), state, "r1")
        return state


def test_a_full_snapshot_is_written_as_of_its_cut_while_training_goes_on(
        tmp_path: Path) -> None:
    """The rows of a full snapshot's sparse tables are read as they are written (copy on
    write): trained on after the cut, written paced in small chunks, the file is the one
    an eager copy taken at the cut makes."""
    trained = _Trained(tmp_path / "job", full_every=10)
    for _ in range(6):
        trained.step()
    state = trained.shard.snapshot("c1")
    assert state.kind == "full" and all(not t.later for t in state.tables
                                        if t.name in ("w", "frozen"))
    assert {n for t in state.tables for n in t.later} == {"value", "state.sum", "state.exp_avg",
                                                          "state.exp_avg_sq", "step"}
    eager = ckpt.materialized(state)
    assert all(not t.later for t in eager.tables)
    for _ in range(6):  # pushes, new rows, and evictions that hand slots to new ids
        trained.step()
    lazy_file = write_shard(tmp_path / "lazy", state, max_bytes_per_s=50e6)
    eager_file = write_shard(tmp_path / "eager", eager)
    assert lazy_file.sha256 == eager_file.sha256
    assert Path(lazy_file.path).read_bytes() == Path(eager_file.path).read_bytes()


def _tensors_by_key(state: ShardState) -> dict[str, dict[str, bytes]]:
    """Every tensor of every table as bytes, sparse rows ordered by key."""
    out: dict[str, dict[str, bytes]] = {}
    for table in ckpt.materialized(state).tables:
        tensors = dict(table.tensors)
        if "keys" in tensors:
            order = torch.argsort(tensors["keys"])
            tensors = {k: v if k in ckpt.WHOLE_TABLE_TENSORS else v[order]
                       for k, v in tensors.items()}
        out[table.name] = {k: repr((v.dtype, tuple(v.shape))).encode()
                           + bytes(v.contiguous().reshape(-1).view(torch.uint8).numpy())
                           for k, v in tensors.items()}
    return out


def test_a_full_and_three_deltas_restore_the_bytes_of_one_full_checkpoint(
        tmp_path: Path) -> None:
    trained = _Trained(tmp_path, full_every=10)
    kinds = []
    for i in range(4):
        for _ in range(3):
            trained.step(dense=i != 2)  # no dense change before c2: it leaves "w" out
        kinds.append(trained.checkpoint(f"c{i}"))
    assert [(s.kind, s.base) for s in kinds] == [
        ("full", ""), ("delta", "c0"), ("delta", "c1"), ("delta", "c2")]
    assert {t.name: t.kind for t in kinds[2].tables} == {"emb": "rows", "hot": "rows"}
    hot = next(t for t in kinds[3].tables if t.name == "hot")
    assert len(hot.tensors["evicted_keys"]) > 0  # eviction is exercised
    reference = trained.checkpoint("ref", full=True)  # the same cut, whole
    assert reference.kind == "full"
    resolved = load_checkpoint(tmp_path, JOB, "c3", 0, 1, trained.files["c3"].sha256)
    assert (resolved.kind, resolved.checkpoint_id, resolved.clock, resolved.meta) == (
        "full", "c3", reference.clock, reference.meta)
    assert _tensors_by_key(resolved) == _tensors_by_key(reference)
    # A delta holds the rows that changed, and a fresh shard restored from the chain holds
    # the state of the cut.
    emb = {s.checkpoint_id: len(next(t for t in s.tables if t.name == "emb").tensors["keys"])
           for s in (kinds[3], reference)}
    assert 0 < emb["c3"] < emb["ref"] / 2, emb
    back = Shard(ShardConfig(shard=0, num_shards=1, job=JOB, mode=modes.ASYNC))
    back.restore(resolved)
    assert _tensors_by_key(back.snapshot("again")) == _tensors_by_key(reference)


def _cut(state: ShardState, keep: Any) -> dict[str, dict[str, bytes]]:
    """`_tensors_by_key` of `state` with every table that has keys cut to the rows `keep`
    selects (and its evicted keys alike), as `read_shard(keep=...)` promises."""
    tables = []
    for table in state.tables:
        tensors = dict(table.tensors)
        if "keys" in tensors:
            at = torch.from_numpy(keep(tensors["keys"].numpy()))
            tensors = {name: t if name in ckpt.WHOLE_TABLE_TENSORS
                       else t[torch.from_numpy(keep(t.numpy()))] if name == "evicted_keys"
                       else t[at] for name, t in tensors.items()}
        tables.append(TableState(table.name, table.spec, tensors, table.kind))
    return _tensors_by_key(dataclasses.replace(state, tables=tables))


def _even(keys: Any) -> Any:
    return keys % 2 == 0


@pytest.mark.parametrize("staged_bytes", [24, 100, ckpt.STAGED_CHUNK_BYTES])
def test_a_read_that_keeps_some_keys_equals_the_whole_read_cut_to_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, staged_bytes: int) -> None:
    monkeypatch.setattr(ckpt, "STAGED_CHUNK_BYTES", staged_bytes)  # many chunks, odd bounds
    trained = _Trained(tmp_path, full_every=10)
    for i in range(4):
        for _ in range(3):
            trained.step()
        trained.checkpoint(f"c{i}")
    chain = trained.files["c3"]
    whole = load_checkpoint(tmp_path, JOB, "c3", 0, 1, chain.sha256)
    part = load_checkpoint(tmp_path, JOB, "c3", 0, 1, chain.sha256, keep=_even)
    assert _tensors_by_key(part) == _cut(whole, _even)
    assert (part.checkpoint_id, part.clock, part.meta) == (whole.checkpoint_id, whole.clock,
                                                           whole.meta)
    # One file (a delta, with evicted keys), rows kept in their order in the file.
    delta = read_shard(chain.path, chain.sha256)
    assert any(len(t.tensors.get("evicted_keys", ())) for t in delta.tables)
    cut = read_shard(chain.path, chain.sha256, keep=_even)
    assert [t.tensors.keys() for t in cut.tables] == [t.tensors.keys() for t in delta.tables]
    for mine, theirs in zip(cut.tables, delta.tables, strict=True):
        if "keys" in theirs.tensors:
            assert mine.tensors["keys"].tolist() == [
                k for k in theirs.tensors["keys"].tolist() if k % 2 == 0]
            assert int(_even(mine.tensors["keys"].numpy()).sum()) == len(mine.tensors["keys"])
    nothing = read_shard(chain.path, chain.sha256,
                         keep=lambda keys: torch.zeros(len(keys), dtype=torch.bool).numpy())
    assert all(len(t.tensors["keys"]) == 0 for t in nothing.tables if "keys" in t.tensors)


def _keyed_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rows: int = 4000,
                ) -> tuple[ShardFile, torch.Tensor]:
    """A shard file of one table whose row of key k holds k, in blocks of 32 rows; the keys
    in the order the file holds them."""
    monkeypatch.setattr(ckpt, "BLOCK_BYTES", 32 * 8 * 4)
    keys = torch.randperm(rows, generator=torch.Generator().manual_seed(5)) * 7 + 3
    state = _state(tables=[TableState("emb", SPARSE_SPEC, {
        "keys": keys, "value": keys[:, None].float().repeat(1, 8),
        "sketch": torch.zeros(5, dtype=torch.uint8)})])
    written = write_shard(tmp_path, state)
    return written, read_shard(written.path, written.sha256).tables[0].tensors["keys"]


def _routes(shard: int, count: int) -> Any:
    return lambda keys: shard_of_keys(keys, count) == shard


def _data_offset(path: str, key: str) -> int:
    """Where tensor `key`'s bytes begin in the safetensors file at `path`."""
    raw = Path(path).read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return 8 + length + json.loads(raw[8 : 8 + length])[key]["data_offsets"][0]


def test_keyed_rows_are_written_in_route_order_and_a_shard_reads_only_its_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    written, keys = _keyed_file(tmp_path, monkeypatch)
    hashes = route_hash(keys.numpy())
    assert bool(np.all(hashes[1:] >= hashes[:-1])) and len(set(keys.tolist())) == 4000
    read_bytes: list[int] = []
    real = ckpt._read_chunk

    def counted(fd: int, buf: memoryview, path: Path, offset: int, digest: bytes | None) -> None:
        read_bytes.append(len(buf))
        real(fd, buf, path, offset, digest)

    monkeypatch.setattr(ckpt, "_read_chunk", counted)
    block = ckpt.BLOCK_BYTES
    for count in (2, 3, 5):
        for shard in range(count):
            read_bytes.clear()
            got = read_shard(written.path, written.sha256, keep=_routes(shard, count))
            tensors = got.tables[0].tensors
            expected = keys[torch.from_numpy(shard_of_keys(keys.numpy(), count) == shard)]
            assert torch.equal(tensors["keys"], expected)
            assert torch.equal(tensors["value"], expected[:, None].float().repeat(1, 8))
            # Keys (8 bytes a row) and values (32): the run's blocks, and at most one more at
            # each end of it, plus the 5-byte sketch.
            assert sum(read_bytes) <= len(expected) * 40 + 2 * 2 * block + 5, (count, shard)


def test_route_order_sorts_by_all_32_bits_of_the_hash_and_leaves_other_tables_be() -> None:
    keys = torch.from_numpy(np.random.default_rng(2).integers(-(2**63), 2**63 - 1, 300_000))
    keys[7:20] = keys[100]  # equal hashes keep their order
    no_pace = ckpt.Pace(0.0)
    order = ckpt._route_order({"keys": keys, "value": torch.zeros(300_000, 2)}, no_pace)
    assert order is not None
    # ~4.6 keys a value of the top 16 bits, over several pieces: one whole stable sort
    expected = np.argsort(route_hash(keys.numpy()), kind="stable")
    assert np.array_equal(order.numpy(), expected)
    ordered = keys[order]
    assert ckpt._route_order({"keys": ordered, "value": torch.zeros(300_000, 2)}, no_pace) is None
    assert ckpt._route_order({"keys": keys, "value": torch.zeros(5, 2)}, no_pace) is None
    assert ckpt._route_order({"value": torch.zeros(5, 2)}, no_pace) is None


def test_route_order_is_paced_piece_by_piece() -> None:
    fake = _FakeTime()
    pace = ckpt.Pace(1e6, clock=lambda: fake.now, sleep=fake.sleep)
    count = 3 * ckpt.ORDER_CHUNK_KEYS
    keys = torch.from_numpy(np.random.default_rng(3).integers(-(2**63), 2**63 - 1, count))
    assert ckpt._route_order({"keys": keys, "value": torch.zeros(count, 2)}, pace) is not None
    # hashing, placing and sorting each piece of keys charges their bytes: nine pauses,
    # none much longer than one piece's budget, 24 bytes a key in all
    piece_s = ckpt.ORDER_CHUNK_KEYS * 8 / 1e6
    assert len(fake.slept) >= 9 and max(fake.slept) <= piece_s * 1.1
    assert fake.now == pytest.approx(count * 24 / 1e6, rel=0.01)


def test_a_filtered_read_checks_every_block_it_reads_and_reads_no_other(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    written, keys = _keyed_file(tmp_path, monkeypatch)
    clean = Path(written.path).read_bytes()
    owner = shard_of_keys(keys.numpy(), 2)
    row = int(np.flatnonzero(owner == 0)[0])  # a value of shard 0 of 2, far from shard 1's
    data = bytearray(clean)
    data[_data_offset(written.path, "emb/value") + row * 32] ^= 0x01
    Path(written.path).write_bytes(data)
    other = read_shard(written.path, written.sha256, keep=_routes(1, 2)).tables[0]
    assert torch.equal(other.tensors["keys"], keys[torch.from_numpy(owner == 1)])
    for keep in (_routes(0, 2), _even, None):
        with pytest.raises(CheckpointCorruptError, match=f"fails its checksum.*{written.sha256}"):
            read_shard(written.path, written.sha256, keep=keep)
    assert read_shard(written.path, keep=_routes(0, 2)).tables  # no digest: not checked
    data = bytearray(clean)  # a key of shard 1's run: every filtered read checks all keys
    data[_data_offset(written.path, "emb/keys") + int(np.flatnonzero(owner == 1)[-1]) * 8] ^= 1
    Path(written.path).write_bytes(data)
    with pytest.raises(CheckpointCorruptError, match="fails its checksum"):
        read_shard(written.path, written.sha256, keep=_routes(0, 2))
    data = bytearray(clean)  # the header: its digest is the file's
    data[data.index(b'"clock":"42"') + 9] = ord("3")
    Path(written.path).write_bytes(data)
    with pytest.raises(CheckpointCorruptError, match=f"sha256 .* manifest says {written.sha256}"):
        read_shard(written.path, written.sha256, keep=_routes(1, 2))


def test_a_file_of_the_flat_format_is_still_read_and_hashed_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    written, keys = _keyed_file(tmp_path, monkeypatch)
    with safe_open(written.path, "pt") as f:
        meta = dict(f.metadata())
        names = f.keys()
        tensors = {k: f.get_tensor(k) for k in names}
    meta["format_version"] = "1"
    del meta["blocks"], meta["kind"]
    flat = tmp_path / "flat.safetensors"
    save_file(tensors, str(flat), metadata=meta)
    digest = hashlib.sha256(flat.read_bytes()).hexdigest()
    whole = read_shard(flat, digest)
    assert torch.equal(whole.tables[0].tensors["keys"], keys)
    half = read_shard(flat, digest, keep=_routes(1, 2)).tables[0].tensors
    assert torch.equal(half["keys"], keys[torch.from_numpy(shard_of_keys(keys.numpy(), 2) == 1)])
    assert ckpt._file_digest(flat) == digest and ckpt._file_digest(Path(written.path)) == (
        written.sha256)
    data = bytearray(flat.read_bytes())
    row = int(np.flatnonzero(shard_of_keys(keys.numpy(), 2) == 0)[0])
    data[_data_offset(str(flat), "emb/value") + row * 32] ^= 0x01  # a row the read leaves out
    flat.write_bytes(data)
    with pytest.raises(CheckpointCorruptError, match="checksum"):
        read_shard(flat, digest, keep=_routes(1, 2))
    assert ckpt._file_digest(flat) != digest


def test_a_read_that_keeps_some_keys_refuses_a_table_not_one_row_per_key_or_a_bad_filter(
        tmp_path: Path) -> None:
    keys = torch.arange(6, dtype=torch.int64)
    bad = write_shard(tmp_path / "bad", _state(tables=[TableState("emb", SPARSE_SPEC, {
        "keys": keys, "value": torch.zeros(5, 2)})]))
    with pytest.raises(CheckpointCorruptError, match="one row for each of its 6 keys"):
        read_shard(bad.path, keep=_even)
    assert read_shard(bad.path).tables  # read whole, it is only what it is
    good = write_shard(tmp_path / "good", _state(tables=[TableState("emb", SPARSE_SPEC, {
        "keys": keys, "value": torch.zeros(6, 2)})]))
    with pytest.raises(CheckpointError, match="one bool per key"):
        read_shard(good.path, keep=lambda k: k[:3] > 0)


def test_a_corrupt_delta_or_base_is_refused_naming_the_file_and_passed_over(
        tmp_path: Path) -> None:
    trained = _Trained(tmp_path, full_every=10)
    for i in range(5):
        trained.step()
        trained.checkpoint(f"c{i}")
    files = trained.files

    def flip_end(path: Path) -> None:  # in place: every link to the file sees it
        data = bytearray(path.read_bytes())
        data[-4:] = bytes(b ^ 0xFF for b in data[-4:])
        with open(path, "r+b") as f:
            f.write(bytes(data))

    own = Path(files["c4"].path)
    flip_end(own)
    with pytest.raises(CheckpointCorruptError, match=f"{own} fails its checksum"):
        load_checkpoint(tmp_path, JOB, "c4", 0, 1, files["c4"].sha256)
    assert "fails its checksum" in str(bad_reason(tmp_path, JOB, "c4"))
    assert bad_reason(tmp_path, JOB, "c3") is None  # the deltas before it are fine
    # The base file c1 is the same file as its link in c2 (and c3, c4): damage there is
    # caught through the chain, marks c2 (read) and c1, and c3, built on them, is passed
    # over from then on without a mark of its own.
    base = Path(files["c1"].path)
    link = tmp_path / JOB / "c2" / "shard-0-of-1.base-c1.safetensors"
    assert os.path.samefile(base, link)
    flip_end(base)
    assert latest_complete(tmp_path, JOB).checkpoint_id == "c3"  # type: ignore[union-attr]
    verified = latest_complete(tmp_path, JOB, verify_checksums=True)  # hashes the chains too
    assert verified is not None and verified.checkpoint_id == "c0"
    with pytest.raises(CheckpointCorruptError, match=f"builds on 'c1'.*{link} fails its"):
        load_checkpoint(tmp_path, JOB, "c2", 0, 1, files["c2"].sha256)
    assert "builds on 'c1'" in str(bad_reason(tmp_path, JOB, "c2"))
    assert str(link) in str(bad_reason(tmp_path, JOB, "c1"))
    assert bad_reason(tmp_path, JOB, "c3") is None
    assert [m.checkpoint_id for m in list_checkpoints(tmp_path, JOB)] == ["c0"]
    latest = latest_complete(tmp_path, JOB)
    assert latest is not None and latest.checkpoint_id == "c0"


def test_a_missing_link_is_refused_naming_it(tmp_path: Path) -> None:
    trained = _Trained(tmp_path, full_every=10)
    for i in range(3):
        trained.step()
        trained.checkpoint(f"c{i}")
    link = tmp_path / JOB / "c2" / "shard-0-of-1.base-c0.safetensors"
    link.unlink()
    with pytest.raises(CheckpointError, match=f"builds on 'c0'.*cannot open .*{link}"):
        read_checkpoint(tmp_path, JOB, "c2", 0, 1, trained.files["c2"].sha256)
    assert [m.checkpoint_id for m in list_checkpoints(tmp_path, JOB)] == ["c0", "c1"]


def test_a_delta_outlives_its_base_rewritten_or_removed(tmp_path: Path) -> None:
    trained = _Trained(tmp_path, full_every=10)
    for i in range(3):
        trained.step()
        trained.checkpoint(f"c{i}")
    expected = _tensors_by_key(read_checkpoint(tmp_path, JOB, "c2", 0, 1,
                                               trained.files["c2"].sha256))
    # Another run writes c0 and c1 again, then they go altogether: c2's links keep its chain.
    again = _Trained(tmp_path, full_every=10)
    again.step()
    again.checkpoint("c0")
    again.checkpoint("c1")
    assert _tensors_by_key(read_checkpoint(tmp_path, JOB, "c2", 0, 1,
                                           trained.files["c2"].sha256)) == expected
    for checkpoint_id in ("c0", "c1"):
        for path in (tmp_path / JOB / checkpoint_id).iterdir():
            path.unlink()
        (tmp_path / JOB / checkpoint_id).rmdir()
    assert _tensors_by_key(read_checkpoint(tmp_path, JOB, "c2", 0, 1,
                                           trained.files["c2"].sha256)) == expected


def _manifest(checkpoint_id: str, at: int, clock: int, kind: str = "full",
              complete: bool = True, run: str = "r1") -> ckpt.Manifest:
    shard = ShardFile(f"/x/{checkpoint_id}", "0" * 64, 1, kind=kind,
                      base="b" if kind == "delta" else "")
    return ckpt.Manifest(JOB, checkpoint_id, clock, 1, {0: shard}, complete, Path("/x"),
                         at * 10**9, run)


HOUR = 3600


@pytest.mark.parametrize(("checkpoints", "keep", "pruned"), [
    # keep the 2 newest full ones (f3, f5) and everything after the older of them
    ([_manifest("f1", 1, 10), _manifest("d2", 2, 20, "delta"), _manifest("f3", 3, 30),
      _manifest("d4", 4, 40, "delta"), _manifest("f5", 5, 50), _manifest("d6", 6, 60, "delta")],
     2, ["f1", "d2"]),
    ([_manifest("f1", 1, 10), _manifest("f3", 3, 30)], 0, []),  # 0 keeps all
    ([_manifest("f1", 1, 10), _manifest("d2", 2, 20, "delta")], 2, []),  # fewer than keep
    # another run's checkpoints are left alone
    ([_manifest("f1", 1, 10, run="r0"), _manifest("f3", 3, 30), _manifest("f5", 5, 50)], 1,
     ["f3"]),
    # an incomplete one is a writer's at work, unless untouched for an hour
    ([_manifest("i1", 1, 10, complete=False), _manifest("f3", 3, 30),
      _manifest("i4", 3 * HOUR, 20, complete=False), _manifest("f5", 3 * HOUR + 1, 50)],
     1, ["i1", "f3"]),
    # written before the cut but of a higher clock (another timeline, or a shard behind)
    ([_manifest("d9", 1, 90, "delta"), _manifest("f3", 3, 30)], 1, []),
    # a full checkpoint with a shard that is a delta is no full checkpoint
    ([_manifest("f1", 1, 10), _manifest("d2", 2, 20, "delta")], 1, []),
])
def test_prunable(checkpoints: list[ckpt.Manifest], keep: int, pruned: list[str]) -> None:
    now = checkpoints[-1].written_at_ns + 10**9
    assert ckpt.prunable(checkpoints, keep, "r1", now) == pruned


def test_pruning_keeps_every_checkpoint_after_the_kept_full_ones_restorable(
        tmp_path: Path) -> None:
    trained = _Trained(tmp_path, full_every=3)
    for i in range(8):  # c0 F, c1 D, c2 D, c3 F, c4 D, c5 D, c6 F, c7 D
        trained.step()
        trained.checkpoint(f"c{i}")
    assert ckpt.prune(tmp_path, JOB, 2, "r1") == ["c0", "c1", "c2"]
    assert ckpt.prune(tmp_path, JOB, 2, "r1") == []  # again, or at once elsewhere: nothing
    left = list_checkpoints(tmp_path, JOB)
    assert [(m.checkpoint_id, m.kind) for m in left] == [
        ("c3", "full"), ("c4", "delta"), ("c5", "delta"), ("c6", "full"), ("c7", "delta")]
    assert sorted(p.name for p in (tmp_path / JOB).iterdir()) == [
        "c3", "c4", "c5", "c6", "c7"]
    for manifest in left:
        state = read_checkpoint(tmp_path, JOB, manifest.checkpoint_id, 0, 1,
                                manifest.shards[0].sha256)
        assert state.kind == "full"


def test_a_read_in_place_fills_the_tensors_given_for_a_full_file_only(tmp_path: Path) -> None:
    trained = _Trained(tmp_path, full_every=10)
    for i in range(2):
        trained.step()
        trained.checkpoint(f"c{i}")
    full, delta = trained.files["c0"], trained.files["c1"]
    given: dict[tuple[str, str], torch.Tensor] = {}

    def into(table: str, name: str, dtype: torch.dtype,
             shape: tuple[int, ...]) -> torch.Tensor | None:
        if name == "value":  # the others: fresh memory
            return given.setdefault((table, name), torch.empty(shape, dtype=dtype))
        if name == "keys":  # a wrong answer is passed over
            return torch.empty((shape[0] + 1, *shape[1:]), dtype=dtype)
        return None

    read = read_shard(full.path, full.sha256, keep=_even, into=into)
    assert _tensors_by_key(read) == _cut(read_shard(full.path), _even)
    sparse = [t for t in read.tables if "keys" in t.tensors]
    assert sparse and {(t.name, "value") for t in sparse} == set(given)
    for table in sparse:
        assert table.tensors["value"] is given[(table.name, "value")]
    given.clear()
    read_shard(delta.path, delta.sha256, keep=_even, into=into)
    assert not given  # a delta's rows are not the state's: never read in place
    assert ckpt.kept_rows(delta.path, _even) is None
    assert ckpt.kept_rows(full.path, _even) == {
        t.name: len(t.tensors["keys"]) for t in sparse}


_FILE_TOO_BIG = """
import resource, signal, sys, torch
from ps.checkpoint import CheckpointError, ShardState, TableState, write_shard
root = sys.argv[1]
rows = {"keys": torch.arange(4), "value": torch.ones(4, 2)}
full = write_shard(root, ShardState("job-1", 0, 1, "c1", 1, {}, [
    TableState("emb", {"kind": "sparse", "dim": 2}, rows)]))
# The OS refuses the delta's bytes past 64 KiB (EFBIG, as a full disk refuses them).
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
big = {"keys": torch.arange(1 << 16), "value": torch.ones(1 << 16, 2)}
try:
    write_shard(root, ShardState("job-1", 0, 1, "c2", 2, {}, [
        TableState("emb", {"kind": "sparse", "dim": 2}, big, kind="rows")],
        kind="delta", base="c1"), base=full)
except CheckpointError as exc:
    print(exc)
    sys.exit(0)
sys.exit("the write did not fail")
"""


def test_a_delta_that_fails_to_write_leaves_no_link_to_its_chain(tmp_path: Path) -> None:
    # Nothing reads a checkpoint directory without a manifest, and retention does not remove
    # one: links to the chain left there would keep the chain's files on disk for good.
    proc = subprocess.run(
        [sys.executable, "-c", _FILE_TOO_BIG, str(tmp_path)], cwd=REPO, capture_output=True,
        env={**os.environ, "PYTHONPATH": str(REPO)}, timeout=60, check=False, text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "File too large" in proc.stdout and "check free space" in proc.stdout, proc.stdout
    assert list((tmp_path / JOB / "c2").iterdir()) == []
    base = tmp_path / JOB / "c1" / "shard-0-of-1.safetensors"
    assert base.stat().st_nlink == 1


def test_retention_removes_what_a_killed_writer_left_once_it_is_stale(tmp_path: Path) -> None:
    clock = _Clock()
    _checkpoint(tmp_path, "c1", [0], 1, clock)
    job_dir = tmp_path / JOB
    # A writer killed in a delta: its link to the base and its temporary file, no entry;
    # and one still writing a full one (its temporary file written a minute ago).
    for name, age_s in (("c2", ckpt.STALE_TMP_AGE_S + 60), ("c3", 60)):
        (job_dir / name).mkdir()
        if name == "c2":
            os.link(job_dir / "c1" / "shard-0-of-1.safetensors",
                    job_dir / name / "shard-0-of-1.base-c1.safetensors")
        temp = job_dir / name / ".shard-0-of-1.safetensors.tmp-1-0a0b0c0d"
        temp.write_bytes(b"x" * 10)
        old = time.time() - age_s
        for path in (temp, job_dir / name):
            os.utime(path, (old, old))
    # Partial, but with an entry: a checkpoint, which retention's own rules keep or remove.
    _checkpoint(tmp_path, "c4", [0], 2, clock)
    os.utime(job_dir / "c4", (time.time() - 2 * ckpt.STALE_TMP_AGE_S,) * 2)
    assert ckpt.prune(tmp_path, JOB, keep=0) == []
    assert (job_dir / "c2").exists()  # keep 0 keeps everything
    ckpt.prune(tmp_path, JOB, keep=1)
    assert sorted(p.name for p in job_dir.iterdir()) == ["c1", "c3", "c4"]
    assert (job_dir / "c1" / "shard-0-of-1.safetensors").stat().st_nlink == 1
