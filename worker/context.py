"""`worker.init()`: a training script's connection to its job.

Inside a job (`pstrain up`, `pstrain worker`) the environment names the Redis URL, the job
and usually the rank; `init()` finds the servers there, registers and heartbeats, and
returns a context holding the client and the clock. Standalone, PSTRAIN_SERVERS (a comma
separated list in shard order) is enough.

Environment: PSTRAIN_REDIS, PSTRAIN_JOB, PSTRAIN_RANK (claimed if unset),
PSTRAIN_WORLD_SIZE, PSTRAIN_SERVERS (standalone only), PSTRAIN_TORCH_THREADS.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from protos.runtime import tune_malloc
from protos.security import Security, SecurityError
from scheduler.heartbeat import Heartbeat
from scheduler.spec import RESTART_EXIT_CODE, JobSpec
from scheduler.store import JobStore, ride_out
from worker.bulk import TransportSettings
from worker.client import PSClient, RetryPolicy
from worker.errors import PSClientError
from worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

# Calls keep retrying this long while a server restarts (checkpoint restore included).
RECOVERY_RETRY = RetryPolicy(attempts=90, initial_backoff_s=0.05, max_backoff_s=1.0)


@dataclass
class _Metrics:
    """What the script reported, for heartbeats (the live view). Guarded by its lock."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    values: dict[str, float] = field(default_factory=dict)
    samples: float = 0.0
    total: float = 0.0
    rate: float = 0.0
    since: float = field(default_factory=time.monotonic)

    def add(self, samples: float, metrics: Mapping[str, float]) -> None:
        with self.lock:
            self.samples += samples
            self.total += samples
            self.values.update({k: float(v) for k, v in metrics.items()})

    def snapshot(self) -> dict[str, float]:
        with self.lock:
            now = time.monotonic()
            elapsed = now - self.since
            if elapsed >= 1.0:
                instant = self.samples / elapsed
                self.rate = instant if self.rate == 0 else 0.5 * self.rate + 0.5 * instant
                self.samples, self.since = 0.0, now
            return {**self.values, "samples_per_s": self.rate}


@dataclass
class WorkerContext:
    """A worker's place in its job. Thread-safe; `close` ends it (also at interpreter exit)."""

    rank: int
    world_size: int
    job: str
    client: PSClient
    spec: JobSpec | None = None
    store: JobStore | None = None
    heartbeat: Heartbeat | None = None
    metrics: _Metrics = field(default_factory=_Metrics)
    exporter: WorkerMetrics | None = None

    @property
    def clock(self) -> int:
        """This worker's iteration count (advanced by `client.end_iteration()`)."""
        return self.client.clock

    def _metric_values(self) -> dict[str, float]:
        snapshot = self.metrics.snapshot()
        with self.metrics.lock:
            total = self.metrics.total
        return {**snapshot, "clock": float(self.client.clock), "samples": total,
                "pushes_dropped": float(self.client.dropped_pushes)}

    def report(self, samples: int = 0, **metrics: float) -> None:
        """Reports progress (samples done since the last call, loss, ...) to the live view.

        Cheap and non-blocking: heartbeats carry the latest values.
        """
        self.metrics.add(samples, metrics)

    def shard(self, items: int) -> range:
        """The indices of `items` this rank owns: every world_size-th, from its rank."""
        return range(self.rank, items, self.world_size)

    def close(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop(forget=True)
            self.heartbeat = None
        if self.exporter is not None:
            self.exporter.close()
            self.exporter = None
        self.client.close()

    def _payload(self) -> dict[str, Any]:
        return {"rank": self.rank, "incarnation": self.client.incarnation,
                "pid": os.getpid(), "host": socket.gethostname(), "clock": self.client.clock,
                **self.metrics.snapshot()}


def _serve_metrics(ctx: WorkerContext, env: Mapping[str, str]) -> None:
    port = int(env.get("PSTRAIN_METRICS_PORT", "0"))
    if port:
        metrics = WorkerMetrics(ctx.rank, ctx._metric_values)
        ctx.client.observe = metrics.observe
        metrics.serve(port)
        ctx.exporter = metrics
        log.info("worker %d: metrics on :%d/metrics", ctx.rank, port)


def init(*, timeout_s: float = 120.0, env: Mapping[str, str] | None = None) -> WorkerContext:
    """Connects this process to its job and returns its context. Blocks until ready.

    Waits (up to `timeout_s`) for every shard to be up and, in sync mode, for the scheduler
    to list this worker live. Raises PSClientError when the job cannot be joined in time.
    """
    env = os.environ if env is None else env
    transport: dict[str, Any] = {**asdict(TransportSettings.from_env(env)),
                                 "security": _security(env)}
    torch.set_num_threads(int(env.get("PSTRAIN_TORCH_THREADS", "1")))
    tune_malloc()
    incarnation = time.time_ns() // 1000
    if not env.get("PSTRAIN_REDIS"):
        servers = [s for s in env.get("PSTRAIN_SERVERS", "").split(",") if s]
        if not servers:
            raise PSClientError(
                "worker.init() needs PSTRAIN_REDIS and PSTRAIN_JOB (set by pstrain up and "
                "pstrain worker), or PSTRAIN_SERVERS=HOST:PORT,... for servers run by hand"
            )
        rank = int(env.get("PSTRAIN_RANK", "0"))
        client = PSClient(servers, worker=rank, incarnation=incarnation, **transport)
        client.join()
        standalone = WorkerContext(rank, int(env.get("PSTRAIN_WORLD_SIZE", "1")), "", client)
        _serve_metrics(standalone, env)
        return standalone

    job = env.get("PSTRAIN_JOB", "")
    if not job:
        raise PSClientError("PSTRAIN_REDIS is set but PSTRAIN_JOB is not")
    store = JobStore.connect(env["PSTRAIN_REDIS"], job)
    deadline = time.monotonic() + timeout_s
    spec = _wait(store.spec, deadline, f"job {job!r} to be created")
    rank = _rank(store, spec, env, incarnation, deadline)
    addresses = _wait(lambda: _server_addresses(store, spec), deadline,
                      f"all {spec.servers} servers of job {job!r} to register")

    def resolve(shard: int) -> str | None:
        return ride_out("resolve", lambda: _address(store, shard), None)

    client = PSClient(addresses, worker=rank, incarnation=incarnation, retry=RECOVERY_RETRY,
                      resolve=resolve, connect_timeout_s=max(1.0, deadline - time.monotonic()),
                      job=job, **transport)
    ctx = WorkerContext(rank, spec.workers, job, client, spec, store)
    generation = ride_out("generation", store.generation, 0)
    client.generation = generation

    def restart() -> None:
        # A sync job rolled back to a checkpoint: this process's progress past it is void.
        # Its supervisor (pstrain up, pstrain worker, systemd) starts it again and it rejoins
        # at the checkpoint's clock.
        log.warning("worker %d: job %r rolled back; exiting to be restarted", rank, job)
        os._exit(RESTART_EXIT_CODE)

    def watch_rollback() -> None:
        if ride_out("generation", store.generation, 0) > generation:
            restart()

    # A restored server may refuse this process before a heartbeat sees the new generation.
    client.on_rolled_back = restart

    ctx.heartbeat = Heartbeat(
        store, "worker", rank, interval_s=spec.heartbeat_interval_s, ttl_s=spec.heartbeat_ttl_s,
        payload=ctx._payload,
        registration={"incarnation": incarnation, "pid": os.getpid(),
                      "host": socket.gethostname()},
        on_beat=watch_rollback if spec.mode == "sync" else None,
    )
    ctx.heartbeat.start()
    client.join()
    if spec.mode == "sync":
        _wait(lambda: client.live_everywhere() or None, deadline,
              f"the scheduler of job {job!r} to list worker {rank} live")
    _serve_metrics(ctx, env)
    log.info("worker %d of job %r joined at clock %d (incarnation %d)", rank, job,
             client.clock, incarnation)
    return ctx


def _security(env: Mapping[str, str]) -> Security:
    """The worker's TLS files and job secret, from PSTRAIN_TLS_* and PSTRAIN_SECRET_FILE."""
    try:
        return Security.from_env(env)
    except SecurityError as exc:
        raise PSClientError(str(exc)) from exc


def _wait(probe: Any, deadline: float, what: str) -> Any:
    while True:
        value = ride_out("wait", probe, None)
        if value:
            return value
        if time.monotonic() > deadline:
            raise PSClientError(f"timed out waiting for {what}")
        time.sleep(0.1)


def _rank(store: JobStore, spec: JobSpec, env: Mapping[str, str], incarnation: int,
          deadline: float) -> int:
    if env.get("PSTRAIN_RANK"):
        rank = int(env["PSTRAIN_RANK"])
        if not 0 <= rank < spec.workers:
            raise PSClientError(
                f"PSTRAIN_RANK={rank} is outside job {spec.job!r}'s ranks 0..{spec.workers - 1}"
            )
        return rank
    claim = {"incarnation": incarnation, "pid": os.getpid(), "host": socket.gethostname()}
    while True:
        for rank in range(spec.workers):
            if store.claim("worker", rank, claim, spec.heartbeat_ttl_s):
                return rank
        if time.monotonic() > deadline:
            raise PSClientError(f"all {spec.workers} ranks of job {spec.job!r} are taken")
        time.sleep(spec.heartbeat_interval_s)


def _server_addresses(store: JobStore, spec: JobSpec) -> list[str] | None:
    members = store.members("server")
    beats = store.heartbeats("server", list(range(spec.servers)))
    if any(beats.get(k) is None or k not in members for k in range(spec.servers)):
        return None
    return [str(members[k]["address"]) for k in range(spec.servers)]


def _address(store: JobStore, shard: int) -> str | None:
    beat = store.heartbeats("server", [shard]).get(shard)
    return None if beat is None else str(beat["address"])
