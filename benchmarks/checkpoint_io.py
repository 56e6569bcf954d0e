"""Checkpoint I/O benchmark: write and restore rate of one ~1 GB parameter-server shard.

    python benchmarks/checkpoint_io.py [--mb 1024] [--reps 3] [--json PATH] [--dir DIR]

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
Prints a table and writes JSON to benchmarks/results/checkpoint_io-<date>.json (and --json
PATH); the headline keys are `checkpoint_write_MBps` and `checkpoint_restore_MBps` (cold).
Files go to a temporary directory under /tmp (or --dir), removed at the end.
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

from ps.checkpoint import ShardState, TableState, read_shard, write_shard  # noqa: E402

DIM = 64


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=1024.0, help="shard size in MB (1e6 bytes)")
    parser.add_argument("--reps", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--json", help="also write the figures to this path")
    parser.add_argument("--dir", default="/tmp", help="parent of the temporary directory")
    parser.add_argument("--no-baselines", action="store_true",
                        help="skip the raw-write and safetensors comparisons")
    args = parser.parse_args()

    state = make_state(args.mb)
    tensors = state.tables[0].tensors
    work = Path(tempfile.mkdtemp(prefix="pstrain-ckpt-bench-", dir=args.dir))
    times: dict[str, list[float]] = {}
    try:
        warm = write_shard(work, ShardState(**{**vars(state), "checkpoint_id": "warmup"}))
        read_shard(warm.path, warm.sha256)
        shutil.rmtree(Path(warm.path).parent)
        nbytes = 0
        for rep in range(args.reps):
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
            if args.no_baselines:
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
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.platform()}",
        "shard_bytes": nbytes,
        "reps": args.reps,
        "checkpoint_write_MBps": mbps["write"],
        "checkpoint_restore_MBps": mbps["restore_cold"],
        "checkpoint_restore_warm_MBps": mbps["restore_warm"],
        "seconds": {k: [round(x, 4) for x in v] for k, v in times.items()},
    }
    if not args.no_baselines:
        results.update({
            "raw_write_fsync_MBps": mbps["raw_write"],
            "safetensors_save_file_fsync_MBps": mbps["safetensors_save_file"],
            "safetensors_load_file_cold_MBps": mbps["safetensors_load_file_cold"],
        })
    print(f"\ncheckpoint I/O, {results['date']}, {results['machine']}")
    print(f"shard of {nbytes / 1e6:.0f} MB, median of {args.reps}, MB/s")
    for key, value in results.items():
        if key.endswith("MBps"):
            print(f"  {key:<36} {value:8.0f}")
    out_dir = REPO / "benchmarks" / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [out_dir / f"checkpoint_io-{results['date']}.json"]
    if args.json:
        paths.append(Path(args.json))
    for out in paths:
        out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
