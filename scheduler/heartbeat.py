"""Heartbeats: a background thread that keeps a process's heartbeat key alive in Redis."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from scheduler.detector import connection_name
from scheduler.store import JobStore, ride_out

log = logging.getLogger(__name__)


class Heartbeat:
    """Beats every `interval_s` for (role, ident) until stopped.

    Each beat writes `payload()` with a time to live of `ttl_s`, and re-writes the
    registration, so a Redis that comes back empty refills itself. `on_beat` runs after each
    beat (a server checks for checkpoint requests there). Redis outages are ridden out: the
    thread logs and keeps trying; it never stops the process. Thread-safe start/stop.
    `sleep(interval_s)` waits between beats and returns True to end them (default: until
    stop); `wall_clock` stamps each beat with the time status reports count its age from.
    Each beat names its Redis connection after the process (role, ident and the
    registration's incarnation), so the scheduler can tell a paused process, whose
    connection stays open, from one that exited (scheduler/detector.py).
    """

    def __init__(
        self, store: JobStore, role: str, ident: int, *, interval_s: float, ttl_s: float,
        payload: Callable[[], Mapping[str, Any]], registration: Mapping[str, Any],
        on_beat: Callable[[], None] | None = None,
        sleep: Callable[[float], bool] | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.role = role
        self.ident = ident
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self._payload = payload
        self._registration = dict(registration)
        self._on_beat = on_beat
        self._stop = threading.Event()
        self._sleep = sleep or self._stop.wait
        self._wall_clock = wall_clock
        self._thread = threading.Thread(
            target=self._run, name=f"heartbeat-{role}{ident}", daemon=True
        )

    def start(self) -> None:
        self.beat()
        self._thread.start()

    def beat(self, ttl_s: float | None = None, **extra: Any) -> None:
        """One beat now (also used at start so the process is visible at once), living
        `ttl_s` (default: the heartbeat's), its payload with `extra` added."""
        payload = {**self._payload(), **extra, "time": self._wall_clock()}
        ttl_s = self.ttl_s if ttl_s is None else ttl_s
        registration = dict(self._registration)
        name = connection_name(self.store.keys.job, self.role, self.ident,
                               int(registration.get("incarnation", 0)))
        ride_out(
            "heartbeat",
            lambda: self.store.beat(self.role, self.ident, payload, ttl_s,
                                    registration, name=name),
            None,
        )

    def update_registration(self, **fields: Any) -> None:
        self._registration.update(fields)

    def _run(self) -> None:
        while not self._sleep(self.interval_s):
            try:
                self.beat()
                if self._on_beat is not None:
                    self._on_beat()
            except Exception:  # a bug in a hook must not stop the heartbeat
                log.exception("%s %d: heartbeat hook failed", self.role, self.ident)

    def linger(self, ttl_s: float) -> None:
        """Stops beating, leaving one last beat (marked "exiting") that lives `ttl_s`: the
        process exits on purpose, and its supervisor says how (a script that returned is
        recorded finished) before the beat lapses. Blocks for one Redis call at most."""
        self.stop(forget=False)
        self.beat(ttl_s, exiting=True)

    def stop(self, forget: bool = True) -> None:
        """Stops beating; with `forget`, deletes the key and hangs up the connections the
        beats named, so the exit is seen at once."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if forget:
            ride_out("heartbeat",
                     lambda: self.store.forget(self.role, self.ident, hang_up=True), None)
