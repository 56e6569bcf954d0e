"""The scheduler: holds the leader lease, detects deaths, publishes events, drives servers.

One scheduler per job leads; others wait as standbys and take over when the lease lapses.
The leader polls heartbeats every `poll_s`, turns them into membership events, tells every
server which workers are live, and asks for periodic checkpoints. Redis outages pause it;
they never stop it.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from scheduler.admin import ServerAdmin
from scheduler.membership import MembershipTracker, Transition
from scheduler.spec import JobSpec
from scheduler.store import REDIS_DOWN, JobStore, ride_out

log = logging.getLogger(__name__)


class Scheduler:
    """Runs the leader loop until `stop` is set. `run` blocks; `step` is one poll (tests)."""

    def __init__(
        self, store: JobStore, spec: JobSpec, *, poll_s: float = 0.1, lease_s: float = 2.0,
        ident: str | None = None, clock: Callable[[], float] = time.monotonic,
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
        self.admin = ServerAdmin()
        self._pushed: dict[int, tuple[int, tuple[int, ...]]] = {}
        self._next_checkpoint_s = 0.0
        # Shards this leader has seen serve: one coming back again was restarted.
        self._seen_servers: set[int] = set()
        # A sync rollback not yet carried out everywhere: (checkpoint id, shards done).
        self._rollback: tuple[str, set[int]] | None = None
        self._generation = 0
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
                if self.leading:
                    self.step()
            except REDIS_DOWN as exc:
                log.warning("scheduler: Redis unavailable (%s); retrying", exc)
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
                log.warning("scheduler %s lost the leader lease", self.ident)
            return
        if self.store.acquire_lease(self.ident, self.lease_s):
            self.leading = True
            log.info("scheduler %s leads job %r", self.ident, self.spec.job)
            self.store.event("leader", "scheduler", self.ident)
            self._adopt()

    def _adopt(self) -> None:
        """A new leader starts from the registrations: registered but silent means dead."""
        self.workers = MembershipTracker()
        self.servers = MembershipTracker()
        self._pushed.clear()
        for role, tracker in (("worker", self.workers), ("server", self.servers)):
            registered = self.store.members(role)
            beats = self.store.heartbeats(role, sorted(registered))
            for member, info in registered.items():
                if beats.get(member) is None:
                    tracker.dead.add(member)
                    tracker.alive.pop(member, None)
                    self.store.event("dead", role, member, incarnation=info.get("incarnation", 0),
                                     note="found dead at takeover")

    # ---- one poll ----------------------------------------------------------------------------

    def step(self) -> None:
        if self.store.spec() is None:
            # Redis came back empty: the leader's memory rebuilds the job.
            self.store.put_spec(self.spec)
            self.store.event("rebuilt", "scheduler", self.ident)
            log.warning("scheduler: job %r was missing from Redis; rebuilt it", self.spec.job)
        worker_ids = sorted(set(range(self.spec.workers)) | set(self.store.members("worker")))
        server_ids = list(range(self.spec.servers))
        worker_beats = self.store.heartbeats("worker", worker_ids)
        server_beats = self.store.heartbeats("server", server_ids)
        for t in self.workers.update(_incarnations(worker_beats)):
            if t.kind == "dead" and t.member in self._restarting:
                self.workers.dead.discard(t.member)
                self.store.event("restarting", "worker", t.member, incarnation=t.incarnation)
                continue
            if t.kind == "joined":
                self._restarting.pop(t.member, None)
            self._announce("worker", t)
        now = self._now()
        for rank, until in list(self._restarting.items()):
            if now > until and rank not in self.workers.alive:
                del self._restarting[rank]
                self.workers.dead.add(rank)
                self.store.event("dead", "worker", rank, note="did not restart after rollback")
        for t in self.servers.update(_incarnations(server_beats)):
            self._announce("server", t)
            if t.kind in ("joined", "restored") and t.member in self._seen_servers \
                    and self.spec.mode == "sync":
                restored = str(self.store.members("server").get(t.member, {}).get("restored", ""))
                self._rollback = (restored, set())
                self._generation = self.store.generation() + 1
                log.warning("server %d came back with checkpoint %r: rolling the job back",
                            t.member, restored or "(none: empty)")
            self._seen_servers.add(t.member)
        if self._rollback is not None:
            self._roll_back(server_beats)
            return
        self._drive_servers(server_beats)
        self._checkpoints(server_beats)

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
        if self._rollback is None:
            return
        checkpoint_id, done = self._rollback
        entries = self.store.checkpoint(checkpoint_id) if checkpoint_id else {}
        for shard, beat in sorted(beats.items()):
            if shard in done or beat is None:
                continue
            entry = entries.get(shard, {})
            try:
                self.admin.restore(str(beat["address"]), checkpoint_id,
                                   str(entry.get("path", "")), str(entry.get("sha256", "")),
                                   self._generation)
                done.add(shard)
            except grpc.RpcError as exc:
                log.warning("scheduler: restoring shard %d failed (%s); retrying", shard,
                            exc.code())
        if len(done) < self.spec.servers:
            return
        clock = int(next(iter(entries.values()), {}).get("clock", 0)) if entries else 0
        generation = self._generation
        until = self._now() + self.restart_grace_s
        self._restarting = {rank: until for rank in self.live_workers()}
        self.store.set_generation(generation)
        self.store.event("rollback", "scheduler", self.ident, checkpoint=checkpoint_id,
                         clock=clock, generation=generation)
        log.warning("job %r rolled back to checkpoint %r (clock %d); workers restart",
                    self.spec.job, checkpoint_id, clock)
        self._rollback = None
        self._pushed.clear()

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


def _incarnations(beats: dict[int, dict[str, Any] | None]) -> dict[int, int | None]:
    return {m: (None if b is None else int(b.get("incarnation", 0))) for m, b in beats.items()}
