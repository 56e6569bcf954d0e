"""A job's heartbeats as tests read them (through the job's Redis store)."""

from __future__ import annotations

from scheduler.store import JobStore


def worker_clock(store: JobStore, rank: int) -> int:
    """The clock rank `rank` last reported; -1 before its first heartbeat."""
    beat = store.heartbeats("worker", [rank]).get(rank)
    return -1 if beat is None else int(beat["clock"])


def server_pid(store: JobStore, shard: int) -> int | None:
    """The pid of shard `shard`'s server as its last heartbeat gives it."""
    beat = store.heartbeats("server", [shard]).get(shard)
    return None if beat is None else int(beat["pid"])
