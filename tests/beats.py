"""A job's heartbeats as tests read them (through the job's Redis store)."""

from __future__ import annotations

from typing import Any

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


def live_beats(store: JobStore, role: str, idents: list[int],
               timeout_s: float = 10.0) -> dict[int, dict[str, Any]]:
    """The heartbeats of every member `idents` of `role`, waiting up to `timeout_s` until
    each has one: a loaded machine may pause a process past its heartbeat's time to live
    (the scheduler only suspects it then), so a single read can miss a live process."""
    def all_beating() -> dict[int, dict[str, Any]] | None:
        beats = store.heartbeats(role, idents)
        if any(b is None for b in beats.values()):
            return None
        return {i: b for i, b in beats.items() if b is not None}

    found = wait_until(all_beating, timeout_s, f"the heartbeats of {role} {idents}")
    assert isinstance(found, dict)
    return found


def live_server_pid(store: JobStore, shard: int, timeout_s: float = 10.0) -> int:
    """The pid of shard `shard`'s live server (see live_beats)."""
    return int(live_beats(store, "server", [shard], timeout_s)[shard]["pid"])
