"""`worker.init()`: a training script's connection to its job.

Inside a job (`pstrain up`, `pstrain worker`) the environment names the Redis URL, the job
and usually the rank; `init()` finds the servers there, registers and heartbeats, and
returns a context holding the client and the clock. Standalone, PSTRAIN_SERVERS (a comma
separated list in shard order) is enough.

A worker that has done its steps leaves the job with `ctx.finish()` (also done by `close()`
and by the end of a `with worker.init() as ctx:` block without an exception), so workers
with more steps to go never wait for it; `ctx.barrier(name)` waits for every live worker. A
script that returns without either leaves a last heartbeat at exit that outlives its process
until its supervisor (`pstrain up`, `pstrain worker`) records the exit status 0 as a finish,
so it is never taken for dead.

Environment: PSTRAIN_REDIS, PSTRAIN_JOB, PSTRAIN_RANK (claimed if unset),
PSTRAIN_WORLD_SIZE, PSTRAIN_SERVERS (standalone only), PSTRAIN_TORCH_THREADS.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from types import TracebackType
from typing import Any

import torch

from protos.positions import DataPosition
from protos.runtime import tune_malloc
from protos.security import Security, SecurityError
from scheduler.finishing import barrier_missing
from scheduler.heartbeat import Heartbeat
from scheduler.spec import RESTART_EXIT_CODE, STOPPED_EXIT_CODE, JobSpec
from scheduler.store import JobStore, ride_out
from worker.bulk import TransportSettings
from worker.client import PSClient, RetryPolicy
from worker.errors import BarrierTimeoutError, FinishTimeoutError, PSClientError
from worker.metrics import WorkerMetrics

log = logging.getLogger(__name__)

# Calls keep retrying this long while a server restarts (checkpoint restore included).
RECOVERY_RETRY = RetryPolicy(attempts=90, initial_backoff_s=0.05, max_backoff_s=1.0)

# How often finish() and barrier() look again: soon at first, then less often, so a long wait
# at a barrier costs Redis little.
POLL_FIRST_S = 0.05
POLL_MAX_S = 0.5
# How long the last heartbeat of a script that exits without finishing (and without an
# uncaught exception) lives: its process's teardown and its supervisor's record of the exit
# status fit in it. A script that exits with another status is declared dead after it.
EXIT_GRACE_S = 5.0
# A barrier round's record outlives its latest arrival this long: a worker restarted later
# finds the rounds the others passed.
BARRIER_TTL_S = 7 * 24 * 3600.0
_BARRIER_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,200}")


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
    """A worker's place in its job. Thread-safe. `finish` leaves the job, `close` ends the
    context (finishing first, unless told not to); as a context manager it closes on exit,
    finishing only when the block ended without an exception."""

    rank: int
    world_size: int
    job: str
    client: PSClient
    spec: JobSpec | None = None
    store: JobStore | None = None
    heartbeat: Heartbeat | None = None
    metrics: _Metrics = field(default_factory=_Metrics)
    exporter: WorkerMetrics | None = None
    monotonic: Callable[[], float] = field(default=time.monotonic, repr=False)
    sleep: Callable[[float], None] = field(default=time.sleep, repr=False)
    # Guards `finished`, `closed` and `barrier_rounds`; held through finish() and close().
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    finished: bool = False
    # `finish()` has written its record: it may still wait for the servers to let go, and it
    # stays True once `finished` is.
    finishing: bool = False
    closed: bool = False
    # Per barrier name, the rounds this process has passed: the next call waits at the next.
    barrier_rounds: dict[str, int] = field(default_factory=dict)

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

    @property
    def position(self) -> DataPosition | None:
        """Where this rank was in its data when it joined: what the servers kept of its
        last `at()` before the job's clock (a checkpoint it resumed from, or the live job
        it rejoined); None for a fresh start. A script starts there, so no sample is
        skipped or trained twice across a restart."""
        return DataPosition.decode(self.client.joined_position)

    def at(self, epoch: int, batch: int, state: str = "") -> None:
        """Says where this rank is in its data once the current step is done: `batch`
        batches of `epoch` trained (so the next is batch `batch`), with `state` for a
        sampler's own text. Call it before the step's `PSOptimizer.step()` (or
        `client.end_iteration()`); the step's end carries it to every server, and
        checkpoints record it. Cheap; PositionError for values that cannot be kept."""
        self.client.position = DataPosition(epoch, batch, state).encode()

    def shard(self, items: int) -> range:
        """The indices of `items` this rank owns: every world_size-th, from its rank."""
        return range(self.rank, items, self.world_size)

    def finish(self, timeout_s: float = 60.0) -> None:
        """Leaves the job: this worker has done its steps, and nobody waits for it any more.

        Records in Redis that this rank finished (it is never claimed or restarted again),
        then blocks until every server has taken it out of the live set (the scheduler does
        that within a poll), writing the record again at each poll meanwhile (a Redis that
        restarts empty loses it): sync clocks close and ssp bounds move without it, and barriers
        stop waiting for it. Then stops the heartbeat, whose end the scheduler records as
        "finished", not "dead". Send the last step's gradients first (`PSOptimizer.flush()`
        or `close()`); pulls still work afterwards, pushes do not (sync).

        A sync rollback to a checkpoint before this finish, while it waits, voids it (the
        steps past the checkpoint are undone): the process then restarts with the others and
        trains them again.

        Idempotent; thread-safe. Raises FinishTimeoutError when the servers still list this
        worker after `timeout_s` (the record stays: the scheduler applies it when it can).
        """
        with self.lock:
            if self.finished:
                return
            if self.closed:
                raise PSClientError(f"worker {self.rank}: finish() after close(finish=False); "
                                    "the context is closed")
            store = self.store
            if store is None:  # standalone: no scheduler, no membership to leave
                self.finished = True
                return
            deadline = self.monotonic() + timeout_s
            incarnation, clock = self.client.incarnation, self.client.clock
            # None: not written yet (Redis unreachable); False: a sync rollback voided it.
            written: bool | None = None

            def left() -> bool:
                # The record is written again at every poll (it is idempotent) until the
                # servers let go: a Redis that restarted empty since the last write lost it,
                # and the scheduler applies only what it reads. A voided finish is not
                # written: this process restarts when it sees the rollback.
                nonlocal written
                answer = ride_out(
                    "finish", lambda: store.finish_worker(self.rank, incarnation, clock), None)
                if answer is None:
                    return False
                written = answer
                self.finishing = self.finishing or answer
                return answer and not self.client.live_on()

            def why() -> str:
                if written is None:
                    return (f"worker {self.rank} could not record in Redis that it finished "
                            f"within {timeout_s:g} s (Redis unreachable?)")
                if not written:
                    return (f"worker {self.rank} of job {self.job!r} finished at clock {clock}, "
                            "but a sync rollback to an earlier checkpoint voided its finish, "
                            f"and it did not see that rollback within {timeout_s:g} s")
                return (f"worker {self.rank} of job {self.job!r} recorded that it finished, "
                        f"but shards {self.client.live_on()} still listed it live after "
                        f"{timeout_s:g} s: is the job's scheduler running? (it applies the "
                        "record when it can)")

            self._poll(left, deadline, FinishTimeoutError, why)
            if self.heartbeat is not None:
                self.heartbeat.stop(forget=True)
                self.heartbeat = None
            self.finished = True
            log.info("worker %d of job %r finished at clock %d and left the job", self.rank,
                     self.job, clock)

    def barrier(self, name: str, timeout_s: float = 3600.0) -> None:
        """Blocks until every live worker of the job has reached barrier `name`.

        Live: not dead and not finished (a worker that finishes or is declared dead while
        others wait stops being waited for; one still starting is waited for). Calls with
        the same name are rounds: the k-th call of each worker waits for the k-th of the
        others, so a name can be used again, e.g. once per epoch. A finished worker may wait
        at a barrier too (to evaluate once everyone has trained). Thread-safe per name.
        Raises BarrierTimeoutError naming the missing workers after `timeout_s`.
        """
        if not _BARRIER_NAME.fullmatch(name):
            raise PSClientError(f"barrier name {name!r} must be 1-200 letters, digits or "
                                "'_.:-'")
        store = self.store
        if store is None:
            if self.world_size == 1:
                return
            raise PSClientError(
                f"ctx.barrier({name!r}) needs the job's Redis (run under pstrain up or pstrain "
                f"worker); a standalone worker cannot see the other {self.world_size - 1}"
            )
        with self.lock:
            round_ = self.barrier_rounds.get(name, 0)
            self.barrier_rounds[name] = round_ + 1
        started = self.monotonic()
        incarnation = self.client.incarnation
        missing: list[int] = []

        def passed() -> bool:
            nonlocal missing
            state = ride_out("barrier", lambda: store.barrier_state(name, round_), None)
            if state is None:
                return False
            arrived, live, left, registered = state
            if arrived.get(self.rank) != incarnation:
                def arrive() -> bool:
                    store.arrive(name, round_, self.rank, incarnation, BARRIER_TTL_S)
                    return True
                if not ride_out("barrier", arrive, False):
                    return False
                arrived[self.rank] = incarnation
            expected = range(self.world_size) if live is None else live
            missing = barrier_missing(expected, registered, left, arrived)
            return not missing

        self._poll(passed, started + timeout_s, BarrierTimeoutError, lambda: (
            f"barrier {name!r} (round {round_}) of job {self.job!r}: worker {self.rank} "
            f"waited {self.monotonic() - started:.1f} s; still missing workers {missing} "
            "(live, not finished, not arrived); raise timeout_s if they are still training"))
        log.info("worker %d passed barrier %r (round %d) after %.1f s", self.rank, name,
                 round_, self.monotonic() - started)

    def _poll(self, done: Callable[[], bool], deadline: float, error: type[PSClientError],
              message: Callable[[], str]) -> None:
        """Asks `done` until it says yes, sleeping a little longer each time; raises `error`
        with `message()` past `deadline`."""
        wait_s = POLL_FIRST_S
        while not done():
            if self.monotonic() >= deadline:
                raise error(message())
            self.sleep(wait_s)
            wait_s = min(POLL_MAX_S, wait_s * 1.5)

    def close(self, *, finish: bool = True, timeout_s: float = 60.0) -> None:
        """Ends this worker's part in the job: with `finish` (a clean end) it first leaves
        the job (`finish`), else it just stops (the scheduler sees its heartbeat end, as for
        a crash). Then stops the heartbeat, the metrics endpoint and the client. Blocks up to
        `timeout_s` for the finish; idempotent; thread-safe."""
        with self.lock:
            if self.closed:
                return
            try:
                if finish:
                    self.finish(timeout_s)
            finally:
                self.closed = True
                if self.heartbeat is not None:
                    self.heartbeat.stop(forget=True)
                    self.heartbeat = None
                if self.exporter is not None:
                    self.exporter.close()
                    self.exporter = None
                self.client.close()

    def __enter__(self) -> WorkerContext:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        # sys.exit(0) inside the block is a clean end too.
        clean = kind is None or (isinstance(error, SystemExit) and error.code in (0, None))
        self.close(finish=clean)

    def _payload(self) -> dict[str, Any]:
        return {"rank": self.rank, "incarnation": self.client.incarnation,
                "pid": os.getpid(), "host": socket.gethostname(), "clock": self.client.clock,
                **self.metrics.snapshot()}


def _serve_metrics(ctx: WorkerContext, env: Mapping[str, str]) -> None:
    port = int(env.get("PSTRAIN_METRICS_PORT", "0"))
    if port:
        metrics = WorkerMetrics(ctx.rank, ctx._metric_values)
        ctx.client.observe = metrics.observe
        try:
            metrics.serve(port)
        except PSClientError:
            ctx.close(finish=False)  # this process cannot run as asked: it leaves the job
            raise
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

    def restart(why: str = "a server refused it: the job rolled back, or this process was "
                           "declared dead") -> None:
        # A sync job rolled back to a checkpoint (this process's progress past it is void), or
        # this process was declared dead (the job went on without it; it never rejoins as
        # itself). Its supervisor (pstrain up, pstrain worker, systemd) starts it again and
        # the new incarnation rejoins: at the checkpoint's clock, or at the open clock.
        if ctx.finishing and ride_out(
                "finished", lambda: rank in store.finished_ranks(), True):
            # Its training is done, at or before the checkpoint: running it again would train
            # the rank twice. It takes the new generation, to pull (evaluate) what is there.
            # (A finish past the checkpoint is voided by the scheduler, before any shard is
            # restored: this process then restarts with the others and trains those steps.)
            client.generation = max(client.generation,
                                    ride_out("generation", store.generation, 0))
            log.warning("worker %d of job %r finished before the job rolled back; it stays "
                        "finished (generation %d)", rank, job, client.generation)
            return
        log.warning("worker %d (incarnation %d) of job %r: %s; exiting to be restarted", rank,
                    incarnation, job, why)
        os._exit(RESTART_EXIT_CODE)

    def watch_rollback() -> None:
        stopped = ride_out("stopped", store.stopped, None)
        if stopped is not None:
            log.error("worker %d of job %r: the job was stopped: %s", rank, job, stopped)
            os._exit(STOPPED_EXIT_CODE)
        if spec.mode == "sync" and ride_out("generation", store.generation, 0) > (
                client.generation):
            restart("the job rolled back")
        # Declared dead while it was paused: found here even if it makes no request.
        if not ctx.finished and ride_out("fenced", lambda: store.fenced_incarnation(rank),
                                         -1) >= incarnation:
            restart("this process was declared dead (silent too long) and the job went on "
                    "without it")

    # A restored server may refuse this process before a heartbeat sees the new generation.
    client.on_rolled_back = restart

    ctx.heartbeat = Heartbeat(
        store, "worker", rank, interval_s=spec.heartbeat_interval_s, ttl_s=spec.heartbeat_ttl_s,
        payload=ctx._payload,
        registration={"incarnation": incarnation, "pid": os.getpid(),
                      "host": socket.gethostname()},
        on_beat=watch_rollback,
    )
    ctx.heartbeat.start()
    client.join()
    if spec.mode == "sync":
        _wait(lambda: client.live_everywhere() or None, deadline,
              f"the scheduler of job {job!r} to list worker {rank} live")
        # Listed live, a worker that replaces a dead one is moved up to the open clock:
        # joining again takes that clock, so its first push is not a late one.
        client.join()
    _serve_metrics(ctx, env)
    atexit.register(_linger_at_exit, ctx)
    log.info("worker %d of job %r joined at clock %d (incarnation %d)", rank, job,
             client.clock, incarnation)
    return ctx


def _linger_at_exit(ctx: WorkerContext) -> None:
    """At the interpreter's exit of a script that did not finish or close its context: its
    heartbeat stops with a last beat that outlives the process by EXIT_GRACE_S, so the
    supervisor's record of the exit status (0: finished) comes first. Not after an uncaught
    exception (a crash: dead at once), nor after os._exit (a restart), which skips exit
    handlers."""
    crashed = getattr(sys, "last_value", None) or getattr(sys, "last_exc", None)
    heartbeat = ctx.heartbeat
    if crashed is not None or ctx.finished or ctx.closed or heartbeat is None:
        return
    heartbeat.linger(EXIT_GRACE_S)


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
