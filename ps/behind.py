"""Write-behind applies: a push is acknowledged once checked, and applied right after.

A push streamed over gRPC spends its last moments in the optimizer: about a millisecond per
16 MiB of dense SGD, more under Adam or for sparse rows, all on the critical path of the
worker's call. Once the push is checked (shape, dtype, keys, every value finite) and admitted
by the ledger, nothing can refuse it any more, so the server may answer first and apply on a
thread of its own while the next request arrives.

Only pushes whose memory the server owns go behind: not those read from a shared-memory or
UCX buffer the worker reuses after the answer. Exchanges apply before they answer too: their
pulls read the same tables right after.

What stays true:
- **Reads see every acknowledged push.** Every read of a table, and every write that does not
  go behind, first settles the table: waits until the applies queued for it have run. A
  worker that pulls after its push was acknowledged sees it, whoever pulls.
- **Order.** One thread applies, in the order the pushes were acknowledged; a table holds at
  most one apply in the queue (the next push to it waits for the one before), which also
  bounds the memory held by gradients waiting to apply.
- **Nothing acknowledged vanishes silently.** An apply that fails (a bug, memory) poisons its
  table: every later access to it raises that error, as an INTERNAL status, until the
  shard is restored from a checkpoint.

Checkpoints settle every table first; restores wait for the queue and drop its failures; stats
wait for it without raising (heartbeats and metrics read them).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from ps.errors import ApplyFailedError

log = logging.getLogger(__name__)


class WriteBehind:
    """One applier thread for one shard, and the latest queued apply of each table."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._queued: dict[str, Future[None]] = {}
        self._executor: ThreadPoolExecutor | None = None

    def submit(self, table: str, apply: Callable[[], None]) -> None:
        """Queues `apply` for `table`. Callers settle(table) first, so that a table holds
        at most one queued apply (two racing pushes to one table may queue two)."""
        with self._lock:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix=self._name)
            future = self._executor.submit(apply)
            self._queued[table] = future
        future.add_done_callback(lambda f: self._report(table, f))

    def settle(self, table: str) -> None:
        """Returns once every apply queued for `table` has run; raises if one failed."""
        with self._lock:
            future = self._queued.get(table)
        if future is None:
            return
        error = future.exception()
        if error is not None:
            raise ApplyFailedError(
                f"an acknowledged push to table {table!r} failed to apply ({error!r}); the "
                "table is unusable until this shard is restored from a checkpoint"
            ) from error
        with self._lock:
            if self._queued.get(table) is future:
                del self._queued[table]

    def settle_all(self) -> None:
        """settle() for every table with an apply queued."""
        with self._lock:
            tables = list(self._queued)
        for table in tables:
            self.settle(table)

    def wait(self) -> None:
        """Returns once every queued apply has run, failed or not (failures stay kept)."""
        with self._lock:
            futures = list(self._queued.values())
        for future in futures:
            future.exception()

    def forget(self) -> None:
        """Waits for queued applies, then drops their outcomes, failures included (a restore
        replaces the tables they wrote)."""
        self.wait()
        with self._lock:
            self._queued.clear()

    def pending(self) -> int:
        """Tables with an apply queued or a failure kept."""
        with self._lock:
            return len(self._queued)

    def _report(self, table: str, future: Future[None]) -> None:
        error = future.exception()
        if error is not None:
            log.error("%s: an acknowledged push to table %r failed to apply", self._name, table,
                      exc_info=error)
