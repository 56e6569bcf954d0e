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
from scheduler.membership import MembershipTracker, Transition
from scheduler.recovery import (
    RedisWatch,
    entry_signed,
    next_generation,
    restarted,
    rollback_target,
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
        self.workers = MembershipTracker()
        self.servers = MembershipTracker()
        self.admin = ServerAdmin(security=security)
        self._pushed: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._next_checkpoint_s = 0.0
        # The incarnation each shard last served under, as this scheduler saw it (kept across
        # outages and lease changes): another one later is a restarted server.
        self._incarnations: dict[int, int] = {}
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

    def _find_dead_at_takeover(self) -> None:
        for role, tracker in (("worker", self.workers), ("server", self.servers)):
            registered = self.store.members(role)
            beats = self.store.heartbeats(role, sorted(registered))
            for member, info in registered.items():
                known = member in tracker.alive or member in tracker.dead
                if beats.get(member) is None and not known:
                    tracker.dead.add(member)
                    self.store.event("dead", role, member, incarnation=info.get("incarnation", 0),
                                     note="found dead at takeover")
        self._adopted = True

    # ---- one poll ----------------------------------------------------------------------------

    def step(self) -> None:
        started = self._now()
        if self.store.spec() is None:
            # Redis came back empty: the leader's memory rebuilds the job.
            self._redis.emptied(self._now())
            self.store.put_spec(self.spec)
            self.store.event("rebuilt", "scheduler", self.ident)
            log.warning("scheduler: job %r was missing from Redis; rebuilt it", self.spec.job)
        worker_ids = sorted(set(range(self.spec.workers)) | set(self.store.members("worker")))
        server_ids = list(range(self.spec.servers))
        worker_beats = self.store.heartbeats("worker", worker_ids)
        server_beats = self.store.heartbeats("server", server_ids)
        self._reached_redis(started)
        now = self._now()
        believe = self._redis.trusts_lapses(now)
        if believe and not self._adopted:
            self._find_dead_at_takeover()
        for t in self.workers.update(_incarnations(worker_beats, believe)):
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
        for t in self.servers.update(_incarnations(server_beats, believe)):
            self._announce("server", t)
            if t.kind == "dead":
                continue
            last_seen = self._incarnations.get(t.member)
            self._incarnations[t.member] = t.incarnation
            if restarted(last_seen, t.incarnation) and self.spec.mode == "sync":
                self._start_rollback(t.member, server_beats)
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
        self.store.event(t.kind, role, t.member, **detail)
        log.info("%s %d %s (incarnation %d)", role, t.member, t.kind, t.incarnation)

    def live_workers(self) -> list[int]:
        """Every rank not declared dead: ranks still starting count, so the quorum holds."""
        ranks = set(range(self.spec.workers)) | set(self.workers.alive)
        return sorted(ranks - self.workers.dead)

    def _drive_servers(self, beats: dict[int, dict[str, Any] | None]) -> None:
        live = tuple(self.live_workers())
        for shard, beat in beats.items():
            if beat is None:
                continue
            incarnation = int(beat.get("incarnation", 0))
            if self._pushed.get(shard) == (incarnation, live):
                continue
            try:
                self.admin.set_membership(str(beat["address"]), list(live))
                self._pushed[shard] = (incarnation, live)
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
            listed = self._signed_checkpoints(rollback.unreadable)
            complete = [(c, min(int(e.get("clock", 0)) for e in entries.values()))
                        for c, entries in listed.items()]
            restored = "" if rollback.restored in rollback.unreadable else rollback.restored
            target = rollback_target(restored, complete)
            if target is None:
                if not rollback.waiting:
                    rollback.waiting = True
                    log.warning("scheduler: checkpoint %r (restored by server %d) is not "
                                "listed in Redis; waiting for its server to list it again",
                                rollback.restored, rollback.shard)
                return
            # The entries checked above, not read again: what is restored is what was checked.
            rollback.target, rollback.entries = target, listed.get(target, {})
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
                    log.warning("scheduler: shard %d cannot restore checkpoint %r (%s); "
                                "rolling back to an older checkpoint", shard, checkpoint_id,
                                exc.details())
                    rollback.unreadable.add(checkpoint_id)
                    rollback.target, rollback.done = None, set()
                    return
                log.warning("scheduler: restoring shard %d to checkpoint %r failed (%s: %s); "
                            "retrying", shard, checkpoint_id, exc.code(), exc.details())
        if len(done) < self.spec.servers:
            return
        clock = int(next(iter(entries.values()), {}).get("clock", 0)) if entries else 0
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

    def _signed_checkpoints(self, skip: set[str]) -> dict[str, dict[int, dict[str, Any]]]:
        """The checkpoints every shard has written, as Redis lists them (id -> entries,
        newest listed first), less those in `skip`. With the job's secret, one with an entry
        not signed with it is left out too, like an unreadable one: added to `skip` with a
        warning."""
        secret, job, servers = self.admin.security.secret, self.spec.job, self.spec.servers
        found: dict[str, dict[int, dict[str, Any]]] = {}
        for checkpoint_id, entries in self.store.complete(servers):
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
        return found

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
    unreadable: set[str] = field(default_factory=set)
    # The chosen checkpoint's entries (shard -> {path, sha256, nbytes, clock, mac}).
    entries: dict[int, dict[str, Any]] = field(default_factory=dict)


def _incarnations(beats: dict[int, dict[str, Any] | None], believe_lapses: bool
                  ) -> dict[int, int | None]:
    """Each member's incarnation, None where its beat lapsed; with `believe_lapses` False
    the lapsed ones are left out (they say nothing about their process)."""
    return {m: (None if b is None else int(b.get("incarnation", 0))) for m, b in beats.items()
            if b is not None or believe_lapses}


def _generations(beats: dict[int, dict[str, Any] | None]) -> list[int]:
    """The rollback generation each live server reports holding."""
    return [int(b.get("generation", 0)) for b in beats.values() if b is not None]
