"""`PSOptimizer`: the training loop's handle on the servers' optimizers.

It plays the local optimizer's part: `step()` hands every gradient of the step of every PS
module of a model (worker/modules.py) and the end of the iteration to the exchange pipeline
(worker/pipeline.py), and decides whether that exchange overlaps the next step's compute
(where every table's mode allows stale reads) and how many steps ahead pulls are asked for.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from typing import Literal

import torch
from torch import nn

from protos import modes
from worker.errors import PSModuleError
from worker.modules import PSDense, PSModule
from worker.pipeline import Gradient, Outbox, Pipeline
from worker.plan import Push

log = logging.getLogger(__name__)

# prefetch_depth="auto" with overlap: pulls asked two steps ahead give each exchange two
# steps of compute to arrive in, at the price of reads one step staler. Over gRPC two
# exchanges travel at once (a round trip there can outlast a step); over request lanes
# (every server on this host) one does, as a second one in flight only adds contention.
AUTO_PREFETCH_DEPTH = 2


def overlap_staleness(
    mode: modes.Mode | None, default_mode: modes.Mode, default_staleness: int
) -> int | None:
    """How many clocks stale a read may be under `mode`: None for unbounded (async).

    Sync reads are exact, so sync counts as 0. `mode` None means the server's default mode;
    an ssp mode without a bound has the server's default bound.
    """
    resolved = (mode or default_mode).with_default(default_staleness)
    if resolved.kind is modes.Kind.ASYNC:
        return None
    return resolved.staleness or 0


class PSOptimizer:
    """The training loop's handle on the servers' optimizers for every PS module of `model`.

    `step()` pushes the step's gradients (the gradients of lookups of one table in a step
    are summed) and ends the iteration on every shard, in one exchange per shard that also
    carries the pulls asked for the next step (prefetches, and every PSDense's values).
    `overlap` (default: allowed by every table's mode, i.e. async or ssp with bound >= 1)
    defers that exchange to the next step, which sends it in the background (at its first
    forward, or at depth > 1 once its forward is done: see `zero_grad`): at most one step's
    pushes wait to be sent. `overlap=True` with a sync (or
    ssp:0) table raises PSModuleError: those modes promise exact reads.

    `prefetch_depth` d > 1 (overlap only) asks for pulls d steps ahead, so an exchange has
    d steps of compute to arrive in; reads are then up to d steps stale, so every ssp
    table's bound must be at least d. Feed `prefetch()` the batch d steps ahead
    (`lookahead(batches, ps.prefetch_depth)`). Where every server answers over a request
    lane (`PSClient.exchange_lanes()`, fixed at construction) the exchanges travel one at a
    time, in order; otherwise up to d at once (`in_flight`), for gRPC round trips longer
    than a step. `prefetch_depth="auto"` picks 2 (AUTO_PREFETCH_DEPTH) where overlap is on
    and every ssp bound allows it; else 1.

    Construction may ask the servers for their default mode (blocks briefly). Methods are
    meant for the training thread and are not thread-safe; the exchange thread they start
    is joined by `close()`.
    """

    def __init__(
        self, model: nn.Module, *, overlap: bool | None = None,
        prefetch_depth: int | Literal["auto"] = 1,
    ) -> None:
        modules = [m for m in model.modules() if isinstance(m, PSModule)]
        if not modules:
            raise PSModuleError(
                "the model has no PSEmbedding, PSEmbeddingBag or PSDense: nothing to push"
            )
        clients = {id(m.client) for m in modules}
        if len(clients) != 1:
            raise PSModuleError("every PS module of one model must share one PSClient")
        for m in modules:
            m.ps_check_free()
        self.client = modules[0].client
        self._modules = modules
        staleness = self._staleness(modules)
        exact = [m.table for m in modules if staleness[m.table] == 0]
        if overlap and exact:
            raise PSModuleError(
                f"overlap needs every table to allow stale reads, but {exact} are sync or "
                "ssp with bound 0; declare them with consistency='async' or 'ssp:S' (S >= 1), or "
                "leave overlap off"
            )
        self.overlap = not exact if overlap is None else overlap
        bounds = [b for b in staleness.values() if b is not None]
        if prefetch_depth == "auto":
            prefetch_depth = min([AUTO_PREFETCH_DEPTH, *bounds]) if self.overlap else 1
        if not isinstance(prefetch_depth, int):
            raise PSModuleError(f"prefetch_depth must be an int or 'auto', got {prefetch_depth!r}")
        if prefetch_depth < 1 or (prefetch_depth > 1 and not self.overlap):
            raise PSModuleError(
                f"prefetch_depth must be 1, or more with overlap; got {prefetch_depth} "
                f"(overlap {self.overlap})"
            )
        if prefetch_depth > 1 and bounds and prefetch_depth > min(bounds):
            raise PSModuleError(
                f"prefetch_depth {prefetch_depth} would read past the staleness bound "
                f"{min(bounds)} of an ssp table; use at most {min(bounds)}"
            )
        self.prefetch_depth = prefetch_depth
        self.in_flight = 1 if all(self.client.exchange_lanes()) else prefetch_depth
        dense = [m for m in modules if isinstance(m, PSDense)]
        self._pipeline = Pipeline(self.client, self.overlap, dense, prefetch_depth,
                                  self.in_flight)
        for m in modules:
            m.ps_attach(self._pipeline)
        log.info("worker %d: PSOptimizer over %d tables, overlap %s, prefetch depth %d, %d "
                 "exchange(s) in flight", self.client.worker, len({m.table for m in modules}),
                 self.overlap, prefetch_depth, self.in_flight)

    def _staleness(self, modules: Sequence[PSModule]) -> dict[str, int | None]:
        default_mode, default_staleness = modes.ASYNC, 0
        # Only the servers know their default mode and bound.
        if any(m.consistency is None or m.consistency == modes.SSP for m in modules):
            info = self.client.stats()[0].info
            try:
                default_mode = modes.from_proto(info.consistency) or modes.ASYNC
            except modes.ModeError as exc:
                raise PSModuleError(f"the servers' default mode: {exc}") from exc
            default_staleness = int(info.staleness)
        return {
            m.table: overlap_staleness(m.consistency, default_mode, default_staleness)
            for m in modules
        }

    @property
    def clock(self) -> int:
        """The clock of the step being computed (the servers' clock may lag under overlap)."""
        return self._pipeline.clock

    def zero_grad(self) -> None:
        """Clears the gradients of the lookups and parameters of this step, as
        torch.optim.Optimizer.zero_grad(set_to_none=True) does. Does not block.

        Called between a step's forward and its backward, it also tells an overlapped
        pipeline deeper than one step that the forward is done, so the exchange leaves
        then and its Python runs beside the backward (otherwise it leaves at `step()`).
        """
        for m in self._modules:
            m.ps_zero_grad()
        self._pipeline.forward_done()

    def step(self) -> None:
        """Pushes this step's gradients and ends the iteration on every shard.

        Without overlap it blocks until both are done (and the next step's pulls with
        them). With overlap it returns at once: this step's gradients leave with the next
        forward, or with `flush()`, each of which first waits for the exchange before it
        (raising its error, if any), so the round trip also hides behind the loading of
        the next batch.
        """
        grads = [g for m in self._modules for g in m.ps_gradients()]
        event = None
        if torch.cuda.is_available() and any(g.grad.is_pinned() for g in grads):
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
        pipeline = self._pipeline
        pushes = [push_of(table, items) for table, items in by_table(grads)]
        if not self.overlap:
            clock = self.client.clock
            self.client.hold_position(clock)
            pipeline.outbox = Outbox(clock, pushes, event)
            pipeline.ask_dense(clock + 1)
            pipeline.dispatch(outbox=True, up_to=clock + 1)
            pipeline.drain()
            return
        pipeline.forward_done()
        if pipeline.outbox is not None:
            # No PS forward ran in this step to send the last one's gradients: send them.
            pipeline.forward_started()
            pipeline.forward_done()
        clock = pipeline.step_clock
        # The script's data position now is the one this step's end reports.
        self.client.hold_position(clock)
        pipeline.outbox = Outbox(clock, pushes, event)
        pipeline.step_clock = clock + 1

    def flush(self) -> None:
        """Blocks until every pushed gradient has been applied and its iteration ended.

        Call it before evaluating or saving. Raises the error of a failed exchange.
        """
        pipeline = self._pipeline
        if pipeline.outbox is not None:
            pipeline.settle()
        pipeline.dispatch(outbox=True, up_to=-1)
        pipeline.drain()
        if self.overlap:
            pipeline.settle()
        pipeline.forget_dense()

    def close(self) -> None:
        """Flushes, stops the exchange thread and releases the modules. Idempotent."""
        try:
            self.flush()
        finally:
            self._pipeline.shutdown()
            for m in self._modules:
                m.ps_detach()

    def __enter__(self) -> PSOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def push_of(table: str, items: list[Gradient]) -> Push:
    """One table's gradients of a step as one push."""
    if items[0].kind == "dense":
        total = items[0].grad
        for item in items[1:]:
            total = total + item.grad
        return Push(table, total)
    keys = [i.keys for i in items if i.keys is not None]
    if len(items) == 1:
        return Push(table, items[0].grad, keys[0].numpy(), assume_unique=True)
    # Lookups of one table in one step may share ids; the client sums their gradients.
    return Push(table, torch.cat([i.grad for i in items]), torch.cat(keys).numpy())


def by_table(grads: list[Gradient]) -> Iterator[tuple[str, list[Gradient]]]:
    tables: dict[str, list[Gradient]] = {}
    for g in grads:
        tables.setdefault(g.table, []).append(g)
    yield from tables.items()
