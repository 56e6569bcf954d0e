"""A server's part in its job: registration, heartbeats and checkpoint requests via Redis.

Nothing here is on the data plane: pulls and pushes never wait on Redis, and a Redis
outage only pauses heartbeats. When Redis comes back empty, each beat writes the server's
registration again, and the checkpoint it last restored or wrote is listed again, so the
scheduler can rebuild the job from the live servers (heartbeats also carry the rollback
generation the shard holds).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple

from protos.runtime import run_in_background
from ps.checkpoint import (
    FULL,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointLinkError,
    CheckpointNotFoundError,
    CheckpointUnsignedError,
    Into,
    ShardFile,
    ShardState,
    bad_reason,
    checkpoint_dir,
    kept_rows,
    list_checkpoints,
    load_checkpoint,
    prune,
    read_manifest,
    shard_file_name,
    write_manifest,
    write_shard,
)
from ps.deltas import WAIT_FOR_EARLIER_S
from ps.errors import PSError
from ps.reshard import JoinedRows, reshard, routes_here, shards_needed
from ps.server import ParameterServer
from ps.shard import Shard, Skipped
from scheduler.heartbeat import Heartbeat
from scheduler.recovery import (
    built_on_bad,
    chain_of,
    entry_signed,
    no_checkpoint_verifies,
    sign_entry,
)
from scheduler.spec import JobSpec
from scheduler.store import JobStore, ride_out

log = logging.getLogger(__name__)
# Sparse tables a server lists in its heartbeat for `pstrain status` (by name), at most.
_SHOWN_TABLES = 16
# Old shard files a resharding server reads at once, at most, and at most one per core it may
# run on: each file's sha256 runs on a thread of its own, and hashing bounds a read.
PARALLEL_READS = 4
# The longest checkpoint id (ps.checkpoint's names).
_MAX_ID = 200


def new_incarnation() -> int:
    """Start time in microseconds: grows with every restart, needs no shared counter, and
    stays ordered even if Redis comes back empty."""
    return time.time_ns() // 1000


def advertised(bind_host: str, port: int, advertise: str) -> str:
    """The address other processes use to reach this server."""
    if advertise:
        return advertise if ":" in advertise else f"{advertise}:{port}"
    if bind_host in ("0.0.0.0", "::", "[::]", ""):
        bind_host = socket.gethostbyname(socket.gethostname())
    return f"{bind_host}:{port}"


# How long a stopping server lets its checkpoint writes finish: with gRPC's own 2 s grace,
# under the 10 s that `pstrain up` and Docker Compose give a process between SIGTERM and
# SIGKILL.
DRAIN_S = 7.0


class ServerCoordinator:
    """Keeps one server registered and heartbeating in its job. start/stop are thread-safe."""

    def __init__(
        self, store: JobStore, spec: JobSpec, server: ParameterServer, address: str,
        restored: str = "", entries: Mapping[int, Mapping[str, Any]] | None = None,
        restore_failed: str = "", resharded_from: Mapping[str, Any] | None = None,
    ) -> None:
        """`restored` names the checkpoint the shard was loaded from and `entries` its
        listing (shard -> {path, sha256, nbytes, clock[, run][, mac]}), every shard's or
        this shard's alone; `restore_failed` says why no checkpoint could be restored ("":
        none failed); `resharded_from` ({checkpoint, servers}) the checkpoint `restored` was
        resharded from, shown by `pstrain status`."""
        self.store = store
        self.spec = spec
        self.server = server
        self.address = address
        shard = server.config.shard
        self.registration = {
            "address": address, "incarnation": server.config.incarnation, "pid": os.getpid(),
            "host": socket.gethostname(), "restored": restored, "started": time.time(),
            **({"restore_failed": restore_failed} if restore_failed else {}),
            **({"resharded_from": dict(resharded_from)} if resharded_from else {}),
        }
        self.heartbeat = Heartbeat(
            store, "server", shard, interval_s=spec.heartbeat_interval_s,
            ttl_s=spec.heartbeat_ttl_s, payload=self.payload, registration=self.registration,
            on_beat=self.on_beat,
        )
        # The newest checkpoint this server restored or wrote, and the entries it knows of
        # it; relisted on each beat where Redis lost them. Guarded by its lock (the heartbeat
        # thread and checkpoint writers).
        self._listed_lock = threading.Lock()
        self._listed: tuple[str, dict[int, dict[str, Any]]] | None = None
        if restored and entries:
            self._listed = (restored, {int(k): dict(v) for k, v in entries.items()})
        self._handled: str | None = None
        self._deferred: str | None = None  # the request last put off for an earlier write
        # The threads that write checkpoints (each write has its own), which `stop` joins.
        self._writers: set[threading.Thread] = set()
        self._writers_lock = threading.Lock()
        # Only the newest request matters: one already pending when this process starts
        # belongs to an earlier incarnation's time.
        request = ride_out("checkpoint", store.checkpoint_request, None)
        if request is not None:
            self._handled = str(request["id"])

    def payload(self) -> dict[str, Any]:
        shard = self.server.shard
        stats = [s for s, _ in shard.stats()]
        state = shard.clock_state()
        return {
            **self.registration,
            "open_clock": state.open_clock,
            "generation": shard.generation,
            "tables": len(stats),
            "rows": sum(s.rows for s in stats),
            "bytes": sum(s.value_bytes + s.state_bytes + s.index_bytes for s in stats),
            "pushes": sum(s.counters.pushes_applied for s in stats),
            "dropped": sum(s.counters.pushes_dropped for s in stats),
            # What `pstrain status` shows per sparse table (a bounded number of them).
            "table_stats": {
                s.name: {"rows": s.rows, "memory_bytes": s.memory_bytes,
                         "admitted": s.counters.admitted,
                         "refused_by_admission": s.counters.refused_by_admission,
                         "evicted": s.counters.evicted, "readmitted": s.counters.readmitted}
                for s in sorted(stats, key=lambda s: s.name)[:_SHOWN_TABLES]
                if s.kind == "sparse"
            },
        }

    def on_beat(self) -> None:
        """Runs in the heartbeat thread after each beat."""
        self.relist_checkpoint()
        self.serve_checkpoint_request()

    def relist_checkpoint(self) -> None:
        """Lists this server's newest checkpoint again where Redis lacks it (it came back
        empty), so a restart or rollback still finds it. Costs one write per beat."""
        with self._listed_lock:
            listed = self._listed
        if listed is not None:
            ride_out("checkpoint", lambda: self.store.relist_checkpoint(*listed), None)

    def serve_checkpoint_request(self) -> None:
        """Runs in the heartbeat thread: starts a checkpoint the scheduler or CLI asked for."""
        request = ride_out("checkpoint", self.store.checkpoint_request, None)
        if request is None or request["id"] == self._handled or not self.spec.checkpoint_dir:
            return
        checkpoint_id, clock = str(request["id"]), int(request["clock"])
        shard = self.server.shard
        if request.get("full"):
            shard.snapshots.ask_full(checkpoint_id)
        if self.spec.mode != "sync":
            if shard.cut_started(checkpoint_id):
                # A worker's mark started it here before this beat read the request.
                self._handled = checkpoint_id
                return
            if shard.snapshots.writing():
                # One copy of the tables waits for its (paced) write at a time: asked faster
                # than it writes, a server would pile up copies. The next beat asks again.
                if self._deferred != checkpoint_id:
                    self._deferred = checkpoint_id
                    log.warning("shard %d: checkpoint %s waits for the write of the one "
                                "before (--checkpoint-write-mb-s %g)", shard.config.shard,
                                checkpoint_id, self.spec.checkpoint_write_mb_s)
                return
            # A consistent cut: it completes once every live worker has reached it. While
            # another is under way, the next beat asks again.
            if shard.cut(checkpoint_id, self._write):
                self._handled = checkpoint_id
            return
        self._handled = checkpoint_id
        if clock >= 0:
            shard.snapshot_at(clock, checkpoint_id, self._write)
        else:
            state = shard.snapshot(checkpoint_id)
            threading.Thread(target=self._write, args=(state,), daemon=True).start()

    def _write(self, state: ShardState | Skipped) -> None:
        """Writes, lists and (a full one) applies retention to one snapshot, on a thread of
        its own, which `stop` joins."""
        with self._writers_lock:
            self._writers = {t for t in self._writers if t.is_alive()}
            self._writers.add(threading.current_thread())
        self._write_listed(state)

    def _write_listed(self, state: ShardState | Skipped) -> None:
        if isinstance(state, Skipped):
            # An event, so that `pstrain checkpoint` asks again at once (sync) or says why.
            log.warning("shard %d: skipping checkpoint %s: %s", self.server.config.shard,
                        state.checkpoint_id, state.reason)
            ride_out("checkpoint", lambda: self.store.event(
                "checkpoint_skipped", "server", self.server.config.shard,
                checkpoint=state.checkpoint_id, reason=state.reason), None)
            return
        run_in_background()  # this thread's own, started for this write
        started = time.monotonic()
        try:
            written = write_snapshot(
                self.server.shard, self.spec.checkpoint_dir, state, self.spec.run_id,
                max_bytes_per_s=self.spec.checkpoint_write_mb_s * 1e6)
        except PSError as exc:
            # One line, and an event in Redis: `pstrain status` shows it to whoever runs the job.
            error = str(exc)[:500]
            log.error("shard %d: checkpoint %s failed: %s", state.shard, state.checkpoint_id,
                      error)
            ride_out("checkpoint", lambda: self.store.event(
                "checkpoint_failed", "server", state.shard, checkpoint=state.checkpoint_id,
                clock=state.clock, error=error), None)
            return
        entry = sign_entry(
            self.server.config.security.secret, state.job, state.checkpoint_id, state.shard,
            state.num_shards, {"path": written.path, "sha256": written.sha256,
                               "nbytes": written.nbytes, "clock": state.clock,
                               "run": self.spec.run_id, **_delta_fields(written)})
        with self._listed_lock:
            if self._listed is not None and self._listed[0] == state.checkpoint_id:
                self._listed[1][state.shard] = entry
            elif self._listed is None or state.clock >= self._newest_clock():
                self._listed = (state.checkpoint_id, {state.shard: entry})
        ride_out("checkpoint", lambda: self.store.record_checkpoint(
            state.checkpoint_id, state.shard, entry), None)
        ride_out("checkpoint", lambda: self.store.event(
            "checkpoint", "server", state.shard, checkpoint=state.checkpoint_id, clock=state.clock,
            nbytes=written.nbytes), None)
        log.info("shard %d: checkpoint %s (%s) at clock %d, %.1f MB in %.2f s", state.shard,
                 state.checkpoint_id, written.kind, state.clock, written.nbytes / 1e6,
                 time.monotonic() - started)
        if written.kind == FULL:
            self._prune(state.checkpoint_id)

    def _prune(self, checkpoint_id: str) -> None:
        """Retention, once full checkpoint `checkpoint_id` is complete: older checkpoints of
        the run go from disk and from Redis. Whichever shard completes it prunes (two at
        once are safe: see ps.checkpoint.prune)."""
        directory, keep = self.spec.checkpoint_dir, self.spec.checkpoint_keep
        if not keep:
            return
        try:
            manifest = read_manifest(checkpoint_dir(directory, self.spec.job, checkpoint_id))
            if not manifest.complete or manifest.kind != FULL:
                return
            pruned = prune(directory, self.spec.job, keep, self.spec.run_id)
        except PSError as exc:
            log.warning("shard %d: retention after checkpoint %s failed: %s",
                        self.server.config.shard, checkpoint_id, exc)
            return
        if pruned:
            ride_out("checkpoint", lambda: self.store.forget_checkpoints(pruned), None)

    def _newest_clock(self) -> int:
        """The clock of the checkpoint listed now (its lock held)."""
        if self._listed is None:
            return -1
        return min(int(e.get("clock", 0)) for e in self._listed[1].values())

    def start(self) -> None:
        if self.spec.mode == "sync" and self.spec.checkpoint_dir:
            self.server.shard.snapshot_every(self.spec.checkpoint_every_clocks, self._write)
        elif self.spec.checkpoint_dir:
            # A worker may bring news of a cut before this server's beat does.
            self.server.shard.on_cut(self._write)
        self.heartbeat.start()
        log.info("shard %d registered in job %r as %s", self.server.config.shard, self.spec.job,
                 self.address)

    def stop(self, drain_s: float = DRAIN_S) -> None:
        """Lets the checkpoint writes under way finish (up to `drain_s`), so that a server
        stopped at the end of a job, as training's last checkpoint is written, leaves it
        listed and retention applied rather than half a directory; then leaves the job."""
        deadline = time.monotonic() + drain_s
        with self._writers_lock:
            writers = [t for t in self._writers if t is not threading.current_thread()]
        # Joined, not only waited for: a thread still running when the interpreter exits is
        # stopped wherever it is, which aborts the process inside a native call.
        for thread in writers:
            thread.join(max(0.0, deadline - time.monotonic()))
        unfinished = sum(t.is_alive() for t in writers)
        if unfinished:
            log.warning("shard %d: stopping with %d checkpoint write(s) unfinished after %.0f s; "
                        "the checkpoint stays incomplete (no restore uses it)",
                        self.server.config.shard, unfinished, drain_s)
        self.heartbeat.stop(forget=True)


def write_snapshot(shard: Shard, directory: str, state: ShardState, run: str = "",
                   wait_s: float = WAIT_FOR_EARLIER_S, max_bytes_per_s: float = 0.0
                   ) -> ShardFile:
    """Writes a snapshot `shard` took, and its manifest entry, after the snapshots it took
    before it (a delta needs its base's file: `SnapshotLog.wait_turn`), and tells the shard
    how it went (a failure makes its next snapshot full). `run` is the job's run id;
    `max_bytes_per_s` paces the file's write (ps.checkpoint.Pace; 0: no limit). Blocks
    on file I/O and on the earlier writes (at most `wait_s`); thread-safe. Raises
    CheckpointError when the snapshot cannot be written."""
    snapshots = shard.snapshots
    done: ShardFile | None = None
    deltas_ok, why = True, ""
    try:
        base = snapshots.wait_turn(state, wait_s)
        written = write_shard(directory, state, base, max_bytes_per_s=max_bytes_per_s)
        write_manifest(directory, state.checkpoint_id, state.job, state.clock,
                       {state.shard: written}, state.num_shards, run=run)
        done = written
    except CheckpointLinkError as exc:
        deltas_ok, why = False, str(exc)
        raise
    finally:
        snapshots.written(state, done, deltas_ok, why)
    return written


def _delta_fields(written: ShardFile) -> dict[str, Any]:
    """What a Redis entry says of a delta: its kind, base, and the ids of its chain."""
    if written.kind == FULL:
        return {}
    return {"kind": written.kind, "base": written.base,
            "chain": [c.checkpoint_id for c in written.chain]}


class Found(NamedTuple):
    """A checkpoint a server can restore: its state for this shard, and the checkpoint's
    entries (shard -> {path, sha256, nbytes, clock, run[, mac]}, every shard's; none for a
    resharded one). `resharded_from` is the shard count the checkpoint was written with
    when that differs from this job's (0 when it does not): the state is this shard's share
    of it (`ps.reshard`), not yet written anywhere (`write_resharded`)."""

    state: ShardState
    entries: dict[int, dict[str, Any]]
    resharded_from: int = 0


def find_checkpoint(
    store: JobStore | None, spec: JobSpec | None, shard: int, num_shards: int, job: str,
    directory: str, from_disk: bool, secret: bytes = b"", resume_from: str = "",
) -> Found | None:
    """The newest complete checkpoint this shard can read (a `Found`), or None when there
    is none.

    Inside a running job Redis lists the checkpoints of the current run (a new run starts
    with none listed; the one it resumed from is listed by the servers that restored it). If
    it lists none (it may have come back empty after an outage) the checkpoint directory is
    searched for those of the current run (`JobSpec.run_id`); with `from_disk` (resuming a
    job under a fresh Redis) for any run's, or with `resume_from` for that checkpoint id or
    the newest of that run id alone (CheckpointError naming it when there is none).

    A checkpoint on disk written by another number of servers than `num_shards` is
    resharded (`ps.reshard`): every one of its shard files is read from `directory`, which
    must therefore be shared by all servers; when one is missing, the CheckpointError names
    it. An incomplete one of another count (this directory holds only some of its shards'
    entries, as a directory that is not shared does) is passed over with a warning, and when
    nothing else can be restored the CheckpointError says which entries are missing.

    A checkpoint marked bad (in Redis or its directory), or a delta built on one that is
    (its entries' chain), is passed over. One whose file of
    this shard cannot be read or fails its digest is skipped with a warning for the next
    older one; a file that fails verification marks the checkpoint bad, in its directory
    and in Redis, so no scheduler or server tries it again. When every one fails, a
    CheckpointError of the newest one's kind is raised, naming every checkpoint tried and
    what failed in it (`no_checkpoint_verifies`).

    With the job's `secret`, an entry of this shard that is not signed with it
    (`entry_signed`) is skipped the same way (CheckpointUnsignedError), and entries found on
    disk are returned signed, for the coordinator to list in Redis. Blocks on Redis and
    file I/O.
    """
    first_error: CheckpointError | None = None
    failures: dict[str, str] = {}
    bad: dict[str, dict[str, Any]] = {}
    if store is not None:
        bad = ride_out("bad", store.bad_checkpoints, bad)
    def marked(checkpoint_id: str) -> str | None:
        return (bad.get(checkpoint_id) or {}).get("reason") or (
            bad_reason(directory, job, checkpoint_id) if directory else None)

    # (id, what is missing) of incomplete checkpoints of another count found on disk.
    partial: list[tuple[str, str]] = []
    for checkpoint_id, entries, count in _candidates(store, spec, num_shards, job, directory,
                                                     from_disk, secret, resume_from, partial):
        reason = marked(checkpoint_id)
        if reason is None:
            on_bad = built_on_bad({c: r for c in chain_of(entries) if (r := marked(c))},
                                  {checkpoint_id: chain_of(entries)})
            reason = on_bad.get(checkpoint_id)
        if reason is not None:
            log.info("shard %d: passing over checkpoint %r, marked bad (%s)", shard,
                     checkpoint_id, reason)
            first_error = first_error or CheckpointCorruptError(
                f"checkpoint {checkpoint_id!r} is marked bad: {reason}")
            failures[checkpoint_id] = reason
            continue
        try:
            if count != num_shards:
                state = _reshard_candidate(directory, job, checkpoint_id, shard, num_shards,
                                           entries, count)
                return Found(state, {}, count)
            state = _read_candidate(directory, job, checkpoint_id, shard, num_shards,
                                    entries.get(shard, {}), secret)
        except CheckpointError as exc:
            log.warning("shard %d: cannot restore checkpoint %r (%s); trying an older one",
                        shard, checkpoint_id, exc)
            if isinstance(exc, CheckpointCorruptError) and store is not None:
                _mark_bad(store, checkpoint_id, shard, f"shard {shard}: {exc}")
            first_error = first_error or exc
            failures[checkpoint_id] = f"shard {shard}: {exc}"
            continue
        return Found(state, entries)
    if first_error is None and partial:
        # Resharding finds nothing to read where servers do not share their directory: say
        # so rather than start afresh.
        checkpoint_id, missing = partial[0]
        first_error = CheckpointError(missing)
        failures[checkpoint_id] = missing
    if first_error is not None:
        # One message naming every checkpoint tried and what failed in it.
        raise type(first_error)(no_checkpoint_verifies(failures)) from first_error
    if resume_from:
        raise CheckpointNotFoundError(
            f"--resume-from {resume_from!r}: no complete checkpoint of job {job!r} has that id, "
            f"and no run of it has that id, in {directory or '(no checkpoint directory)'}; "
            "`pstrain status` and the checkpoint directory list them")
    return None


def _mark_bad(store: JobStore, checkpoint_id: str, shard: int, reason: str) -> None:
    """Marks a checkpoint bad in Redis, with an event the first time (riding out outages)."""
    if ride_out("bad", lambda: store.mark_bad(checkpoint_id, reason, shard), False):
        ride_out("bad", lambda: store.event("bad_checkpoint", "server", shard,
                                            checkpoint=checkpoint_id, error=reason), None)


def _read_candidate(directory: str, job: str, checkpoint_id: str, shard: int, num_shards: int,
                    entry: dict[str, Any], secret: bytes) -> ShardState:
    """This shard's state in a checkpoint, if its entry is signed with the job's `secret`
    (when there is one). The entry names the checkpoint and its digest; the file is found
    in `directory`. CheckpointError when it cannot be used."""
    if not entry_signed(secret, job, checkpoint_id, shard, num_shards, entry):
        raise CheckpointUnsignedError(
            f"the entry of shard {shard} of checkpoint {checkpoint_id!r} in Redis is not "
            "signed with the job's secret: someone changed Redis, or the job's secret changed"
        )
    return load_checkpoint(directory, job, checkpoint_id, shard, num_shards,
                           str(entry.get("sha256", "")))


def _candidates(
    store: JobStore | None, spec: JobSpec | None, num_shards: int, job: str, directory: str,
    from_disk: bool, secret: bytes, resume_from: str = "",
    partial: list[tuple[str, str]] | None = None,
) -> Iterator[tuple[str, dict[int, dict[str, Any]], int]]:
    """Complete checkpoints as (id, entries, the number of shards that wrote them), newest
    first, read as they are asked for: those Redis lists (of this job's shard count), else
    those on disk of the current run (any run's: `from_disk`; those `resume_from` names), of
    any shard count. Incomplete ones on disk of another count are noted in `partial`.

    Entries from disk are signed with `secret` here: the checkpoint directory is the job's
    own, and the coordinator lists them in Redis again (every shard's), where the other
    servers and the scheduler check them."""
    listed = False
    for checkpoint_id, entries in store.complete(num_shards) if store is not None else ():
        listed = True
        yield checkpoint_id, entries, num_shards
    if listed or not directory or not (from_disk or resume_from or spec is not None):
        return
    run = spec.run_id if spec is not None else ""
    created_ns = int(spec.created_s * 1e9) if spec is not None else 0
    for manifest in reversed(list_checkpoints(directory, job)):
        if resume_from:
            if resume_from not in (manifest.checkpoint_id, manifest.run):
                continue
        elif not from_disk and not (manifest.run == run if run and manifest.run
                                    else manifest.written_at_ns >= created_ns):
            continue
        count = manifest.num_shards
        if not manifest.complete:
            if count != num_shards and partial is not None:
                missing = sorted(set(range(count)) - set(manifest.shards))
                log.warning("checkpoint %r of %d servers: %s has no entry of shard(s) %s",
                            manifest.checkpoint_id, count, manifest.directory, missing)
                partial.append((manifest.checkpoint_id, _partial_message(
                    manifest.checkpoint_id, count, num_shards, str(manifest.directory),
                    [f"shard-{k}.json" for k in missing])))
            continue
        yield manifest.checkpoint_id, {
            k: sign_entry(secret, job, manifest.checkpoint_id, k, count,
                          {"path": f.path, "sha256": f.sha256, "nbytes": f.nbytes,
                           "clock": manifest.clock, "run": manifest.run, **_delta_fields(f)})
            for k, f in manifest.shards.items()}, count


def _partial_message(checkpoint_id: str, count: int, num_shards: int, where: str,
                     missing: list[str]) -> str:
    return (f"checkpoint {checkpoint_id!r} was written by {count} servers; restoring it onto "
            f"{num_shards} reads every one of their files from the checkpoint directory, and "
            f"{where} lacks {', '.join(missing)}. Resharding needs one checkpoint directory "
            "shared by all servers (as the local cluster and docker-compose have it): copy "
            "every server's files into it, or start the job with its old number of servers")


def _reshard_candidate(directory: str, job: str, checkpoint_id: str, shard: int,
                       num_shards: int, entries: dict[int, dict[str, Any]],
                       count: int) -> ShardState:
    """This shard's share of checkpoint `checkpoint_id`, written by `count` servers: the
    files of the old shards that hold its rows (`ps.reshard.shards_needed`; those that hold
    only dense blocks of it are known once the others are read) are read, side by side where
    the server has the cores (`PARALLEL_READS`), by `load_checkpoint` (hashed against their
    entries, keeping only the rows that route here: `ps.reshard.routes_here`) and cut by
    `ps.reshard`, each file's rows read straight into their place in the share
    (`ps.reshard.JoinedRows`). CheckpointError naming each of them that is missing from
    `directory`. Blocks on file I/O; holds this shard's share of the model, never a whole old
    shard."""
    ckpt_dir = checkpoint_dir(directory, job, checkpoint_id)
    keep = routes_here(shard, num_shards)

    def check_present(shards: list[int]) -> None:
        missing = [shard_file_name(k, count) for k in shards
                   if k not in entries or not (ckpt_dir / shard_file_name(k, count)).is_file()]
        if missing:
            raise CheckpointError(_partial_message(checkpoint_id, count, num_shards,
                                                   str(ckpt_dir), missing))

    def load(k: int, into: Into | None = None) -> ShardState:
        return load_checkpoint(directory, job, checkpoint_id, k, count,
                               str(entries[k].get("sha256", "")), keep, into)

    def planned(k: int) -> dict[str, int] | None:
        try:
            return kept_rows(ckpt_dir / shard_file_name(k, count), keep)
        except CheckpointError:  # the read that follows reports it, and marks it bad
            return None

    started = time.monotonic()
    by_key = shards_needed(count, shard, num_shards)
    check_present(by_key)
    layout = JoinedRows([planned(k) for k in by_key])
    at_once = max(1, min(PARALLEL_READS, _cores()))
    with ThreadPoolExecutor(max_workers=at_once, thread_name_prefix="reshard-read") as pool:
        states = list(pool.map(lambda i: load(by_key[i], layout.into(i)),
                               range(len(by_key))))
        rest = [k for k in shards_needed(count, shard, num_shards,
                                         [t.spec for t in states[0].tables]) if k not in by_key]
        check_present(rest)
        states += pool.map(load, rest)
    state = reshard(_handed_over(states), shard, num_shards)
    log.info("shard %d: checkpoint %s of %d servers resharded onto %d from shard(s) %s in "
             "%.2f s (clock %d)", shard, checkpoint_id, count, num_shards, by_key + rest,
             time.monotonic() - started, state.clock)
    return state


def _cores() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0))


def _handed_over(states: list[ShardState]) -> Iterator[ShardState]:
    """The states, each let go of here as it is yielded: `reshard` then holds the only
    reference to what it keeps of each, and frees it as it joins the share."""
    while states:
        yield states.pop(0)


def resharded_id(checkpoint_id: str, num_shards: int) -> str:
    """The id a checkpoint resharded onto `num_shards` servers is written under:
    ``<checkpoint_id>.on-<num_shards>`` (a digest of an id too long for that)."""
    suffix = f".on-{num_shards}"
    if len(checkpoint_id) + len(suffix) > _MAX_ID:
        checkpoint_id = "resharded-" + hashlib.sha256(checkpoint_id.encode()).hexdigest()[:32]
    return checkpoint_id + suffix


def write_resharded(directory: str, found: Found, spec: JobSpec, secret: bytes) -> Found:
    """Writes a resharded state (`found.resharded_from` set) as this shard's file of
    checkpoint `resharded_id` and records it in that checkpoint's manifest; returns it as
    found there, with this shard's signed entry.

    Every server of the job does the same at its start, so once all have, the cut stands on
    disk and in Redis (each coordinator lists its entry) as a checkpoint of the job's own
    shard count: a restarting server and a sync rollback restore it like any other. The
    file's bytes depend only on the old checkpoint, so writing it again (a server restarted
    before all were written) changes nothing another server may be reading. CheckpointError
    when it cannot be written. Blocks on file I/O."""
    state = found.state
    new_id = resharded_id(state.checkpoint_id, state.num_shards)
    state = dataclasses.replace(state, checkpoint_id=new_id)
    written = write_shard(directory, state)
    write_manifest(directory, new_id, state.job, state.clock, {state.shard: written},
                   state.num_shards, run=spec.run_id)
    entry = sign_entry(secret, state.job, new_id, state.shard, state.num_shards, {
        "path": written.path, "sha256": written.sha256, "nbytes": written.nbytes,
        "clock": state.clock, "run": spec.run_id})
    return Found(state, {state.shard: entry}, found.resharded_from)
