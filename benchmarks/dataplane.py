"""Data-plane benchmark: pstrain against raw gRPC and in-process PyTorch, in one run.

    python benchmarks/dataplane.py [--quick] [--json PATH]

Measures, each as a median over repetitions interleaved between the methods compared so
that the machine's noise falls on all of them alike:
- dense pull and push of 1, 16 and 64 MiB through a pstrain server, beside a raw-bytes
  gRPC echo server started by this script (unary with identity serializers, and a stream of
  1 MiB chunks); ratios are pstrain over the faster raw method;
- sparse pull and push of 64k unique keys x dim 64 float32 against a shard holding 10 M
  rows, beside index_select / index_add_ on a table of the same size in this process;
- the key index's lookup-or-insert rate on a 10 M-key table;
- server memory per sparse row against the raw bytes of its value and optimizer state;
- each bulk transport (grpc, shm, ucx where installed, and auto) beside a PyTorch RPC
  (torch.distributed.rpc over TensorPipe) parameter server in its own process doing the same
  work: dense pull and push of 1, 16 and 64 MiB, and sparse pull (index_select) and push (SGD
  through index_add_) of 64k rows x dim 64 on a table of the same size, and a small
  training step's round trip (push 128 rows' gradients and pull 128 rows in one exchange;
  `small_step_us`, microseconds per step). `torchrpc_ratio` holds pstrain's rate with
  transport auto over PyTorch RPC's for the four headline figures;
- across hosts (`cross_host`): two hosts made of network namespaces joined by a veth pair
  (benchmarks/netns.py; needs root), pstrain's server and a PyTorch RPC server on one, a
  client on the other: the transport the handshake picks, then gRPC (and UCX over TCP where
  the ucx transport is available) beside PyTorch RPC forced onto TensorPipe's TCP path, for
  dense pull and push of 16 MiB and sparse pull and push of 64k rows x dim 64. Where
  namespaces may not be made, `cross_host` holds only `skipped`, the reason.
- the CPU a training step's exchange costs (`--only exchange`, the `exchange_cpu` key): a
  MovieLens-shaped step (the gradients of two sparse tables of dim 16 under Adagrad and of
  a 10,369-element MLP under Adam pushed, the iteration ended, the next step's rows and the
  MLP pulled, in one exchange) at batch 128 and 1024, one exchange after another over each
  of `grpc` and `auto`: the server's and this client process's CPU per exchange (from
  their clocks over 3 runs of many exchanges; medians) and the round trip: the fixed cost
  of an exchange, which a training job's samples/s shows only through its noise;
- one server's capacity (`--only capacity`, the `capacity` key): 1, 2 and 3 client
  processes, alternated round by round, each sending those batch-128 exchanges over `auto`
  (or `--capacity-transport`) back to back for 6 s: the exchanges answered a second in
  all, and the server's CPU per exchange, share of a core and context switches per
  exchange (medians of 3 rounds);
- mutual TLS and the job secret (`--only tls`): two pstrain servers, one with TLS and the
  secret (certificates made for the run, as `pstrain up` does) and one without, each reached
  over transport grpc (TLS carries every byte) and auto (on one host shm with its request
  lane: TLS carries only the control calls), interleaved: dense pull and push of 16 MiB and
  sparse pull and push of 64k rows x dim 64 on a table of the same size as above.
  `tls_<figure>_ratio_<transport>` is the rate with TLS over the rate without.
Prints a table and writes JSON to benchmarks/results/dataplane-<date>.json (and --json PATH);
a run of some parts (`--only`) names them in the file name.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from functools import partial
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import torch
from torch.distributed import rpc

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import netns  # noqa: E402  (benchmarks/netns.py, beside this script)
from saved import save  # noqa: E402

from protos.runtime import tune_malloc  # noqa: E402
from protos.security import Security  # noqa: E402
from protos.transport import available  # noqa: E402
from ps.index import KeyIndex  # noqa: E402
from scheduler.certs import make_job_certs  # noqa: E402
from worker.client import PSClient, Pull, Push  # noqa: E402

MiB = 1024 * 1024
PARTS = ["dense", "sparse", "index", "transports", "exchange", "capacity", "cross-host", "tls"]
RAW_SERVICE = "/bench.Raw/"
TRPC_LR = 1e-9
STEP_ROWS = 128  # rows pushed and pulled by a small training step (small_step_us)
TLS_TRANSPORTS = ("grpc", "auto")  # grpc: TLS carries every byte; auto: on one host, shm
# A MovieLens training step's exchange (examples/movielens.py's defaults): seven one-id
# features fused in one table, the genres in another, both dim 16; the MLP 128-64-32-1.
STEP_FIELDS_VOCAB, STEP_GENRES, STEP_DIM, STEP_MLP = 9_800, 18, 16, 10_369


# ---- the PyTorch RPC baseline server (runs in a subprocess) ---------------------------------

_trpc_tables: dict[str, torch.Tensor] = {}


def _trpc_make(name: str, rows: int, cols: int) -> None:
    _trpc_tables[name] = torch.randn(rows, cols)


def _trpc_pull_dense(name: str) -> torch.Tensor:
    return _trpc_tables[name]


def _trpc_push_dense(name: str, grad: torch.Tensor) -> None:
    _trpc_tables[name].add_(grad, alpha=-TRPC_LR)


def _trpc_pull_sparse(name: str, rows: torch.Tensor) -> torch.Tensor:
    return _trpc_tables[name].index_select(0, rows)


def _trpc_push_sparse(name: str, rows: torch.Tensor, grads: torch.Tensor) -> None:
    _trpc_tables[name].index_add_(0, rows, grads, alpha=-TRPC_LR)


def _trpc_step_sparse(name: str, rows: torch.Tensor, grads: torch.Tensor,
                      ahead: torch.Tensor) -> torch.Tensor:
    """A training step's round trip: push rows' gradients, pull the next step's rows."""
    _trpc_push_sparse(name, rows, grads)
    return _trpc_pull_sparse(name, ahead)


def trpc_options(port: int, tcp_only: bool, host: str = "127.0.0.1") -> object:
    """TensorPipe options; `tcp_only` keeps it to its TCP transport (libuv) and the basic
    channel, which sends tensors through that transport, as between two hosts."""
    kw: dict[str, object] = {"init_method": f"tcp://{host}:{port}", "num_worker_threads": 8,
                             "rpc_timeout": 120}
    if tcp_only:
        kw["_transports"] = ["uv"]
        kw["_channels"] = ["basic"]
    return rpc.TensorPipeRpcBackendOptions(**kw)  # type: ignore[arg-type]


def serve_torchrpc(port: int, tcp_only: bool, host: str) -> None:
    """The peer baseline: a parameter server written with torch.distributed.rpc."""
    torch.set_num_threads(1)
    tune_malloc()
    rpc.init_rpc("ps", rank=0, world_size=2,
                 rpc_backend_options=trpc_options(port, tcp_only, host))  # type: ignore[arg-type]
    rpc.shutdown()  # blocks until the client has shut down too


# ---- the raw gRPC baseline server (runs in a subprocess) ------------------------------------


def serve_raw(ready_file: str) -> None:
    """A gRPC server that moves raw bytes: the fastest Python gRPC can go, for comparison."""
    torch.set_num_threads(1)
    tune_malloc(arenas=1)  # the same process settings pstrain's server uses
    blobs: dict[int, bytes] = {}

    def blob(n: int) -> bytes:
        if n not in blobs:
            blobs[n] = os.urandom(1024) * (n // 1024)
        return blobs[n]

    def pull_unary(request: bytes, context: object) -> bytes:
        return blob(int(request))

    def push_unary(request: bytes, context: object) -> bytes:
        return str(len(request)).encode()

    def pull_stream(request: bytes, context: object) -> Iterator[bytes]:
        data = memoryview(blob(int(request)))
        for start in range(0, len(data), MiB):
            yield bytes(data[start : start + MiB])

    def push_stream(requests: Iterator[bytes], context: object) -> bytes:
        return str(sum(len(r) for r in requests)).encode()

    handler = grpc.method_handlers_generic_handler(
        "bench.Raw",
        {
            "PullUnary": grpc.unary_unary_rpc_method_handler(pull_unary),
            "PushUnary": grpc.unary_unary_rpc_method_handler(push_unary),
            "PullStream": grpc.unary_stream_rpc_method_handler(pull_stream),
            "PushStream": grpc.stream_unary_rpc_method_handler(push_stream),
        },
    )
    opts = [("grpc.max_receive_message_length", 256 * MiB),
            ("grpc.max_send_message_length", 256 * MiB)]
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=opts)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    Path(ready_file).write_text(json.dumps({"address": f"127.0.0.1:{port}"}))
    signal.sigwait({signal.SIGTERM, signal.SIGINT})
    server.stop(0)


# ---- helpers --------------------------------------------------------------------------------


def spawn(args: list[str], ready: Path) -> tuple[subprocess.Popen[bytes], str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(args, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise RuntimeError(f"{args} did not start: {err}")
        time.sleep(0.05)
    return proc, json.loads(ready.read_text())["address"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


def interleaved(methods: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median seconds per call of each method, calling them in turn `reps` times."""
    for fn in methods.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(reps):
        for name, fn in methods.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


# ---- the measurements -----------------------------------------------------------------------


def bench_dense(client: PSClient, raw: grpc.Channel, sizes_mib: list[int],
                reps: dict[int, int]) -> dict[str, dict[str, float]]:
    pull_unary = raw.unary_unary(RAW_SERVICE + "PullUnary")
    push_unary = raw.unary_unary(RAW_SERVICE + "PushUnary")
    pull_stream = raw.unary_stream(RAW_SERVICE + "PullStream")
    push_stream = raw.stream_unary(RAW_SERVICE + "PushStream")
    def methods(mib: int) -> dict[str, Callable[[], object]]:
        n = mib * MiB
        table = f"dense{mib}"
        client.declare_dense(table, (n // 4 // 1024, 1024), optimizer="sgd", lr=1e-9)
        grad = torch.full((n // 4 // 1024, 1024), 1e-3)
        payload = os.urandom(1024) * (n // 1024)
        chunks = [payload[i : i + MiB] for i in range(0, n, MiB)]
        size = str(n).encode()
        return {
            "pstrain_pull": lambda: client.pull_dense(table),
            "raw_unary_pull": lambda: pull_unary(size),
            "raw_stream_pull": lambda: sum(len(c) for c in pull_stream(size)),
            "pstrain_push": lambda: client.push_dense(table, grad),
            "raw_unary_push": lambda: push_unary(payload),
            "raw_stream_push": lambda: push_stream(iter(chunks)),
        }

    out: dict[str, dict[str, float]] = {}
    for mib in sizes_mib:
        t = interleaved(methods(mib), reps[mib])
        gbps = {k: mib * MiB / v / 1e9 for k, v in t.items()}
        for op in ("pull", "push"):
            best_raw = max(gbps[f"raw_unary_{op}"], gbps[f"raw_stream_{op}"])
            gbps[f"ratio_{op}"] = gbps[f"pstrain_{op}"] / best_raw
        out[f"{mib}MiB"] = gbps
    return out


def fill_sparse(client: PSClient, table: str, rows: int, batch: int) -> np.ndarray:
    keys = np.random.default_rng(0).permutation(rows * 3)[:rows].astype(np.int64) - rows
    for start in range(0, rows, batch):
        client.pull_sparse(table, keys[start : start + batch], assume_unique=True)
    fill_sparse.last_keys = keys  # type: ignore[attr-defined]
    return keys


def sparse_batches(keys: np.ndarray, batch: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Eight batches of (almost always) `batch` unique keys drawn from `keys`, each shuffled."""
    batches = [np.unique(keys[rng.integers(0, len(keys), batch + batch // 8)])[:batch]
               for _ in range(8)]
    for b in batches:
        rng.shuffle(b)
    return batches


def bench_sparse(client: PSClient, server_pid: int, rows: int, batch: int, dim: int,
                 reps: int) -> dict[str, float]:
    table = "emb"
    client.declare_sparse(table, dim, optimizer="sgd", lr=1e-6)
    client.pull_sparse(table, np.arange(batch, dtype=np.int64) + 2**62)  # first growth
    rss_before = rss_bytes(server_pid)
    fill_start = time.perf_counter()
    keys = fill_sparse(client, table, rows, batch)
    fill_s = time.perf_counter() - fill_start
    rss_after = rss_bytes(server_pid)
    raw_row = dim * 4  # value only: SGD keeps no state
    memory_ratio = (rss_after - rss_before) / rows / raw_row

    rng = np.random.default_rng(1)
    local = torch.empty(rows, dim)
    local.normal_()
    grads = torch.randn(batch, dim)
    batches = sparse_batches(keys, batch, rng)
    local_rows = [torch.from_numpy(rng.integers(0, rows, len(b))) for b in batches]
    i = iter(range(10**9))

    def pick() -> int:
        return next(i) % len(batches)

    t = interleaved(
        {
            "pstrain_pull": lambda: client.pull_sparse(table, batches[pick()],
                                                       assume_unique=True),
            "pstrain_push": lambda: client.push_sparse(table, batches[pick()],
                                                       grads[: len(batches[0])],
                                                       assume_unique=True),
            "inprocess_index_select": lambda: local.index_select(0, local_rows[pick()]),
            "inprocess_index_add": lambda: local.index_add_(0, local_rows[pick()],
                                                            grads[: len(local_rows[0])]),
        },
        reps,
    )
    n = len(batches[0])
    rates = {k: n / v for k, v in t.items()}
    return {
        "sparse_pull_rows_per_s": rates["pstrain_pull"],
        "sparse_push_rows_per_s": rates["pstrain_push"],
        "inprocess_index_select_rows_per_s": rates["inprocess_index_select"],
        "inprocess_index_add_rows_per_s": rates["inprocess_index_add"],
        "sparse_pull_ratio_inprocess": rates["pstrain_pull"] / rates["inprocess_index_select"],
        "sparse_push_ratio_inprocess": rates["pstrain_push"] / rates["inprocess_index_add"],
        "fill_rows_per_s": rows / fill_s,
        "row_memory_ratio": memory_ratio,
        "server_rss_bytes_per_row": (rss_after - rss_before) / rows,
    }


def bench_transports(
    address: str, transports: list[str], sizes_mib: list[int], reps: dict[int, int],
    sparse_keys: np.ndarray | None, sparse_reps: int, batch: int, dim: int,
) -> dict[str, dict[str, float]]:
    """Dense GB/s and sparse rows/s of each transport and of PyTorch RPC, interleaved."""
    clients = {t: PSClient([address], worker=i + 1, transport=t) for i, t in enumerate(transports)}
    for t, c in clients.items():
        if c.transports() != [t if t != "auto" else c.transports()[0]]:
            raise RuntimeError(f"client for {t} uses {c.transports()}")
    out: dict[str, dict[str, float]] = {}
    try:
        for mib in sizes_mib:
            n = mib * MiB
            table = f"tdense{mib}"
            shape = (n // 4 // 1024, 1024)
            grad = torch.full(shape, 1e-3)
            methods: dict[str, Callable[[], object]] = {}
            for t, c in clients.items():
                c.declare_dense(table, shape, optimizer="sgd", lr=1e-9)
                methods[f"{t}_pull"] = partial(c.pull_dense, table)
                methods[f"{t}_push"] = partial(c.push_dense, table, grad)
            rpc.rpc_sync("ps", _trpc_make, args=(table, *shape))
            methods["torchrpc_pull"] = partial(rpc.rpc_sync, "ps", _trpc_pull_dense,
                                               args=(table,))
            methods["torchrpc_push"] = partial(rpc.rpc_sync, "ps", _trpc_push_dense,
                                               args=(table, grad))
            t_s = interleaved(methods, reps[mib])
            out[f"dense_{mib}MiB_GBps"] = {k: n / v / 1e9 for k, v in t_s.items()}
        if sparse_keys is not None:
            rows = len(sparse_keys)
            rng = np.random.default_rng(3)
            rpc.rpc_sync("ps", _trpc_make, args=("emb", rows, dim))
            batches = sparse_batches(sparse_keys, batch, rng)
            row_ids = [torch.from_numpy(rng.integers(0, rows, len(b))) for b in batches]
            grads = torch.randn(len(batches[0]), dim)
            count = iter(range(10**9))

            def pick() -> int:
                return next(count) % len(batches)

            methods = {}
            for t, c in clients.items():
                c.declare_sparse("emb", dim, optimizer="sgd", lr=1e-6)
                methods[f"{t}_pull"] = lambda c=c: c.pull_sparse("emb", batches[pick()],
                                                                 assume_unique=True)
                methods[f"{t}_push"] = lambda c=c: c.push_sparse("emb", batches[pick()], grads,
                                                                 assume_unique=True)
            methods["torchrpc_pull"] = lambda: rpc.rpc_sync(
                "ps", _trpc_pull_sparse, args=("emb", row_ids[pick()]))
            methods["torchrpc_push"] = lambda: rpc.rpc_sync(
                "ps", _trpc_push_sparse, args=("emb", row_ids[pick()], grads))
            t_s = interleaved(methods, sparse_reps)
            out["sparse_rows_per_s"] = {k: len(batches[0]) / v for k, v in t_s.items()}
            # A small training step's round trip (the fixed cost per step at small batches):
            # push STEP_ROWS rows' gradients, pull STEP_ROWS others, in one exchange.
            small = [b[:STEP_ROWS] for b in batches]
            small_ids = [ids[:STEP_ROWS] for ids in row_ids]
            small_grads = grads[:STEP_ROWS]
            methods = {}
            for t, c in clients.items():
                methods[t] = lambda c=c: c.exchange(
                    [Push("emb", small_grads, small[pick()])],
                    pulls=[Pull("emb", small[pick()])])
            methods["torchrpc"] = lambda: rpc.rpc_sync(
                "ps", _trpc_step_sparse, args=("emb", small_ids[pick()], small_grads,
                                               small_ids[pick()]))
            t_s = interleaved(methods, sparse_reps * 4)
            out["small_step_us"] = {k: v * 1e6 for k, v in t_s.items()}
    finally:
        for c in clients.values():
            c.close()
    return out


def cpu_seconds(pid: int) -> float:
    """A process's user + system CPU seconds so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def step_items(batch: int, count: int, rng: np.random.Generator
               ) -> list[tuple[np.ndarray, np.ndarray, torch.Tensor, torch.Tensor]]:
    """`count` steps of a MovieLens-shaped batch: (unique field keys, unique genre keys,
    their gradient rows)."""
    out = []
    for _ in range(count):
        fields = np.unique(rng.integers(0, STEP_FIELDS_VOCAB, 7 * batch))
        genres = np.unique(rng.integers(0, STEP_GENRES, 2 * batch))
        out.append((fields, genres, torch.randn(len(fields), STEP_DIM),
                    torch.randn(len(genres), STEP_DIM)))
    return out


def declare_step_tables(client: PSClient) -> None:
    """The tables of a MovieLens-shaped step (see STEP_*)."""
    client.declare_sparse("step.fields", STEP_DIM, optimizer="adagrad", lr=0.1)
    client.declare_sparse("step.genres", STEP_DIM, optimizer="adagrad", lr=0.1)
    client.declare_dense("step.mlp", (STEP_MLP,), optimizer="adam", lr=3e-3)


def step_exchange(client: PSClient, batch: int, rng: np.random.Generator
                  ) -> Callable[[int], object]:
    """`step(i)`: the i-th step's exchange on the tables of `declare_step_tables`: its
    gradients pushed, the iteration ended, the next step's rows and the MLP pulled."""
    items = step_items(batch, 64, rng)
    mlp_grad = torch.randn(STEP_MLP)

    def step(i: int) -> object:
        fields, genres, g_fields, g_genres = items[i % len(items)]
        ahead = items[(i + 1) % len(items)]
        return client.exchange(
            [Push("step.fields", g_fields, fields, assume_unique=True),
             Push("step.genres", g_genres, genres, assume_unique=True),
             Push("step.mlp", mlp_grad)],
            end_iteration=True,
            pulls=[Pull("step.fields", ahead[0], assume_unique=True),
                   Pull("step.genres", ahead[1], assume_unique=True),
                   Pull("step.mlp")])

    return step


def bench_exchange_cpu(address: str, server_pid: int, transports: list[str],
                       runs: int, steps: dict[int, int]) -> dict[str, dict[str, Any]]:
    """CPU per exchange of a MovieLens-shaped training step on the server and in this
    process, and its round trip, per transport and batch size (medians of `runs`)."""
    rng = np.random.default_rng(5)
    out: dict[str, dict[str, Any]] = {}
    for worker, transport in enumerate(transports, start=100):
        with PSClient([address], worker=worker, transport=transport) as client:
            declare_step_tables(client)
            for batch, count in steps.items():
                step = step_exchange(client, batch, rng)
                for i in range(50):  # every row exists, every buffer is warm
                    step(i)
                server_us, client_us, trip_us = [], [], []
                for _ in range(runs):
                    server0, client0 = cpu_seconds(server_pid), time.process_time()
                    trips = []
                    for i in range(count):
                        start = time.perf_counter()
                        step(i)
                        trips.append(time.perf_counter() - start)
                    server_us.append((cpu_seconds(server_pid) - server0) / count * 1e6)
                    client_us.append((time.process_time() - client0) / count * 1e6)
                    trip_us.append(statistics.median(trips) * 1e6)
                out[f"{transport}_b{batch}"] = {
                    "server_cpu_us": statistics.median(server_us),
                    "client_cpu_us": statistics.median(client_us),
                    "round_trip_us": statistics.median(trip_us),
                    "transport": client.transports()[0],
                    "runs": {"server_cpu_us": server_us, "client_cpu_us": client_us,
                             "round_trip_us": trip_us},
                }
    return out


def capacity_client(config_path: str) -> None:
    """One client of the capacity part (runs in its own process): warms up, says so, waits
    for the go file, then sends step exchanges back to back for the given seconds and
    writes how many it sent."""
    cfg = json.loads(Path(config_path).read_text())
    torch.set_num_threads(1)
    tune_malloc()
    with PSClient([cfg["address"]], worker=cfg["worker"], transport=cfg["transport"]) as client:
        declare_step_tables(client)
        step = step_exchange(client, cfg["batch"], np.random.default_rng(cfg["worker"]))
        for i in range(50):
            step(i)
        ready = Path(cfg["ready"])
        ready.with_suffix(".tmp").write_text(client.transports()[0])
        ready.with_suffix(".tmp").replace(ready)  # whole when it appears
        go = Path(cfg["go"])
        while not go.exists():
            time.sleep(0.01)
        sent = 0
        end = time.monotonic() + cfg["seconds"]
        while time.monotonic() < end:
            step(sent)
            sent += 1
    Path(cfg["out"]).write_text(json.dumps({"exchanges": sent}))


def _await_files(files: list[Path], procs: list[subprocess.Popen[bytes]], logs: list[Path],
                 timeout_s: float = 120.0) -> None:
    """Waits until every file exists; RuntimeError with its log when a process exits first,
    or when `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while not all(f.exists() for f in files):
        for proc, log in zip(procs, logs, strict=True):
            if proc.poll() is not None:
                raise RuntimeError(f"{proc.args!r} exited with status {proc.returncode}: "
                                   f"{_tail(log)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"not ready within {timeout_s:.0f} s: {files}")
        time.sleep(0.05)


def context_switches(pid: int) -> int:
    """Voluntary and involuntary context switches of all of a process's threads so far."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):  # a thread that just ended
            for line in (task / "status").read_text().splitlines():
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    total += int(line.split()[1])
    return total


def bench_capacity(address: str, server_pid: int, clients: list[int], rounds: int,
                   seconds: float, batch: int = 128, transport: str = "auto"
                   ) -> dict[str, Any]:
    """One server's capacity: K client processes (for each K in `clients`, alternated
    round by round) each sending MovieLens-shaped exchanges back to back for `seconds`.
    Per K, medians over `rounds` of the exchanges answered a second in all, the server's
    CPU per exchange and share of a core, and its threads' context switches per exchange.
    Ends every client it starts by its pid."""
    tmp = Path(tempfile.mkdtemp(prefix="pstrain-capacity-"))
    runs: dict[int, list[dict[str, float]]] = {k: [] for k in clients}
    used = ""
    try:
        for r in range(rounds):
            for k in clients:
                procs: list[subprocess.Popen[bytes]] = []
                go = tmp / f"go-{r}-{k}"
                try:
                    configs: list[dict[str, Any]] = []
                    logs: list[Path] = []
                    for c in range(k):
                        name = f"{r}-{k}-{c}"
                        cfg: dict[str, Any] = {
                            "address": address, "worker": 200 + c, "transport": transport,
                            "batch": batch, "seconds": seconds, "go": str(go),
                            "ready": str(tmp / f"ready-{name}"), "out": str(tmp / f"out-{name}"),
                        }
                        path = tmp / f"client-{name}.json"
                        path.write_text(json.dumps(cfg))
                        configs.append(cfg)
                        logs.append(tmp / f"client-{name}.log")
                        procs.append(_start([sys.executable, __file__, "--capacity-client",
                                             str(path)], logs[-1], {}))
                    _await_files([Path(cfg["ready"]) for cfg in configs], procs, logs)
                    used = Path(configs[0]["ready"]).read_text()
                    switches0, cpu0 = context_switches(server_pid), cpu_seconds(server_pid)
                    start = time.monotonic()
                    go.write_text("go")
                    time.sleep(seconds)  # the clients send for as long (their own clocks)
                    wall = time.monotonic() - start
                    cpu = cpu_seconds(server_pid) - cpu0
                    switches = context_switches(server_pid) - switches0
                    for p in procs:
                        if p.wait(timeout=120) != 0:
                            raise RuntimeError(f"a capacity client failed: {p.args!r}")
                finally:
                    _stop(procs)
                sent = sum(json.loads(Path(cfg["out"]).read_text())["exchanges"]
                           for cfg in configs)
                runs[k].append({"exchanges_per_s": sent / seconds,
                                "server_cpu_us": cpu / sent * 1e6,
                                "server_core_share": cpu / wall,
                                "server_switches_per_exchange": switches / sent})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    figures = {f"clients_{k}": {name: statistics.median(run[name] for run in runs[k])
                                for name in runs[k][0]} | {"runs": runs[k]}
               for k in clients}
    return {"batch": batch, "transport": used, "seconds": seconds, "rounds": rounds,
            **figures}


def torchrpc_ratios(tr: dict[str, dict[str, float]], name: str = "auto") -> dict[str, float]:
    """pstrain (transport `name`) over PyTorch RPC, for the headline figures."""
    out: dict[str, float] = {}
    dense = tr.get("dense_16MiB_GBps")
    if dense:
        out["dense_pull_16MiB"] = dense[f"{name}_pull"] / dense["torchrpc_pull"]
        out["dense_push_16MiB"] = dense[f"{name}_push"] / dense["torchrpc_push"]
    sparse = tr.get("sparse_rows_per_s")
    if sparse:
        out["sparse_pull"] = sparse[f"{name}_pull"] / sparse["torchrpc_pull"]
        out["sparse_push"] = sparse[f"{name}_push"] / sparse["torchrpc_push"]
    return out


# ---- mutual TLS and the job secret, on against off ------------------------------------------


def bench_tls(rows: int, reps: int, sparse_reps: int, chunk_mib: float | None,
              batch: int = 65536, dim: int = 64) -> dict[str, Any]:
    """Dense 16 MiB pull and push, and sparse pull and push of `batch` rows x `dim` on a table
    of `rows` rows, through a server with mutual TLS and the job secret and one without, each
    over every transport of TLS_TRANSPORTS, interleaved. Blocks for minutes; ends its
    servers by pid even on failure."""
    tmp = Path(tempfile.mkdtemp(prefix="pstrain-tls-"))
    procs: list[subprocess.Popen[bytes]] = []
    clients: dict[str, PSClient] = {}
    try:
        certs = make_job_certs(tmp / "certs", "bench")
        server_flags = {"on": ["--tls-cert", str(certs.cert("server")), "--tls-key",
                               str(certs.key("server")), "--tls-ca", str(certs.ca()),
                               "--secret-file", str(certs.secret())],
                        "off": []}
        security = {"on": Security(str(certs.cert("worker")), str(certs.key("worker")),
                                   str(certs.ca()), str(certs.secret())),
                    "off": Security()}
        addresses: dict[str, str] = {}
        for side, flags in server_flags.items():
            ready = tmp / f"ps-{side}.ready"
            server, addresses[side] = spawn(
                [sys.executable, "-m", "ps", "--bind", "127.0.0.1:0", "--ready-file", str(ready),
                 "--log-level", "WARNING",
                 *(["--chunk-mib", str(chunk_mib)] if chunk_mib else []), *flags], ready)
            procs.append(server)
        # In this order, so that each rep alternates TLS on and off for every transport.
        for i, t in enumerate(TLS_TRANSPORTS):
            for side in ("on", "off"):
                clients[f"{t}_{side}"] = PSClient([addresses[side]], worker=i + 1, transport=t,
                                                  security=security[side])
        used: dict[str, str] = {}
        for name, c in clients.items():
            t = name.rsplit("_", 1)[0]
            if t != "auto" and c.transports() != [t]:
                raise RuntimeError(f"client for {t} uses {c.transports()}")
            lane = " with its exchange lane" if c.exchange_lanes()[0] else ""
            used[name] = c.transport_details()[0] + lane

        n = 16 * MiB
        shape = (n // 4 // 1024, 1024)
        grad = torch.full(shape, 1e-3)
        methods: dict[str, Callable[[], object]] = {}
        for name, c in clients.items():
            c.declare_dense("tls_dense16", shape, optimizer="sgd", lr=1e-9)
            methods[f"{name}_pull"] = partial(c.pull_dense, "tls_dense16")
            methods[f"{name}_push"] = partial(c.push_dense, "tls_dense16", grad)
        t_s = interleaved(methods, reps)
        dense = {k: n / v / 1e9 for k, v in t_s.items()}

        for c in clients.values():
            c.declare_sparse("tls_emb", dim, optimizer="sgd", lr=1e-6)
        for side in ("on", "off"):
            keys = fill_sparse(clients[f"auto_{side}"], "tls_emb", rows, batch)  # the same keys
        batches = sparse_batches(keys, batch, np.random.default_rng(3))
        grads = torch.randn(len(batches[0]), dim)
        count = iter(range(10**9))

        def pick() -> int:
            return next(count) % len(batches)

        methods = {}
        for name, c in clients.items():
            methods[f"{name}_pull"] = lambda c=c: c.pull_sparse("tls_emb", batches[pick()],
                                                                assume_unique=True)
            methods[f"{name}_push"] = lambda c=c: c.push_sparse("tls_emb", batches[pick()],
                                                                grads, assume_unique=True)
        t_s = interleaved(methods, sparse_reps)
        sparse = {k: len(batches[0]) / v for k, v in t_s.items()}
    finally:
        for c in clients.values():
            c.close()
        _stop(procs)
        shutil.rmtree(tmp, ignore_errors=True)
    return {"dense_16MiB_GBps": dense, "sparse_rows_per_s": sparse, "transport_used": used,
            "sparse_rows": rows, "reps": {"dense_16MiB": reps, "sparse": sparse_reps}}


def tls_ratios(tls: dict[str, Any]) -> dict[str, float]:
    """Each figure's rate with TLS and the job secret over its rate without, per transport."""
    dense, sparse = tls["dense_16MiB_GBps"], tls["sparse_rows_per_s"]
    out: dict[str, float] = {}
    for t in TLS_TRANSPORTS:
        for op in ("pull", "push"):
            out[f"tls_dense16_{op}_ratio_{t}"] = dense[f"{t}_on_{op}"] / dense[f"{t}_off_{op}"]
        for op in ("pull", "push"):
            out[f"tls_sparse_{op}_ratio_{t}"] = sparse[f"{t}_on_{op}"] / sparse[f"{t}_off_{op}"]
    return out


# ---- across hosts: two network namespaces joined by a veth pair ---------------------------

TRPC_PORT = 29500  # in the server host's fresh namespace, where nothing else listens
TRPC_TCP = "torch.distributed.rpc, TensorPipe transport uv (TCP), channel basic"
CROSS_HOST_TIMEOUT_S = 1800.0


def cross_host_client(config_path: str) -> None:
    """The client host's side (runs in its namespace): fills the sparse table, records the
    transport the handshake picks, then measures each transport beside PyTorch RPC over TCP,
    interleaved, and writes the figures as JSON."""
    cfg = json.loads(Path(config_path).read_text())
    torch.set_num_threads(1)
    tune_malloc()
    address, rows, batch, dim = cfg["address"], cfg["rows"], cfg["batch"], cfg["dim"]
    with PSClient([address], worker=100, transport="auto") as probe:
        auto = probe.transports()[0]
        print(f"cross-host: the handshake picks transport {auto}; filling {rows:,} rows ...",
              flush=True)
        probe.declare_sparse("emb", dim, optimizer="sgd", lr=1e-6)
        start = time.perf_counter()
        keys = fill_sparse(probe, "emb", rows, batch)
        fill_s = time.perf_counter() - start
    options = trpc_options(cfg["trpc_port"], True, cfg["trpc_host"])
    rpc.init_rpc("worker", rank=1, world_size=2,
                 rpc_backend_options=options)  # type: ignore[arg-type]
    try:
        print(f"cross-host: transports {cfg['transports']} and PyTorch RPC over TCP ...",
              flush=True)
        figures = bench_transports(address, cfg["transports"], [16], {16: cfg["reps"]}, keys,
                                   cfg["sparse_reps"], batch, dim)
    finally:
        rpc.shutdown()
    Path(cfg["out"]).write_text(json.dumps(
        {"auto_transport": auto, "fill_rows_per_s": rows / fill_s, "figures": figures}))


def _start(args: list[str], log: Path, env: dict[str, str], quiet: bool = True
           ) -> subprocess.Popen[bytes]:
    with open(log, "wb") as f:
        return subprocess.Popen(args, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1", **env},
                                stdout=f if quiet else None, stderr=f)


def _tail(log: Path, chars: int = 3000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else ""


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    """Ends each process by its pid: SIGTERM, then SIGKILL after 10 s."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=10)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the clean-up of processes and namespaces


def bench_cross_host(rows: int, reps: int, sparse_reps: int, chunk_mib: float | None
                     ) -> dict[str, object]:
    """pstrain's server on one emulated host and its client on another (network namespaces
    joined by a veth pair), beside a PyTorch RPC server likewise over TensorPipe's TCP path.
    Returns the figures, or {"skipped": reason} where namespaces may not be made. Blocks for
    minutes; ends its processes and deletes its namespaces even on failure or Ctrl-C."""
    reason = netns.unavailable_reason()
    if reason:
        return {"skipped": reason}
    ucx_ok, ucx_reason = available("ucx")
    transports = ["grpc", *(["ucx"] if ucx_ok else [])]
    status = {"grpc": "measured", "ucx": "measured (UCX_TLS=tcp)" if ucx_ok
              else f"unavailable: {ucx_reason}"}
    tmp = Path(tempfile.mkdtemp(prefix="pstrain-xhost-"))
    procs: list[subprocess.Popen[bytes]] = []
    previous = signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        with netns.host_pair(str(os.getpid() % 100000)) as (srv, cli):
            try:
                def env(host: netns.Host) -> dict[str, str]:
                    ucx = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": host.device} if ucx_ok else {}
                    # Gloo (which TensorPipe RPC starts with) and TensorPipe bind to the link.
                    return {"TP_SOCKET_IFNAME": host.device, "GLOO_SOCKET_IFNAME": host.device,
                            **ucx}

                ready = tmp / "ps.ready"
                procs.append(_start(srv.command(
                    [sys.executable, "-m", "ps", "--bind", f"{srv.address}:0", "--ready-file",
                     str(ready), "--log-level", "WARNING",
                     *(["--chunk-mib", str(chunk_mib)] if chunk_mib else [])]),
                    tmp / "ps.log", env(srv)))
                deadline = time.monotonic() + 60
                while not ready.exists():
                    if procs[0].poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the server host's pstrain server did not start: "
                                           f"{_tail(tmp / 'ps.log')}")
                    time.sleep(0.05)
                address = json.loads(ready.read_text())["address"]
                procs.append(_start(srv.command(
                    [sys.executable, __file__, "--serve-torchrpc", str(TRPC_PORT),
                     "--torchrpc-tcp", "--torchrpc-host", srv.address]),
                    tmp / "torchrpc.log", env(srv)))
                config = {"address": address, "trpc_host": srv.address, "trpc_port": TRPC_PORT,
                          "transports": transports, "reps": reps, "sparse_reps": sparse_reps,
                          "rows": rows, "batch": 65536, "dim": 64,
                          "out": str(tmp / "figures.json")}
                (tmp / "client.json").write_text(json.dumps(config))
                client = _start(cli.command(
                    [sys.executable, __file__, "--cross-host-client", str(tmp / "client.json")]),
                    tmp / "client.log", env(cli), quiet=False)
                procs.append(client)
                rc = client.wait(timeout=CROSS_HOST_TIMEOUT_S)
                if rc != 0:
                    raise RuntimeError(f"the cross-host client exited with status {rc}: "
                                       f"{_tail(tmp / 'client.log')}\nPyTorch RPC server: "
                                       f"{_tail(tmp / 'torchrpc.log')}")
                got = json.loads((tmp / "figures.json").read_text())
                link_mtu = netns.mtu(srv)
            finally:
                _stop(procs)
    except netns.NotPermittedError as exc:
        return {"skipped": f"network namespaces may not be made here: {exc}"}
    finally:
        signal.signal(signal.SIGTERM, previous)
        shutil.rmtree(tmp, ignore_errors=True)
    figures: dict[str, dict[str, float]] = got["figures"]
    auto = got["auto_transport"]
    by_transport = {t: torchrpc_ratios(figures, t) for t in transports}
    return {
        "topology": (f"server host {srv.address}, client host {cli.address}: network namespaces "
                     "joined by a veth pair (a kernel loopback between namespaces, no NIC), "
                     "each process with its host's own hostname"),
        "link_mtu": link_mtu,
        "auto_transport": auto,
        "transport_status": status,
        "torchrpc": TRPC_TCP,
        "sparse_rows": rows,
        "reps": {"dense_16MiB": reps, "sparse": sparse_reps},
        "fill_rows_per_s": got["fill_rows_per_s"],
        **figures,
        "torchrpc_ratio_by_transport": by_transport,
        "torchrpc_ratio": by_transport.get(auto, {}),
    }


def bench_index(rows: int, batch: int, reps: int) -> dict[str, float]:
    index = KeyIndex()
    rng = np.random.default_rng(2)
    keys = rng.integers(-(2**62), 2**62, rows)
    start = time.perf_counter()
    for s in range(0, rows, batch):
        index.lookup_or_insert(keys[s : s + batch])
    bulk = rows / (time.perf_counter() - start)
    hits, news = [], []
    for _ in range(reps):
        b = keys[rng.integers(0, rows, batch)]
        t0 = time.perf_counter()
        index.lookup_or_insert(b)
        hits.append(batch / (time.perf_counter() - t0))
        b = rng.integers(-(2**62), 2**62, batch)
        t0 = time.perf_counter()
        index.lookup_or_insert(b)
        news.append(batch / (time.perf_counter() - t0))
    return {
        "index_lookup_or_insert_per_s": statistics.median(hits),
        "index_insert_new_per_s": statistics.median(news),
        "index_bulk_fill_per_s": bulk,
        "index_bytes_per_key": index.nbytes / len(index),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="smaller table (1 M rows) and fewer repetitions")
    parser.add_argument("--json", help="also write the figures to this path")
    parser.add_argument("--only", choices=PARTS,
                        action="append",
                        help="run only these parts (repeatable); figures of others are absent")
    parser.add_argument("--chunk-mib", type=float, default=None,
                        help="chunk size of the pstrain server (default: the server's own)")
    parser.add_argument("--transports", default="",
                        help="comma-separated transports to compare with PyTorch RPC "
                             "(default: grpc, shm, ucx where available, and auto)")
    parser.add_argument("--serve-raw", help=argparse.SUPPRESS)
    parser.add_argument("--serve-torchrpc", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--torchrpc-tcp", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--torchrpc-host", default="127.0.0.1", help=argparse.SUPPRESS)
    parser.add_argument("--cross-host-client", help=argparse.SUPPRESS)
    parser.add_argument("--capacity-transport", default="auto",
                        help="the transport the capacity part's clients use (default auto)")
    parser.add_argument("--capacity-client", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_raw:
        serve_raw(args.serve_raw)
        return
    if args.serve_torchrpc:
        serve_torchrpc(args.serve_torchrpc, args.torchrpc_tcp, args.torchrpc_host)
        return
    if args.cross_host_client:
        cross_host_client(args.cross_host_client)
        return
    if args.capacity_client:
        capacity_client(args.capacity_client)
        return
    transports = (args.transports.split(",") if args.transports else
                  [t for t in ("grpc", "shm", "ucx") if available(t)[0]] + ["auto"])

    torch.set_num_threads(1)
    tune_malloc()
    parts = set(args.only or PARTS)
    rows = 1_000_000 if args.quick else 10_000_000
    reps = {1: 20, 16: 11, 64: 3} if args.quick else {1: 40, 16: 25, 64: 7}
    dense: dict[str, dict[str, float]] = {}
    sparse: dict[str, float] = {}
    index: dict[str, float] = {}
    transport_figures: dict[str, dict[str, float]] = {}
    exchange_cpu: dict[str, dict[str, Any]] = {}
    capacity: dict[str, Any] = {}
    if parts - {"cross-host", "tls"}:
        tmp = Path(tempfile.mkdtemp(prefix="pstrain-bench-"))
        procs = []
        try:
            server, address = spawn(
                [sys.executable, "-m", "ps", "--bind", "127.0.0.1:0",
                 "--ready-file", str(tmp / "ps.ready"), "--log-level", "WARNING",
                 *(["--chunk-mib", str(args.chunk_mib)] if args.chunk_mib else [])],
                tmp / "ps.ready",
            )
            procs.append(server)
            raw_proc, raw_address = spawn(
                [sys.executable, __file__, "--serve-raw", str(tmp / "raw.ready")], tmp / "raw.ready"
            )
            procs.append(raw_proc)
            raw = grpc.insecure_channel(raw_address, options=[
                ("grpc.max_receive_message_length", 256 * MiB),
                ("grpc.max_send_message_length", 256 * MiB)])
            keys = None
            with PSClient([address], transport="grpc") as client:
                if "dense" in parts:
                    print("dense transfers ...", flush=True)
                    dense = bench_dense(client, raw, [1, 16, 64], reps)
                if "sparse" in parts or "transports" in parts:
                    print(f"sparse table of {rows:,} rows ...", flush=True)
                    sparse = bench_sparse(client, server.pid, rows, 65536, 64,
                                          9 if args.quick else 15)
                    keys = fill_sparse.last_keys  # type: ignore[attr-defined]
                    if "sparse" not in parts:
                        sparse = {}
            if "transports" in parts:
                port = free_port()
                trpc = subprocess.Popen([sys.executable, __file__, "--serve-torchrpc", str(port)],
                                        cwd=REPO)
                procs.append(trpc)
                torch.set_num_threads(1)
                rpc.init_rpc("worker", rank=1, world_size=2,
                             rpc_backend_options=trpc_options(port, False))  # type: ignore[arg-type]
                try:
                    print(f"transports {transports} and PyTorch RPC ...", flush=True)
                    transport_figures = bench_transports(
                        address, transports, [1, 16, 64], reps, keys, 9 if args.quick else 15,
                        65536, 64)
                finally:
                    rpc.shutdown()
            if "exchange" in parts:
                print("a training step's exchange, CPU per exchange ...", flush=True)
                exchange_cpu = bench_exchange_cpu(
                    address, server.pid, ["grpc", "auto"], 3,
                    {128: 500, 1024: 200} if args.quick else {128: 2000, 1024: 700})
            if "capacity" in parts:
                print("one server's capacity, 1 to 3 clients ...", flush=True)
                capacity = bench_capacity(address, server.pid, [1, 2, 3],
                                          2 if args.quick else 3, 3.0 if args.quick else 6.0,
                                          transport=args.capacity_transport)
            if "index" in parts:
                print("key index ...", flush=True)
                index = bench_index(rows, 65536, 9 if args.quick else 15)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.send_signal(signal.SIGTERM)
            for p in procs:
                p.wait(timeout=30)
    tls: dict[str, Any] = {}
    if "tls" in parts:
        print("mutual TLS and the job secret, on against off ...", flush=True)
        tls = bench_tls(rows, reps[16], 9 if args.quick else 15, args.chunk_mib)
    cross_host: dict[str, object] = {}
    if "cross-host" in parts:
        print("across hosts (network namespaces joined by a veth pair) ...", flush=True)
        cross_host = bench_cross_host(rows, reps[16], 9 if args.quick else 15, args.chunk_mib)

    results = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.system()}",
        "quick": args.quick,
        "torch": torch.__version__,
        "grpc": grpc.__version__,
        **({"dense_pull_ratio_16MiB": dense["16MiB"]["ratio_pull"],
            "dense_push_ratio_16MiB": dense["16MiB"]["ratio_push"]} if dense else {}),
        **sparse,
        **index,
        **({"torchrpc_ratio": torchrpc_ratios(transport_figures),
            "transports": transport_figures} if transport_figures else {}),
        **({"exchange_cpu": exchange_cpu} if exchange_cpu else {}),
        **({"capacity": capacity} if capacity else {}),
        **({"cross_host": cross_host} if cross_host else {}),
        **({**tls_ratios(tls), "tls": tls} if tls else {}),
        "dense_GBps": dense,
        "sparse_rows": rows,
    }
    print_table(results)
    # A partial run names its parts.
    suffix = ("-quick" if args.quick else "") + (
        "" if parts == set(PARTS) else "-" + "-".join(p for p in PARTS if p in parts))
    save(results, f"dataplane-{results['date']}{suffix}", args.json)


def print_table(r: dict[str, object]) -> None:
    dense = r["dense_GBps"]
    assert isinstance(dense, dict)
    print(f"\npstrain data plane, {r['date']}, {r['machine']}")
    if dense:
        print_dense(dense)
    if "sparse_pull_rows_per_s" in r:
        print_sparse(r)
    if "transports" in r:
        print_transports(r["transports"], r["torchrpc_ratio"])  # type: ignore[arg-type]
    if "exchange_cpu" in r:
        print_exchange_cpu(r["exchange_cpu"])  # type: ignore[arg-type]
    if "capacity" in r:
        print_capacity(r["capacity"])  # type: ignore[arg-type]
    if "cross_host" in r:
        print_cross_host(r["cross_host"])  # type: ignore[arg-type]
    if "tls" in r:
        print_tls(r["tls"])  # type: ignore[arg-type]
    if "index_lookup_or_insert_per_s" in r:
        print(f"index: lookup-or-insert {r['index_lookup_or_insert_per_s'] / 1e6:.1f} M/s "
              f"(existing keys), {r['index_insert_new_per_s'] / 1e6:.1f} M/s (new keys), "
              f"{r['index_bytes_per_key']:.1f} B/key")


def print_dense(dense: dict[str, dict[str, float]]) -> None:
    print(f"{'dense':<8}{'op':<6}{'pstrain':>10}{'raw unary':>11}{'raw stream':>12}{'ratio':>8}")
    for size, g in dense.items():
        for op in ("pull", "push"):
            print(f"{size:<8}{op:<6}{g[f'pstrain_{op}']:>8.2f}GB/s{g[f'raw_unary_{op}']:>9.2f}"
                  f"{g[f'raw_stream_{op}']:>12.2f}{g[f'ratio_{op}']:>8.2f}x")


def print_transports(tr: dict[str, dict[str, float]], ratios: dict[str, float],
                     title: str = "one host (dense GB/s, sparse M rows/s), PyTorch RPC beside",
                     ratio_title: str = "pstrain (auto) / PyTorch RPC: ") -> None:
    rates = {what: g for what, g in tr.items() if what != "small_step_us"}
    names = sorted({k.rsplit("_", 1)[0] for g in rates.values() for k in g})
    print(f"\nby transport, {title}")
    print(f"{'':<22}" + "".join(f"{n:>10}" for n in names))
    for what, g in rates.items():
        scale = 1e6 if what.startswith("sparse") else 1.0
        for op in ("pull", "push"):
            print(f"{what.replace('_GBps', '').replace('_rows_per_s', '') + ' ' + op:<22}"
                  + "".join(f"{g[f'{n}_{op}'] / scale:>10.2f}" for n in names))
    small = tr.get("small_step_us")
    if small:
        print(f"{f'step of {STEP_ROWS} rows, us':<22}"
              + "".join(f"{small[n]:>10.0f}" for n in names))
    print(ratio_title + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))


def print_exchange_cpu(ex: dict[str, dict[str, Any]]) -> None:
    print("\na MovieLens-shaped step's exchange, one after another (medians)")
    print(f"{'':<14}{'transport':>10}{'server CPU':>12}{'client CPU':>12}{'round trip':>12}")
    for what, f in ex.items():
        print(f"{what:<14}{f['transport']:>10}{f['server_cpu_us']:>10.0f}us"
              f"{f['client_cpu_us']:>10.0f}us{f['round_trip_us']:>10.0f}us")


def print_capacity(cap: dict[str, Any]) -> None:
    print(f"\none server's capacity: clients sending batch-{cap['batch']} step exchanges back "
          f"to back over {cap['transport']} ({cap['rounds']} rounds of {cap['seconds']:.0f} s, "
          "medians)")
    print(f"{'clients':<10}{'exchanges/s':>12}{'server CPU':>14}{'of a core':>11}"
          f"{'switches':>10}")
    for what, f in cap.items():
        if what.startswith("clients_"):
            print(f"{what.removeprefix('clients_'):<10}{f['exchanges_per_s']:>12.0f}"
                  f"{f['server_cpu_us']:>10.0f}us/x{100 * f['server_core_share']:>10.0f}%"
                  f"{f['server_switches_per_exchange']:>10.1f}")


def print_cross_host(ch: dict[str, Any]) -> None:
    if "skipped" in ch:
        print(f"\nacross hosts: skipped, {ch['skipped']}")
        return
    print(f"\nacross hosts ({ch['topology']}; MTU {ch['link_mtu']})")
    print(f"the handshake picks transport {ch['auto_transport']}; "
          + "; ".join(f"{t}: {s}" for t, s in ch["transport_status"].items()))
    figures = {k: v for k, v in ch.items() if k.startswith(("dense_", "sparse_rows_per_s"))}
    print_transports(figures, ch["torchrpc_ratio"],
                     f"PyTorch RPC over TCP beside; pstrain ({ch['auto_transport']})",
                     f"across hosts, pstrain ({ch['auto_transport']}) / PyTorch RPC (TCP): ")


def print_tls(tls: dict[str, Any]) -> None:
    ratios = tls_ratios(tls)
    print(f"\nmutual TLS and the job secret, on against off, one host (dense GB/s, sparse M "
          f"rows/s of 64k rows x dim 64, table of {tls['sparse_rows']:,} rows)")
    print(f"{'':<18}" + "".join(f"{t + ' on':>10}{t + ' off':>10}{'on/off':>8}"
                                for t in TLS_TRANSPORTS))
    for what, figure, key, scale in (("dense 16MiB", "dense16", "dense_16MiB_GBps", 1.0),
                                     ("sparse", "sparse", "sparse_rows_per_s", 1e6)):
        g = tls[key]
        for op in ("pull", "push"):
            print(f"{what + ' ' + op:<18}" + "".join(
                f"{g[f'{t}_on_{op}'] / scale:>10.2f}{g[f'{t}_off_{op}'] / scale:>10.2f}"
                f"{ratios[f'tls_{figure}_{op}_ratio_{t}']:>7.2f}x" for t in TLS_TRANSPORTS))
    print("transports: " + "; ".join(f"{k.replace('_', ' TLS ')}: {v}"
                                     for k, v in tls["transport_used"].items()))


def print_sparse(r: dict[str, object]) -> None:
    print(f"\nsparse, 64k unique keys x dim 64 float32, table of {r['sparse_rows']:,} rows")
    print(f"  pull {r['sparse_pull_rows_per_s'] / 1e6:6.2f} M rows/s   in-process index_select "
          f"{r['inprocess_index_select_rows_per_s'] / 1e6:6.2f} M rows/s   ratio "
          f"{r['sparse_pull_ratio_inprocess']:.2f}x")
    print(f"  push {r['sparse_push_rows_per_s'] / 1e6:6.2f} M rows/s   in-process index_add_  "
          f"{r['inprocess_index_add_rows_per_s'] / 1e6:6.2f} M rows/s   ratio "
          f"{r['sparse_push_ratio_inprocess']:.2f}x")
    print(f"  memory per row {r['server_rss_bytes_per_row']:.0f} B = "
          f"{r['row_memory_ratio']:.2f}x the raw value bytes (SGD, no state)")


if __name__ == "__main__":
    main()
