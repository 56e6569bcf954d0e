"""`pstrain worker`: claim a rank of the job (or take the one --rank gives), run the script,
record its end.

A worker that is not told its rank takes the lowest free one from Redis in one atomic step
(`JobStore.claim_rank`): free means not finished, not claimed by another `pstrain worker`,
and not heartbeating. It keeps the claim alive while its script runs (the claim expires like
a heartbeat when this process dies), runs the script as its child with `PSTRAIN_RANK` set,
starts the script again at once when it exits to be restarted after a sync rollback, and
when the script exits with status 0 marks the rank finished, so no later worker trains it
again. With --rank R the rank is not claimed, but the script runs, restarts and finishes
the same way: a script that returns (status 0) is recorded finished, never dead. Replicas
started without ranks (`docker compose --scale worker=N`, one systemd unit
per machine) therefore sort themselves out; extra ones wait as spares, take over the rank of
a worker that dies, and exit with status 0 once every rank has finished.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import FrameType

from scheduler.errors import ConfigError, JobNotFoundError, RankUnavailableError
from scheduler.launcher import check_script, die_with_parent, shell_status
from scheduler.spec import RESTART_EXIT_CODE, JobSpec
from scheduler.store import ALL_FINISHED, NO_FREE_RANK, JobStore, redact, ride_out

log = logging.getLogger(__name__)

# Restarts after rollbacks before the worker gives up (each one is a job-wide event).
MAX_ROLLBACK_RESTARTS = 20
STOP_GRACE_S = 10.0


@dataclass(frozen=True)
class WorkerRunConfig:
    """What `pstrain worker` without --rank was asked to run. Validated on construction."""

    redis: str
    job: str
    script: str
    script_args: tuple[str, ...] = ()
    metrics_port: int = 0
    spec_wait_s: float = 60.0  # for the job's scheduler to create the job
    rank_wait_s: float = 0.0  # for a free rank; 0: as long as any rank is unfinished
    rank: int | None = None  # given with --rank: not claimed

    def __post_init__(self) -> None:
        if self.rank is not None and self.rank < 0:
            raise ConfigError(f"--rank must be >= 0, got {self.rank}")
        if not 0 <= self.metrics_port <= 65535:
            raise ConfigError(f"--metrics-port must be in [0, 65535], got {self.metrics_port}")
        if self.spec_wait_s < 0:
            raise ConfigError(f"--spec-wait-s must be >= 0, got {self.spec_wait_s:g}")
        if self.rank_wait_s < 0:
            raise ConfigError(f"--rank-wait-s must be >= 0 (0: no limit), got "
                              f"{self.rank_wait_s:g}")
        check_script(self.script)


def wait_for_spec(store: JobStore, timeout_s: float,
                  sleep: Callable[[float], None] = time.sleep) -> JobSpec:
    """The job's spec, waiting up to `timeout_s` for its scheduler to write it. Blocks."""
    deadline = time.monotonic() + timeout_s
    while True:
        spec = ride_out("spec", store.spec, None)
        if spec is not None:
            return spec
        if time.monotonic() >= deadline:
            raise JobNotFoundError(
                f"job {store.keys.job!r} has no spec in Redis at {redact(store.url)} after "
                f"{timeout_s:g} s: start its scheduler (pstrain scheduler --job "
                f"{store.keys.job} ...) or check --job and --redis"
            )
        sleep(0.2)


class RankClaim:
    """One process's claim on a worker rank. Not thread-safe: one thread drives it."""

    def __init__(self, store: JobStore, spec: JobSpec, *, pid: int | None = None,
                 host: str | None = None, sleep: Callable[[float], None] = time.sleep,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.spec = spec
        pid = os.getpid() if pid is None else pid
        host = socket.gethostname() if host is None else host
        # The value stored under the rank key: unique to this process, compared on renewal.
        self.holder = json.dumps({"holder": f"{host}:{pid}:{time.time_ns()}", "pid": pid,
                                  "host": host})
        self.pid = pid
        self.host = host
        self.rank: int | None = None
        self._sleep = sleep
        self._now = clock

    def acquire(self, wait_s: float) -> int | None:
        """Claims the lowest free rank; None when every rank of the job has finished.

        Blocks while every unfinished rank is held, polling once per heartbeat interval, for
        at most `wait_s` (0: no limit); RankUnavailableError after that.
        """
        deadline = None if wait_s == 0 else self._now() + wait_s
        announced = False
        while True:
            got = ride_out("claim", lambda: self.store.claim_rank(
                self.spec.workers, self.holder, self.spec.heartbeat_ttl_s), NO_FREE_RANK)
            if got == ALL_FINISHED:
                return None
            if got >= 0:
                self._took(got)
                return got
            if not announced:
                log.info("worker: all %d ranks of job %r are held by live workers; waiting as a "
                         "spare for one to come free", self.spec.workers, self.spec.job)
                announced = True
            if deadline is not None and self._now() >= deadline:
                raise RankUnavailableError(
                    f"no rank of job {self.spec.job!r} came free within {wait_s:g} s: all "
                    f"{self.spec.workers} are held by live workers (raise the job's --workers "
                    "or --rank-wait-s)"
                )
            self._sleep(self.spec.heartbeat_interval_s)

    def _took(self, rank: int) -> None:
        self.rank = rank
        ride_out("claim", lambda: self.store.event("claimed", "worker", rank, pid=self.pid,
                                                   host=self.host), None)

    def renew(self) -> bool:
        """Keeps the claim alive; False only when another worker holds the rank now.

        A Redis outage is ridden out (the claim counts as kept): training does not wait on
        Redis, and the claim is taken back when Redis returns if nobody took it meanwhile.
        """
        if self.rank is None:
            return False
        rank = self.rank
        got = ride_out("claim", lambda: self.store.renew_rank(
            rank, self.holder, self.spec.heartbeat_ttl_s), 1)
        if got == 2:
            log.warning("worker %d: its claim had lapsed (Redis unreachable?); took it back", rank)
        return got != 0

    def end(self, *, finished: bool) -> None:
        """Gives the rank up; with `finished` it is recorded as done and never run again
        (`mark_finished`: with the clock its script stopped at, had it not called
        `ctx.finish()`)."""
        if self.rank is None:
            return
        rank, store, holder = self.rank, self.store, self.holder
        if not finished:
            ride_out("claim", lambda: store.end_rank(rank, holder, finished=False), None)
        elif not ride_out("finished", lambda: store.mark_finished(rank, holder), True):
            log.warning("worker %d: the script finished, but another worker holds the rank now "
                        "(this one's claim lapsed): the rank is its to finish", rank)
        self.rank = None


class GivenRank:
    """The rank --rank gives: nothing to claim or renew; an end with status 0 records it
    finished, as `RankClaim.end` does. Same interface as RankClaim for the supervisor."""

    def __init__(self, store: JobStore, spec: JobSpec, rank: int) -> None:
        self.store = store
        self.spec = spec
        self.rank: int | None = rank

    def renew(self) -> bool:
        return True

    def end(self, *, finished: bool) -> None:
        rank, store = self.rank, self.store
        if finished and rank is not None:
            ride_out("finished", lambda: store.mark_finished(rank), None)
        self.rank = None


class _Supervisor:
    """Runs the script as a child, forwarding signals and renewing the claim meanwhile."""

    def __init__(self, claim: RankClaim | GivenRank, args: list[str],
                 env: Mapping[str, str]) -> None:
        self.claim = claim
        self.args = args
        self.env = dict(env)
        self.child: subprocess.Popen[bytes] | None = None
        self.stopping = False
        self.lost = False

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True
        if self.child is not None and self.child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.child.pid, signum)

    def run_once(self) -> int:
        """Starts the script and waits for it, renewing the claim every heartbeat interval.
        Blocks until the script exits; returns its exit status as a shell reports it."""
        self.child = subprocess.Popen(
            self.args, env=self.env, stdin=subprocess.DEVNULL, start_new_session=True,
            # No other thread runs in this process, so a pre-exec hook cannot deadlock.
            preexec_fn=die_with_parent,  # noqa: PLW1509
        )
        interval_s = self.claim.spec.heartbeat_interval_s
        while True:
            try:
                code = self.child.wait(timeout=interval_s)
                break
            except subprocess.TimeoutExpired:
                pass
            if not self.lost and not self.claim.renew():
                self.lost = True
                log.error("worker %s: another worker took this rank while this one could not "
                          "reach Redis; stopping the script", self.claim.rank)
                self._stop_child()
        return shell_status(code)

    def _stop_child(self) -> None:
        child = self.child
        if child is None or child.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signal.SIGTERM)
        try:
            child.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signal.SIGKILL)


def run_worker(config: WorkerRunConfig, environ: Mapping[str, str] | None = None) -> int:
    """Claims a rank, runs the script until it ends, and records the outcome. Blocks.

    Returns the script's exit status (0 also when every rank had already finished, so there
    was nothing to run); raises CoordinationError when Redis, the job or a rank cannot be
    had in time.
    """
    store = JobStore.connect(config.redis, config.job)
    spec = wait_for_spec(store, config.spec_wait_s)
    claim: RankClaim | GivenRank
    if config.rank is not None:
        if config.rank >= spec.workers:
            raise ConfigError(f"--rank {config.rank} is outside job {spec.job!r}'s ranks "
                              f"0..{spec.workers - 1}")
        claim = GivenRank(store, spec, config.rank)
        rank: int | None = config.rank
    else:
        claim = RankClaim(store, spec)
        rank = claim.acquire(config.rank_wait_s)
    if rank is None:
        print(f"pstrain worker: every rank (0..{spec.workers - 1}) of job {spec.job!r} has "
              "finished; nothing to run", file=sys.stderr, flush=True)
        return 0
    log.info("worker: %s rank %d of %d in job %r",
             "claimed" if config.rank is None else "runs", rank, spec.workers, spec.job)
    env = {**(os.environ if environ is None else environ), "PSTRAIN_REDIS": config.redis,
           "PSTRAIN_JOB": config.job, "PSTRAIN_RANK": str(rank),
           "PSTRAIN_WORLD_SIZE": str(spec.workers)}
    if config.metrics_port:
        env["PSTRAIN_METRICS_PORT"] = str(config.metrics_port)
    supervisor = _Supervisor(claim, [sys.executable, config.script, *config.script_args], env)
    previous = {s: signal.signal(s, supervisor.on_signal)
                for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    code = 1
    try:
        for attempt in range(MAX_ROLLBACK_RESTARTS + 1):
            code = supervisor.run_once()
            if code != RESTART_EXIT_CODE or supervisor.stopping or supervisor.lost:
                break
            if rank in ride_out("claim", store.finished_ranks, set[int]()):
                # The script finished its training (ctx.finish()) before it exited: running
                # it again would train the rank twice.
                log.error("worker %d exited with %d after it finished training; not running "
                          "it again", rank, code)
                break
            log.warning("worker %d: the job rolled back; starting the script again (%d)", rank,
                        attempt + 1)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        supervisor._stop_child()
        done = code == 0 and not supervisor.lost
        claim.end(finished=done)
    if done:
        log.info("worker %d of job %r finished", rank, spec.job)
    return 1 if supervisor.lost and code == 0 else code
