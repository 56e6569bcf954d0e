"""`python -m ps` (and `pstrain server`): run one parameter-server shard.

This is the one place where the server reads its environment. Standalone, the flags say
everything; with --redis the job's spec (written by its scheduler) supplies what the flags
leave out, and a flag that disagrees with it is refused.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from protos import modes, security
from protos.transport import PREFERENCE
from ps.concurrency import RESERVED_THREADS
from ps.errors import InvalidArgumentError, PSError
from ps.limits import Limits, MiB, parse_size
from scheduler.errors import CoordinationError
from scheduler.spec import JobSpec, at_least
from scheduler.store import JobStore, ride_out

if TYPE_CHECKING:
    from ps.server import ParameterServer, ServerConfig

# The modules above are light. The shard's (ps.server, ps.coordination, ps.checkpoint) load
# torch, seconds on a slow host, so they are imported only once the flags are read and the
# job's Redis has answered: a wrong flag or an unreachable --redis fails within moments.

log = logging.getLogger("ps")


def _int(env: str) -> int | None:
    value = os.environ.get(env)
    return int(value) if value else None


def parser() -> argparse.ArgumentParser:
    env = os.environ
    p = argparse.ArgumentParser(
        prog="pstrain server", description="Run one parameter-server shard."
    )
    p.add_argument("--bind", default=env.get("PSTRAIN_BIND", "127.0.0.1:7000"),
                   help="HOST:PORT to listen on (default 127.0.0.1:7000, this host only; "
                        "0.0.0.0:PORT for every interface); port 0 picks a free one (env "
                        "PSTRAIN_BIND)")
    p.add_argument("--advertise", default=env.get("PSTRAIN_ADVERTISE", ""),
                   help="HOST[:PORT] other machines reach this server at (default: the bind "
                        "host, or this host's address when binding all interfaces; env "
                        "PSTRAIN_ADVERTISE)")
    p.add_argument("--shard", type=int, default=int(env.get("PSTRAIN_SHARD", "0")),
                   help="this server's shard index K, 0 <= K < N (env PSTRAIN_SHARD)")
    p.add_argument("--redis", default=env.get("PSTRAIN_REDIS", ""),
                   help="Redis URL of the job (env PSTRAIN_REDIS); omit to run standalone")
    p.add_argument("--job", default=env.get("PSTRAIN_JOB", ""), help="job name (env PSTRAIN_JOB)")
    p.add_argument("--num-shards", type=int, default=_int("PSTRAIN_NUM_SHARDS"),
                   help="shards in the job (env PSTRAIN_NUM_SHARDS; default: the job's, or 1)")
    p.add_argument("--mode", default=env.get("PSTRAIN_MODE"),
                   help="default consistency mode of tables: sync, ssp, ssp:S or async "
                        "(env PSTRAIN_MODE; default: the job's, or async)")
    p.add_argument("--staleness", type=int, default=_int("PSTRAIN_STALENESS"),
                   help="ssp staleness bound S (env PSTRAIN_STALENESS; default: the job's, or 0)")
    p.add_argument("--workers", type=int, default=_int("PSTRAIN_WORKERS"),
                   help="workers in the job, backups included; ranks 0..W-1 start live "
                        "(env PSTRAIN_WORKERS; default: the job's, or 1)")
    p.add_argument("--backups", type=int, default=_int("PSTRAIN_BACKUPS"),
                   help="sync backup workers b: a clock closes with the first W - b "
                        "(env PSTRAIN_BACKUPS; default: the job's, or 0)")
    p.add_argument("--max-wait-s", type=float, default=300.0,
                   help="longest a pull or push waits for the clocks (default 300)")
    p.add_argument("--restore", choices=("auto", "latest", "none"), default="auto",
                   help="auto: restore the newest checkpoint Redis lists for the job (a "
                        "restarted server); latest: also search --checkpoint-dir on disk "
                        "(resuming a job); none: start empty")
    p.add_argument("--resume-from", default="", metavar="ID",
                   help="restore the checkpoint of this id, or the newest of the run of this "
                        "id, from the checkpoint directory (an unknown one is refused)")
    p.add_argument("--checkpoint-dir", default=env.get("PSTRAIN_CHECKPOINT_DIR", ""),
                   help="standalone: where --restore latest looks (env PSTRAIN_CHECKPOINT_DIR); "
                        "in a job, the job's directory")
    p.add_argument("--checkpoint-full-every", type=at_least(1, "1: every checkpoint full"),
                   default=None, metavar="N",
                   help="with --redis: a full checkpoint every N, the others deltas (default: "
                        "the job's; a value given must agree with it)")
    p.add_argument("--checkpoint-keep", type=at_least(0, "0: keep every checkpoint"),
                   default=None, metavar="K",
                   help="with --redis: keep the K newest full checkpoints (default: the "
                        "job's; a value given must agree with it)")
    p.add_argument("--spec-wait-s", type=float, default=60.0,
                   help="with --redis: how long to wait for the job's scheduler to create "
                        "the job (default 60)")
    p.add_argument("--torch-threads", type=int,
                   default=int(env.get("PSTRAIN_TORCH_THREADS", "1")),
                   help="torch intra-op threads (env PSTRAIN_TORCH_THREADS, default 1)")
    p.add_argument("--grpc-threads", type=int, default=16,
                   help="handler threads (concurrent requests served); data calls take all "
                        f"but {RESERVED_THREADS}, kept for health and admin calls (default 16)")
    p.add_argument("--max-client-calls", type=int, default=8,
                   help="data calls one client may have in flight; more are refused with "
                        "RESOURCE_EXHAUSTED (default 8)")
    p.add_argument("--chunk-mib", type=float, default=2.0,
                   help="size of streamed chunks in MiB (default 2)")
    p.add_argument("--max-message-mib", type=float, default=64.0,
                   help="largest single gRPC message accepted, MiB (default 64)")
    p.add_argument("--max-request-mib", type=float, default=4096.0,
                   help="largest whole push accepted, MiB (default 4096)")
    p.add_argument("--stream-idle-s", type=float, default=60.0,
                   help="cancel a streamed request that sends nothing for this long "
                        "(default 60)")
    limits = Limits()
    p.add_argument("--max-answer-mib", type=float, default=limits.max_answer_bytes / MiB,
                   help="largest answer one exchange may make the server build, MiB "
                        f"(default {limits.max_answer_bytes // MiB})")
    p.add_argument("--max-table-mib", type=float, default=limits.max_table_bytes / MiB,
                   help="largest dense table that may be declared, MiB "
                        f"(default {limits.max_table_bytes // MiB})")
    p.add_argument("--max-dim", type=int, default=limits.max_dim,
                   help=f"widest sparse row that may be declared (default {limits.max_dim})")
    p.add_argument("--max-tables", type=int, default=limits.max_tables,
                   help=f"tables one server holds at most (default {limits.max_tables})")
    p.add_argument("--max-declare-tables", type=int, default=limits.max_declare,
                   help=f"tables one declare may name (default {limits.max_declare})")
    p.add_argument("--max-new-rows", type=int, default=limits.max_new_rows,
                   help="sparse rows one request may create, over all its tables "
                        f"(default {limits.max_new_rows})")
    p.add_argument("--memory-budget", default="0",
                   help="what this server's tables may hold, as bytes or with a unit (512MiB, "
                        "8GiB, 1.5GB); past it new rows and tables are refused with "
                        "RESOURCE_EXHAUSTED (default 0: no budget)")
    p.add_argument("--metrics-port", type=int,
                   default=int(env.get("PSTRAIN_METRICS_PORT", "0")),
                   help="serve Prometheus metrics on this port (env PSTRAIN_METRICS_PORT; "
                        "0: off)")
    p.add_argument("--transport", default=env.get("PSTRAIN_TRANSPORT", "auto"),
                   help="bulk transport offered to workers: auto (every one that works here; "
                        "each worker gets the fastest both share), or one of "
                        f"{', '.join(PREFERENCE)} (env PSTRAIN_TRANSPORT, default auto)")
    security.add_flags(p, env, "this server's certificate (its common name: server)")
    p.add_argument("--ready-file", default="",
                   help="write {address, pid} as JSON here once serving")
    p.add_argument("--log-level", default=env.get("PSTRAIN_LOG_LEVEL", "INFO"),
                   help="DEBUG, INFO, WARNING or ERROR (env PSTRAIN_LOG_LEVEL)")
    return p


def wait_for_spec(store: JobStore, timeout_s: float) -> JobSpec:
    """The job's spec, waiting for its scheduler to write it (through Redis outages)."""
    deadline = time.monotonic() + timeout_s
    while True:
        spec = ride_out("spec", store.spec, None)
        if spec is not None:
            return spec
        if time.monotonic() > deadline:
            raise InvalidArgumentError(
                f"job {store.keys.job!r} has no spec in Redis after {timeout_s:g} s: start "
                "its scheduler (pstrain scheduler --job ...) or check --job"
            )
        time.sleep(0.2)


Built = tuple[
    "ServerConfig",
    Callable[["ParameterServer"], Callable[[], None]] | None,
    Callable[["ParameterServer"], None] | None,
]


def build(argv: list[str]) -> Built:
    a = parser().parse_args(argv)
    logging.basicConfig(
        level=a.log_level.upper(),
        format=f"%(asctime)s %(levelname)s server[{a.shard}] %(name)s: %(message)s",
    )
    mode, staleness = _mode_flags(a.mode, a.staleness)
    attach = None
    if a.redis:
        if not a.job:
            raise InvalidArgumentError("--redis needs --job NAME (or PSTRAIN_JOB)")
        store = JobStore.connect(a.redis, a.job)
        spec = wait_for_spec(store, a.spec_wait_s)
        spec.check_agrees(servers=a.num_shards, mode=mode and mode.kind.value,
                          staleness=staleness, workers=a.workers, backups=a.backups,
                          checkpoint_full_every=a.checkpoint_full_every,
                          checkpoint_keep=a.checkpoint_keep)
        mode, staleness = modes.parse(spec.mode), spec.staleness
        num_shards, workers, backups = spec.servers, spec.workers, spec.backups
        directory = spec.checkpoint_dir or a.checkpoint_dir
        full_every = spec.checkpoint_full_every
    else:
        for flag, value in (("--checkpoint-full-every", a.checkpoint_full_every),
                            ("--checkpoint-keep", a.checkpoint_keep)):
            if value is not None:
                raise InvalidArgumentError(
                    f"{flag} {value}: a standalone server writes no checkpoints; the flag "
                    "applies to a server of a job (--redis)")
        store, spec = None, None
        num_shards, workers, backups = a.num_shards or 1, a.workers or 1, a.backups or 0
        directory = a.checkpoint_dir
        full_every = 1
    credentials = security.from_flags(a)
    from ps.checkpoint import CheckpointError, CheckpointNotFoundError  # noqa: PLC0415
    from ps.coordination import find_checkpoint, new_incarnation, write_resharded  # noqa: PLC0415
    from ps.server import ServerConfig  # noqa: PLC0415
    found = None
    restore_failed = ""
    resharded: dict[str, Any] = {}  # the checkpoint of another count this shard was cut from
    if a.restore != "none" or a.resume_from:
        try:
            candidate = find_checkpoint(store, spec, a.shard, num_shards, a.job, directory,
                                        from_disk=a.restore == "latest",
                                        secret=credentials.secret, resume_from=a.resume_from)
            source = {"checkpoint": candidate.state.checkpoint_id,
                      "servers": candidate.resharded_from} if candidate is not None else {}
            if candidate is not None and candidate.resharded_from and spec is not None:
                # In a job the cut is written again under the job's shard count, so that
                # restarts and rollbacks restore it as a checkpoint of their own count.
                candidate = write_resharded(directory, candidate, spec, credentials.secret)
            found = candidate
            if found is not None and found.resharded_from:
                resharded = source
        except CheckpointNotFoundError:
            raise
        except CheckpointError as exc:
            if store is None:
                raise
            # Inside a job no crash loop: the server starts empty and says why in its
            # registration, and the job's scheduler stops the job with that message.
            restore_failed = str(exc)
            log.error("shard %d: no checkpoint can be restored: %s", a.shard, exc)
    restored = found.state if found is not None else None
    if store is not None and spec is not None:
        if restored is not None and resharded:
            event = {"checkpoint": restored.checkpoint_id, "from_checkpoint":
                     resharded["checkpoint"], "from_servers": resharded["servers"],
                     "servers": num_shards, "clock": restored.clock}
            ride_out("event", lambda: store.event("resharded", "server", a.shard, **event),
                     None)
        attach = _attacher(store, spec, a.bind, a.advertise,
                           restored.checkpoint_id if restored else "",
                           found.entries if found is not None else {}, restore_failed,
                           resharded)
    config = ServerConfig(
        bind=a.bind, shard=a.shard, num_shards=num_shards, job=a.job,
        incarnation=new_incarnation(), mode=mode or modes.ASYNC, staleness=staleness or 0,
        workers=workers, backups=backups, max_wait_s=a.max_wait_s,
        torch_threads=a.torch_threads, grpc_threads=a.grpc_threads,
        max_client_calls=a.max_client_calls,
        chunk_bytes=int(a.chunk_mib * MiB), max_message_bytes=int(a.max_message_mib * MiB),
        max_request_bytes=int(a.max_request_mib * MiB), stream_idle_s=a.stream_idle_s,
        ready_file=a.ready_file,
        metrics_port=a.metrics_port, transport=a.transport,
        limits=Limits(max_table_bytes=int(a.max_table_mib * MiB), max_dim=a.max_dim,
                      max_tables=a.max_tables, max_declare=a.max_declare_tables,
                      max_answer_bytes=int(a.max_answer_mib * MiB),
                      max_new_rows=a.max_new_rows,
                      memory_budget_bytes=parse_size(a.memory_budget, "--memory-budget")),
        checkpoint_dir=directory, checkpoint_full_every=full_every, security=credentials,
    )
    prepare = None
    if restored is not None:
        state = restored

        def prepare(server: ParameterServer) -> None:
            server.shard.restore(state)

    return config, attach, prepare


def _mode_flags(text: str | None, staleness: int | None) -> tuple[modes.Mode | None, int | None]:
    """--mode and --staleness as (the mode's kind, the bound): "ssp:S" gives S as the bound.

    InvalidArgumentError for a mode outside the grammar, or a bound given twice differently.
    """
    if not text:
        return None, staleness
    try:
        mode = modes.parse(text)
    except modes.ModeError as exc:
        raise InvalidArgumentError(f"--mode: {exc}") from exc
    if mode.staleness is None:
        return mode, staleness
    if staleness is not None and staleness != mode.staleness:
        raise InvalidArgumentError(
            f"--mode {mode} and --staleness {staleness} disagree; give the bound once"
        )
    return modes.Mode(mode.kind), mode.staleness


def _attacher(
    store: JobStore, spec: JobSpec, bind: str, advertise: str, restored: str,
    entries: dict[int, dict[str, Any]], restore_failed: str = "",
    resharded: dict[str, Any] | None = None,
) -> Callable[[ParameterServer], Callable[[], None]]:
    from ps.coordination import ServerCoordinator, advertised  # noqa: PLC0415

    def attach(server: ParameterServer) -> Callable[[], None]:
        address = advertised(bind.rpartition(":")[0], server.port, advertise)
        coordinator = ServerCoordinator(store, spec, server, address, restored, entries,
                                        restore_failed, resharded)
        coordinator.start()
        return coordinator.stop

    return attach


def main(argv: list[str] | None = None) -> int:
    try:
        config, attach, prepare = build(sys.argv[1:] if argv is None else argv)
        from ps.server import run  # noqa: PLC0415
        run(config, attach, prepare)
    except (PSError, CoordinationError, security.SecurityError) as exc:
        print(f"pstrain server: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
