"""A job's heartbeats as tests read them (through the job's Redis store)."""

from __future__ import annotations

from procs import wait_until

from scheduler.store import JobStore


def worker_clock(store: JobStore, rank: int) -> int:
    """The clock rank `rank` last reported; -1 before its first heartbeat."""
    beat = store.heartbeats("worker", [rank]).get(rank)
    return -1 if beat is None else int(beat["clock"])


def server_pid(store: JobStore, shard: int) -> int | None:
    """The pid of shard `shard`'s server as its last heartbeat gives it."""
    beat = store.heartbeats("server", [shard]).get(shard)
    return None if beat is None else int(beat["pid"])


def live_server_pid(store: JobStore, shard: int, timeout_s: float = 10.0) -> int:
    """The pid of shard `shard`'s live server, waiting up to `timeout_s` for its heartbeat: a
    loaded machine may pause a server past its heartbeat's time to live (the scheduler only
    suspects it then), so a single read can miss a server that is alive."""
    pid = wait_until(lambda: server_pid(store, shard), timeout_s, f"server {shard}'s heartbeat")
    assert isinstance(pid, int)
    return pid
