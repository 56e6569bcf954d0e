"""The scheduler: holds the leader lease, detects deaths, publishes events, drives servers.

One scheduler per job leads; others wait as standbys and take over when the lease lapses.
The leader polls heartbeats every `poll_s`, turns them into membership events, tells every
server which workers are live, and asks for periodic checkpoints. Redis outages pause it;
they never stop it: when Redis comes back (with its data or empty) the leader rebuilds the
job from its own memory and the live processes' registrations, believes a missing heartbeat
only once Redis has been back for a heartbeat's life, and rolls a sync job back only for a
server that really restarted (a new incarnation).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from protos import marks
from protos.security import Security
from scheduler.admin import ServerAdmin
from scheduler.detector import FailureDetector, Notice, Suspicions, connection_name
from scheduler.finishing import Departures, finishes_past
from scheduler.membership import (
    MEMBERSHIP_KEPT,
    MembershipTracker,
    Transition,
    describe_change,
    merged_changes,
)
from scheduler.recovery import (
    RedisWatch,
    chain_of,
    choose_rollback,
    entry_signed,
    next_generation,
    restarted,
)
from scheduler.spec import JobSpec
from scheduler.store import REDIS_DOWN, JobStore, ride_out

log = logging.getLogger(__name__)


class Scheduler:
    """Runs the leader loop until `stop` is set. `run` blocks; `step` is one poll (tests)."""

    def __init__(
        self, store: JobStore, spec: JobSpec, *, poll_s: float = 0.1, lease_s: float = 2.0,
        ident: str | None = None, clock: Callable[[], float] = time.monotonic,
        security: Security | None = None,
    ) -> None:
        self.store = store
        self.spec = spec
        self.poll_s = poll_s
        self.lease_s = lease_s
        self.ident = ident or f"{socket.gethostname()}:{os.getpid()}:{time.time_ns()}"
        self._now = clock
        self.leading = False
        # A worker declared dead is fenced (`_fence`): it never rejoins as itself, as a paused
        # one would silently change a sync job's result. A paused server keeps its state, so
        # it may come back.
        self.workers = MembershipTracker()
        self.servers = MembershipTracker()
        # Who is silent, since when: a lapsed heartbeat is a death only once the failure
        # detector confirms it (scheduler/detector.py).
        detector = FailureDetector(spec.suspect_timeout_s)
        self._suspicions = {"worker": Suspicions(detector), "server": Suspicions(detector)}
        # Ranks declared dead and not yet back as a new incarnation (for membership records),
        # and whether this lease has read the fences and records of earlier leaders.
        self._gone: set[int] = set()
        self._fences_loaded = True
        # The changes of the job's workers on record, oldest first: this scheduler's and, read
        # at each new lease, earlier leaders'. Put back if Redis returns without them.
        self._changes: list[dict[str, Any]] = []
        # The open sync clock as this poll's server heartbeats give it.
        self._clock = 0
        self.admin = ServerAdmin(security=security)
        # What each shard was last told: (its incarnation, live workers, fenced incarnations).
        self._pushed: dict[int, tuple[int, tuple[int, ...], tuple[tuple[int, int], ...]]] = {}
        self._next_checkpoint_s = 0.0
        # The incarnation each shard last served under, as this scheduler saw it (kept across
        # outages and lease changes): another one later is a restarted server.
        self._incarnations: dict[int, int] = {}
        # Those the job has accounted for (a sync job: rolled back for), also in Redis for a
        # leader that takes over: a server restarted while none led is still recognised.
        self._served: dict[int, int] = {}
        # A sync rollback not yet carried out everywhere.
        self._rollback: _Rollback | None = None
        # The newest generation this scheduler published.
        self._generation = 0
        # When a missing heartbeat means a dead process: not while Redis is down, nor until it
        # has been back for a heartbeat's life (the beats that lapsed meanwhile are renewed).
        self._redis = RedisWatch(settle_s=spec.heartbeat_ttl_s + spec.heartbeat_interval_s,
                                 max_call_s=spec.heartbeat_interval_s)
        # Whether the registered-but-silent check of a new lease has been made.
        self._adopted = True
        # Ranks that exit to restart after a rollback, and until when they may take: they
        # keep their place in the quorum meanwhile.
        self._restarting: dict[int, float] = {}
        self.restart_grace_s = 60.0
        # Workers that finished: out of the membership, and the end of their heartbeat is
        # no death. `_departed` is the last poll's answer; `_live_said` what Redis was told.
        self.departures = Departures()
        self._departed: set[int] = set()
        self._live_said: tuple[tuple[int, ...], float] = ((), float("-inf"))
        # The job stopped (no checkpoint verifies): nothing more to drive.
        self._stopped = False

    def run(self, stop: threading.Event) -> None:
        log.info("scheduler %s for job %r started", self.ident, self.spec.job)
        while True:
            started = self._now()
            try:
                self._lead()
                self._reached_redis(started)
                if self.leading:
                    self.step()
            except REDIS_DOWN as exc:
                if self._redis.failed():
                    log.warning("scheduler: Redis unavailable (%s); joins and failure handling "
                                "pause until it is back (training goes on)", exc)
            if stop.wait(max(0.0, self.poll_s - (self._now() - started))):
                break
        if self.leading:
            ride_out("release lease", lambda: self.store.redis.delete(self.store.keys.leader()),
                     0)
        self.admin.close()

    def _lead(self) -> None:
        if self.leading:
            self.leading = self.store.renew_lease(self.ident, self.lease_s)
            if not self.leading:
                self._redis.emptied(self._now())
                log.warning("scheduler %s lost the leader lease", self.ident)
            return
        if self.store.acquire_lease(self.ident, self.lease_s):
            self.leading = True
            log.info("scheduler %s leads job %r", self.ident, self.spec.job)
            self.store.event("leader", "scheduler", self.ident)
            self._adopt()

    def _reached_redis(self, started: float) -> None:
        """Records a Redis call begun at `started` that answered; logs Redis's return."""
        now = self._now()
        if self._redis.ok(now, now - started):
            log.warning("scheduler: Redis is back; rebuilding the job from the live processes "
                        "(deaths are believed again after %.1f s)", self._redis.settle_s)

    def _adopt(self) -> None:
        """A new lease: servers get their membership again, and (once missing heartbeats are
        believed) members registered but silent are declared dead. What this scheduler knew
        as an earlier leader (its trackers, the incarnations it saw) stays: losing the lease
        to an outage changes nothing about the processes."""
        self._pushed.clear()
        self._adopted = False
        self._fences_loaded = False

    def _load_fences(self) -> None:
        """What earlier leaders fenced stays fenced, and whom they saw die is still gone:
        read before this lease's first beats are."""
        for rank, incarnation in self.store.fenced_workers().items():
            self.workers.fence(rank, incarnation)
        recorded = self.store.membership_changes()
        for change in recorded:
            if change.get("change") == "dead":
                self._gone.add(int(change["worker"]))
            else:
                self._gone.discard(int(change["worker"]))
        self._changes = merged_changes(self._changes, recorded)
        # What an earlier leader accounted for, for the servers this scheduler never saw;
        # its own memory wins (Redis may have come back with less than it knew).
        for shard, incarnation in self.store.served_incarnations().items():
            self._incarnations.setdefault(shard, incarnation)
            self._served.setdefault(shard, incarnation)
        self._fences_loaded = True

    def _find_dead_at_takeover(self) -> None:
        for role, tracker in (("worker", self.workers), ("server", self.servers)):
            registered = self.store.members(role)
            beats = self.store.heartbeats(role, sorted(registered))
            for member, info in registered.items():
                known = member in tracker.alive or member in tracker.dead
                finished = role == "worker" and member in self._departed
                if beats.get(member) is None and not known and not finished:
                    tracker.dead.add(member)
                    if role == "worker":
                        self._fence(member, int(info.get("incarnation", 0)))
                    self.store.event("dead", role, member, incarnation=info.get("incarnation", 0),
                                     note="found dead at takeover")
        self._adopted = True

    # ---- one poll ----------------------------------------------------------------------------

    def step(self) -> None:
        started = self._now()
        if self._stopped or self.store.stopped() is not None:
            self._stopped = True
            return
        if self.store.spec() is None:
            # Redis came back empty: the leader's memory rebuilds the job, its spec last, so
            # a job listed again is a whole one.
            self._redis.emptied(self._now())
            for rank, incarnation in self.workers.fenced.items():
                self.store.fence_worker(rank, incarnation)
            self.store.record_served(self._served)
            self.store.put_membership(self._changes)
            self.store.put_spec(self.spec)
            self.store.event("rebuilt", "scheduler", self.ident)
            log.warning("scheduler: job %r was missing from Redis; rebuilt it", self.spec.job)
        worker_ids = sorted(set(range(self.spec.workers)) | set(self.store.members("worker")))
        server_ids = list(range(self.spec.servers))
        if not self._fences_loaded:
            self._load_fences()
        worker_beats = self.store.heartbeats("worker", worker_ids)
        server_beats = self.store.heartbeats("server", server_ids)
        # Read after the beats: a finishing worker writes its record before its heartbeat
        # ends, so a beat missing here is never a finish that this poll has not read.
        self._note_departures(worker_beats)
        self._reached_redis(started)
        now = self._now()
        believe = self._redis.trusts_lapses(now)
        if believe and not self._adopted:
            self._find_dead_at_takeover()
        self._clock = max([int(b.get("open_clock", 0)) for b in server_beats.values() if b]
                          or [self._clock])
        for t in self.workers.update(self._judge("worker", self.workers, worker_beats, believe,
                                                 now)):
            if t.kind == "dead" and t.member in self._restarting:
                self.workers.dead.discard(t.member)
                self.store.event("restarting", "worker", t.member, incarnation=t.incarnation)
                continue
            if t.kind == "joined":
                self._restarting.pop(t.member, None)
            self._announce("worker", t)
        for rank, until in list(self._restarting.items()):
            if now > until and rank not in self.workers.alive:
                del self._restarting[rank]
                self.workers.dead.add(rank)
                self.store.event("dead", "worker", rank, note="did not restart after rollback")
        for t in self.servers.update(self._judge("server", self.servers, server_beats, believe,
                                                 now)):
            self._announce("server", t)
            if t.kind == "dead":
                continue
            failed = str((server_beats.get(t.member) or {}).get("restore_failed", ""))
            if failed:
                # It found no checkpoint that verifies (every one it tried is marked bad):
                # no rollback can help, and training on would throw the job's work away.
                self._stop(f"server {t.member}: {failed}")
                return
            last_seen = self._incarnations.get(t.member)
            self._incarnations[t.member] = t.incarnation
            if restarted(last_seen, t.incarnation) and self.spec.mode == "sync":
                self._start_rollback(t.member, server_beats)
        if self._rollback is None:
            # Not while a rollback is due: a leader that takes over before it is done
            # rolls back again.
            self._account()
        self._publish_live()
        if self._rollback is not None:
            self._roll_back(server_beats)
            return
        if self.spec.mode == "sync":
            self._restore_generation(server_beats)
        self._drive_servers(server_beats)
        self._checkpoints(server_beats)

    def _start_rollback(self, shard: int, beats: dict[int, dict[str, Any] | None]) -> None:
        """A sync server restarted: the job goes back to the newest checkpoint, under a
        generation never used before (Redis's count may have been lost with its data)."""
        restored = str((beats.get(shard) or {}).get("restored", ""))
        generation = next_generation([self.store.generation(), self._generation,
                                      *_generations(beats)])
        if self._rollback is not None:
            generation = max(generation, self._rollback.generation)
        self._rollback = _Rollback(shard, restored, generation)
        log.warning("server %d restarted (checkpoint %r): rolling the job back (generation %d)",
                    shard, restored or "(none: empty)", generation)

    def _restore_generation(self, beats: dict[int, dict[str, Any] | None]) -> None:
        """Puts back the rollback generation when Redis lost it: workers restarted later
        must join under the one the servers hold, and the next rollback must exceed it."""
        known = max([self._generation, *_generations(beats)])
        if known > self.store.generation():
            self.store.set_generation(known)
            self._generation = known
            log.warning("scheduler: Redis had lost the rollback generation; set it back to %d",
                        known)

    def _announce(self, role: str, t: Transition) -> None:
        detail: dict[str, Any] = {"incarnation": t.incarnation}
        if t.previous:
            detail["previous"] = t.previous
        if role == "worker" and t.kind in ("dead", "joined", "refused"):
            detail["clock"] = self._clock
        self.store.event(t.kind, role, t.member, **detail)
        if t.kind == "refused":
            log.warning("worker %d incarnation %d beats again after it was declared dead; it "
                        "stays out, and restarts when a server refuses it", t.member,
                        t.incarnation)
            return
        log.info("%s %d %s (incarnation %d)", role, t.member, t.kind, t.incarnation)
        if role != "worker":
            return
        if t.kind == "dead":
            self._fence(t.member, t.incarnation)
            self._gone.add(t.member)
            self._record_change(t.member, "dead", t.incarnation)
        elif t.kind == "joined" and t.member in self._gone:
            self._gone.discard(t.member)
            self._record_change(t.member, "joined", t.incarnation)

    def _fence(self, rank: int, incarnation: int) -> None:
        """Worker `rank`'s `incarnation` was declared dead: it never takes part again."""
        self.workers.fence(rank, incarnation)
        self.store.fence_worker(rank, incarnation)

    def _record_change(self, rank: int, change: str, incarnation: int, **detail: int) -> None:
        """Records a change of the job's workers, which `pstrain up` and `pstrain status`
        report: after one, a sync job's result is no longer the single-process one."""
        entry = {"time": time.time(), "clock": self._clock, "worker": rank, "change": change,
                 "incarnation": incarnation, **detail}
        self._changes = [*self._changes, entry][-MEMBERSHIP_KEPT:]
        self.store.record_membership(entry)
        if self.spec.mode == "sync":
            log.warning("%s: the sync job's membership changed, so its result is no longer the "
                        "single-process one", describe_change(entry))

    def _judge(self, role: str, tracker: MembershipTracker,
               beats: dict[int, dict[str, Any] | None], believe: bool, now: float
               ) -> dict[int, int | None]:
        """This poll's observation of `role` as the failure detector judges it: a lapsed
        heartbeat is left out while its process is only suspect, None once it is dead. The
        connections of lapsed members are looked up only when there are any."""
        suspicions = self._suspicions[role]
        observed = _incarnations(beats, believe)
        if not believe:
            # Silences say nothing now: they are counted again once lapses are believed.
            for member in sorted(suspicions.since):
                self.store.set_suspect(role, member, None)
            suspicions.reset()
            return observed
        # A worker that finished ended its heartbeat on purpose: no suspicion, it is gone.
        alive = {m: i for m, i in tracker.alive.items()
                 if not (role == "worker" and m in self._departed)}
        probe = suspicions.to_probe(observed, alive)
        connected: dict[int, bool | None] = {}
        if probe:
            names = self.store.client_names()
            connected = {m: None if names is None else
                         connection_name(self.spec.job, role, m, incarnation) in names
                         for m, incarnation in probe.items()}
        suspected = set(suspicions.since)
        judged, notices = suspicions.judge(observed, alive, now, connected)
        for notice in notices:
            self._notice(role, notice)
        for member in sorted(suspected):
            if member in judged and judged[member] is None:  # a suspect no more: dead
                self.store.set_suspect(role, member, None)
        return judged

    def _notice(self, role: str, notice: Notice) -> None:
        member, incarnation = notice.member, notice.incarnation
        if notice.kind == "suspect":
            self.store.set_suspect(role, member, {"incarnation": incarnation,
                                                  "since": time.time(), "clock": self._clock})
            self.store.event("suspect", role, member, incarnation=incarnation, clock=self._clock)
            log.warning("%s %d is suspect: its heartbeat lapsed, but it has not been seen to "
                        "exit; it keeps its place for up to %.1f s (paused or starved?)", role,
                        member, self.spec.suspect_timeout_s)
        else:
            self.store.set_suspect(role, member, None)
            self.store.event("cleared", role, member, incarnation=incarnation,
                             silent_s=round(notice.silent_s, 3))
            log.warning("%s %d beats again after %.1f s as a suspect; it was never declared "
                        "dead", role, member, notice.silent_s)

    def live_workers(self) -> list[int]:
        """Every rank not declared dead and not finished: ranks still starting count, so the
        quorum holds."""
        ranks = set(range(self.spec.workers)) | set(self.workers.alive)
        return sorted(ranks - self.workers.dead - self._departed)

    def _note_departures(self, beats: dict[int, dict[str, Any] | None]) -> None:
        """Reads which workers finished; one that leaves while it still heartbeats (it
        called `ctx.finish()`) is announced as "left", the end of a finished worker's
        heartbeat as "finished". Runs before the failure detector sees the beats, so a
        finished worker is never suspected, declared dead or fenced: it may still pull (to
        evaluate) after it has left."""
        finished, left = self.store.departures()
        self.departures.update(finished,
                               {r: int(v.get("incarnation", 0)) for r, v in left.items()},
                               self.workers.alive)
        departed = self.departures.departed(
            {r: None if b is None else int(b.get("incarnation", 0)) for r, b in beats.items()})
        for rank in sorted(departed - self._departed):
            if beats.get(rank) is not None:
                record = left.get(rank, {})
                self.store.event("left", "worker", rank,
                                 incarnation=record.get("incarnation", 0),
                                 clock=record.get("clock", -1))
                log.info("worker %d finished at clock %s: it leaves the membership", rank,
                         record.get("clock", "?"))
        for rank in sorted(departed):
            if beats.get(rank) is None and rank in self.workers.alive:
                incarnation = self.workers.alive.pop(rank)
                self.store.event("finished", "worker", rank, incarnation=incarnation)
                log.info("worker %d finished (incarnation %d)", rank, incarnation)
        self._departed = departed

    def _publish_live(self) -> None:
        """Tells Redis which workers are live (barriers wait for them): when that changes,
        and once a second (Redis may have come back empty)."""
        live, now = tuple(self.live_workers()), self._now()
        said, when = self._live_said
        if live != said or now - when >= 1.0:
            self.store.set_live_workers(list(live))
            self._live_said = (live, now)

    def _drive_servers(self, beats: dict[int, dict[str, Any] | None]) -> None:
        live = tuple(self.live_workers())
        fenced = tuple(sorted(self.workers.fenced.items()))
        for shard, beat in beats.items():
            if beat is None:
                continue
            incarnation = int(beat.get("incarnation", 0))
            if self._pushed.get(shard) == (incarnation, live, fenced):
                continue
            try:
                self.admin.set_membership(str(beat["address"]), list(live), dict(fenced))
                self._pushed[shard] = (incarnation, live, fenced)
            except grpc.RpcError as exc:
                log.warning("scheduler: membership to shard %d failed: %s", shard, exc.code())

    def _roll_back(self, beats: dict[int, dict[str, Any] | None]) -> None:
        """Sync: every shard back to the restarted one's checkpoint, then the workers.

        Restores every shard (the restarted one too, to raise its generation), retrying on
        later polls until all have; shards then refuse the old workers. Then publishes the
        new generation: workers see it, exit, are restarted, and rejoin at the checkpoint.
        """
        rollback = self._rollback
        if rollback is None:
            return
        if rollback.target is None:
            bad = {c: str(v.get("reason", "marked bad"))
                   for c, v in self.store.bad_checkpoints().items()}
            skip = set(bad) | set(rollback.unreadable)
            before = set(skip)
            listed, complete = self._signed_checkpoints(skip)
            rollback.unsigned |= skip - before
            for checkpoint_id in skip - set(bad):
                reason = rollback.unreadable.setdefault(
                    checkpoint_id, "an entry in Redis is not signed with the job's secret")
                bad[checkpoint_id] = reason
            chains = {c: chain_of(entries) for c, entries in listed.items()}
            choice = choose_rollback(rollback.restored, complete, bad, chains,
                                     unsigned=rollback.unsigned)
            if choice.stop:
                self._stop(choice.reason)
                return
            if choice.wait or choice.checkpoint is None:
                if not rollback.waiting:
                    rollback.waiting = True
                    log.warning("scheduler: checkpoint %r (restored by server %d) is not "
                                "listed in Redis; waiting for its server to list it again",
                                rollback.restored, rollback.shard)
                return
            # The entries checked above, not read again: what is restored is what was checked.
            rollback.target, rollback.entries = choice.checkpoint, listed.get(choice.checkpoint, {})
            # Before any shard is restored: a worker learns of the rollback only from a
            # restored shard or the new generation, and by then its finish is void or stands.
            self._void_finishes(rollback)
        checkpoint_id, done, entries = rollback.target, rollback.done, rollback.entries
        for shard, beat in sorted(beats.items()):
            if shard in done or beat is None:
                continue
            entry = entries.get(shard, {})
            try:
                self.admin.restore(str(beat["address"]), checkpoint_id,
                                   str(entry.get("sha256", "")), rollback.generation)
                done.add(shard)
            except grpc.RpcError as exc:
                if marks.CHECKPOINT_UNREADABLE in marks.marks_of(exc.trailing_metadata()):
                    # Marked bad in Redis: no later rollback, standby or restarting server
                    # tries it again (the server marked its directory too).
                    reason = f"shard {shard}: {exc.details()}"
                    self.store.mark_bad(checkpoint_id, reason, shard)
                    self.store.event("bad_checkpoint", "server", shard,
                                     checkpoint=checkpoint_id, error=reason)
                    log.warning("scheduler: shard %d cannot restore checkpoint %r (%s); marked "
                                "it bad, rolling back to an older checkpoint", shard,
                                checkpoint_id, exc.details())
                    rollback.unreadable[checkpoint_id] = reason
                    rollback.target, rollback.done = None, set()
                    return
                log.warning("scheduler: restoring shard %d to checkpoint %r failed (%s: %s); "
                            "retrying", shard, checkpoint_id, exc.code(), exc.details())
        if len(done) < self.spec.servers:
            return
        clock = rollback.clock()
        self._record_undone(rollback)
        generation = self._generation = rollback.generation
        until = self._now() + self.restart_grace_s
        self._restarting = {rank: until for rank in self.live_workers()}
        self.store.set_generation(generation)
        self.store.event("rollback", "scheduler", self.ident, checkpoint=checkpoint_id,
                         clock=clock, generation=generation)
        log.warning("job %r rolled back to checkpoint %r (clock %d); workers restart",
                    self.spec.job, checkpoint_id, clock)
        self._rollback = None
        self._pushed.clear()

    def _void_finishes(self, rollback: _Rollback) -> None:
        """The rollback undoes the steps of clocks at and past its checkpoint's, those of
        workers that finished past it too. One still in `ctx.finish()` (beating) has its
        finish voided: it restarts with the others and trains them again. One already let go
        (its heartbeat stopped: it has exited, or evaluates on) does not (`_record_undone`)."""
        clock = rollback.clock()
        void, _ = finishes_past(self.store.departures()[1], clock, self.workers.alive)
        for rank, incarnation in void.items():
            if not self.store.void_finish(rank, incarnation):
                continue
            self.departures.forget(rank)
            self._departed.discard(rank)
            self.store.event("unfinished", "worker", rank, incarnation=incarnation,
                             checkpoint=rollback.target, clock=clock)
            log.warning("worker %d finished past checkpoint %r (clock %d) and is still running: "
                        "its finish is void; it restarts and trains again from there", rank,
                        rollback.target, clock)

    def _record_undone(self, rollback: _Rollback) -> None:
        """Once every shard is back at the checkpoint (the one restored: a checkpoint some
        shard could not read sends the rollback to an older one), each finish still standing
        past its clock is of a worker that does not take those steps again: recorded as a
        change of the job's workers."""
        clock = rollback.clock()
        _, undone = finishes_past(self.store.departures()[1], clock, {})
        for rank, finished_at in undone.items():
            if rank in rollback.undone:
                continue
            rollback.undone.add(rank)  # a poll that fails after this does not record it twice
            self._record_change(rank, "undone", self.departures.finished.get(rank) or 0,
                                clock=finished_at, checkpoint=clock)
            log.warning("worker %d finished at clock %d and was let go; the rollback to clock %d "
                        "undoes its last %d steps, which it does not take again", rank,
                        finished_at, clock, finished_at - clock)

    def _account(self) -> None:
        """The job has accounted for the servers' incarnations seen: recorded in Redis (a
        call that fails is made again at the next poll)."""
        changed = {k: v for k, v in self._incarnations.items() if self._served.get(k) != v}
        if changed:
            self.store.record_served(changed)
            self._served.update(changed)

    def _signed_checkpoints(self, skip: set[str]) -> tuple[
            dict[str, dict[int, dict[str, Any]]], list[tuple[str, int]]]:
        """The checkpoints every shard has written, as Redis lists them: (id -> entries of
        those usable, less those in `skip`; (id, clock) of all of them, newest listed
        first). With the job's secret, one with an entry not signed with it is left out
        too, like an unreadable one: added to `skip` with a warning."""
        secret, job, servers = self.admin.security.secret, self.spec.job, self.spec.servers
        found: dict[str, dict[int, dict[str, Any]]] = {}
        complete: list[tuple[str, int]] = []
        for checkpoint_id, entries in self.store.complete(servers):
            complete.append((checkpoint_id, min(int(e.get("clock", 0))
                                                for e in entries.values())))
            if checkpoint_id in skip:
                continue
            unsigned = [s for s in range(servers) if not entry_signed(
                secret, job, checkpoint_id, s, servers, entries.get(s))]
            if unsigned:
                log.warning("scheduler: the entry of shard %d of checkpoint %r in Redis is not "
                            "signed with the job's secret (someone changed Redis, or the "
                            "job's secret changed); the rollback skips it for an older one",
                            unsigned[0], checkpoint_id)
                skip.add(checkpoint_id)
                continue
            found[checkpoint_id] = entries
        return found, complete

    def _stop(self, reason: str) -> None:
        """No checkpoint verifies: the job ends, with one message saying why."""
        self._rollback = None
        self._stopped = True
        self.store.stop_job(reason)
        self.store.event("stopped", "scheduler", self.ident, error=reason)
        log.error("job %r stopped: %s", self.spec.job, reason)

    def _checkpoints(self, beats: dict[int, dict[str, Any] | None]) -> None:
        # Sync jobs need no requests: every shard snapshots at multiples of the period.
        spec = self.spec
        if spec.mode != "sync" and spec.checkpoint_every_s > 0:
            now = time.time()
            if self._next_checkpoint_s == 0.0:
                self._next_checkpoint_s = now + spec.checkpoint_every_s
            elif now >= self._next_checkpoint_s:
                self.store.request_checkpoint(f"time-{int(now * 1000):015d}", -1)
                self._next_checkpoint_s = now + spec.checkpoint_every_s


@dataclass
class _Rollback:
    """A sync rollback under way: the restarted shard and the checkpoint it restored, the
    generation, the checkpoint chosen (None until it is listed), and the shards restored."""

    shard: int
    restored: str
    generation: int
    target: str | None = None
    done: set[int] = field(default_factory=set)
    waiting: bool = False  # the wait for `restored` to be listed was logged
    # Checkpoints some shard could not read or verify, or with an entry not signed with the
    # job's secret: the rollback goes to an older one.
    unreadable: dict[str, str] = field(default_factory=dict)  # id -> what failed
    # Those of them passed over only for an entry not signed: the deltas built on them stay
    # usable (a delta's own signed entry and file vouch for its chain).
    unsigned: set[str] = field(default_factory=set)
    # The chosen checkpoint's entries (shard -> {path, sha256, nbytes, clock, mac}).
    entries: dict[int, dict[str, Any]] = field(default_factory=dict)
    # Workers let go after finishing past the checkpoint whose lost steps are recorded (a
    # voided finish leaves no record to find again).
    undone: set[int] = field(default_factory=set)

    def clock(self) -> int:
        """The chosen checkpoint's clock (0 before one is chosen)."""
        return int(next(iter(self.entries.values()), {}).get("clock", 0))


def _incarnations(beats: dict[int, dict[str, Any] | None], believe_lapses: bool
                  ) -> dict[int, int | None]:
    """Each member's incarnation, None where its beat lapsed; with `believe_lapses` False
    the lapsed ones are left out (they say nothing about their process)."""
    return {m: (None if b is None else int(b.get("incarnation", 0))) for m, b in beats.items()
            if b is not None or believe_lapses}


def _generations(beats: dict[int, dict[str, Any] | None]) -> list[int]:
    """The rollback generation each live server reports holding."""
    return [int(b.get("generation", 0)) for b in beats.values() if b is not None]
