"""Checkpoint I/O benchmark: write and restore rate of one ~1 GB parameter-server shard, and
what a delta checkpoint costs next to a full one.

    python benchmarks/checkpoint_io.py [--only io|delta] [--mb MB] [--reps 3] [--json PATH]
        [--dir DIR]

The shard holds one sparse table of float32 rows x 64 with an Adagrad sum of the same size
and int64 keys, ~1 GB in all. Each figure is the median of --reps runs, in MB/s (1e6 bytes)
of file size:
- write: `write_shard` with fsync of file and directory and the sha256 computed on the way;
- restore (cold): `read_shard` with sha256 verification after the file was dropped from the
  page cache (posix_fadvise DONTNEED), as after a machine restart;
- restore (warm): the same with the file in the page cache, as after a process restart;
- for scale, on the same data: raw bytes written with os.write + fsync (the disk's ceiling),
  `safetensors.torch.save_file` + fsync (no hash), and `safetensors.torch.load_file` (cold)
  with every tensor cloned (it maps the file lazily; the clone reads it into owned memory,
  which is what `read_shard` returns).
One untimed write and restore run first: on a VM the first touch of guest memory is slow
(the host backs pages lazily), which would otherwise land on the first timed run only.

The delta section (`--only delta` runs it alone; --mb sizes it, default ~2 GiB) builds a real
`Shard` holding one sparse table of float32 rows x 64 with Adagrad state, its rows created by
pulls, so the tables' change tracking is what a server runs. Each rep changes 1% of the rows
(a gradient push to random keys), writes a full checkpoint, changes another 1%, and writes a
delta of it, each the way a server does: `Shard.snapshot` (the copy) and `write_snapshot`
(file, fsync, sha256, manifest entry, links), timed together. `delta_time_ratio` is the
median delta time over the median full time, `delta_bytes_ratio` the delta file's size over
the full one's; `delta_restore_s` is the median time to read the delta back through its
chain (`read_resolved`, warm page cache), against `full_restore_s` for the full file.

Prints a table and writes JSON to benchmarks/results/checkpoint_io-<date>.json
(checkpoint_io-delta-<date>.json with `--only delta`; and --json PATH); the headline keys
are `checkpoint_write_MBps` and `checkpoint_restore_MBps` (cold), and `delta_time_ratio` and
`delta_bytes_ratio`. Files go to a temporary directory under /tmp (or --dir), removed at the
end.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from ps.checkpoint import (  # noqa: E402
    ShardState,
    TableState,
    read_resolved,
    read_shard,
    write_shard,
)
from ps.coordination import write_snapshot  # noqa: E402
from ps.shard import Exchange, Pull, PushMeta, Shard, ShardConfig, SparsePush  # noqa: E402
from ps.tables import OptimizerConfig, TableSpec  # noqa: E402

DIM = 64
# The share of rows a delta holds: changed between two checkpoints.
CHANGED = 0.01


def make_state(total_mb: float) -> ShardState:
    """A shard snapshot of about `total_mb` MB: value + Adagrad sum (float32) + int64 keys."""
    row_bytes = DIM * 4 * 2 + 8
    rows = int(total_mb * 1e6 / row_bytes)
    gen = torch.Generator().manual_seed(0)
    value = torch.randn(rows, DIM, generator=gen)
    state_sum = torch.rand(rows, DIM, generator=gen)
    keys = torch.randint(-(2**62), 2**62, (rows,), generator=gen)
    table = TableState(
        name="emb",
        spec={"kind": "sparse", "dim": DIM, "optimizer": {"name": "adagrad", "lr": 0.01}},
        tensors={"keys": keys, "value": value, "state.sum": state_sum, "step": torch.tensor(7)},
    )
    return ShardState(
        job="bench", shard=0, num_shards=1, checkpoint_id="c000000", clock=7,
        meta={"mode": "sync", "worker_clocks": {"0": 7, "1": 7}}, tables=[table],
    )


def drop_cache(path: Path) -> None:
    """Evicts `path` from the page cache (clean pages only; it was fsynced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def raw_write(path: Path, tensors: list[torch.Tensor]) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for t in tensors:
            view = t.reshape(-1).view(torch.uint8).numpy().data
            while view:
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def safetensors_save(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(path))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_and_clone(path: Path) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in load_file(str(path)).items()}


class DeltaBench:
    """A real shard of one sparse Adagrad table of about `total_mb` MB (values, state, keys),
    written as a server writes it."""

    def __init__(self, total_mb: float, work: Path) -> None:
        self.work = work
        self.rows = int(total_mb * 1e6 / (DIM * 4 * 2 + 8))
        self.shard = Shard(ShardConfig(shard=0, num_shards=1, job="bench",
                                       checkpoint_full_every=1 << 30))
        self.shard.declare([TableSpec("emb", "sparse", torch.float32, dim=DIM,
                                      optimizer=OptimizerConfig("adagrad", (("lr", 0.01),)))])
        self.keys = np.random.default_rng(0).permutation(self.rows).astype(np.int64) * 7919
        self.seq = 0
        self.rng = np.random.default_rng(1)
        for start in range(0, self.rows, 1 << 20):
            self.exchange([], [Pull("emb", self.keys[start : start + (1 << 20)])])

    def exchange(self, pushes: list[SparsePush], pulls: list[Pull]) -> None:
        self.shard.exchange(Exchange(worker=0, incarnation=1, generation=0, push_clock=0,
                                     pushes=pushes, end_iteration=False, pull_clock=0,
                                     pulls=pulls))

    def change(self) -> None:
        """A gradient push to CHANGED of the rows, at random."""
        picked = self.keys[self.rng.choice(self.rows, int(self.rows * CHANGED), replace=False)]
        grads = self.rng.standard_normal((len(picked), DIM), dtype=np.float32)
        self.seq += 1
        self.exchange([SparsePush("emb", PushMeta(0, 1, self.seq), torch.float32, DIM, picked,
                                  memoryview(grads).cast("B"))], [])

    def write(self, checkpoint_id: str, full: bool) -> tuple[float, int, Path, str]:
        """(seconds to snapshot and write, file bytes, file path, sha256)."""
        if full:
            self.shard.snapshots.ask_full(checkpoint_id)
        start = time.perf_counter()
        state = self.shard.snapshot(checkpoint_id)
        written = write_snapshot(self.shard, str(self.work), state)
        elapsed = time.perf_counter() - start
        if written.kind != ("full" if full else "delta"):
            raise RuntimeError(f"{checkpoint_id} is {written.kind}, not what was asked")
        return elapsed, written.nbytes, Path(written.path), written.sha256


def delta_section(total_mb: float, reps: int, work: Path) -> dict[str, object]:
    bench = DeltaBench(total_mb, work)
    times: dict[str, list[float]] = {}
    sizes: dict[str, int] = {}
    for rep in range(reps + 1):  # the first run warms up (see the module docstring)
        bench.change()
        full_s, sizes["full"], full_path, full_sha = bench.write(f"full-{rep}", full=True)
        bench.change()
        delta_s, sizes["delta"], delta_path, delta_sha = bench.write(f"delta-{rep}", full=False)
        if rep:
            times.setdefault("full_write", []).append(full_s)
            times.setdefault("delta_write", []).append(delta_s)
            times.setdefault("full_restore", []).append(
                timed(lambda: read_resolved(full_path, full_sha)))  # noqa: B023
            times.setdefault("delta_restore", []).append(
                timed(lambda: read_resolved(delta_path, delta_sha)))  # noqa: B023
        for path in (full_path, delta_path):
            shutil.rmtree(path.parent)
    median = {k: statistics.median(v) for k, v in times.items()}
    return {
        "rows": bench.rows,
        "changed_rows": int(bench.rows * CHANGED),
        "full_bytes": sizes["full"],
        "delta_bytes": sizes["delta"],
        "full_write_s": median["full_write"],
        "delta_write_s": median["delta_write"],
        "full_restore_s": median["full_restore"],
        "delta_restore_s": median["delta_restore"],
        "delta_time_ratio": median["delta_write"] / median["full_write"],
        "delta_bytes_ratio": sizes["delta"] / sizes["full"],
        "seconds": {k: [round(x, 4) for x in v] for k, v in times.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("io", "delta"),
                        help="run one section (default: both)")
    parser.add_argument("--mb", type=float, default=None,
                        help="shard size in MB (1e6 bytes); default 1024 for io, 2147 (2 GiB) "
                             "for delta")
    parser.add_argument("--reps", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--json", help="also write the figures to this path")
    parser.add_argument("--dir", default="/tmp", help="parent of the temporary directory")
    parser.add_argument("--no-baselines", action="store_true",
                        help="skip the raw-write and safetensors comparisons")
    args = parser.parse_args()
    results: dict[str, object] = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.platform()}",
        "reps": args.reps,
    }
    if args.only != "delta":
        results.update(io_section(args.mb or 1024.0, args.reps, args.dir, args.no_baselines))
    if args.only != "io":
        work = Path(tempfile.mkdtemp(prefix="pstrain-delta-bench-", dir=args.dir))
        try:
            delta = delta_section(args.mb or 2147.0, args.reps, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        results["delta"] = delta
        results["delta_time_ratio"] = delta["delta_time_ratio"]
        results["delta_bytes_ratio"] = delta["delta_bytes_ratio"]
        print(f"\ndelta checkpoints, {results['date']}, {results['machine']}")
        print(f"shard of {delta['full_bytes'] / 1e6:.0f} MB ({delta['rows']} rows), "
              f"{delta['changed_rows']} changed, median of {args.reps}")
        for key in ("full_write_s", "delta_write_s", "full_restore_s", "delta_restore_s"):
            print(f"  {key:<36} {delta[key]:8.3f}")
        print(f"  {'delta_time_ratio':<36} {delta['delta_time_ratio']:8.4f}")
        print(f"  {'delta_bytes_ratio':<36} {delta['delta_bytes_ratio']:8.4f}")
    out_dir = REPO / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    name = "checkpoint_io-delta" if args.only == "delta" else "checkpoint_io"
    paths = [out_dir / f"{name}-{results['date']}.json"]
    if args.json:
        paths.append(Path(args.json))
    for out in paths:
        out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {out}")


def io_section(total_mb: float, reps: int, parent: str, no_baselines: bool
               ) -> dict[str, object]:
    state = make_state(total_mb)
    tensors = state.tables[0].tensors
    work = Path(tempfile.mkdtemp(prefix="pstrain-ckpt-bench-", dir=parent))
    times: dict[str, list[float]] = {}
    try:
        warm = write_shard(work, ShardState(**{**vars(state), "checkpoint_id": "warmup"}))
        read_shard(warm.path, warm.sha256)
        shutil.rmtree(Path(warm.path).parent)
        nbytes = 0
        for rep in range(reps):
            # A fresh checkpoint id each run, the previous one removed, so every write
            # allocates new blocks the way a real periodic checkpoint does.
            rep_state = ShardState(**{**vars(state), "checkpoint_id": f"c{rep:06d}"})
            start = time.perf_counter()
            written = write_shard(work, rep_state)
            times.setdefault("write", []).append(time.perf_counter() - start)
            nbytes = written.nbytes
            path = Path(written.path)
            drop_cache(path)
            times.setdefault("restore_cold", []).append(
                timed(lambda: read_shard(path, written.sha256)))  # noqa: B023
            times.setdefault("restore_warm", []).append(
                timed(lambda: read_shard(path, written.sha256)))  # noqa: B023
            shutil.rmtree(path.parent)
            if no_baselines:
                continue
            raw = work / "raw.bin"
            times.setdefault("raw_write", []).append(
                timed(lambda: raw_write(raw, list(tensors.values()))))  # noqa: B023
            raw.unlink()
            st = work / "plain.safetensors"
            times.setdefault("safetensors_save_file", []).append(
                timed(lambda: safetensors_save(st, tensors)))  # noqa: B023
            drop_cache(st)
            times.setdefault("safetensors_load_file_cold", []).append(
                timed(lambda: load_and_clone(st)))  # noqa: B023
            st.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    mbps = {k: nbytes / 1e6 / statistics.median(v) for k, v in times.items()}
    results: dict[str, object] = {
        "shard_bytes": nbytes,
        "checkpoint_write_MBps": mbps["write"],
        "checkpoint_restore_MBps": mbps["restore_cold"],
        "checkpoint_restore_warm_MBps": mbps["restore_warm"],
        "seconds": {k: [round(x, 4) for x in v] for k, v in times.items()},
    }
    if not no_baselines:
        results.update({
            "raw_write_fsync_MBps": mbps["raw_write"],
            "safetensors_save_file_fsync_MBps": mbps["safetensors_save_file"],
            "safetensors_load_file_cold_MBps": mbps["safetensors_load_file_cold"],
        })
    print(f"\ncheckpoint I/O, shard of {nbytes / 1e6:.0f} MB, median of {reps}, MB/s")
    for key, value in results.items():
        if key.endswith("MBps"):
            print(f"  {key:<36} {value:8.0f}")
    return results


if __name__ == "__main__":
    main()
