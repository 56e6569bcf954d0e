"""A reader-writer lock: many holders in shared mode, or one in exclusive mode."""

from __future__ import annotations

import threading


class RWLock:
    """Shared/exclusive lock that prefers writers, so growth is not starved by a stream of reads.

    `with lock.shared():` and `with lock.exclusive():` hold it. Not reentrant. Thread-safe.
    """

    def __init__(self) -> None:
        # Guards _readers, _writer and _writers_waiting.
        self._cond = threading.Condition(threading.Lock())
        self._readers = 0
        self._writer = False
        self._writers_waiting = 0
        # Every push and pull takes the shared mode several times: plain objects with
        # __enter__ and __exit__ cost a third of what a generator context manager does.
        self._shared = _Shared(self)
        self._exclusive = _Exclusive(self)

    def shared(self) -> _Shared:
        """Hold the lock in shared mode; blocks while a writer holds or waits for it."""
        return self._shared

    def exclusive(self) -> _Exclusive:
        """Hold the lock alone; blocks until every shared holder has left."""
        return self._exclusive


class _Mode:
    """One mode of an RWLock, as a context manager."""

    __slots__ = ("_lock",)

    def __init__(self, lock: RWLock) -> None:
        self._lock = lock


class _Shared(_Mode):
    __slots__ = ()

    def __enter__(self) -> None:
        lock = self._lock
        with lock._cond:
            while lock._writer or lock._writers_waiting:
                lock._cond.wait()
            lock._readers += 1

    def __exit__(self, *exc: object) -> None:
        lock = self._lock
        with lock._cond:
            lock._readers -= 1
            # Only a writer waits for readers to leave.
            if not lock._readers and lock._writers_waiting:
                lock._cond.notify_all()


class _Exclusive(_Mode):
    __slots__ = ()

    def __enter__(self) -> None:
        lock = self._lock
        with lock._cond:
            lock._writers_waiting += 1
            while lock._writer or lock._readers:
                lock._cond.wait()
            lock._writers_waiting -= 1
            lock._writer = True

    def __exit__(self, *exc: object) -> None:
        lock = self._lock
        with lock._cond:
            lock._writer = False
            lock._cond.notify_all()
