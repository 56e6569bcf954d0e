"""Checkpoint I/O benchmark: write and restore rate of one ~1 GB parameter-server shard, the
rate of restoring a checkpoint onto another number of servers (resharding), what a delta
checkpoint costs next to a full one, and the training stall a consistent checkpoint causes.

    python benchmarks/checkpoint_io.py [--only io|reshard|delta|stall] [--mb MB] [--reps 3]
        [--json PATH] [--dir DIR]

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
Every section runs with one torch thread, as a server does (--torch-threads; before
2026-11-26 they ran with torch's default, one per core). One untimed write and restore run
first: on a VM the first touch of guest memory is slow
(the host backs pages lazily), which would otherwise land on the first timed run only.
Prints a table and writes JSON to benchmarks/results/checkpoint_io-<date>.json (with
`--only S`, checkpoint_io-S-<date>.json; and --json PATH); the headline keys are
`checkpoint_write_MBps` and `checkpoint_restore_MBps` (cold), `reshard_restore_ratio`,
`delta_time_ratio`, `delta_bytes_ratio` and `snapshot_stall_p99_ratio`. Files go to a
temporary directory under /tmp (or --dir), removed at the end.

The reshard section (`--only reshard` runs it alone, into checkpoint_io-reshard-<date>.json)
writes one model of about --mb MB (a sparse table of float32 rows x 64 with Adagrad state and
int64 keys, and a 2048 x 1024 dense table with Adam state) as a checkpoint of 2 servers and as
one of 3, and restores each onto 2 and onto 3 servers the way a starting server does
(`find_checkpoint`, which reads and verifies the shard files, resharding when the counts
differ, then `Shard.restore`; a resharding server in a job then also writes its share,
timed apart: `..._and_write_MBps`). Each target server's restore is timed alone with the
checkpoint's files dropped from the page cache first, as on a machine of its own. The rate is
the model's MB (its files' size) over the slowest target's time (servers restore in
parallel); `..._serial_MBps` over the sum of the targets' times (one after another on one
machine). `reshard_restore_ratio_<n>to<m>` is the rate of n -> m over that of the same
checkpoint restored onto n (same-count); `reshard_restore_ratio` the smaller of 2 -> 3 and
3 -> 2 (goal >= 0.7); `..._vs_<m>to<m>` over that of m servers restoring the checkpoint
m servers wrote, and `reshard_restore_ratio_vs_target_count` the smaller of those two (what
resharding costs a job of m servers; the same-count ratio of n -> m also holds the change in
each server's share, 1.5x for 3 -> 2). A server that wrote its share syncs the file system
after removing it, so its deferred I/O does not fall in the next timed read. Medians of
--reps. `reshard_peak_MB` gives, per case and target, the peak memory of a fresh process
finding its share (read, verify, reshard; no restore) above what it held before, beside the
share's size: each runs alone, once.

The delta section (`--only delta` runs it alone; --mb sizes it, default ~2 GiB) builds a real
`Shard` holding one sparse table of float32 rows x 64 with Adagrad state, its rows created by
pulls, so the tables' change tracking is what a server runs. Each rep changes 1% of the rows
(a gradient push to random keys), writes a full checkpoint, changes another 1%, and writes a
delta of it, each the way a server does: `Shard.snapshot` (the copy) and `write_snapshot`
(file, fsync, sha256, manifest entry, links), timed together. `delta_time_ratio` is the
median delta time over the median full time, `delta_bytes_ratio` the delta file's size over
the full one's; `delta_restore_s` is the median time to read the delta back through its
chain (`read_resolved`, warm page cache), against `full_restore_s` for the full file.

The stall section (`--only stall`; --mb sizes the model, default 1024) is
benchmarks/snapshot_stall.py: a real async job (2 servers, 2 workers at batch 1024), asked for
checkpoints while it trains; `snapshot_stall_p99_ratio` is the p99 step time during
checkpoints over the median step outside them (goal <= 2). It runs twice: every checkpoint
full (`--checkpoint-full-every 1`), and the job's default of deltas between fulls, --reps
times each; the run of the median ratio is kept, with every run's ratio (`ratios`) and the
same p99 over the median with no checkpoint under way (`outside_ratios`): the floor that the
machine's own spread of steps puts under the figure.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import numpy as np  # noqa: E402
from saved import save  # noqa: E402
from snapshot_stall import measure as measure_stall  # noqa: E402

from protos import modes  # noqa: E402
from protos.partition import dense_placement, shard_of_keys  # noqa: E402
from ps.checkpoint import (  # noqa: E402
    ShardState,
    TableState,
    read_resolved,
    read_shard,
    write_manifest,
    write_shard,
)
from ps.clocks import ClockBoard, Quorum  # noqa: E402
from ps.coordination import find_checkpoint, write_resharded, write_snapshot  # noqa: E402
from ps.server import tune_process  # noqa: E402
from ps.shard import Exchange, Pull, PushMeta, Shard, ShardConfig, SparsePush  # noqa: E402
from ps.tables import OptimizerConfig, TableSpec  # noqa: E402
from scheduler.spec import JobSpec  # noqa: E402

DIM = 64
# The share of rows a delta holds: changed between two checkpoints.
CHANGED = 0.01
RESHARD_JOB = "bench"
SECTIONS = ("io", "reshard", "delta", "stall")
# (checkpoint's servers, target servers): each reshard against the same count.
RESHARD_CASES = [(2, 2), (2, 3), (3, 3), (3, 2)]
EMB = TableSpec("emb", "sparse", torch.float32, dim=DIM,
                optimizer=OptimizerConfig("adagrad", (("lr", 0.01),)))
MLP = TableSpec("mlp", "dense", torch.float32, shape=(2048, 1024),
                optimizer=OptimizerConfig("adam", (("lr", 0.001),)))


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


def write_model_checkpoints(work: Path, total_mb: float) -> dict[int, int]:
    """The reshard section's model, written as a checkpoint of each count in RESHARD_CASES
    (ids ckpt-<n>); returns each one's bytes on disk."""
    mlp_bytes = 3 * 2048 * 1024 * 4  # value, exp_avg, exp_avg_sq
    rows = int(max(total_mb * 1e6 - mlp_bytes, 1e6) / (DIM * 4 * 2 + 8))
    gen = torch.Generator().manual_seed(0)
    value = torch.randn(rows, DIM, generator=gen)
    state_sum = torch.rand(rows, DIM, generator=gen)
    # Distinct keys, spread over the int64 range (a bijection of 0..rows-1).
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps by design
        keys = (np.arange(rows, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)).view(np.int64)
    dense = {name: torch.randn(2048, 1024, generator=gen)
             for name in ("value", "state.exp_avg", "state.exp_avg_sq")}
    dense["state.exp_avg_sq"].abs_()
    board = ClockBoard(Quorum(2))
    board.open_clock = board.clocks_closed = 7
    board.clocks = {0: 7, 1: 7}
    meta = {"mode": "sync", "incarnation": 1, **board.to_meta(), "ledger": []}
    sizes: dict[int, int] = {}
    for count in sorted({n for n, _ in RESHARD_CASES}):
        owner = shard_of_keys(keys, count)
        total = 0
        for shard in range(count):
            at = torch.from_numpy(np.flatnonzero(owner == shard))
            block = dense_placement("mlp", MLP.shape, 4, count)[shard]
            tables = [
                TableState("emb", EMB.to_dict(), {
                    "keys": torch.from_numpy(keys).index_select(0, at),
                    "value": value.index_select(0, at),
                    "state.sum": state_sum.index_select(0, at)}),
                TableState("mlp", MLP.to_dict(), {
                    **{n: t[block.start:block.end].clone() for n, t in dense.items()},
                    "step": torch.tensor([7]), "written": torch.tensor(True)}),
            ]
            state = ShardState(RESHARD_JOB, shard, count, f"ckpt-{count}", 7, meta, tables)
            written = write_shard(work, state)
            write_manifest(work, state.checkpoint_id, RESHARD_JOB, 7, {shard: written}, count)
            total += written.nbytes
        sizes[count] = total
    return sizes


def restore_as_a_server(work: Path, count: int, shard: int,
                        servers: int) -> tuple[float, float, float]:
    """Shard `shard` of `servers` restores checkpoint ckpt-<count> as a starting server does,
    its files cold; returns (seconds to find and read it, resharded if need be; seconds of
    Shard.restore; seconds to write the resharded share as a server in a job then does, 0
    for the same count). The written share is removed again."""
    for path in (work / RESHARD_JOB / f"ckpt-{count}").glob("*.safetensors"):
        drop_cache(path)
    start = time.perf_counter()
    found = find_checkpoint(None, None, shard, servers, RESHARD_JOB, str(work),
                            from_disk=True, resume_from=f"ckpt-{count}")
    read = time.perf_counter() - start
    if found is None or found.resharded_from != (count if count != servers else 0):
        raise RuntimeError(f"checkpoint ckpt-{count} not found as expected: {found!r}")
    target = Shard(ShardConfig(shard, servers, mode=modes.SYNC, quorum=Quorum(2)))
    start = time.perf_counter()
    target.restore(found.state)
    restore = time.perf_counter() - start
    del target
    if not found.resharded_from:
        return read, restore, 0.0
    start = time.perf_counter()
    written = write_resharded(str(work), found, JobSpec(RESHARD_JOB, servers=servers), b"")
    write = time.perf_counter() - start
    shutil.rmtree(work / RESHARD_JOB / written.state.checkpoint_id)
    # The file system frees the removed file's blocks later, with I/O of its own: done now,
    # so it does not land in the next server's timed read.
    os.sync()
    return read, restore, write


def peak_of_restore(work: Path, count: int, shard: int, servers: int) -> dict[str, float]:
    """Memory of shard `shard` of `servers` finding (reading, resharding) checkpoint
    ckpt-<count>, in a fresh process: its peak RSS above what the process held before
    (pstrain loaded), and the share it ends up with, in MB (2**20 bytes)."""
    child = subprocess.run(
        [sys.executable, __file__, "--peak-of-restore", str(work), str(count), str(shard),
         str(servers)], capture_output=True, text=True, check=True)
    return dict(json.loads(child.stdout.strip().splitlines()[-1]))


def _peak_of_restore_here(work: str, count: int, shard: int, servers: int) -> None:
    tune_process(1)
    before = _peak_rss_kib()
    found = find_checkpoint(None, None, shard, servers, RESHARD_JOB, work, from_disk=True,
                            resume_from=f"ckpt-{count}")
    if found is None:
        raise RuntimeError(f"checkpoint ckpt-{count} not found in {work}")
    peak = _peak_rss_kib()
    share = sum(t.numel() * t.element_size() for table in found.state.tables
                for t in table.tensors.values())
    print(json.dumps({"peak_above_start_MB": round((peak - before) / 1024, 1),
                      "share_MB": round(share / 2**20, 1)}))


def _peak_rss_kib() -> int:
    """This process's peak RSS (VmHWM: its own, unlike ru_maxrss, which a child started by
    a larger parent inherits)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status")


def reshard_section(work: Path, args: argparse.Namespace) -> dict[str, object]:
    sizes = write_model_checkpoints(work, args.mb)
    # One untimed restore first (see the module docstring: first touch of guest memory).
    restore_as_a_server(work, 2, 0, 3)
    parallel: dict[str, list[float]] = {}
    serial: dict[str, list[float]] = {}
    written: dict[str, list[float]] = {}
    parts: dict[str, list[list[float]]] = {}
    for _ in range(args.reps):
        for count, servers in RESHARD_CASES:
            case = f"{count}to{servers}"
            times = [restore_as_a_server(work, count, k, servers) for k in range(servers)]
            totals = [read + restore for read, restore, _ in times]
            parallel.setdefault(case, []).append(max(totals))
            serial.setdefault(case, []).append(sum(totals))
            written.setdefault(case, []).append(max(sum(t) for t in times))
            parts.setdefault(case, []).append([round(x, 4) for t in times for x in t])
    out: dict[str, object] = {"reshard_model_bytes": sizes}
    for count, servers in RESHARD_CASES:
        case = f"{count}to{servers}"
        out[f"restore_{case}_MBps"] = sizes[count] / 1e6 / statistics.median(parallel[case])
        out[f"restore_{case}_serial_MBps"] = (sizes[count] / 1e6
                                              / statistics.median(serial[case]))
        if count != servers:
            # A server in a job also writes its share before it serves (write_resharded).
            out[f"restore_{case}_and_write_MBps"] = (sizes[count] / 1e6
                                                     / statistics.median(written[case]))
    for count, servers in RESHARD_CASES:
        if count != servers:
            case, same = f"{count}to{servers}", f"{count}to{count}"
            out[f"reshard_restore_ratio_{case}"] = (
                statistics.median(parallel[same]) / statistics.median(parallel[case]))
            out[f"reshard_restore_ratio_{case}_serial"] = (
                statistics.median(serial[same]) / statistics.median(serial[case]))
            # Against the target count's own restore of its own checkpoint (the same model).
            out[f"reshard_restore_ratio_{case}_vs_{servers}to{servers}"] = (
                out[f"restore_{case}_MBps"]  # type: ignore[operator]
                / out[f"restore_{servers}to{servers}_MBps"])
    out["reshard_restore_ratio"] = min(out["reshard_restore_ratio_2to3"],  # type: ignore[type-var]
                                       out["reshard_restore_ratio_3to2"])
    out["reshard_restore_ratio_vs_target_count"] = min(
        float(out["reshard_restore_ratio_2to3_vs_3to3"]),  # type: ignore[arg-type]
        float(out["reshard_restore_ratio_3to2_vs_2to2"]))  # type: ignore[arg-type]
    out["reshard_peak_MB"] = {f"{count}to{servers}": [peak_of_restore(work, count, k, servers)
                                                      for k in range(servers)]
                              for count, servers in RESHARD_CASES}
    out["reshard_seconds"] = {"per_target_read_restore_write": parts,
                              "slowest_target": {k: [round(x, 4) for x in v]
                                                 for k, v in parallel.items()}}
    return out


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


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The stall run of the median `snapshot_stall_p99_ratio`, with every run's ratio."""
    ranked = sorted(runs, key=lambda r: r["snapshot_stall_p99_ratio"])
    return {**ranked[len(ranked) // 2],
            "ratios": [r["snapshot_stall_p99_ratio"] for r in runs],
            "outside_ratios": [r["p99_outside_ratio"] for r in runs]}


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
    parser.add_argument("--only", choices=SECTIONS,
                        help="run one section (default: every one): io (one shard's write "
                             "and restore), reshard (a checkpoint restored onto another "
                             "number of servers), delta (a delta against a full checkpoint), "
                             "stall (training steps during checkpoints)")
    parser.add_argument("--mb", type=float, default=None,
                        help="model size in MB (1e6 bytes); default 1024, 2147 (2 GiB) for "
                             "delta")
    parser.add_argument("--reps", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--json", help="also write the figures to this path")
    parser.add_argument("--dir", default="/tmp", help="parent of the temporary directory")
    parser.add_argument("--no-baselines", action="store_true",
                        help="skip the raw-write and safetensors comparisons")
    parser.add_argument("--peak-of-restore", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peak_of_restore:
        work, *numbers = args.peak_of_restore
        _peak_of_restore_here(work, *(int(n) for n in numbers))
        return
    # Every section times what a server does, and a server runs one torch thread
    # (--torch-threads); from 2026-11-26 on, so do they.
    torch.set_num_threads(1)
    results: dict[str, object] = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus, {platform.platform()}",
        "reps": args.reps,
    }
    mb = args.mb
    for section in [args.only] if args.only else SECTIONS:
        if section == "io":
            args.mb = mb or 1024.0
            results.update(io_section(args))
        elif section == "reshard":
            args.mb = mb or 1024.0
            work = Path(tempfile.mkdtemp(prefix="pstrain-reshard-bench-", dir=args.dir))
            try:
                results.update(reshard_section(work, args))
            finally:
                shutil.rmtree(work, ignore_errors=True)
        elif section == "delta":
            work = Path(tempfile.mkdtemp(prefix="pstrain-delta-bench-", dir=args.dir))
            try:
                delta = delta_section(mb or 2147.0, args.reps, work)
            finally:
                shutil.rmtree(work, ignore_errors=True)
            results["delta"] = delta
            results["delta_time_ratio"] = delta["delta_time_ratio"]
            results["delta_bytes_ratio"] = delta["delta_bytes_ratio"]
        else:
            stall = {kind: median_run([measure_stall(mb or 1024.0, up_flags=flags,
                                                     directory=args.dir)
                                       for _ in range(args.reps)])
                     for kind, flags in (("full", ["--checkpoint-full-every", "1"]),
                                         ("deltas", []))}
            results["stall"] = stall
            results["snapshot_stall_p99_ratio"] = stall["deltas"]["snapshot_stall_p99_ratio"]
            results["snapshot_stall_p99_ratio_full"] = stall["full"]["snapshot_stall_p99_ratio"]
    print(f"\ncheckpoint I/O, {results['date']}, {results['machine']}")
    print(f"median of {args.reps}")
    for key, value in results.items():
        if key.endswith("MBps"):
            print(f"  {key:<36} {value:8.0f} MB/s")
        elif "ratio" in key:
            print(f"  {key:<36} {value:8.3f}")
    for name, figures in results.items():
        if isinstance(figures, dict):
            print(f"  {name}: {json.dumps(figures)}")
    section_name = f"-{args.only}" if args.only and args.only != "io" else ""
    save(results, f"checkpoint_io{section_name}-{results['date']}", args.json)


def io_section(args: argparse.Namespace) -> dict[str, object]:
    """One shard's write and restore, with the baselines."""
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
        "shard_bytes": nbytes,
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
    return results


if __name__ == "__main__":
    main()
