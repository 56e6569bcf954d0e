"""The exchange pipeline shared by a PSOptimizer and its modules: the step clock, the pulls
asked for the steps ahead (tickets), the gradients of a finished step (the outbox), and the
one thread that runs exchanges in order.

Every step costs one `PSClient.exchange` per shard: a finished step's pushes and the end of
its iteration, with the pulls of the steps ahead. With overlap the exchange leaves during
the next step (so the loop's prefetches ride along) and runs while that step computes: at
its first forward when pulls are asked one step ahead, as the exchange then has only that
step to arrive in; deeper, once its forward is done (`forward_done`), so the exchange
thread's Python runs beside the backward, which leaves the interpreter lock free, rather
than beside the forward, which needs it. Without overlap `step()` sends it and waits. Also
here: moving pulled rows to a module's device and gradients back (pinned host memory for
GPUs).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from worker.client import PSClient
from worker.errors import PSModuleError
from worker.plan import Pull, Push

log = logging.getLogger(__name__)


def same_ids(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two int64 CPU id tensors are equal, shape and values.

    Compared as bytes, not with torch.equal: a torch op lets go of the GIL, and the
    exchange thread that takes it over keeps the training thread waiting.
    """
    return a is b or (a.shape == b.shape and a.numpy().tobytes() == b.numpy().tobytes())


def staged(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` ready for a copy to `device`: in pinned memory when `device` is a GPU."""
    if device.type != "cuda" or host.is_pinned():
        return host
    pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    pinned.copy_(host)
    return pinned


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return host
    # The caching host allocator keeps a pinned buffer alive until this copy has run.
    return staged(host, device).to(device, non_blocking=True)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor`, detached; from a GPU it is pinned and asynchronous (see
    Gradient)."""
    if tensor.requires_grad:
        tensor = tensor.detach()
    if tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


@dataclass
class Pulled:
    """Rows pulled for a batch of ids: unique keys, where each id sits in them, host rows."""

    keys: torch.Tensor
    inverse: torch.Tensor
    rows: torch.Tensor


@dataclass(eq=False)  # tickets are told apart by identity, never by their tensors
class Ticket:
    """A pull a module will need at step `clock`: of sparse rows for `ids`, or (ids None)
    of a dense table. It waits in the pipeline until an exchange carries it; `future` then
    gives that exchange's pulled tensors, this ticket's at `index`.
    """

    table: str
    clock: int
    device: torch.device
    ids: torch.Tensor | None = None
    keys: torch.Tensor | None = None
    inverse: torch.Tensor | None = None
    future: Future[list[torch.Tensor]] | None = None
    index: int = -1

    def pull(self) -> Pull:
        """What to ask the servers for. Runs on the exchange thread, which also finds the
        unique keys of a sparse ticket: that work stays off the training thread."""
        if self.ids is None:
            return Pull(self.table)
        if self.keys is None or self.inverse is None:
            self.keys, self.inverse = torch.unique(self.ids, return_inverse=True)
        return Pull(self.table, self.keys.numpy(), assume_unique=True)

    def pulled(self, rows: torch.Tensor) -> Pulled:
        """A sparse ticket's answer, once its exchange is done."""
        if self.keys is None or self.inverse is None:
            raise PSModuleError(f"table {self.table!r}: rows arrived for a pull never sent")
        return Pulled(self.keys, self.inverse, rows)


@dataclass
class Gradient:
    """A gradient to push. A GPU gradient's host copy is complete once the step's event is."""

    table: str
    kind: str  # "sparse" or "dense"
    grad: torch.Tensor
    keys: torch.Tensor | None = None


@dataclass
class Outbox:
    """A finished step's gradients and the end of its iteration, not sent yet."""

    clock: int
    pushes: list[Push]
    event: torch.cuda.Event | None


class DenseSource(Protocol):
    """A module whose dense table's values every step pulls (PSDense)."""

    table: str

    @property
    def device(self) -> torch.device: ...


class Pipeline:
    """What a PSOptimizer shares with its modules: the step clock, the tickets of pulls
    to come (each held for the module that asked, until its forward takes it), the
    gradients to send, and the one thread that runs exchanges in order.

    Methods are for the training thread only; the exchange thread touches only futures.
    """

    def __init__(
        self, client: PSClient, overlap: bool, dense: Sequence[DenseSource], depth: int,
        in_flight: int = 1,
    ) -> None:
        """`depth`: how many steps ahead pulls are asked for; `in_flight` (1 to `depth`): how
        many exchanges may travel at once."""
        if not 1 <= in_flight <= depth:
            raise ValueError(f"in_flight must be from 1 to depth {depth}, got {in_flight}")
        self.client = client
        self.overlap = overlap
        self.depth = depth
        # The clock of the step being computed, in overlap mode (the client's clock lags
        # behind it while the previous step's pushes are in flight).
        self.step_clock = client.clock
        self.dense = list(dense)
        # One thread: exchanges apply in the order they were sent, each with `depth` steps to
        # arrive in. More: up to `in_flight` overlap; each still carries the end of the
        # iteration its own pulls need, and the staleness bound (>= depth) covers the ones
        # still in flight.
        self._exchanges = ThreadPoolExecutor(max_workers=in_flight,
                                             thread_name_prefix="ps-exchange")
        self.outbox: Outbox | None = None
        self._waiting: list[Ticket] = []  # not sent yet
        # Tickets asked ahead of the forward that will use them, by the module that asked
        # (its id), oldest first.
        self._ahead: dict[int, deque[Ticket]] = {}
        self._dense_clock = -1  # the newest step whose dense pulls were asked for
        self._sent: deque[Future[list[torch.Tensor]]] = deque()
        self._due = False  # a forward has begun a step whose exchange has not left yet

    @property
    def clock(self) -> int:
        """The clock of the step being computed."""
        return self.step_clock if self.overlap else self.client.clock

    def wait(self, ticket: Ticket) -> torch.Tensor:
        """Blocks until `ticket`'s pull has arrived (sending it first if it is waiting)."""
        if ticket.future is None:
            self.dispatch(outbox=self.overlap, up_to=ticket.clock)
        if ticket.future is None:
            raise PSModuleError(f"the pull of {ticket.table!r} for step {ticket.clock} was "
                                "never sent")
        return ticket.future.result()[ticket.index]

    def forward_started(self) -> None:
        """A PS module's forward is about to run. With overlap, the first of a step waits
        for the exchanges in flight but the newest depth - 1 (raising their error); then,
        at depth 1, sends the previous step's gradients with the pulls asked for the next
        step; deeper, leaves that to `forward_done`."""
        if self.overlap:
            if self.outbox is not None:
                self.settle()
            self.ask_dense(self.step_clock + self.depth)
            self._due = True
            if self.depth == 1:
                self.forward_done()

    def forward_done(self) -> None:
        """The step's forward is over (PSOptimizer's zero_grad or step): sends the exchange
        its first forward began, if it has not left. Pulls further ahead than the depth wait
        for their turn: sent now, they could wait on this worker's own iterations still to
        come."""
        if self._due:
            self._due = False
            self.dispatch(outbox=True, up_to=self.step_clock + self.depth)

    def ask(self, ticket: Ticket) -> Ticket:
        """Queues `ticket` for the next exchange that carries pulls of its step."""
        self._waiting.append(ticket)
        return ticket

    def ask_ahead(self, owner: object, ticket: Ticket) -> None:
        """As `ask`, and keeps `ticket` for `owner`'s forward at its step (`ticket_for`)."""
        self._ahead.setdefault(id(owner), deque()).append(self.ask(ticket))

    def ticket_for(self, owner: object, clock: int, ids: torch.Tensor | None) -> Ticket | None:
        """The ticket `owner` asked ahead for step `clock` (and these ids), dropping its
        older ones; None when it asked for none."""
        tickets = self._ahead.get(id(owner))
        while tickets:
            head = tickets[0]
            if head.clock > clock:
                return None
            tickets.popleft()
            if head.clock == clock and (
                ids is None or (head.ids is not None and same_ids(head.ids, ids))
            ):
                return head
            log.debug("worker %d: table %r: pull for step %d unused at step %d",
                      self.client.worker, head.table, head.clock, clock)
        return None

    def forget_dense(self) -> None:
        """Drops the dense tickets asked ahead (pulled while the last gradients travelled):
        the next forward pulls afresh."""
        for source in self.dense:
            self._ahead.pop(id(source), None)

    def ask_dense(self, clock: int) -> None:
        """Tickets for every PSDense module's values at step `clock`, once per step."""
        if clock <= self._dense_clock:
            return
        self._dense_clock = clock
        for source in self.dense:
            self.ask_ahead(source, Ticket(source.table, clock, source.device))

    def dispatch(self, *, outbox: bool, up_to: int | None = None) -> None:
        """Sends, as one exchange, the outbox (if `outbox`) and the waiting tickets for
        steps up to `up_to` (all when None). Does not wait for it."""
        tickets = [t for t in self._waiting if up_to is None or t.clock <= up_to]
        box = self.outbox if outbox else None
        if box is None and not tickets:
            return
        if box is not None:
            self.outbox = None
        chosen = {id(t) for t in tickets}
        self._waiting = [t for t in self._waiting if id(t) not in chosen]
        clocks = sorted({t.clock for t in tickets})
        # Pulls for different steps wait for different clocks: one exchange per step.
        groups = [[t for t in tickets if t.clock == c] for c in clocks] or [[]]
        for i, group in enumerate(groups):
            future = self._exchanges.submit(self._run, box if i == 0 else None, group)
            for index, ticket in enumerate(group):
                ticket.future, ticket.index = future, index
            self._sent.append(future)
        while len(self._sent) > self.depth + 4 and self._sent[0].done():
            self._sent.popleft().result()

    def _run(self, box: Outbox | None, tickets: list[Ticket]) -> list[torch.Tensor]:
        if box is not None and box.event is not None:
            box.event.synchronize()
        client = self.client
        pushes = box.pushes if box is not None else []
        push_clock = box.clock if box is not None else client.clock
        pull_clock = tickets[0].clock if tickets else push_clock + 1
        pulled = client.exchange(
            pushes, end_iteration=box is not None, pulls=[t.pull() for t in tickets],
            push_clock=push_clock, pull_clock=pull_clock, follow_open_clock=self.depth == 1,
        )
        # Staging in pinned memory here keeps that copy off the training thread.
        return [staged(rows, t.device) for rows, t in zip(pulled, tickets, strict=True)]

    def settle(self) -> None:
        """Overlap: waits for the exchanges sent so far but the newest depth - 1, then
        follows a clock the servers moved on (the outbox, not sent yet, moves with it)."""
        self.drain(self.depth - 1)
        jumped = self.client.clock
        box = self.outbox
        first = box.clock if box is not None else self.step_clock
        if jumped > first:
            # The servers moved this worker on (it fell behind closed clocks); follow them.
            log.info("worker %d: clock jumped from %d to %d", self.client.worker, first, jumped)
            if box is not None:
                box.clock = jumped
            self.step_clock = jumped + (1 if box is not None else 0)

    def drain(self, keep: int = 0) -> None:
        """Blocks until every exchange sent so far but the newest `keep` is done; raises the
        first error among them."""
        done: list[Future[list[torch.Tensor]]] = []
        while len(self._sent) > keep:
            done.append(self._sent.popleft())
        errors = [f.exception() for f in done]
        for error in errors:
            if error is not None:
                raise error

    def shutdown(self) -> None:
        self._exchanges.shutdown(wait=True, cancel_futures=True)
        self._ahead.clear()


