"""`pstrain up`: a whole local cluster from one command.

Starts a private redis-server (unless --redis is given; with a password of its own), a
scheduler, the servers and the workers, each as its own process through the CLI, with
certificates and a secret made for the run (mutual TLS and the job token, unless --no-tls);
restarts crashed ones with --restart; shows a live view; returns the workers' exit status;
and on Ctrl-C or SIGTERM stops every process it started. Children get a parent-death signal,
so none outlives this process even if it is killed outright.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import enum
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from protos.security import Security
from scheduler.errors import ConfigError, CoordinationError
from scheduler.membership import describe_change
from scheduler.recovery import built_on_bad, chain_of
from scheduler.spec import RESTART_EXIT_CODE, STOPPED_EXIT_CODE, JobSpec
from scheduler.store import Event, JobStore, ride_out

log = logging.getLogger(__name__)

MAX_RESTARTS = 20


def check_script(script: str) -> None:
    """ConfigError unless `script` is a file (a path from this process's directory): found
    before anything starts."""
    if not os.path.isfile(script):
        raise ConfigError(f"training script {script!r} not found (relative to {os.getcwd()})")


@dataclass(frozen=True)
class UpConfig:
    script: str
    script_args: tuple[str, ...]
    spec: JobSpec
    redis: str = ""
    restart: bool = False
    resume: bool = False
    resume_from: str = ""  # a checkpoint id or a run id to start from
    # --servers was given: resuming a stopped job in a shared Redis takes that count.
    servers_given: bool = False
    view: bool = True
    log_dir: str = ""
    host: str = "127.0.0.1"
    start_timeout_s: float = 120.0
    metrics_base_port: int = 0
    tls: bool = True  # certificates and a job secret made for this run

    def __post_init__(self) -> None:
        check_script(self.script)


class State(enum.Enum):
    RUNNING = "running"
    EXITED = "exited"
    STOPPED = "stopped"


@dataclass
class Child:
    """A started process and how to start it again."""

    name: str
    role: str
    ident: int
    args: list[str]
    env: dict[str, str]
    log_path: Path
    popen: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    state: State = State.STOPPED
    exit_code: int | None = None


def _credentials(directory: Path, job: str, workers: int) -> dict[str, dict[str, str]]:
    """Makes the run's CA, role certificates (one per worker rank) and secret in `directory`;
    per role (server, admin, worker-R), the environment entries that hand them to its
    processes."""
    # Imported here: only a run with TLS pays for the cryptography package.
    from scheduler.certs import make_job_certs  # noqa: PLC0415

    try:
        certs = make_job_certs(directory, job, workers=workers)
    except ConfigError as exc:
        raise CoordinationError(f"cannot make the run's certificates: {exc}; or pass "
                                "--no-tls") from exc
    ca, secret = str(certs.ca()), str(certs.secret())
    made = {role: Security(str(certs.cert(role)), str(certs.key(role)), ca, secret).env()
            for role in ("server", "admin")}
    for rank in range(workers):
        made[f"worker-{rank}"] = Security(str(certs.rank_cert(rank)), str(certs.rank_key(rank)),
                                          ca, secret).env()
    return made


def shell_status(returncode: int) -> int:
    """A child's exit status as a shell reports it: 128 + N for one that signal N killed
    (Popen gives -N)."""
    return 128 - returncode if returncode < 0 else returncode


def die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it when its parent dies."""
    name = ctypes.util.find_library("c")
    if name:
        pr_set_pdeathsig = 1
        ctypes.CDLL(name).prctl(pr_set_pdeathsig, signal.SIGKILL)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class Cluster:
    """The processes of one `pstrain up`. Not thread-safe: one launcher thread drives it."""

    def __init__(self, config: UpConfig) -> None:
        self.config = config
        self.spec = config.spec
        self.tmp = Path(tempfile.mkdtemp(prefix=f"pstrain-{self.spec.job}-"))
        self.log_dir = Path(config.log_dir) if config.log_dir else self.tmp / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.children: list[Child] = []
        self.redis_url = config.redis
        self.redis_child: Child | None = None
        self.store: JobStore | None = None
        # Each role's credentials, as environment entries for its processes.
        self.credentials: dict[str, dict[str, str]] = {}
        self._stopping = False
        self._last_view = 0.0
        self._last_stop_check = 0.0

    # ---- starting --------------------------------------------------------------------------

    def _spawn(self, child: Child) -> None:
        with open(child.log_path, "ab") as out:
            child.popen = subprocess.Popen(
                child.args, env=child.env, stdout=out, stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL, start_new_session=True,
                # The launcher runs no other threads, so a pre-exec hook cannot deadlock.
                preexec_fn=die_with_parent,  # noqa: PLW1509
            )
        child.state = State.RUNNING
        child.exit_code = None
        log.debug("started %s (pid %d)", child.name, child.popen.pid)

    def _child(self, name: str, role: str, ident: int, args: list[str],
               env: dict[str, str] | None = None) -> Child:
        child = Child(name, role, ident, args, {**os.environ, "PYTHONUNBUFFERED": "1",
                                                **(env or {})},
                      self.log_dir / f"{name}.log")
        self.children.append(child)
        self._spawn(child)
        return child

    def start(self) -> None:
        """Starts Redis (if private), the scheduler, the servers and the workers. Blocks
        until each stage is up; CoordinationError naming the stage and its log otherwise."""
        if not self.redis_url:
            self._start_redis()
        self.store = JobStore.connect(self.redis_url, self.spec.job)
        # A new job refuses a live one of the same name; --resume adopts it (the same run
        # carries on, on --servers if given), --resume-from starts a new run from the
        # checkpoint it names. A checkpoint of another count is resharded by the servers.
        given = {"servers": self.spec.servers} if self.config.servers_given else None
        self.spec = self.store.create_job(self.spec, adopt=self.config.resume, given=given,
                                          resumed_from=self.config.resume_from)
        how = (f", resuming from {self.config.resume_from}" if self.config.resume_from else
               ", resuming from the newest checkpoint" if self.config.resume else "")
        print(f"pstrain up: job {self.spec.job!r} run {self.spec.run_id}{how}", flush=True)
        if self.config.tls:
            self.credentials = _credentials(self.tmp / "certs", self.spec.job,
                                            self.spec.workers)
        py = sys.executable
        spec = self.spec
        # The Redis URL travels in the environment: it may hold a password, and a command
        # line is readable by every user of the host.
        redis = {"PSTRAIN_REDIS": self.redis_url}
        self._child("scheduler", "scheduler", 0, [
            py, "-m", "scheduler.cli", "scheduler", "--job", spec.job, *self._spec_flags(),
            "--adopt",
        ], {**redis, **self.credentials.get("admin", {})})
        self._await(lambda: self.store is not None and self.store.leader() is not None,
                    "the scheduler to lead", "scheduler")
        for k in range(spec.servers):
            args = [py, "-m", "ps", "--job", spec.job, "--shard", str(k), "--bind",
                    f"{self.config.host}:0"]
            if self.config.resume:
                args += ["--restore", "latest"]
            if self.config.resume_from:
                args += ["--resume-from", self.config.resume_from]
            if self.config.metrics_base_port:
                args += ["--metrics-port", str(self.config.metrics_base_port + k)]
            self._child(f"server{k}", "server", k, args,
                        {**redis, **self.credentials.get("server", {})})
        self._await(self._servers_up, f"all {spec.servers} servers to register", "server0")
        env = {"PSTRAIN_REDIS": self.redis_url, "PSTRAIN_JOB": spec.job,
               "PSTRAIN_WORLD_SIZE": str(spec.workers)}
        for r in range(spec.workers):
            metrics = ({"PSTRAIN_METRICS_PORT": str(self.config.metrics_base_port
                                                     + spec.servers + r)}
                       if self.config.metrics_base_port else {})
            self._child(f"worker{r}", "worker", r,
                        [py, self.config.script, *self.config.script_args],
                        {**env, "PSTRAIN_RANK": str(r), **metrics,
                         **self.credentials.get(f"worker-{r}", {})})

    def _spec_flags(self) -> list[str]:
        s = self.spec
        return ["--mode", s.mode, "--staleness", str(s.staleness), "--servers", str(s.servers),
                "--workers", str(s.workers), "--backups", str(s.backups),
                "--heartbeat-interval-s", str(s.heartbeat_interval_s),
                "--heartbeat-misses", str(s.heartbeat_misses),
                "--suspect-timeout-s", str(s.suspect_timeout_s),
                "--checkpoint-dir", s.checkpoint_dir,
                "--checkpoint-every-s", str(s.checkpoint_every_s),
                "--checkpoint-every-clocks", str(s.checkpoint_every_clocks),
                "--checkpoint-full-every", str(s.checkpoint_full_every),
                "--checkpoint-keep", str(s.checkpoint_keep),
                "--checkpoint-write-mb-s", str(s.checkpoint_write_mb_s)]

    def _start_redis(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise CoordinationError(
                "redis-server is not installed: run `apt-get install redis-server` (or "
                "bash scripts/setup.sh), or pass --redis URL of a running Redis"
            )
        # A password, so that other users of this host cannot reach the job's state; it lies
        # in a file only this user reads, not on a command line.
        password = secrets.token_hex(16)
        conf = self.tmp / "redis.conf"
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"requirepass {password}\n")
        for _ in range(5):
            port = free_port(self.config.host)
            child = self._child("redis", "redis", 0, [
                binary, str(conf), "--port", str(port), "--bind", self.config.host, "--save",
                "", "--appendonly", "no", "--dir", str(self.tmp), "--protected-mode", "no",
            ])
            self.redis_url = f"redis://:{password}@{self.config.host}:{port}/0"
            try:
                JobStore.connect(self.redis_url, self.spec.job, timeout_s=5)
            except CoordinationError:
                self._terminate(child)
                self.children.remove(child)
                continue
            self.redis_child = child
            return
        raise CoordinationError(f"could not start redis-server; see {self.log_dir}")

    def _servers_up(self) -> bool:
        if self.store is None:
            return False
        beats = self.store.heartbeats("server", list(range(self.spec.servers)))
        return all(b is not None for b in beats.values())

    def _await(self, ready: Callable[[], bool], what: str, name: str) -> None:
        deadline = time.monotonic() + self.config.start_timeout_s
        while not ride_out("start", ready, False):
            for child in self.children:
                if child.popen is not None and child.popen.poll() is not None:
                    raise CoordinationError(
                        f"{child.name} exited with {child.popen.returncode} while waiting for "
                        f"{what}:\n{_tail(child.log_path)}"
                    )
            if time.monotonic() > deadline or self._stopping:
                raise CoordinationError(f"timed out waiting for {what}; see {self.log_dir}")
            time.sleep(0.05)

    # ---- running ---------------------------------------------------------------------------

    def run(self) -> int:
        """Supervises until every worker has finished; returns their exit status."""
        while not self._stopping:
            self._check_stopped()
            self._reap()
            workers = [c for c in self.children if c.role == "worker"]
            if all(c.state is State.EXITED for c in workers):
                failed = [c for c in workers if c.exit_code]
                return failed[0].exit_code or 1 if failed else 0
            if self.config.view:
                self._view()
            time.sleep(0.1)
        return 130

    def _check_stopped(self, now: bool = False) -> None:
        """_Stopped when the job's scheduler stopped the job (no checkpoint verifies);
        asks Redis twice a second (or `now`)."""
        store = self.store
        if store is None or (not now and time.monotonic() - self._last_stop_check < 0.5):
            return
        self._last_stop_check = time.monotonic()
        reason = ride_out("stopped", store.stopped, None)
        if reason is not None:
            raise _Stopped(reason)

    def _reap(self) -> None:
        for child in self.children:
            if child.state is not State.RUNNING or child.popen is None:
                continue
            code = child.popen.poll()
            if code is None:
                continue
            child.state, child.exit_code = State.EXITED, code
            if code == STOPPED_EXIT_CODE:
                self._check_stopped(now=True)
            if child.role == "worker" and code == 0:
                log.info("%s finished", child.name)
                # A script that returned without ctx.finish(): its rank is done all the same,
                # and the scheduler records the end of its heartbeat as a finish.
                self._mark_finished(child.ident)
                continue
            if child.role == "worker" and child.ident in self._finished_ranks():
                # Its training is done (ctx.finish()): running the script again would train
                # the rank twice. The job goes on; `up` returns this status at the end.
                log.error("%s exited with status %d after it finished training; a finished "
                          "rank is not restarted; see %s", child.name, code, child.log_path)
                continue
            again = code == RESTART_EXIT_CODE or self.config.restart
            if again and child.restarts < MAX_RESTARTS:
                child.restarts += 1
                log.warning("%s exited with %d; restarting it (restart %d)", child.name, code,
                            child.restarts)
                self._spawn(child)
            elif child.role == "worker":
                log.error("%s failed with exit status %d; see %s", child.name, code,
                          child.log_path)
                raise _Failed(code, child)
            else:
                raise _Failed(code, child)

    def _finished_ranks(self) -> set[int]:
        """The ranks Redis records as finished (none while Redis is unreachable)."""
        store = self.store
        return set() if store is None else ride_out("finished", store.finished_ranks, set())

    def _mark_finished(self, rank: int) -> None:
        store = self.store
        if store is not None:
            ride_out("finished", lambda: store.mark_finished(rank), None)

    def _view(self) -> None:
        now = time.monotonic()
        interactive = sys.stdout.isatty()
        if now - self._last_view < (1.0 if interactive else 10.0) or self.store is None:
            return
        self._last_view = now
        lines = render_view(self.store, self.spec, self.children)
        if interactive:
            sys.stdout.write("\x1b[H\x1b[2J" + "\n".join(lines) + "\n")
        else:
            sys.stdout.write("\n".join(lines) + "\n")
        sys.stdout.flush()

    # ---- stopping --------------------------------------------------------------------------

    def request_stop(self) -> None:
        self._stopping = True

    def stop(self, keep_logs: bool = False) -> None:
        """Stops every process started here, workers first: SIGTERM, then SIGKILL; then
        removes this run's temporary directory. Without --log-dir, `keep_logs` (a failed
        run) keeps the logs there, and says where, so the messages that point at them hold."""
        order = {"worker": 0, "server": 1, "scheduler": 2, "redis": 3}
        for child in sorted(self.children, key=lambda c: order.get(c.role, 9)):
            self._terminate(child)
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.redis.close()
        if keep_logs and not self.config.log_dir:
            for entry in self.tmp.iterdir():
                if entry == self.log_dir:
                    continue
                if entry.is_dir():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
            print(f"pstrain up: the processes' logs are kept in {self.log_dir}",
                  file=sys.stderr)
        else:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _terminate(self, child: Child) -> None:
        popen = child.popen
        if popen is None or popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(popen.pid, signal.SIGTERM)
        try:
            popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)
            popen.wait(timeout=10)
        child.state = State.STOPPED


class _Stopped(Exception):
    """The job's scheduler stopped the job: recovery found no checkpoint that verifies."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class _Failed(Exception):
    """A child ended badly: `code` is its exit status, or -N when signal N killed it."""

    def __init__(self, code: int, child: Child) -> None:
        how = (f"was killed by {signal.Signals(-code).name}" if code < 0
               else f"exited with status {code}")
        super().__init__(f"{child.name} {how}")
        self.code = shell_status(code)
        self.child = child


# How many of the newest events the live view reads for checkpoint failures.
VIEW_EVENTS = 200


def render_view(store: JobStore, spec: JobSpec, children: list[Child]) -> list[str]:
    """The live view: one line per worker and per server."""
    pids = {(c.role, c.ident): c for c in children}
    none: dict[int, dict[str, Any] | None] = {}
    workers = ride_out("view", lambda: store.heartbeats("worker", list(range(spec.workers))),
                       none)
    servers = ride_out("view", lambda: store.heartbeats("server", list(range(spec.servers))),
                       none)
    lines = [f"pstrain job {spec.job!r}: {spec.mode}, {spec.servers} servers, "
             f"{spec.workers} workers ({spec.backups} backups)   {time.strftime('%H:%M:%S')}",
             f"{'worker':<8}{'clock':>8}{'samples/s':>11}{'loss':>10}  state"]
    for r in range(spec.workers):
        beat = workers.get(r) or {}
        child = pids.get(("worker", r))
        state = child.state.value if child else "-"
        if child and child.restarts:
            state += f" ({child.restarts} restarts)"
        loss = beat.get("loss")
        lines.append(f"{r:<8}{beat.get('clock', '-'):>8}{beat.get('samples_per_s', 0.0):>11.0f}"
                     f"{'-' if loss is None else f'{loss:.4f}':>10}  "
                     f"{state if beat else state + ', no heartbeat'}")
    lines.append(f"{'server':<8}{'rows':>12}{'MiB':>9}{'pushes':>10}{'dropped':>9}  address")
    for k in range(spec.servers):
        beat = servers.get(k) or {}
        lines.append(f"{k:<8}{beat.get('rows', 0):>12}{beat.get('bytes', 0) / 2**20:>9.1f}"
                     f"{beat.get('pushes', 0):>10}{beat.get('dropped', 0):>9}  "
                     f"{beat.get('address', 'no heartbeat')}")
    recent: list[Event] = ride_out("view", lambda: store.recent_events(VIEW_EVENTS), [])
    lines += [f"checkpoint {e.detail.get('checkpoint')} failed on server {e.member}: "
              f"{e.detail.get('error')}" for e in failing_checkpoints(recent)]
    return lines


def failing_checkpoints(events: list[Event]) -> list[Event]:
    """Per server, its newest checkpoint_failed event not followed by a checkpoint it wrote
    (`events` oldest first). Pure."""
    newest: dict[str, Event] = {}
    for e in events:
        if e.role != "server":
            continue
        if e.type == "checkpoint_failed":
            newest[e.member] = e
        elif e.type == "checkpoint":
            newest.pop(e.member, None)
    return [newest[m] for m in sorted(newest)]


def _last_json(path: Path) -> str | None:
    """A worker's result: the last line of its log, if that line is a JSON object."""
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except FileNotFoundError:
        return None
    if lines and lines[-1].startswith("{"):
        try:
            json.loads(lines[-1])
        except ValueError:
            return None
        return lines[-1]
    return None


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def up(config: UpConfig) -> int:
    """Runs the cluster to completion. Blocks; returns the exit status for the shell."""
    cluster = Cluster(config)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        cluster.request_stop()
        raise KeyboardInterrupt

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    keep_logs = True  # unless the run ends well, or by the user's interrupt
    try:
        cluster.start()
        code = cluster.run()
        keep_logs = code != 0
        for child in cluster.children:
            if child.role == "worker":
                result = _last_json(child.log_path)
                if result is not None:
                    print(f"worker {child.ident}: {result}", flush=True)
        report: dict[str, Any] = {}
        store = cluster.store
        if store is not None:
            report = ride_out("report", lambda: membership_report(store, cluster.spec), {})
            none: dict[str, Any] = {}
            report.update(ride_out("report", lambda: checkpoint_report(store, cluster.spec),
                                   none))
        changes = report.get("membership_changes")
        if changes and cluster.spec.mode == "sync":
            print("pstrain up: the workers of this sync job changed ("
                  + ", ".join(describe_change(c) for c in changes)
                  + f"; {report.get('pushes_dropped', 0)} gradients dropped): its result is "
                  "not the single-process one", file=sys.stderr, flush=True)
        failure = report.get("last_checkpoint_error")
        if failure:
            print(f"pstrain up: {report['checkpoints_failed']} checkpoint write(s) failed; the "
                  f"last, {failure['checkpoint']} on server {failure['shard']}: "
                  f"{failure['error']} (the newest complete checkpoint: "
                  f"{report.get('latest_checkpoint') or 'none'})", file=sys.stderr, flush=True)
        summary = {"job": config.spec.job, "exit_status": code,
                   "restarts": {c.name: c.restarts for c in cluster.children if c.restarts},
                   **report}
        print(json.dumps(summary), flush=True)
        return code
    except KeyboardInterrupt:
        keep_logs = False
        print("pstrain up: interrupted; stopping every process it started", file=sys.stderr)
        return 130
    except _Stopped as stopped:
        print(f"pstrain up: job {config.spec.job!r} stopped: {stopped.reason}", file=sys.stderr,
              flush=True)
        print(json.dumps({"job": config.spec.job, "exit_status": STOPPED_EXIT_CODE,
                          "stopped": stopped.reason}), flush=True)
        return STOPPED_EXIT_CODE
    except _Failed as failed:
        print(f"pstrain up: {failed}; last lines of {failed.child.log_path}:\n"
              f"{_tail(failed.child.log_path)}", file=sys.stderr)
        return failed.code or 1
    finally:
        # Stopping is bounded (SIGTERM, then SIGKILL after 10 s a process): a second Ctrl-C
        # while it runs is noted, not raised through it.
        for s in previous:
            signal.signal(s, _still_stopping)
        cluster.stop(keep_logs=keep_logs)
        for s, handler in previous.items():
            signal.signal(s, handler)


def _still_stopping(signum: int, frame: FrameType | None) -> None:
    print("pstrain up: still stopping the processes it started", file=sys.stderr)


def membership_report(store: JobStore, spec: JobSpec) -> dict[str, Any]:
    """What tells a user whether a job's result is still the single-process one: the changes
    of its workers (each {time, clock, worker, change: "dead" or "joined", incarnation}), the
    gradients the servers dropped (late, or past a sync quorum), and how often each process
    was suspect (paused or starved, never declared dead)."""
    servers = store.heartbeats("server", list(range(spec.servers)))
    return {
        "membership_changes": store.membership_changes(),
        "pushes_dropped": sum(int(b.get("dropped", 0)) for b in servers.values() if b),
        "suspicions": store.suspicion_counts(),
    }


# Events read at a time by the report at the end of a run.
REPORT_PAGE = 1000


def checkpoint_report(store: JobStore, spec: JobSpec) -> dict[str, Any]:
    """How a job's checkpoints went in this run: the newest complete one, and the writes that
    failed ({checkpoint, shard, error} of the newest), from the job's events since the run
    started. Empty for a job without a checkpoint directory."""
    if not spec.checkpoint_dir:
        return {}
    run = store.run() or {}
    since = float(run.get("started") or 0.0)
    failed: list[Event] = []
    after = "-"
    while True:
        page = store.events(after, count=REPORT_PAGE)
        failed += [e for e in page if e.type == "checkpoint_failed" and e.time_s >= since]
        if len(page) < REPORT_PAGE:
            break
        after = page[-1].id
    latest = store.latest_checkpoint(spec.servers)
    last = failed[-1] if failed else None
    return {"latest_checkpoint": None if latest is None else latest[0],
            "checkpoints_failed": len(failed),
            "last_checkpoint_error": None if last is None else {
                "checkpoint": last.detail.get("checkpoint"), "shard": last.member,
                "error": last.detail.get("error")}}


def status_of(store: JobStore, events: int = 20) -> dict[str, Any]:
    """The job as `pstrain status` shows it."""
    spec = store.spec()
    now = time.time()
    out: dict[str, Any] = {"job": store.keys.job, "spec": None if spec is None else
                           json.loads(spec.to_json()), "leader": store.leader(), "processes": []}
    suspects = store.suspects()
    for role in ("server", "worker"):
        members = store.members(role)
        ids = sorted(set(members) | set(range(spec.servers if role == "server" else
                                               spec.workers) if spec else set()))
        beats = store.heartbeats(role, ids)
        for ident in ids:
            info = {**members.get(ident, {}), **(beats.get(ident) or {})}
            out["processes"].append({
                "role": role, "id": ident, "pid": info.get("pid"), "host": info.get("host"),
                "address": info.get("address"), "incarnation": info.get("incarnation"),
                "heartbeat_age_s": None if beats.get(ident) is None else
                round(now - float(info.get("time", now)), 3),
                "clock": info.get("clock", info.get("open_clock")),
                "alive": beats.get(ident) is not None,
                # Its heartbeat lapsed but it was not seen to exit: it keeps its place.
                "suspect": (role, ident) in suspects,
                **({"tables": info.get("table_stats") or {}, "restored":
                    info.get("restored") or "", "resharded_from": info.get("resharded_from")}
                   if role == "server" else {}),
            })
    out["events"] = [{**e.detail, "id": e.id, "time": e.time_s, "type": e.type,
                      "role": e.role, "member": e.member} for e in store.recent_events(events)]
    out["finished_ranks"] = sorted(store.finished_ranks())
    if spec is not None:
        out.update(membership_report(store, spec))
    out["run"] = store.run() or ({"id": spec.run_id} if spec and spec.run_id else None)
    out["bad_checkpoints"] = store.bad_checkpoints()
    out["stopped"] = store.stopped()
    bad = {c: str(v.get("reason", "")) for c, v in out["bad_checkpoints"].items()}
    latest = next((c for c in store.complete(spec.servers) if c[0] not in bad
                   and not built_on_bad(bad, {c[0]: chain_of(c[1])})), None) if spec else None
    out["latest_checkpoint"] = None if latest is None else {"id": latest[0],
                                                            "shards": latest[1]}
    return out
