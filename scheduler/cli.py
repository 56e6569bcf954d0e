"""The `pstrain` command line. This is the one place it reads environment variables.

Roles run as their own processes: `pstrain server` replaces itself with `python -m ps`
(`pstrain export` with `python -m ps.export`, `pstrain plan` with `python -m ps.plan`);
`pstrain worker` (claiming a rank in Redis, or given one with --rank) runs the script as its
child (scheduler/runner.py). So the CLI never
imports the server or the worker (DESIGN.md: the launcher starts roles through the CLI).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from protos import modes, security
from protos.transport import ENV_VAR as ENV_TRANSPORT
from protos.transport import PREFERENCE, TransportError, parse_choice
from scheduler.admin import check_address, health, take_checkpoint
from scheduler.entry import exec_server_side
from scheduler.errors import ConfigError, CoordinationError
from scheduler.launcher import UpConfig, status_of, up
from scheduler.membership import describe_change
from scheduler.runner import WorkerRunConfig, run_worker
from scheduler.scheduler import Scheduler
from scheduler.spec import JobSpec, at_least, at_least_float
from scheduler.store import JobStore

ENV_REDIS = "PSTRAIN_REDIS"
ENV_JOB = "PSTRAIN_JOB"


def _spec_flags(p: argparse.ArgumentParser, defaults: bool) -> None:
    """Flags that make up a JobSpec. Without defaults, unset flags stay None (adopt)."""
    d = JobSpec("x") if defaults else None
    p.add_argument("--mode", type=_mode, default=d and d.mode, metavar="MODE",
                   help="consistency mode of the job's tables: sync, ssp, ssp:S or async "
                        "(default async)")
    # No default here: "--mode ssp:S" may give the bound, and JobSpec's default is 0.
    p.add_argument("--staleness", type=int, default=None,
                   help="ssp staleness bound (default 0)")
    # No default here either: `up --resume` tells a count it was given (the job is resumed
    # on that many servers, resharded) from none (it keeps the job's); JobSpec's is 1.
    p.add_argument("--servers", type=int, default=None,
                   help="parameter servers (shards) (default 1; with up --resume, the job's: "
                        "another count restores the checkpoint resharded)")
    p.add_argument("--workers", type=int, default=d and d.workers,
                   help="workers, backups included (default 1)")
    p.add_argument("--backups", type=int, default=d and d.backups,
                   help="sync backup workers: clocks close with the first workers - backups")
    p.add_argument("--heartbeat-interval-s", type=float, default=d and d.heartbeat_interval_s,
                   help="seconds between heartbeats (default 0.5)")
    p.add_argument("--heartbeat-misses", type=int, default=d and d.heartbeat_misses,
                   help="missed heartbeats after which a process is suspect (default 3)")
    p.add_argument("--suspect-timeout-s", type=float, default=d and d.suspect_timeout_s,
                   help="how long a suspect process (its heartbeat lapsed, not seen to exit) "
                        "keeps its place before it is declared dead; a sync job waits for it "
                        "that long (default 10; 0: dead when the heartbeat lapses)")
    p.add_argument("--checkpoint-dir", default=d and d.checkpoint_dir,
                   help="directory for checkpoints (default: none written)")
    p.add_argument("--checkpoint-every-s", type=float, default=d and d.checkpoint_every_s,
                   help="async/ssp: seconds between checkpoints (0: off)")
    p.add_argument("--checkpoint-every-clocks", type=int,
                   default=d and d.checkpoint_every_clocks,
                   help="sync: clocks between checkpoints (0: off)")
    p.add_argument("--checkpoint-full-every", type=at_least(1, "1: every checkpoint full"),
                   default=d and d.checkpoint_full_every, metavar="N",
                   help="a full checkpoint every N checkpoints, the others deltas of the one "
                        "before (default 10; 1: every checkpoint full)")
    p.add_argument("--checkpoint-keep", type=at_least(0, "0: keep every checkpoint"),
                   default=None if d is None else d.checkpoint_keep, metavar="K",
                   help="keep the K newest full checkpoints and the deltas after them; older "
                        "ones of the run are removed (default 3; 0: keep all)")
    p.add_argument("--checkpoint-write-mb-s", type=at_least_float(0.0, "0: no limit"),
                   default=None if d is None else d.checkpoint_write_mb_s, metavar="R",
                   help="each server writes a checkpoint at most R MB/s, so that the write "
                        "leaves training its CPU (default 64; 0: no limit)")


_SPEC_FIELDS = ("mode", "staleness", "servers", "workers", "backups", "heartbeat_interval_s",
                "heartbeat_misses", "suspect_timeout_s", "checkpoint_dir", "checkpoint_every_s",
                "checkpoint_every_clocks", "checkpoint_full_every", "checkpoint_keep",
                "checkpoint_write_mb_s")


def _mode(text: str) -> modes.Mode:
    try:
        return modes.parse(text)
    except modes.ModeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _given(a: argparse.Namespace) -> dict[str, Any]:
    """The JobSpec fields the flags set. A job keeps the ssp bound apart from the mode, so
    "--mode ssp:S" sets mode "ssp" and staleness S."""
    given = {f: getattr(a, f) for f in _SPEC_FIELDS if getattr(a, f) is not None}
    mode = given.get("mode")
    if isinstance(mode, modes.Mode):
        given["mode"] = mode.kind.value
        if mode.staleness is not None and (
            given.setdefault("staleness", mode.staleness) != mode.staleness
        ):
            raise ConfigError(
                f"--mode {mode} and --staleness {given['staleness']} disagree; give the "
                "bound once"
            )
    return given


def _spec(job: str, a: argparse.Namespace) -> JobSpec:
    return JobSpec(job, **_given(a))


def _redis_flags(p: argparse.ArgumentParser, job_required: bool = True) -> None:
    p.add_argument("--redis", default=os.environ.get(ENV_REDIS, ""),
                   help=f"Redis URL: redis://[user:password@]host:port/db or rediss:// for TLS "
                        f"(env {ENV_REDIS})")
    p.add_argument("--job", default=os.environ.get(ENV_JOB, "" if job_required else "local"),
                   help=f"job name (env {ENV_JOB})")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pstrain", description="pstrain: a parameter-server training system for PyTorch."
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    sub.add_parser("server", help="run one parameter-server shard (see pstrain server --help)",
                   add_help=False)
    sub.add_parser("export", help="turn a checkpoint into a model served without servers "
                                  "(see pstrain export --help)", add_help=False)
    sub.add_parser("plan", help="memory per server of sparse tables, before a job (see "
                                "pstrain plan --help)", add_help=False)

    w = sub.add_parser("worker", help="run a training script as a worker of a job")
    _redis_flags(w)
    w.add_argument("--rank", type=int,
                   help="this worker's rank (default: claim the lowest free one in Redis)")
    w.add_argument("--metrics-port", type=int, default=0,
                   help="serve the worker's Prometheus metrics on this port (0: off)")
    _transport_flag(w)
    w.add_argument("--spec-wait-s", type=float, default=60.0,
                   help="without --rank: how long to wait for the job's scheduler to create "
                        "the job (default 60)")
    w.add_argument("--rank-wait-s", type=float, default=0.0,
                   help="without --rank: how long to wait as a spare while every unfinished "
                        "rank is held by a live worker (default 0: no limit)")
    w.add_argument("script", help="the training script (it calls worker.init())")
    w.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")

    s = sub.add_parser("scheduler", help="run a job's scheduler (leader or standby)")
    _redis_flags(s)
    _spec_flags(s, defaults=False)
    s.add_argument("--adopt", action="store_true",
                   help="adopt the job if it exists (a standby, or a restarted scheduler); "
                        "without it a live job of that name is refused")
    s.add_argument("--poll-s", type=float, default=0.1, help="heartbeat polling period")
    s.add_argument("--lease-s", type=float, default=2.0, help="leader lease")
    security.add_flags(s, os.environ, "the scheduler's certificate (its common name: admin)")

    u = sub.add_parser("up", help="run a whole local cluster and a training script on it")
    _redis_flags(u, job_required=False)
    _spec_flags(u, defaults=True)
    u.add_argument("--restart", action="store_true", help="restart crashed processes")
    u.add_argument("--resume", action="store_true",
                   help="carry on from the job's newest complete checkpoint that verifies "
                        "(of its newest run)")
    u.add_argument("--resume-from", default="", metavar="ID",
                   help="start a new run from checkpoint ID, or from the newest checkpoint of "
                        "run ID (an unknown ID is refused, naming it)")
    u.add_argument("--no-view", action="store_true", help="no live view")
    u.add_argument("--no-tls", action="store_true",
                   help="no certificates or job secret: every process talks in the clear "
                        "(default: mutual TLS and a job token, made for the run)")
    u.add_argument("--log-dir", default="", help="keep each process's log here")
    u.add_argument("--metrics-base-port", type=int, default=0,
                   help="serve Prometheus metrics: server K on this port + K, worker R on "
                        "this port + servers + R (0: off)")
    _transport_flag(u)
    u.add_argument("script", help="the training script, run by every worker")
    u.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script (after --)")

    st = sub.add_parser("status", help="show a job: spec, processes, events, checkpoint")
    _redis_flags(st)
    st.add_argument("--json", action="store_true", help="print JSON")

    c = sub.add_parser("checkpoint", help="ask a job's servers for a checkpoint now")
    _redis_flags(c)
    c.add_argument("--wait-s", type=float, default=120.0, help="how long to wait for it")
    c.add_argument("--full", action="store_true",
                   help="a full checkpoint, not a delta of the one before")

    h = sub.add_parser("health", help="ask a server's gRPC health service; exit 0 if SERVING")
    h.add_argument("address", help="the server's HOST:PORT")
    h.add_argument("--service", default="",
                   help="service name to ask about (default '': the server as a whole)")
    h.add_argument("--timeout-s", type=float, default=2.0, help="how long to wait (default 2)")
    security.add_flags(h, os.environ, "a certificate of the job (any role)")
    ce = sub.add_parser("certs", help="make a job's CA, a certificate for each role, and its "
                                      "secret, for mutual TLS between roles")
    ce.add_argument("--out", required=True, help="directory to write them to (made 0700)")
    ce.add_argument("--job", default=os.environ.get(ENV_JOB, ""),
                    help=f"job name, written into every certificate (env {ENV_JOB})")
    # The default is spelled out rather than imported: scheduler.certs loads `cryptography`,
    # which the other commands need not pay for at start-up.
    ce.add_argument("--host", action="append", default=None, metavar="HOST",
                    help="a DNS name or IP address clients dial to reach the servers, for the "
                         "server certificate; repeat for each (default: localhost, 127.0.0.1 "
                         "and ::1)")
    ce.add_argument("--days", type=int, default=365,
                    help="days the certificates stay valid (default 365)")
    ce.add_argument("--force", action="store_true",
                    help="replace the files of an earlier run (every role then needs new ones)")
    ce.add_argument("--workers", type=int, default=0,
                    help="also make worker-R.pem/.key for ranks 0..N-1: a worker holding one "
                         "may act as rank R only (worker.pem may act as any rank)")
    ce.add_argument("--keep", action="store_true",
                    help="leave a directory that already holds every file as it is (for a "
                         "service that may run again)")
    return p


def _transport_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--transport", default=os.environ.get(ENV_TRANSPORT, "auto"),
                   help="bulk transport: auto (the fastest each worker and server share), "
                        f"or one of {', '.join(PREFERENCE)}; a forced one that cannot work is an "
                        f"error (env {ENV_TRANSPORT}, default auto)")


def _transport_env(a: argparse.Namespace) -> dict[str, str]:
    """The environment entry that hands --transport to the processes started from here."""
    try:
        choice = parse_choice(a.transport)
    except TransportError as exc:
        raise CoordinationError(f"--transport: {exc}") from exc
    return {ENV_TRANSPORT: choice.name}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    parser = _parser()
    if not args:
        parser.print_help()
        return 2
    exec_server_side(args)  # `python -m scheduler.cli server ...` too
    a = parser.parse_args(args)
    logging.basicConfig(level=os.environ.get("PSTRAIN_LOG_LEVEL", "INFO").upper(),
                        format=f"%(asctime)s %(levelname)s {a.command} %(name)s: %(message)s")
    try:
        return _run(a)
    except CoordinationError as exc:
        print(f"pstrain {a.command}: {exc}", file=sys.stderr)
        return 2


def _need_redis(a: argparse.Namespace) -> None:
    if not a.redis:
        raise CoordinationError(f"--redis URL (or {ENV_REDIS}) is required")
    if not a.job:
        raise CoordinationError(f"--job NAME (or {ENV_JOB}) is required")


def _run(a: argparse.Namespace) -> int:
    if a.command == "certs":
        return _certs(a)
    if a.command == "worker":
        _need_redis(a)
        script_args = a.args[1:] if a.args[:1] == ["--"] else a.args
        # The script (started here or by the worker runner) finds the transport here.
        os.environ.update(_transport_env(a))
        # With or without --rank the script runs as a child of the worker runner, which
        # records a script that returns as finished and starts it again after a rollback.
        return run_worker(WorkerRunConfig(
            redis=a.redis, job=a.job, script=a.script, script_args=tuple(script_args),
            metrics_port=a.metrics_port, spec_wait_s=a.spec_wait_s,
            rank_wait_s=a.rank_wait_s, rank=a.rank,
        ))
    if a.command == "health":
        return _health(a.address, a.service, a.timeout_s, _security(a))
    if a.command == "scheduler":
        return _scheduler(a)
    if a.command == "up":
        script_args = a.args[1:] if a.args[:1] == ["--"] else a.args
        # Servers and workers started by `up` inherit this process's environment.
        os.environ.update(_transport_env(a))
        if a.resume and a.resume_from:
            raise ConfigError("give --resume or --resume-from ID, not both")
        return up(UpConfig(
            script=a.script, script_args=tuple(script_args), spec=_spec(a.job, a),
            servers_given=a.servers is not None,
            redis=a.redis, restart=a.restart, resume=a.resume, resume_from=a.resume_from,
            view=not a.no_view,
            log_dir=a.log_dir, metrics_base_port=a.metrics_base_port, tls=not a.no_tls,
        ))
    if a.command == "status":
        _need_redis(a)
        return _status(JobStore.connect(a.redis, a.job), a.json)
    if a.command == "checkpoint":
        _need_redis(a)
        return _checkpoint(JobStore.connect(a.redis, a.job), a.wait_s, a.full)
    raise CoordinationError(f"unknown command {a.command!r}")


def _security(a: argparse.Namespace) -> security.Security:
    try:
        return security.from_flags(a)
    except security.SecurityError as exc:
        raise ConfigError(str(exc)) from exc


def _health(address: str, service: str, timeout_s: float,
            credentials: security.Security) -> int:
    if timeout_s <= 0:
        raise ConfigError(f"--timeout-s must be > 0, got {timeout_s:g}")
    status = health(check_address(address), service, timeout_s, credentials)
    print(f"{address}: {status}")
    return 0 if status == "SERVING" else 1


def _scheduler(a: argparse.Namespace) -> int:
    _need_redis(a)
    store = JobStore.connect(a.redis, a.job)
    spec = store.create_job(_spec(a.job, a), adopt=a.adopt, given=_given(a))
    scheduler = Scheduler(store, spec, poll_s=a.poll_s, lease_s=a.lease_s,
                          security=_security(a))
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    scheduler.run(stop)
    return 0


def _mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.1f} MiB"


def _status(store: JobStore, as_json: bool) -> int:
    status = status_of(store)
    if status["spec"] is None:
        print(f"pstrain status: no job {store.keys.job!r} in this Redis", file=sys.stderr)
        return 1
    if as_json:
        print(json.dumps(status, indent=2))
        return 0
    spec = status["spec"]
    print(f"job {status['job']}: {spec['mode']}, {spec['servers']} servers, {spec['workers']} "
          f"workers ({spec['backups']} backups), leader {status['leader'] or 'none'}")
    run = status.get("run") or {}
    if run:
        print(f"run {run.get('id') or '-'}"
              + (f", resumed from {run['resumed_from']}" if run.get("resumed_from") else "")
              + (f" (previous run {run['previous']})" if run.get("previous") else ""))
    if status.get("stopped"):
        print(f"STOPPED: {status['stopped']}")
    print(f"{'role':<8}{'id':>3} {'pid':>8} {'host':<14}{'address':<22}{'incarnation':>18}"
          f"{'hb age':>8}{'clock':>7}")
    for p in status["processes"]:
        age = "-" if p["heartbeat_age_s"] is None else f"{p['heartbeat_age_s']:.1f}s"
        print(f"{p['role']:<8}{p['id']:>3} {p['pid'] or '-':>8} {p['host'] or '-'!s:<14}"
              f"{p['address'] or '-'!s:<22}{p['incarnation'] or '-':>18}{age:>8}"
              f"{p['clock'] if p['clock'] is not None else '-':>7}")
    restored: dict[str, list[str]] = {}
    for p in status["processes"]:
        if p["role"] == "server" and p.get("restored"):
            source = p.get("resharded_from") or {}
            what = p["restored"] + (f" (resharded from {source.get('checkpoint')} of "
                                    f"{source.get('servers')} servers)" if source else "")
            restored.setdefault(what, []).append(str(p["id"]))
    for what, servers in restored.items():
        print(f"server {', '.join(servers)} restored {what}")
    tables = [(p["id"], name, t) for p in status["processes"] if p["role"] == "server"
              for name, t in sorted((p.get("tables") or {}).items())]
    if tables:
        print(f"sparse tables:\n{'server':>8} {'table':<16}{'rows':>12}{'memory':>11}"
              f"{'admitted':>11}{'refused':>11}{'evicted':>11}{'readmitted':>11}")
        for server, name, t in tables:
            print(f"{server:>8} {name:<16}{t['rows']:>12}{_mib(t['memory_bytes']):>11}"
                  f"{t['admitted']:>11}{t['refused_by_admission']:>11}{t['evicted']:>11}"
                  f"{t['readmitted']:>11}")
    print("recent events:")
    for e in status["events"]:
        when = time.strftime("%H:%M:%S", time.localtime(e["time"]))
        error = f": {e['error']}" if "error" in e else ""
        print(f"  {when} {e['type']:<9} {e['role']} {e['member']}{error}")
    finished = status["finished_ranks"]
    print(f"finished ranks: {', '.join(map(str, finished)) if finished else 'none'}")
    suspect = [f"{p['role']} {p['id']}" for p in status["processes"] if p.get("suspect")]
    if suspect:
        print(f"suspect now (heartbeat lapsed, not seen to exit): {', '.join(suspect)}")
    changes = status.get("membership_changes") or []
    print("membership changes: " + (", ".join(describe_change(c) for c in changes) or "none")
        + f"; gradients dropped: {status.get('pushes_dropped', 0)}")
    latest = status["latest_checkpoint"]
    print(f"latest checkpoint: {latest['id'] if latest else 'none'}")
    for checkpoint_id, bad in sorted(status.get("bad_checkpoints", {}).items()):
        print(f"bad checkpoint {checkpoint_id}: {bad.get('reason', '')}")
    return 0


def _checkpoint(store: JobStore, wait_s: float, full: bool = False) -> int:
    taken = take_checkpoint(store, wait_s, full)
    if isinstance(taken, str):
        print(f"pstrain checkpoint: {taken}", file=sys.stderr)
        return 1
    checkpoint_id, entries = taken
    print(json.dumps({"checkpoint": checkpoint_id, "shards": entries}, indent=2))
    return 0


def _certs(a: argparse.Namespace) -> int:
    # Here, not at the top: only this command pays for importing `cryptography`.
    from scheduler.certs import DEFAULT_HOSTS, ROLES, JobCerts, make_job_certs  # noqa: PLC0415

    kept = a.keep and all(p.exists() for p in JobCerts(Path(a.out)).files(a.workers))
    certs = make_job_certs(a.out, a.job, hosts=a.host or DEFAULT_HOSTS, days=a.days,
                           force=a.force, keep=a.keep, workers=a.workers)
    files = certs.files(a.workers)
    print(f"{'kept' if kept else 'wrote'} {len(files)} files for job {a.job!r} in "
          f"{certs.directory}:")
    for path in files:
        print(f"  {path.name}")
    holders = {"server": "server", "worker": "worker", "admin": "admin/scheduler"}
    for role in ROLES:
        print(f"{holders[role]} needs: {' '.join(p.name for p in certs.needed_by(role))}")
    if a.workers:
        print(f"the worker of rank R may instead get worker-R.pem and worker-R.key "
              f"(R in 0..{a.workers - 1}): it can then act as rank R only")
    print(f"{certs.ca_key().name} stays with whoever makes certificates; give it to no role")
    return 0


if __name__ == "__main__":
    sys.exit(main())
