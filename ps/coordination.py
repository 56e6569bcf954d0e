"""A server's part in its job: registration, heartbeats and checkpoint requests via Redis.

Nothing here is on the data plane: pulls and pushes never wait on Redis, and a Redis
outage only pauses heartbeats.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from ps.server import ParameterServer
from scheduler.heartbeat import Heartbeat
from scheduler.spec import JobSpec
from scheduler.store import JobStore

log = logging.getLogger(__name__)


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


class ServerCoordinator:
    """Keeps one server registered and heartbeating in its job. start/stop are thread-safe."""

    def __init__(
        self, store: JobStore, spec: JobSpec, server: ParameterServer, address: str,
        restored: str = "",
    ) -> None:
        self.store = store
        self.spec = spec
        self.server = server
        self.address = address
        shard = server.config.shard
        self.registration = {
            "address": address, "incarnation": server.config.incarnation, "pid": os.getpid(),
            "host": socket.gethostname(), "restored": restored, "started": time.time(),
        }
        self.heartbeat = Heartbeat(
            store, "server", shard, interval_s=spec.heartbeat_interval_s,
            ttl_s=spec.heartbeat_ttl_s, payload=self.payload, registration=self.registration,
        )

    def payload(self) -> dict[str, Any]:
        shard = self.server.shard
        stats = [s for s, _ in shard.stats()]
        state = shard.clock_state()
        return {
            **self.registration,
            "open_clock": state.open_clock,
            "tables": len(stats),
            "rows": sum(s.rows for s in stats),
            "bytes": sum(s.value_bytes + s.state_bytes + s.index_bytes for s in stats),
            "pushes": sum(s.counters.pushes_applied for s in stats),
            "dropped": sum(s.counters.pushes_dropped for s in stats),
        }

    def start(self) -> None:
        self.heartbeat.start()
        log.info("shard %d registered in job %r as %s", self.server.config.shard, self.spec.job,
                 self.address)

    def stop(self) -> None:
        self.heartbeat.stop(forget=True)
