"""`pstrain export`: real shards' checkpoints reassembled into one served model, the layout
it writes, refusals of bad checkpoints, and deltas."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from protos.exported import (
    DenseTable,
    ExportFormatError,
    SparseTable,
    read_export,
    sha256_file,
    table_file_name,
)
from protos.partition import dense_placement, shard_of_keys
from ps.checkpoint import CheckpointCorruptError, ShardFile, write_manifest, write_shard
from ps.coordination import write_snapshot
from ps.export import ExportError, Publisher, export, find, main
from ps.shard import DensePush, Exchange, Pull, PushMeta, Shard, ShardConfig, SparsePush
from ps.tables import SparseRows, TableSpec
from worker.serving import apply_delta, load_published, save

REPO = Path(__file__).resolve().parents[2]
JOB = "exp"
SHARDS = 2
BIG = (300, 64)  # 75 KiB of float32: split across the shards by rows
SPECS = [
    TableSpec("big", "dense", torch.float32, shape=BIG),
    TableSpec("bias", "dense", torch.float32, shape=(3,)),
    TableSpec("half/bias", "dense", torch.float16, shape=(2,)),
    TableSpec("emb", "sparse", torch.float32, dim=4),
    TableSpec("half/emb", "sparse", torch.bfloat16, dim=3, seed=5),
]


class Cluster:
    """SHARDS real shards holding SPECS, with known dense values and pulled sparse rows."""

    def __init__(self, full_every: int = 1) -> None:
        self.shards = [Shard(ShardConfig(shard=k, num_shards=SHARDS, job=JOB,
                                         checkpoint_full_every=full_every))
                       for k in range(SHARDS)]
        for shard in self.shards:
            shard.declare(SPECS)
        self.seq = 0
        self.dense = {"big": torch.arange(BIG[0] * BIG[1], dtype=torch.float32).reshape(BIG),
                      "bias": torch.tensor([1.0, -2.0, 3.5]),
                      "half/bias": torch.tensor([0.5, 1e-3], dtype=torch.float16)}
        for name, value in self.dense.items():
            self.assign(name, value)
        self.rows: dict[str, dict[int, torch.Tensor]] = {"emb": {}, "half/emb": {}}
        self.touch("emb", [5, -3, 1 << 40, 17, 2])
        self.touch("half/emb", [9, 8, 7])

    def exchange(self, k: int, pushes: list[DensePush], pulls: list[Pull]) -> list[object]:
        self.seq += 1
        result = self.shards[k].exchange(Exchange(
            worker=0, incarnation=1, generation=0, push_clock=0, pushes=pushes,
            end_iteration=False, pull_clock=0, pulls=pulls))
        return list(result.pulled)

    def assign(self, name: str, value: torch.Tensor) -> None:
        spec = next(s for s in SPECS if s.name == name)
        for where in dense_placement(name, spec.shape, spec.itemsize, SHARDS):
            block = value[where.start : where.end]
            push = DensePush(name, PushMeta(0, 1, self.seq + 1, assign=True), spec.dtype,
                             tuple(block.shape), [(0, block.reshape(-1).clone())])
            self.exchange(where.shard, [push], [])

    def touch(self, name: str, keys: list[int]) -> None:
        array = np.array(keys, dtype=np.int64)
        owners = shard_of_keys(array, SHARDS)
        for k in range(SHARDS):
            mine = array[owners == k]
            if len(mine):
                (rows,) = self.exchange(k, [], [Pull(name, mine)])
                assert isinstance(rows, SparseRows)
                for i, key in enumerate(mine):
                    self.rows[name][int(key)] = rows.gather(i, i + 1)[0].clone()

    def train(self, name: str, keys: list[int]) -> None:
        array = np.array(keys, dtype=np.int64)
        owners = shard_of_keys(array, SHARDS)
        for k in range(SHARDS):
            mine = array[owners == k]
            if len(mine):
                self.seq += 1
                grads = torch.ones(len(mine), 4)
                push = SparsePush(name, PushMeta(0, 1, self.seq), torch.float32, 4, mine,
                                  memoryview(grads.numpy()).cast("B"))
                self.exchange(k, [push], [])

    def write(self, root: Path, checkpoint_id: str, full: bool = False) -> None:
        """A checkpoint as servers write it: full or a delta, as each shard plans."""
        for shard in self.shards:
            if full:
                shard.snapshots.ask_full(checkpoint_id)
            write_snapshot(shard, str(root), shard.snapshot(checkpoint_id))

    def checkpoint(self, root: Path, checkpoint_id: str) -> list[ShardFile]:
        files = [write_shard(root, s.snapshot(checkpoint_id)) for s in self.shards]
        for k, f in enumerate(files):
            write_manifest(root, checkpoint_id, JOB, 7, {k: f}, SHARDS)
        return files


def test_an_export_reassembles_every_table_in_its_dtype(tmp_path: Path) -> None:
    cluster = Cluster()
    cluster.checkpoint(tmp_path / "ckpt", "c1")
    export(tmp_path / "ckpt", JOB, tmp_path / "out")
    # Both shards held part of "big": the placement really split it.
    assert all(r.rows for r in dense_placement("big", BIG, 4, SHARDS))
    got = read_export(tmp_path / "out")
    assert (got.job, got.checkpoint_id, got.clock, got.kind) == (JOB, "c1", 7, "full")
    for name, value in cluster.dense.items():
        table = got.tables[name]
        assert isinstance(table, DenseTable)
        assert torch.equal(table.value, value)
    for name, rows in cluster.rows.items():
        table = got.tables[name]
        assert isinstance(table, SparseTable)
        assert table.keys.tolist() == sorted(rows)
        assert torch.equal(table.values, torch.stack([rows[k] for k in sorted(rows)]))
        assert torch.equal(table.default, torch.zeros(table.dim, dtype=table.dtype))
    assert got.tables["half/emb"].dtype == torch.bfloat16
    assert got.tables["half/bias"].dtype == torch.float16


def test_the_layout_is_a_manifest_and_one_plain_safetensors_file_per_table(
    tmp_path: Path,
) -> None:
    Cluster().checkpoint(tmp_path / "ckpt", "c1")
    export(tmp_path / "ckpt", JOB, tmp_path / "out")
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == sorted(["manifest.json", "big.safetensors", "bias.safetensors",
                            "emb.safetensors", "half%2Femb.safetensors",
                            "half%2Fbias.safetensors"])
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert {k: manifest[k] for k in ("format", "format_version", "kind", "job",
                                     "checkpoint_id", "clock", "default_row")} == {
        "format": "pstrain.export", "format_version": 1, "kind": "full", "job": JOB,
        "checkpoint_id": "c1", "clock": 7, "default_row": "zeros"}
    emb = manifest["tables"]["half/emb"]
    assert {k: emb[k] for k in ("kind", "dim", "dtype", "file", "rows")} == {
        "kind": "sparse", "dim": 3, "dtype": "bfloat16", "file": "half%2Femb.safetensors",
        "rows": 3}
    assert emb["spec"]["seed"] == 5 and emb["spec"]["init"][0] == "uniform"
    big = manifest["tables"]["big"]
    assert (big["kind"], big["shape"], big["dtype"], big["rows"]) == ("dense", list(BIG),
                                                                      "float32", 300)
    # Plain safetensors, readable without pstrain; no optimizer state.
    assert set(load_file(tmp_path / "out" / emb["file"])) == {"keys", "values", "default"}
    assert set(load_file(tmp_path / "out" / big["file"])) == {"value"}
    assert table_file_name(".x") == "%2Ex.safetensors"


def test_the_newest_complete_checkpoint_or_the_one_named_is_exported(tmp_path: Path) -> None:
    cluster = Cluster()
    cluster.checkpoint(tmp_path, "c1")
    cluster.assign("bias", torch.tensor([9.0, 9.0, 9.0]))
    cluster.checkpoint(tmp_path, "c2")
    assert find(tmp_path, JOB).checkpoint_id == "c2"
    export(tmp_path, JOB, tmp_path / "old", checkpoint_id="c1")
    assert read_export(tmp_path / "old").tables["bias"].value.tolist() == [1.0, -2.0, 3.5]


def test_missing_incomplete_and_corrupt_checkpoints_are_refused_naming_the_file(
    tmp_path: Path,
) -> None:
    with pytest.raises(ExportError, match="no complete checkpoint of job 'exp'"):
        export(tmp_path, JOB, tmp_path / "out")
    cluster = Cluster()
    files = cluster.checkpoint(tmp_path, "c1")
    (tmp_path / JOB / "c1" / "shard-1.json").unlink()
    with pytest.raises(ExportError, match=r"incomplete: .* shard-1-of-2\.safetensors"):
        export(tmp_path, JOB, tmp_path / "out", checkpoint_id="c1")
    write_manifest(tmp_path, "c1", JOB, 7, {1: files[1]}, SHARDS)
    raw = bytearray(Path(files[0].path).read_bytes())
    raw[-1] ^= 0xFF  # same size, other bytes: only the digest can tell
    Path(files[0].path).write_bytes(bytes(raw))
    with pytest.raises(CheckpointCorruptError, match=r"shard-0-of-2\.safetensors fails"):
        export(tmp_path, JOB, tmp_path / "out", checkpoint_id="c1")
    assert not (tmp_path / "out").exists()


def test_an_export_is_never_written_over_an_existing_directory(tmp_path: Path) -> None:
    Cluster().checkpoint(tmp_path, "c1")
    (tmp_path / "out").mkdir()
    with pytest.raises(ExportFormatError, match="exists"):
        export(tmp_path, JOB, tmp_path / "out")


def test_a_corrupt_export_file_is_refused_on_reading(tmp_path: Path) -> None:
    Cluster().checkpoint(tmp_path, "c1")
    export(tmp_path, JOB, tmp_path / "out")
    path = tmp_path / "out" / "emb.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(ExportFormatError, match=r"emb\.safetensors fails its checksum"):
        read_export(tmp_path / "out")


def test_a_delta_of_more_training_applied_to_the_first_export_gives_the_second(
    tmp_path: Path,
) -> None:
    cluster = Cluster()
    cluster.checkpoint(tmp_path, "c1")
    export(tmp_path, JOB, tmp_path / "a")
    cluster.touch("emb", [100, 101])  # new rows
    cluster.train("emb", [17, 2])  # changed rows
    cluster.assign("bias", torch.tensor([0.0, 0.0, 0.0]))
    cluster.checkpoint(tmp_path, "c2")
    export(tmp_path, JOB, tmp_path / "b")
    export(tmp_path, JOB, tmp_path / "d", since=tmp_path / "a")
    d = read_export(tmp_path / "d")
    assert (d.kind, d.base and d.base.checkpoint_id) == ("delta", "c1")
    assert set(d.tables) == {"emb", "half/emb", "bias"}  # "big" did not change
    emb, half = d.tables["emb"], d.tables["half/emb"]
    assert isinstance(emb, SparseTable) and isinstance(half, SparseTable)
    assert emb.keys.tolist() == [2, 17, 100, 101] and half.keys.numel() == 0
    assert emb.removed.numel() == 0
    save(tmp_path / "b2", apply_delta(tmp_path / "a", tmp_path / "d"))
    for name in sorted(p.name for p in (tmp_path / "b").iterdir()):
        assert sha256_file(tmp_path / "b2" / name) == sha256_file(tmp_path / "b" / name), name


def test_a_delta_checkpoint_exports_as_a_full_one_of_the_same_cut(tmp_path: Path) -> None:
    cluster = Cluster(full_every=10)
    cluster.write(tmp_path, "c1")
    cluster.touch("emb", [100, 101])
    cluster.train("emb", [17, 2])
    cluster.assign("bias", torch.tensor([0.0, 4.0, 0.0]))
    cluster.write(tmp_path, "c2")
    assert find(tmp_path, JOB, "c2").kind == "delta"
    cluster.write(tmp_path, "ref", full=True)
    assert find(tmp_path, JOB, "ref").kind == "full"
    export(tmp_path, JOB, tmp_path / "d", checkpoint_id="c2")
    export(tmp_path, JOB, tmp_path / "f", checkpoint_id="ref")
    tables = sorted(p.name for p in (tmp_path / "f").iterdir() if p.name != "manifest.json")
    assert len(tables) == len(SPECS)
    for name in tables:
        assert sha256_file(tmp_path / "d" / name) == sha256_file(tmp_path / "f" / name), name
    assert read_export(tmp_path / "d").tables["bias"].value.tolist() == [0.0, 4.0, 0.0]


def test_the_command_line_exports_and_refuses_with_a_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    Cluster().checkpoint(tmp_path, "c1")
    flags = ["--job", JOB, "--checkpoint-dir", str(tmp_path)]
    # `pstrain export` runs `python -m ps.export`, as `pstrain server` runs `python -m ps`.
    done = subprocess.run([sys.executable, "-m", "scheduler.cli", "export", *flags, "--out",
                           str(tmp_path / "out")], capture_output=True, text=True, cwd=REPO,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(tmp_path / "out" / "manifest.json")
    assert main([*flags, "--checkpoint", "nope", "--out", str(tmp_path / "o2")]) == 2
    assert "pstrain export: checkpoint path" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*flags, "--delta", "--out", str(tmp_path / "o3")])
    assert "--delta and --since EXPORT_DIR go together" in capsys.readouterr().err


def test_a_publisher_writes_a_full_export_then_deltas_that_build_the_newest_model(
    tmp_path: Path,
) -> None:
    cluster, out = Cluster(), tmp_path / "published"
    publisher = Publisher(tmp_path, JOB, out, full_every=3)
    cluster.checkpoint(tmp_path, "c1")
    first = publisher.publish_once()
    assert first is not None and first.name == "000000-full-c1"
    assert publisher.publish_once() is None  # nothing newer
    for n, keys in enumerate(([100, 101], [17, 2], [5]), start=2):
        cluster.train("emb", keys)
        cluster.checkpoint(tmp_path, f"c{n}")
        published = publisher.publish_once()
        assert published is not None
        # What an online store serves, from the full export and the deltas in order, is
        # the newest checkpoint's full export, table for table.
        export(tmp_path, JOB, tmp_path / f"ref{n}", checkpoint_id=f"c{n}")
        save(tmp_path / f"got{n}", load_published(out))
        for name in sorted(p.name for p in (tmp_path / f"ref{n}").iterdir()):
            assert sha256_file(tmp_path / f"got{n}" / name) == sha256_file(
                tmp_path / f"ref{n}" / name), (n, name)
    listing = json.loads((out / "published.json").read_text())
    # Three exports from the full one on, the fourth is full again; the chain before the
    # previous full one is gone.
    assert listing["full"] == "000003-full-c4" and listing["deltas"] == []
    assert listing["checkpoint_id"] == "c4"
    assert sorted(p.name for p in out.iterdir()) == [
        "000000-full-c1", "000001-delta-c2", "000002-delta-c3", "000003-full-c4",
        "published.json"]
    with pytest.raises(ExportError, match="--full-every must be >= 1"):
        Publisher(tmp_path, JOB, out, full_every=0)


def test_the_command_line_publishes_and_refuses_flags_that_do_not_go_together(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    Cluster().checkpoint(tmp_path, "c1")
    flags = ["--job", JOB, "--checkpoint-dir", str(tmp_path), "--out", str(tmp_path / "p")]
    assert main([*flags, "--publish-every", "0.01", "--count", "1"]) == 0
    assert json.loads((tmp_path / "p" / "published.json").read_text())["full"] == (
        "000000-full-c1")
    for bad, said in ((["--publish-every", "-1"], "--publish-every and --count must be >= 0"),
                      (["--publish-every", "1", "--checkpoint", "c1"], "leave out --delta"),
                      (["--count", "2"], "--redis and --count go with --publish-every")):
        with pytest.raises(SystemExit):
            main([*flags, *bad])
        assert said in capsys.readouterr().err
