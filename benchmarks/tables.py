"""Sparse tables within a budget (issue #16): admission, eviction and compact rows.

    python benchmarks/tables.py [--quick] [--only index,memory,quality,stream] [--json PATH]
        [--update] [--stream-ids N] [--stream-max-s S] [--stream-repeats N] [--max-rows R]
        [--quality-steps S] ...

The full run takes about 15 minutes on 2 cores; `--only` with `--json PATH --update` runs
sections separately into one file.

Sections (each a figure of the issue, under its key):
- stream: a worker pushing and pulling batches through 2 real servers, each step one exchange
  (the previous batch's gradients pushed, this batch's rows pulled, the clock ended). A batch
  is `--hot-share` ids drawn by Zipf from a vocabulary of `--hot-ids` that keeps coming back
  and the rest fresh ids never seen before, until `--stream-ids` distinct ids were offered
  (or `--stream-max-s` passed). The table (dim `--stream-dim`, float32, Adagrad) holds at
  most `--max-rows` rows per server. `budget_rss_ratio`: each server's peak resident memory
  (VmHWM) above its resident memory before the stream, over the budget, which is what
  `pstrain plan` (the table's own accounting, SparseTable.bytes_for) says the table costs at
  max_rows per server; the larger of the two servers (goal <= 1.1). `budget_speed_ratio`:
  keys/s over the last tenth of the steps against the first tenth (after `WARMUP_STEPS`)
  (goal >= 0.9). `evict_p99_ratio`: p99 step time of the evicting table against a table
  without eviction, on the same stream and the same steps (the second half of the first
  `p99_steps` steps: the evicting table is at max_rows from a quarter of them on, and the
  table without eviction, run first on fresh servers, still fits) (goal <= 1.25). Each
  figure is the median of `--stream-repeats` runs.
- quality: examples/synthetic_ctr.py's model and stream (26 hashed Zipf features with a
  planted logistic model) trained in this process against 2 fresh servers per setting, the
  same seed and batches, test AUC on the example's held-out samples: `admit="count:2"` with
  `max_rows` = half the rows the unbounded table ends with (per server) against unbounded
  (`auc_delta_bounded`, goal >= -0.003), and float16 rows against float32
  (`auc_delta_fp16`, goal >= -0.001); the float32 setting run twice gives the run-to-run
  difference (`auc_delta_repeat`), and a control whose ids almost never get a row
  (`admit="prob:1e-9"`) how much of the AUC the rows carry (`auc_delta_no_rows`).
- index: lookup-or-insert keys/s in this process, batches of 64k existing keys, on the raw
  KeyIndex (`index_lookup_or_insert_per_s`), a SparseTable without admission or eviction
  (`table_lookup_or_insert_per_s`) and one with `admit="count:2"`, `ttl_clocks` and
  `max_rows` (`index_lookup_or_insert_admit_per_s`, goal >= 10 M keys/s), through the table's
  row resolution (`SparseTable._rows` as a pull runs it, a sight of each key; it also stamps
  rows under eviction, and at max_rows evicts to make room for new ones). Also batches with
  10% new keys (`*_new10_per_s`), the admitting table running one eviction step after each.
- memory: bytes per row of a table of `--memory-rows` rows (dim `--row-dim`, with
  `admit="count:2"` and `max_rows`, so the sketch, stamps and evicted-id bits are there) on
  its own server, everything included, over the raw bytes of its values and optimizer state
  (`row_memory_ratio_<config>`, goal <= 1.3), from the server's resident memory (its growth
  from after a warm-up table of the same options to after the fill, both read at rest, two
  trim periods after the last request: protos.runtime.trim_heap) and from its own
  accounting (`memory_bytes` in GetStats), for float32 + Adagrad, float16 +
  rowwise_adagrad and float32 + FTRL; and `pstrain plan`'s estimate against both
  (`plan_vs_measured`).
Prints a table; writes JSON to benchmarks/results/tables-<date>.json (and --json PATH); a
run of some sections (--only) names them in the file name.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from procs import Proc, Procs  # noqa: E402
from saved import save  # noqa: E402

from protos.runtime import TRIM_HEAP_S, tune_malloc  # noqa: E402
from ps.index import KeyIndex  # noqa: E402
from ps.initializers import InitSpec  # noqa: E402
from ps.plan import plan_table  # noqa: E402
from ps.row_policy import hash_keys  # noqa: E402
from ps.tables import OptimizerConfig, SparseTable, TableSpec  # noqa: E402
from worker.client import PSClient  # noqa: E402
from worker.modules import PSDense, PSEmbedding  # noqa: E402
from worker.optimizer import PSOptimizer  # noqa: E402
from worker.plan import Pull, Push  # noqa: E402
from worker.training import lookahead  # noqa: E402

SECTIONS = ("index", "memory", "quality", "stream")
# The stream's figures, medians over --stream-repeats runs.
STREAM_FIGURES = (
    "budget_rss_ratio", "budget_rss_ratio_end", "budget_rss_ratio_whole_process",
    "server_memory_over_budget_end", "start_keys_per_s", "end_keys_per_s",
    "budget_speed_ratio", "p99_step_s_evicting", "p99_step_s_unbounded", "evict_p99_ratio",
    "evict_p90_ratio", "evict_median_ratio",
)
TABLE = "stream"
SERVERS = 2
WARMUP_STEPS = 5  # first steps of a stream left out of the speed figures (connections, growth)
# Fresh ids are hashed counters below 2**62, hot ids hashed ranks with this bit set: the hash
# is a bijection, so the two never collide and every fresh id is new.
_HOT_BIT = 1 << 62
_SALT = 0x5EED_7AB1E5


def load_example() -> ModuleType:
    """examples/synthetic_ctr.py as a module (examples/ is not a package)."""
    path = REPO / "examples" / "synthetic_ctr.py"
    spec = importlib.util.spec_from_file_location("synthetic_ctr", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules["synthetic_ctr"] = module
    spec.loader.exec_module(module)
    return module


def status_bytes(pid: int, field: str) -> int:
    """A memory line of /proc/PID/status (VmRSS, VmHWM) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} for pid {pid}")


def table_stats(client: PSClient, name: str) -> list[Any]:
    """The TableStats of `name` on each shard, in shard order (one stats call per shard)."""
    return [t for s in client.stats() for t in s.tables if t.name == name]


# ---- stream within a budget ------------------------------------------------------------------


class FreshStream:
    """Batches of distinct keys: Zipf-drawn ids of a hot vocabulary that come back, and fresh
    ids never seen before. Counts the distinct ids offered exactly."""

    def __init__(self, seed: int, batch: int, hot_share: float, hot_ids: int) -> None:
        self.seed = seed
        self.hot = int(batch * hot_share)
        self.fresh = batch - self.hot
        self.hot_ids = hot_ids
        self.hot_seen = np.zeros(hot_ids, dtype=bool)
        self.next_fresh = 0

    @property
    def distinct(self) -> int:
        return self.next_fresh + int(self.hot_seen.sum())

    def batch(self, step: int) -> npt.NDArray[np.int64]:
        rng = np.random.default_rng([self.seed, step])
        ranks = np.unique((rng.zipf(1.2, self.hot) - 1) % self.hot_ids)
        self.hot_seen[ranks] = True
        fresh = np.arange(self.next_fresh, self.next_fresh + self.fresh, dtype=np.int64)
        self.next_fresh += self.fresh
        raw = np.concatenate([ranks | _HOT_BIT, fresh])
        return hash_keys(raw, _SALT).view(np.int64)


def run_stream(addresses: list[str], args: argparse.Namespace, max_rows: int, steps: int,
               max_ids: int, max_s: float, server_pids: list[int]) -> dict[str, Any]:
    """Steps of the fresh-id stream through the servers at `addresses` into a table with
    `max_rows` (0: no eviction): every step's seconds and keys, rows and memory."""
    client = PSClient(addresses, timeout_s=120.0)
    try:
        client.declare_sparse(TABLE, args.stream_dim, optimizer="adagrad", lr=0.05,
                              admit=args.stream_admit, max_rows=max_rows)
        stream = FreshStream(args.seed, args.stream_batch, args.hot_share, args.hot_ids)
        grads = torch.full((args.stream_batch, args.stream_dim), 1e-3)
        # Exchanges of a whole batch on a small table first, so that what a request
        # allocates on the servers (buffers, threads, arenas) is resident before the start.
        client.declare_sparse("warm-up", args.stream_dim, optimizer="adagrad", lr=0.05)
        warm = np.arange(args.stream_batch, dtype=np.int64)
        for _ in range(3):
            client.exchange([Push("warm-up", grads, warm, True)], end_iteration=True,
                            pulls=[Pull("warm-up", warm, True)])
        rss_before = [status_bytes(pid, "VmRSS") for pid in server_pids]
        step_s: list[float] = []
        step_keys: list[int] = []
        prev: npt.NDArray[np.int64] | None = None
        started = time.monotonic()
        step = 0
        while step < steps and stream.distinct < max_ids and time.monotonic() - started < max_s:
            keys = stream.batch(step)
            pushes = ([Push(TABLE, grads[: len(prev)], prev, True)] if prev is not None else [])
            t0 = time.perf_counter()
            client.exchange(pushes, end_iteration=True, pulls=[Pull(TABLE, keys, True)])
            step_s.append(time.perf_counter() - t0)
            step_keys.append(len(keys))
            prev = keys
            step += 1
            if step % 200 == 0:
                rows = sum(t.rows for t in table_stats(client, TABLE))
                print(f"    step {step}: {stream.distinct:,} ids offered, {rows:,} rows, "
                      f"{time.monotonic() - started:.0f} s", flush=True)
        wall_s = time.monotonic() - started
        stats = table_stats(client, TABLE)
        return {
            "steps": step, "wall_s": wall_s, "step_s": step_s, "step_keys": step_keys,
            "ids_offered": stream.distinct,
            "rows": [t.rows for t in stats], "memory_bytes": [t.memory_bytes for t in stats],
            "admitted": sum(t.admitted for t in stats), "evicted": sum(t.evicted for t in stats),
            "readmitted": sum(t.readmitted for t in stats),
            "rss_before": rss_before,
            "rss_peak": [status_bytes(pid, "VmHWM") for pid in server_pids],
            "rss_end": [status_bytes(pid, "VmRSS") for pid in server_pids],
        }
    finally:
        client.close()


def p99(values: list[float]) -> float:
    return float(np.percentile(np.asarray(values), 99))


def keys_per_s(run: dict[str, Any], start: int, end: int) -> float:
    return float(sum(run["step_keys"][start:end]) / sum(run["step_s"][start:end]))


def bench_stream(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    spec = TableSpec(name=TABLE, kind="sparse", dtype=torch.float32, dim=args.stream_dim,
                     optimizer=OptimizerConfig("adagrad"), admit=args.stream_admit,
                     max_rows=args.max_rows)
    # What the table costs per server at max_rows, as `pstrain plan` and the server count it.
    budget = plan_table(spec, 10**18, SERVERS).memory_bytes
    fresh_per_server = args.stream_batch * (1 - args.hot_share) / SERVERS
    fill_steps = int(args.max_rows / fresh_per_server) + 1
    p99_steps = args.p99_steps or 4 * fill_steps
    window = (p99_steps // 2, p99_steps)
    print(f"  stream: dim {args.stream_dim}, batch {args.stream_batch} ({args.hot_share:.0%} "
          f"hot), max_rows {args.max_rows:,} per server (budget {budget / 2**20:.1f} MiB "
          f"per server by pstrain plan); p99 over steps {window[0]}-{window[1]}", flush=True)
    runs: dict[str, dict[str, Any]] = {}
    for name, max_rows, steps, max_ids, max_s in (
        ("unbounded", 0, p99_steps, 10**18, args.stream_max_s),
        ("bounded", args.max_rows, 10**12, args.stream_ids, args.stream_max_s),
    ):
        print(f"  {name} table ...", flush=True)
        procs = Procs(Path(tempfile.mkdtemp(prefix=f"tables-{name}-", dir=work)))
        try:
            servers = procs.servers(SERVERS, ["--log-level", "WARNING"])
            runs[name] = run_stream([s.address for s in servers], args, max_rows, steps,
                                    max_ids, max_s, [s.pid for s in servers])
        finally:
            procs.close()
    free, bounded = runs["unbounded"], runs["bounded"]
    if bounded["steps"] < window[1] or free["steps"] < window[1]:
        raise RuntimeError(f"the stream ran {bounded['steps']} and {free['steps']} steps, "
                           f"fewer than the p99 window's {window[1]}; lower --p99-steps")
    steps = bounded["steps"]
    tenth = max(1, (steps - WARMUP_STEPS) // 10)
    start_rate = keys_per_s(bounded, WARMUP_STEPS, WARMUP_STEPS + tenth)
    end_rate = keys_per_s(bounded, steps - tenth, steps)
    peak_over = [peak - before
                 for peak, before in zip(bounded["rss_peak"], bounded["rss_before"], strict=True)]
    p99_bounded = p99(bounded["step_s"][window[0]:window[1]])
    p99_free = p99(free["step_s"][window[0]:window[1]])
    unbounded_rows = bounded["ids_offered"] / SERVERS
    out: dict[str, Any] = {
        "dim": args.stream_dim, "batch": args.stream_batch, "hot_share": args.hot_share,
        "hot_ids": args.hot_ids, "admit": args.stream_admit, "max_rows": args.max_rows,
        "servers": SERVERS, "budget_bytes": budget, "budget_source": "pstrain plan "
        "(SparseTable.bytes_for at max_rows per server; the servers ran without --memory-budget)",
        "ids_offered": bounded["ids_offered"], "ids_target": args.stream_ids,
        "steps": steps, "wall_s": bounded["wall_s"],
        "unbounded_over_budget": plan_table(
            dataclasses.replace(spec, max_rows=0), int(bounded["ids_offered"]), SERVERS
        ).memory_bytes / budget,
        "unbounded_rows_per_server": unbounded_rows,
        "rows_end": bounded["rows"], "server_memory_bytes_end": bounded["memory_bytes"],
        "admitted": bounded["admitted"], "evicted": bounded["evicted"],
        "readmitted": bounded["readmitted"],
        "rss_before": bounded["rss_before"], "rss_peak": bounded["rss_peak"],
        "rss_end": bounded["rss_end"], "rss_peak_over_start": peak_over,
        "budget_rss_ratio": max(peak_over) / budget,
        "budget_rss_ratio_end": max(
            end - before
            for end, before in zip(bounded["rss_end"], bounded["rss_before"], strict=True)
        ) / budget,
        "server_memory_over_budget_end": max(bounded["memory_bytes"]) / budget,
        "budget_rss_ratio_whole_process": max(
            peak / (before + budget)
            for peak, before in zip(bounded["rss_peak"], bounded["rss_before"], strict=True)),
        "start_keys_per_s": start_rate, "end_keys_per_s": end_rate,
        "budget_speed_ratio": end_rate / start_rate,
        "p99_window_steps": list(window),
        "p99_step_s_evicting": p99_bounded, "p99_step_s_unbounded": p99_free,
        "median_step_s_evicting": statistics.median(bounded["step_s"][window[0]:window[1]]),
        "median_step_s_unbounded": statistics.median(free["step_s"][window[0]:window[1]]),
        "evict_p99_ratio": p99_bounded / p99_free,
        # The unbounded table's p99 holds the steps that moved its storage as it doubled;
        # the lower percentiles show the steps in between.
        "evict_p90_ratio": (np.percentile(bounded["step_s"][window[0]:window[1]], 90)
                            / np.percentile(free["step_s"][window[0]:window[1]], 90)),
        "evict_median_ratio": (statistics.median(bounded["step_s"][window[0]:window[1]])
                               / statistics.median(free["step_s"][window[0]:window[1]])),
        "unbounded_run": {k: v for k, v in free.items() if k not in ("step_s", "step_keys")},
        "step_s_evicting": [round(s, 5) for s in bounded["step_s"]],
        "step_s_unbounded": [round(s, 5) for s in free["step_s"]],
    }
    if out["ids_offered"] < args.stream_ids:
        rate = out["ids_offered"] / bounded["wall_s"]
        out["stream_s_for_target"] = args.stream_ids / rate
    return out


# ---- quality ---------------------------------------------------------------------------------


def train_ctr(ctr: ModuleType, addresses: list[str], args: argparse.Namespace,
              dtype: torch.dtype, admit: str, max_rows: int) -> dict[str, Any]:
    """examples/synthetic_ctr.py's distributed training, in this process, with the table's
    dtype, admission and max_rows chosen; test AUC and the table's rows."""
    torch.manual_seed(args.seed)
    stream = ctr.Stream(args.seed, 1.1)
    eval_keys, eval_dense, eval_labels, eval_logits = stream.sample(
        np.random.default_rng([args.seed, 1 << 20]), args.eval_samples)
    client = PSClient(addresses, timeout_s=120.0)
    try:
        mlp = ctr.make_mlp(16, [256, 128], args.seed)
        fields = PSEmbedding(client, ctr.TABLE, 16, optimizer="adagrad", lr=0.05,
                             init=("normal", 0.0, 0.01), seed=args.seed, dtype=dtype,
                             admit=admit, max_rows=max_rows)
        model = ctr.CTRModel(fields, PSDense(client, mlp, "ctr.mlp", optimizer="adam",
                                             lr=1e-3))
        ps = PSOptimizer(model)

        def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
            for step in range(args.quality_steps):
                keys, dense, labels, _ = stream.sample(
                    np.random.default_rng([args.seed, 0, step]), args.quality_batch)
                yield torch.from_numpy(keys), torch.from_numpy(dense), torch.from_numpy(labels)

        started = time.monotonic()
        for (keys, dense, labels), upcoming in lookahead(batches(), ps.prefetch_depth):
            if upcoming is not None:
                model.prefetch(upcoming[0])
            loss = F.binary_cross_entropy_with_logits(model(keys, dense), labels)
            ps.zero_grad()
            loss.backward()
            ps.step()
        train_s = time.monotonic() - started
        ps.close()
        auc, logloss = ctr.evaluate(model, eval_keys, eval_dense, eval_labels, 8192)
        stats = table_stats(client, ctr.TABLE)
        return {"test_auc": auc, "test_logloss": logloss,
                "best_auc": ctr.roc_auc(eval_labels, eval_logits),
                "rows": [t.rows for t in stats], "admitted": sum(t.admitted for t in stats),
                "refused_by_admission": sum(t.refused_by_admission for t in stats),
                "evicted": sum(t.evicted for t in stats), "train_s": train_s,
                "samples_per_s": args.quality_steps * args.quality_batch / train_s}
    finally:
        client.close()


def bench_quality(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    ctr = load_example()
    runs: dict[str, dict[str, Any]] = {}

    def run(name: str, dtype: torch.dtype, admit: str, max_rows: int) -> None:
        procs = Procs(Path(tempfile.mkdtemp(prefix=f"tables-{name}-", dir=work)))
        try:
            servers = procs.servers(SERVERS, ["--log-level", "WARNING"])
            runs[name] = train_ctr(ctr, [s.address for s in servers], args, dtype, admit,
                                   max_rows)
        finally:
            procs.close()
        r = runs[name]
        print(f"  {name}: test AUC {r['test_auc']:.4f} (best {r['best_auc']:.4f}), rows "
              f"{sum(r['rows']):,}, {r['samples_per_s']:.0f} samples/s", flush=True)

    run("float32", torch.float32, "always", 0)
    half = max(1, max(runs["float32"]["rows"]) // 2)
    run("bounded", torch.float32, "count:2", half)
    run("float16", torch.float16, "always", 0)
    # The same float32 run again: how far two runs of one setting differ (the prefetching
    # worker and the servers' threads do not order every update alike).
    run("float32_again", torch.float32, "always", 0)
    # A control: ids almost never get a row (all read 0), so the model learns from the dense
    # features alone; how much of the AUC the embedding rows carry.
    run("no_rows", torch.float32, "prob:1e-9", 0)
    base = runs["float32"]["test_auc"]
    return {"steps": args.quality_steps, "batch": args.quality_batch,
            "eval_samples": args.eval_samples, "bounded_max_rows": half, "runs": runs,
            "auc_delta_repeat": runs["float32_again"]["test_auc"] - base,
            "auc_delta_no_rows": runs["no_rows"]["test_auc"] - base,
            "auc_delta_bounded": runs["bounded"]["test_auc"] - base,
            "auc_delta_fp16": runs["float16"]["test_auc"] - base}


# ---- index speed -----------------------------------------------------------------------------


def timed_median(fn: Any, batches: list[npt.NDArray[np.int64]]) -> float:
    """Median keys/s of fn(batch) over `batches`."""
    rates = []
    for b in batches:
        t0 = time.perf_counter()
        fn(b)
        rates.append(len(b) / (time.perf_counter() - t0))
    return statistics.median(rates)


def bench_index(rows: int, batch: int, reps: int) -> dict[str, Any]:
    rng = np.random.default_rng(2)
    keys = rng.integers(-(2**62), 2**62, rows)
    hits = [keys[rng.integers(0, rows, batch)] for _ in range(reps)]

    def mixed() -> list[npt.NDArray[np.int64]]:
        """Batches of 90% known keys and 10% keys never seen."""
        return [np.concatenate([keys[rng.integers(0, rows, batch - batch // 10)],
                                rng.integers(-(2**62), 2**62, batch // 10)])
                for _ in range(reps)]

    index = KeyIndex()
    for s in range(0, rows, batch):
        index.lookup_or_insert(keys[s : s + batch])
    out: dict[str, Any] = {"rows": rows, "batch": batch, "reps": reps}
    out["index_lookup_or_insert_per_s"] = timed_median(index.lookup_or_insert, hits)
    out["index_lookup_or_insert_new10_per_s"] = timed_median(index.lookup_or_insert, mixed())
    del index
    for name, extra in (("table", {}),
                        ("admit", {"admit": "count:2", "ttl_clocks": 1000, "max_rows": rows})):
        spec = TableSpec(name="t", kind="sparse", dtype=torch.float32, dim=16,
                         optimizer=OptimizerConfig("adagrad"),
                         init=InitSpec("normal", 0.0, 0.01), **extra)  # type: ignore[arg-type]
        table = SparseTable(spec, 0, 1)
        # Resolved as a pull does: a sight, which count:2 counts (a push's keys are none).
        resolve_rows = functools.partial(table._rows, sight=True)
        for _ in range(2 if "admit" in extra else 1):  # count:2 admits on the second sight
            for s in range(0, rows, batch):
                resolve_rows(keys[s : s + batch])
        if table.rows != rows:
            raise RuntimeError(f"{name}: {table.rows} rows after the fill, not {rows}")

        evict_s: list[float] = []

        def resolve(b: npt.NDArray[np.int64], table: SparseTable = table,
                    evict_s: list[float] = evict_s) -> None:
            table._rows(b, sight=True)
            t0 = time.perf_counter()
            table.evict()
            evict_s.append(time.perf_counter() - t0)

        key = "index_lookup_or_insert_admit" if name == "admit" else "table_lookup_or_insert"
        out[f"{key}_per_s"] = timed_median(resolve_rows, hits)
        out[f"{key}_new10_per_s"] = timed_median(resolve, mixed())
        if evict_s and name == "admit":
            # One eviction step (a TTL window of EVICT_SCAN_ROWS rows; the room for the
            # batch's new rows was made as they were created): what each pull and each push
            # of an evicting table runs.
            out["evict_step_ms"] = statistics.median(evict_s) * 1e3
        del table
    return out


# ---- memory per row --------------------------------------------------------------------------

ROW_CONFIGS = {  # name: (dtype, optimizer)
    "f32_adagrad": (torch.float32, "adagrad"),
    "f16_rowwise_adagrad": (torch.float16, "rowwise_adagrad"),
    "f32_ftrl": (torch.float32, "ftrl"),
}


def fill_server(server: Proc, name: str, dtype: torch.dtype, optimizer: str, dim: int,
                rows: int, batch: int) -> dict[str, Any]:
    client = PSClient([server.address], timeout_s=120.0)
    try:
        # A small table of the same options first, so that what a request of `batch` keys
        # allocates on the server (buffers, threads, arenas, the code of admission and
        # eviction) is resident before the measured table is declared.
        client.declare_sparse("warm-up", dim, dtype=dtype, optimizer=optimizer,
                              admit="count:2", max_rows=batch)
        for _ in range(4):  # two sights admit, two more read the rows
            client.pull_sparse("warm-up", np.arange(batch, dtype=np.int64), assume_unique=True)
        # Both readings at rest: once the server has handed its freed request buffers back
        # to the OS (protos.runtime.trim_heap, every TRIM_HEAP_S).
        time.sleep(2 * TRIM_HEAP_S)
        before = status_bytes(server.pid, "VmRSS")
        client.declare_sparse(name, dim, dtype=dtype, optimizer=optimizer, admit="count:2",
                              max_rows=rows)
        keys = np.random.default_rng(3).integers(-(2**62), 2**62, rows)
        for s in range(0, rows, batch):
            for _ in range(2):  # count:2 admits an id on its second sight
                client.pull_sparse(name, keys[s : s + batch], assume_unique=True)
        (stats,) = table_stats(client, name)
        time.sleep(2 * TRIM_HEAP_S)
        after = status_bytes(server.pid, "VmRSS")
        return {"rows": stats.rows, "rss_delta": after - before,
                "memory_bytes": stats.memory_bytes, "evicted": stats.evicted}
    finally:
        client.close()


def bench_memory(rows: int, dim: int, work: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"rows": rows, "dim": dim, "configs": {}}
    procs = Procs(Path(tempfile.mkdtemp(prefix="tables-memory-", dir=work)))
    try:
        for name, (dtype, optimizer) in ROW_CONFIGS.items():
            server = procs.server(0, 1, ["--log-level", "WARNING"])
            got = fill_server(server, name, dtype, optimizer, dim, rows, 65536)
            procs.kill(server)
            spec = TableSpec(name=name, kind="sparse", dtype=dtype, dim=dim,
                             optimizer=OptimizerConfig(optimizer), admit="count:2",
                             max_rows=rows)
            raw = SparseTable.value_bytes(spec)  # values and optimizer state, nothing else
            plan = plan_table(spec, rows, 1)
            held = got["rows"]
            c = {**got, "raw_bytes_per_row": raw,
                 "rss_bytes_per_row": got["rss_delta"] / held,
                 "accounting_bytes_per_row": got["memory_bytes"] / held,
                 "plan_memory_bytes": plan.memory_bytes, "plan_at_least_bytes": plan.budget_bytes,
                 "plan_bytes_per_row": plan.memory_bytes / rows}
            c["row_memory_ratio"] = c["rss_bytes_per_row"] / raw
            c["row_memory_ratio_accounting"] = c["accounting_bytes_per_row"] / raw
            c["plan_vs_measured"] = plan.memory_bytes / got["rss_delta"]
            c["plan_vs_accounting"] = plan.memory_bytes / got["memory_bytes"]
            out["configs"][name] = c
            out[f"row_memory_ratio_{name}"] = c["row_memory_ratio"]
            out[f"row_memory_ratio_{name}_accounting"] = c["row_memory_ratio_accounting"]
            out[f"plan_vs_measured_{name}"] = c["plan_vs_measured"]
            print(f"  {name}: {held:,} rows, {c['rss_bytes_per_row']:.1f} B/row resident, "
                  f"{c['accounting_bytes_per_row']:.1f} B/row counted, raw {raw} B", flush=True)
    finally:
        procs.close()
    return out


# ---- report ----------------------------------------------------------------------------------


def print_table(r: dict[str, Any]) -> None:
    print(f"\ntables within a budget, {r['date']}, {r['machine']}")

    def line(what: str, value: str, goal: str = "") -> None:
        print(f"  {what:<62} {value:<28} {goal}")

    if "stream" in r:
        s = r["stream"]
        line("ids offered (stream)", f"{s['ids_offered']:,}", f"target {s['ids_target']:,}")
        line("unbounded table / budget", f"{s['unbounded_over_budget']:.1f}x")
        line("peak RSS above start / budget (budget_rss_ratio)",
             f"{s['budget_rss_ratio']:.3f}", "goal <= 1.1")
        line("  at the end: RSS above start / budget; server's count / budget",
             f"{s['budget_rss_ratio_end']:.3f}; {s['server_memory_over_budget_end']:.3f}")
        line("keys/s end / start (budget_speed_ratio)", f"{s['budget_speed_ratio']:.3f} "
             f"({s['end_keys_per_s'] / 1e6:.2f} / {s['start_keys_per_s'] / 1e6:.2f} M)",
             "goal >= 0.9")
        line("p99 step evicting / unbounded (evict_p99_ratio)", f"{s['evict_p99_ratio']:.3f} "
             f"({s['p99_step_s_evicting'] * 1e3:.1f} / {s['p99_step_s_unbounded'] * 1e3:.1f} ms)",
             "goal <= 1.25")
        line("  p90; median step evicting / unbounded",
             f"{s['evict_p90_ratio']:.3f}; {s['evict_median_ratio']:.3f}")
    if "quality" in r:
        q = r["quality"]
        line("AUC count:2 + max_rows=half - unbounded (auc_delta_bounded)",
             f"{q['auc_delta_bounded']:+.5f}", "goal >= -0.003")
        line("AUC float16 - float32 (auc_delta_fp16)", f"{q['auc_delta_fp16']:+.5f}",
             "goal >= -0.001")
        line("  AUC float32 run again - float32 (run-to-run noise)",
             f"{q['auc_delta_repeat']:+.5f}")
        line("  AUC without embedding rows (prob:1e-9) - float32 (control)",
             f"{q['auc_delta_no_rows']:+.4f}")
    if "index" in r:
        i = r["index"]
        line("KeyIndex lookup-or-insert (index_lookup_or_insert_per_s)",
             f"{i['index_lookup_or_insert_per_s'] / 1e6:.1f} M keys/s")
        line("SparseTable plain (table_lookup_or_insert_per_s)",
             f"{i['table_lookup_or_insert_per_s'] / 1e6:.1f} M keys/s")
        line("SparseTable admit+evict (index_lookup_or_insert_admit_per_s)",
             f"{i['index_lookup_or_insert_admit_per_s'] / 1e6:.1f} M keys/s", "goal >= 10 M")
        line("  10% new keys: index / table / admit+evict",
             f"{i['index_lookup_or_insert_new10_per_s'] / 1e6:.1f} / "
             f"{i['table_lookup_or_insert_new10_per_s'] / 1e6:.1f} / "
             f"{i['index_lookup_or_insert_admit_new10_per_s'] / 1e6:.1f} M")
        line("  one eviction step, evicting a batch's 10% new rows",
             f"{i['evict_step_ms']:.2f} ms")
    if "memory" in r:
        for name, c in r["memory"]["configs"].items():
            line(f"row_memory_ratio_{name} (resident; counted)",
                 f"{c['row_memory_ratio']:.2f}; {c['row_memory_ratio_accounting']:.2f}",
                 "goal <= 1.3")
            line(f"  plan / measured resident ({name})", f"{c['plan_vs_measured']:.3f}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    p.add_argument("--only", default=",".join(SECTIONS),
                   help=f"comma-separated sections, of {','.join(SECTIONS)} (default all)")
    p.add_argument("--json", help="also write the figures to this path")
    p.add_argument("--update", action="store_true",
                   help="merge this run's sections into the --json file where it exists "
                        "(to run the sections as separate shorter runs)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stream-ids", type=float, default=1e8,
                   help="stream: distinct ids to offer (default 1e8)")
    p.add_argument("--stream-max-s", type=float, default=400.0,
                   help="stream: stop the evicting run after this many seconds (default 400)")
    p.add_argument("--stream-repeats", type=int, default=3,
                   help="stream: runs (each an unbounded and a bounded table on fresh "
                        "servers); figures are medians (default 3)")
    p.add_argument("--stream-batch", type=int, default=32768, help="stream: keys per step")
    p.add_argument("--stream-dim", type=int, default=16)
    p.add_argument("--stream-admit", default="always", help="stream: the table's admission")
    p.add_argument("--hot-share", type=float, default=0.5,
                   help="stream: share of a batch drawn from the hot vocabulary")
    p.add_argument("--hot-ids", type=int, default=1_000_000, help="stream: hot vocabulary")
    p.add_argument("--max-rows", type=int, default=1_000_000,
                   help="stream: max_rows per server (default 1 M)")
    p.add_argument("--p99-steps", type=int, default=0,
                   help="stream: steps run without eviction for the p99 (default: 4x the "
                        "steps that fill max_rows)")
    p.add_argument("--quality-steps", type=int, default=300)
    p.add_argument("--quality-batch", type=int, default=4096)
    p.add_argument("--eval-samples", type=int, default=50_000)
    p.add_argument("--index-rows", type=int, default=4_000_000)
    p.add_argument("--memory-rows", type=int, default=2_000_000)
    p.add_argument("--row-dim", type=int, default=64, help="memory: row width")
    a = p.parse_args()
    only = set(a.only.split(","))
    if not only <= set(SECTIONS):
        p.error(f"--only: unknown section(s) {sorted(only - set(SECTIONS))}")
    if a.quick:
        a.stream_ids, a.stream_max_s, a.stream_batch = 2e6, 20.0, 8192
        a.stream_repeats = 1
        a.max_rows, a.hot_ids = 100_000, 100_000
        a.quality_steps, a.quality_batch, a.eval_samples = 20, 1024, 5000
        a.index_rows, a.memory_rows = 200_000, 100_000
    a.stream_ids = int(a.stream_ids)
    torch.set_num_threads(1)
    tune_malloc()
    results: dict[str, Any] = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "quick": a.quick, "sections": sorted(only),
        "argv_by_section": {section: sys.argv[1:] for section in sorted(only)},
    }
    work = Path(tempfile.mkdtemp(prefix="pstrain-tables-"))
    if "index" in only:
        print(f"index: lookup-or-insert on {a.index_rows:,} keys ...", flush=True)
        results["index"] = bench_index(a.index_rows, 65536, 15)
    if "memory" in only:
        print(f"memory: {a.memory_rows:,} rows of dim {a.row_dim} per config ...", flush=True)
        results["memory"] = bench_memory(a.memory_rows, a.row_dim, work)
    if "quality" in only:
        print(f"quality: synthetic CTR, {a.quality_steps} steps of {a.quality_batch} ...",
              flush=True)
        results["quality"] = bench_quality(a, work)
    if "stream" in only:
        print("stream within a budget ...", flush=True)
        reps = [bench_stream(a, work) for _ in range(a.stream_repeats)]
        # The figures are medians over the repeats; the step times are the last repeat's.
        results["stream"] = {
            **reps[-1], **{k: statistics.median(r[k] for r in reps) for k in STREAM_FIGURES},
            "repeats": [{k: r[k] for k in (*STREAM_FIGURES, "ids_offered", "wall_s")}
                        for r in reps],
        }
    for section, keys in (
        ("stream", ("budget_rss_ratio", "budget_speed_ratio", "evict_p99_ratio",
                    "ids_offered")),
        ("quality", ("auc_delta_bounded", "auc_delta_fp16", "auc_delta_repeat")),
        ("index", ("index_lookup_or_insert_per_s", "index_lookup_or_insert_admit_per_s",
                   "table_lookup_or_insert_per_s")),
        ("memory", tuple(f"{k}_{n}" for n in ROW_CONFIGS
                         for k in ("row_memory_ratio", "plan_vs_measured"))),
    ):
        for key in keys if section in results else ():
            results[key] = results[section][key]
    print_table(results)
    partial = "" if only == set(SECTIONS) else "-" + "-".join(s for s in SECTIONS if s in only)
    stem = f"tables-{results['date']}{'-quick' if a.quick else ''}{partial}"
    if a.json and a.update and Path(a.json).exists():
        # Sections run before keep their figures; those of this run replace theirs.
        earlier = json.loads(Path(a.json).read_text())
        results = {**earlier, **results,
                   "sections": sorted(set(earlier.get("sections", [])) | only),
                   "argv_by_section": {**earlier.get("argv_by_section", {}),
                                       **results["argv_by_section"]}}
    save(results, stem, a.json)


if __name__ == "__main__":
    main()
