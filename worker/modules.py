"""PyTorch modules whose parameters live on the parameter servers.

`PSEmbedding` and `PSEmbeddingBag` look up rows of server-side sparse tables (ids are any
int64, rows are created on first touch); `PSDense` keeps an ordinary `nn.Module`'s
parameters in one flat dense table on the servers. None of them owns an `nn.Parameter` that
a local optimizer should step: the servers run the optimizer. `PSOptimizer` plays the local
optimizer's part in the training loop: its `step()` pushes every gradient of the step and
ends the iteration, so a loop reads like plain PyTorch::

    client = PSClient(servers, worker=rank)
    model = nn.ModuleDict({
        "user": PSEmbedding(client, "user", 16, optimizer="adagrad", lr=0.05),
        "mlp": PSDense(client, nn.Linear(16, 1), "mlp", optimizer="adam", lr=1e-3),
    })
    ps = PSOptimizer(model)
    for (ids, y), upcoming in lookahead(batches):
        if upcoming is not None:
            model["user"].prefetch(upcoming[0])   # the next batch's rows, in the background
        loss = F.binary_cross_entropy_with_logits(model["mlp"](model["user"](ids)), y)
        ps.zero_grad()
        loss.backward()
        ps.step()              # pushes; returns at once where the mode allows overlap
    ps.flush()

How a step travels. A forward de-duplicates the ids (`torch.unique`), gathers or pools from
the unique rows (a small leaf tensor); autograd then leaves each unique row's summed
gradient in the leaf's `.grad`. A `PSDense` keeps a module's parameters in one flat dense
table. `step()` hands every table's gradients and the end of the iteration to one
`PSClient.exchange` per shard, and the same request carries the pulls asked for the next
step: `prefetch()`ed rows and every PSDense's values. So a step costs one round trip per
shard, however many tables the model has.

Overlap. Where every table's consistency mode allows staleness (async, or ssp with a bound
of at least 1), that exchange leaves at the next step's first forward, in the background,
and its pulls are ready by the step after: the network time hides behind a step of
compute, and reads are one step stale. Under `sync` (and ssp with bound 0) `step()` sends
it and waits, and the pulls in it wait for the iteration to close on the servers, so the
same loop keeps sync's exact semantics while still paying one round trip per step.

GPU workers. Give the sparse modules `device="cuda"` (or move the model with `.to()`), and
put the module wrapped by `PSDense` on the GPU. Pulled rows are staged in pinned host
memory and copied with `non_blocking=True`; gradients come back the same way and the
background pusher waits for that copy before sending.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from protos import modes
from worker.client import PSClient, Pull, Push
from worker.errors import PSClientError

log = logging.getLogger(__name__)

__all__ = [
    "InitializationTimeoutError",
    "PSDense",
    "PSEmbedding",
    "PSEmbeddingBag",
    "PSModuleError",
    "PSOptimizer",
]

Init = tuple[str, float, float]

# How often a worker that does not initialise a PSDense table looks for the initial values.
_INIT_POLL_S = 0.05
# prefetch_depth="auto" with overlap: two exchanges in flight hide a round trip longer than
# a step of compute (measured: MovieLens at batch 128 on 2 cores over gRPC, 1.2-1.3x the
# samples/s of depth 1), at the price of reads one step staler. Where a step's compute
# already hides the round trip, the second exchange only adds contention: at batch 1024, and
# at batch 128 too once every server is reached over a request lane (one host), so "auto"
# stays at 1 when every shard has one.
AUTO_PREFETCH_DEPTH = 2
_BAG_MODES = ("sum", "mean", "max")


class PSModuleError(PSClientError):
    """A PS module or PSOptimizer was built or used in a way it cannot work (message says why)."""


class InitializationTimeoutError(PSModuleError):
    """A worker waited too long for the worker that initialises a PSDense table."""


def _delay(seconds: float) -> None:
    """The one place this module sleeps, so tests can replace it."""
    time.sleep(seconds)


def _overlap_staleness(
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


def _parse_consistency(text: str) -> modes.Mode | None:
    try:
        return modes.parse_optional(text)
    except modes.ModeError as exc:
        raise PSModuleError(f"consistency={text!r}: {exc}") from exc


def _check_hyper(hyper: dict[str, float]) -> None:
    if "mode" in hyper:
        raise PSModuleError(
            "PS modules take the consistency mode as consistency='sync'|'ssp:S'|'async' "
            "(PSEmbeddingBag's mode is its pooling, as in nn.EmbeddingBag)"
        )


def _kwargs(hyper: dict[str, float]) -> dict[str, Any]:
    # Optimizer hyperparameters travel as **kwargs next to the client's typed keywords;
    # _check_hyper has kept those names out, which mypy cannot see.
    return hyper


def _as_ids(ids: torch.Tensor, what: str) -> torch.Tensor:
    """`ids` as a flat int64 CPU tensor (a copy when it lives on a GPU)."""
    if not isinstance(ids, torch.Tensor):
        raise PSModuleError(f"{what} must be a torch.Tensor of int64 ids, got {type(ids).__name__}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise PSModuleError(f"{what} must hold int64 (or int32) ids, got {ids.dtype}")
    return ids.detach().reshape(-1).to(device="cpu", dtype=torch.int64)


def _same_ids(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two flat int64 CPU id tensors are equal.

    Compared as bytes, not with torch.equal: a torch op lets go of the GIL, and the
    exchange thread that takes it over keeps the training thread waiting.
    """
    return a.shape == b.shape and a.numpy().tobytes() == b.numpy().tobytes()


def _staged(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` ready for a copy to `device`: in pinned memory when `device` is a GPU."""
    if device.type != "cuda" or host.is_pinned():
        return host
    pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    pinned.copy_(host)
    return pinned


def _to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return host
    # The caching host allocator keeps a pinned buffer alive until this copy has run.
    return _staged(host, device).to(device, non_blocking=True)


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A host copy of `tensor`; from a GPU it is pinned and asynchronous (see _Gradient)."""
    tensor = tensor.detach()
    if tensor.device.type == "cpu":
        return tensor
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    return host


@dataclass
class _Pulled:
    """Rows pulled for a batch of ids: unique keys, where each id sits in them, host rows."""

    keys: torch.Tensor
    inverse: torch.Tensor
    rows: torch.Tensor


@dataclass(eq=False)  # tickets are told apart by identity, never by their tensors
class _Ticket:
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

    def pulled(self, rows: torch.Tensor) -> _Pulled:
        """A sparse ticket's answer, once its exchange is done."""
        if self.keys is None or self.inverse is None:
            raise PSModuleError(f"table {self.table!r}: rows arrived for a pull never sent")
        return _Pulled(self.keys, self.inverse, rows)


@dataclass
class _Lookup:
    """One forward's pulled rows (a leaf tensor) waiting for their gradient."""

    table: str
    keys: torch.Tensor
    rows: torch.Tensor


@dataclass
class _Gradient:
    """A gradient to push. A GPU gradient's host copy is complete once the step's event is."""

    table: str
    kind: str  # "sparse" or "dense"
    grad: torch.Tensor
    keys: torch.Tensor | None = None


@dataclass
class _Outbox:
    """A finished step's gradients and the end of its iteration, not sent yet."""

    clock: int
    pushes: list[Push]
    event: torch.cuda.Event | None


class _Pipeline:
    """What a PSOptimizer shares with its modules: the step clock, the tickets of pulls
    to come, the gradients to send, and the one thread that runs exchanges in order.

    Every step costs one `PSClient.exchange` per shard: a finished step's pushes and the
    end of its iteration, with the pulls of the steps ahead. With overlap the exchange
    leaves at the first forward of the next step (so the loop's prefetches ride along) and
    runs while that step computes; without it `step()` sends it and waits.

    Methods are for the training thread only; the exchange thread touches only futures.
    """

    def __init__(
        self, client: PSClient, overlap: bool, dense: Sequence[PSDense], depth: int
    ) -> None:
        self.client = client
        self.overlap = overlap
        # How many steps ahead pulls are asked for, and exchanges may be in flight.
        self.depth = depth
        # The clock of the step being computed, in overlap mode (the client's clock lags
        # behind it while the previous step's pushes are in flight).
        self.step_clock = client.clock
        self.dense = list(dense)
        # With depth 1, one thread: exchanges apply in the order they were sent. Deeper,
        # `depth` exchanges overlap; each still carries the end of the iteration its own
        # pulls need, and the staleness bound (>= depth) covers the ones still in flight.
        self._exchanges = ThreadPoolExecutor(max_workers=depth,
                                             thread_name_prefix="ps-exchange")
        self.outbox: _Outbox | None = None
        self._waiting: list[_Ticket] = []
        self._dense_clock = -1  # the newest step whose dense pulls were asked for
        self._sent: deque[Future[list[torch.Tensor]]] = deque()

    @property
    def clock(self) -> int:
        """The clock of the step being computed."""
        return self.step_clock if self.overlap else self.client.clock

    def wait(self, ticket: _Ticket) -> torch.Tensor:
        """Blocks until `ticket`'s pull has arrived (sending it first if it is waiting)."""
        if ticket.future is None:
            self.dispatch(outbox=self.overlap, up_to=ticket.clock)
        if ticket.future is None:
            raise PSModuleError(f"the pull of {ticket.table!r} for step {ticket.clock} was "
                                "never sent")
        return ticket.future.result()[ticket.index]

    def forward_started(self) -> None:
        """A PS module's forward is about to run. With overlap, the first of a step waits
        for the exchanges in flight but the newest depth - 1 (raising their error), then
        sends the previous step's gradients with the pulls asked for the steps ahead."""
        if self.overlap:
            if self.outbox is not None:
                self.settle()
            self.ask_dense(self.step_clock + self.depth)
            # Pulls further ahead wait for their turn: sent now, they could wait on this
            # worker's own iterations still to come.
            self.dispatch(outbox=True, up_to=self.step_clock + self.depth)

    def ask(self, ticket: _Ticket) -> _Ticket:
        self._waiting.append(ticket)
        return ticket

    def ask_dense(self, clock: int) -> None:
        """Tickets for every PSDense module's values at step `clock`, once per step."""
        if clock <= self._dense_clock:
            return
        self._dense_clock = clock
        for module in self.dense:
            module._tickets.append(self.ask(
                _Ticket(module.table, clock, module.device)
            ))

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

    def _run(self, box: _Outbox | None, tickets: list[_Ticket]) -> list[torch.Tensor]:
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
        return [_staged(rows, t.device) for rows, t in zip(pulled, tickets, strict=True)]

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


class _PSModule(nn.Module):
    """What PSOptimizer needs from a module whose parameters live on the servers."""

    def __init__(self, client: PSClient, name: str, mode: str) -> None:
        super().__init__()
        if not name:
            raise PSModuleError("a PS module needs a non-empty table name")
        self.client = client
        self.table = name
        # The table's own mode; None keeps the servers' default.
        self.consistency = _parse_consistency(mode)
        self._pipeline: _Pipeline | None = None
        # Pulls asked for ahead of the forward that will use them, oldest first.
        self._tickets: deque[_Ticket] = deque()

    def _check_free(self) -> None:
        if self._pipeline is not None:
            raise PSModuleError(
                f"table {self.table!r} already belongs to another PSOptimizer; use one "
                "PSOptimizer per model (close the old one first)"
            )

    def _attach(self, pipeline: _Pipeline) -> None:
        self._pipeline = pipeline

    def _detach(self) -> None:
        self._pipeline = None
        self._tickets.clear()

    def _clock(self) -> int | None:
        return None if self._pipeline is None else self._pipeline.clock

    def _ticket_for(self, clock: int, ids: torch.Tensor | None) -> _Ticket | None:
        """The ticket asked for step `clock` (and these ids), dropping older ones."""
        while self._tickets:
            head = self._tickets[0]
            if head.clock > clock:
                return None
            self._tickets.popleft()
            if head.clock == clock and (
                ids is None or (head.ids is not None and _same_ids(head.ids, ids))
            ):
                return head
            log.debug("worker %d: table %r: pull for step %d unused at step %d",
                      self.client.worker, self.table, head.clock, clock)
        return None

    def _take_gradients(self) -> list[_Gradient]:
        raise NotImplementedError

    def _zero_grad(self) -> None:
        raise NotImplementedError


class _SparseLookup(_PSModule):
    """Shared by PSEmbedding and PSEmbeddingBag: pulls, prefetches, pending gradients."""

    _anchor: torch.Tensor

    def __init__(
        self, client: PSClient, name: str, embedding_dim: int, *, optimizer: str, lr: float,
        init: Init, seed: int, mode: str, dtype: torch.dtype,
        device: torch.device | str | None, hyper: dict[str, float],
    ) -> None:
        super().__init__(client, name, mode)
        _check_hyper(hyper)
        if embedding_dim < 1:
            raise PSModuleError(f"embedding_dim must be >= 1, got {embedding_dim}")
        self.embedding_dim = embedding_dim
        self.dtype = dtype
        client.declare_sparse(
            name, embedding_dim, dtype=dtype, optimizer=optimizer, init=init, seed=seed,
            mode=self.consistency, lr=lr, **_kwargs(hyper),
        )
        # No parameters to carry the device, so an empty buffer does: model.to(device)
        # moves it, and outputs follow it.
        self.register_buffer("_anchor", torch.empty(0, device=device), persistent=False)
        self._pending: list[_Lookup] = []

    @property
    def device(self) -> torch.device:
        """Where outputs are placed; `model.to(device)` changes it."""
        return self._anchor.device

    def prefetch(self, ids: torch.Tensor) -> None:
        """Asks for the rows the forward on `ids` will need `prefetch_depth` steps from now
        (the next step, unless the PSOptimizer says otherwise). Returns at once.

        The pull travels in the exchange that carries the current step's gradients: with
        overlap, in the background while this step computes; without, in `step()`'s
        request, after the step's pushes (so under sync the rows are exact). The next
        step's forward uses them if it is called with equal ids, and pulls afresh
        otherwise. Does nothing unless a PSOptimizer owns this module. Call it from the
        training thread.
        """
        pipeline = self._pipeline
        if pipeline is None:
            return
        flat = _as_ids(ids, "ids").clone()
        ahead = pipeline.depth if pipeline.overlap else 1
        self._tickets.append(pipeline.ask(
            _Ticket(self.table, pipeline.clock + ahead, self.device, flat)
        ))

    def _pull(self, flat: torch.Tensor, clock: int | None) -> _Pulled:
        pipeline = self._pipeline
        if pipeline is None or clock is None:
            keys, inverse = torch.unique(flat, return_inverse=True)
            rows = self.client.pull_sparse(self.table, keys, clock=clock, assume_unique=True)
            return _Pulled(keys, inverse, rows)
        ticket = pipeline.ask(_Ticket(self.table, clock, self.device, flat))
        rows = pipeline.wait(ticket)
        return ticket.pulled(rows)

    def _lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(index of each id into the unique rows, on the output device; those rows)."""
        flat = _as_ids(ids, "ids")
        clock = self._clock()
        pipeline = self._pipeline
        if flat.numel() == 0:
            empty = torch.empty((0, self.embedding_dim), dtype=self.dtype)
            pulled = _Pulled(flat, flat, empty)
        else:
            if pipeline is not None:
                pipeline.forward_started()
            ticket = self._ticket_for(clock, flat) if clock is not None else None
            if ticket is not None and pipeline is not None:
                rows = pipeline.wait(ticket)
                pulled = ticket.pulled(rows)
            else:
                pulled = self._pull(flat, clock)
        device = self.device
        rows = _to_device(pulled.rows, device)
        inverse = _to_device(pulled.inverse, device).view(ids.shape)
        # Only a module with a PSOptimizer records gradients: nothing else would push them.
        if pipeline is not None and torch.is_grad_enabled() and pulled.keys.numel():
            rows.requires_grad_(True)
            self._pending.append(_Lookup(self.table, pulled.keys, rows))
        return inverse, rows

    def _take_gradients(self) -> list[_Gradient]:
        pending, self._pending = self._pending, []
        return [
            _Gradient(self.table, "sparse", _to_host(p.rows.grad), p.keys)
            for p in pending
            if p.rows.grad is not None
        ]

    def _zero_grad(self) -> None:
        for p in self._pending:
            p.rows.grad = None

    def _detach(self) -> None:
        super()._detach()
        self._pending.clear()


class PSEmbedding(_SparseLookup):
    """Like `nn.Embedding`, over a server-side sparse table of rows created on first touch.

    `forward(ids)` takes int64 ids of any value and shape and returns
    `[*ids.shape, embedding_dim]`. Rows start from `init` ("uniform", a, b),
    ("normal", mean, std), ("zeros", 0, 0) or ("constant", v, 0), a pure function of
    (seed, id), and are updated by the servers' `optimizer` ("sgd", "adagrad", "adam") with
    `lr` and `hyper` (eps, weight_decay, beta1, ...). `consistency` ("sync", "ssp", "ssp:S",
    "async") overrides the servers' default mode for this table ("" keeps it; PSModuleError
    for anything else); it is not called `mode` because PSEmbeddingBag's `mode` is its
    pooling, as in nn.EmbeddingBag.

    Construction declares the table (blocks on every shard; declaring the same table again,
    from any worker, is harmless). A forward blocks on its pull unless the rows were
    prefetched. Gradients are recorded only when a PSOptimizer owns the module and grad
    mode is on; its `step()` pushes them. Not thread-safe: use a module from one thread.
    """

    def __init__(
        self, client: PSClient, name: str, embedding_dim: int, *, optimizer: str = "adagrad",
        lr: float = 0.01, init: Init = ("uniform", -0.05, 0.05), seed: int = 0,
        consistency: str = "", dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None, **hyper: float,
    ) -> None:
        super().__init__(
            client, name, embedding_dim, optimizer=optimizer, lr=lr, init=init, seed=seed,
            mode=consistency, dtype=dtype, device=device, hyper=hyper,
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        inverse, rows = self._lookup(ids)
        return F.embedding(inverse, rows)

    def extra_repr(self) -> str:
        return f"table={self.table!r}, embedding_dim={self.embedding_dim}"


class PSEmbeddingBag(_SparseLookup):
    """Like `nn.EmbeddingBag` (include_last_offset=False), over a server-side sparse table.

    `forward(input, offsets=None, per_sample_weights=None)`: a 2-D `input` is a batch of
    fixed-length bags; a 1-D `input` is the concatenated bags starting at `offsets`. Bags
    are pooled by `mode` ("sum", "mean" or "max"); `per_sample_weights` (sum only) weight
    each id. Returns `[bags, embedding_dim]`; an empty bag gives zeros. Tables, blocking
    and thread-safety are as for PSEmbedding.
    """

    def __init__(
        self, client: PSClient, name: str, embedding_dim: int, mode: str = "mean", *,
        optimizer: str = "adagrad", lr: float = 0.01, init: Init = ("uniform", -0.05, 0.05),
        seed: int = 0, consistency: str = "", dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None, **hyper: float,
    ) -> None:
        if mode not in _BAG_MODES:
            raise PSModuleError(f"PSEmbeddingBag mode must be one of {_BAG_MODES}, got {mode!r}")
        super().__init__(
            client, name, embedding_dim, optimizer=optimizer, lr=lr, init=init, seed=seed,
            mode=consistency, dtype=dtype, device=device, hyper=hyper,
        )
        self.pooling = mode

    def prefetch(self, ids: torch.Tensor, offsets: torch.Tensor | None = None) -> None:
        """As PSEmbedding.prefetch; `offsets` do not change which rows are needed."""
        super().prefetch(ids)

    def forward(
        self, input: torch.Tensor, offsets: torch.Tensor | None = None,
        per_sample_weights: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if input.dim() == 1 and offsets is None:
            raise PSModuleError("a 1-D input needs offsets (the start of each bag)")
        if input.dim() == 2 and offsets is not None:
            raise PSModuleError("a 2-D input is a batch of fixed-length bags; pass no offsets")
        if input.dim() not in (1, 2):
            raise PSModuleError(f"input must be 1-D or 2-D, got {input.dim()}-D")
        if per_sample_weights is not None and self.pooling != "sum":
            raise PSModuleError(
                f"per_sample_weights need mode 'sum', this bag pools by {self.pooling!r}"
            )
        inverse, rows = self._lookup(input)
        if offsets is not None:
            offsets = offsets.to(device=inverse.device, dtype=torch.int64)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.to(device=rows.device, dtype=rows.dtype)
        return F.embedding_bag(
            inverse, rows, offsets, mode=self.pooling, per_sample_weights=per_sample_weights
        )

    def extra_repr(self) -> str:
        return (
            f"table={self.table!r}, embedding_dim={self.embedding_dim}, mode={self.pooling!r}"
        )


class PSDense(_PSModule):
    """Wraps an `nn.Module` whose trainable parameters live on the servers, in ONE flat
    dense table `name` (one request per shard and step, however many tensors).

    The worker that initialises (`initialize`, by default the one with worker id 0) writes
    the module's own initial values to the servers, unless they were written before (a
    restarted worker must not overwrite trained values); every other worker waits, up to
    `init_timeout_s`, until they are there. So construction blocks.

    `forward(*args, **kwargs)` first loads the servers' values into the module's parameters
    (once per step: a pull that blocks, unless PSOptimizer prefetched it), then calls the
    module. The parameters stay ordinary `nn.Parameter`s so autograd fills their `.grad`;
    do not give them to a local optimizer: PSOptimizer.step() pushes their gradient and the
    servers run `optimizer`. Buffers (e.g. BatchNorm statistics) and parameters with
    requires_grad=False stay local. Not thread-safe: use it from one thread.
    """

    def __init__(
        self, client: PSClient, module: nn.Module, name: str, *, optimizer: str = "adam",
        lr: float = 1e-3, consistency: str = "", initialize: bool | None = None,
        init_timeout_s: float = 300.0, **hyper: float,
    ) -> None:
        super().__init__(client, name, consistency)
        _check_hyper(hyper)
        self.module = module
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise PSModuleError(f"PSDense {name!r}: the module has no trainable parameters")
        dtypes = {p.dtype for p in params}
        if len(dtypes) != 1:
            raise PSModuleError(
                f"PSDense {name!r}: parameters must share one dtype to live in one flat "
                f"table, got {sorted(str(d) for d in dtypes)}; wrap each dtype separately"
            )
        self._params = params
        self.numel = sum(p.numel() for p in params)
        self._loaded_clock: int | None = None
        dtype = params[0].dtype
        self._ready_table = f"{name}.initialized"
        client.declare_dense(name, (self.numel,), dtype=dtype, optimizer=optimizer,
                             mode=self.consistency, lr=lr, **_kwargs(hyper))
        # A one-element flag, set once the values are written: workers that do not
        # initialise wait for it, and a restarted initialiser sees it and keeps its hands off.
        client.declare_dense(self._ready_table, (1,), optimizer="sgd", mode=modes.ASYNC,
                             lr=1.0)
        if initialize is None:
            initialize = client.worker == 0
        if initialize:
            self._initialize()
        else:
            self._wait_initialized(init_timeout_s)

    def _initialized(self) -> bool:
        return bool(self.client.pull_dense(self._ready_table, clock=0).item() != 0)

    def _initialize(self) -> None:
        if self._initialized():
            log.info("worker %d: %r was initialised before; not overwriting it",
                     self.client.worker, self.table)
            return
        self.client.assign_dense(self.table, self._flat_values())
        self.client.assign_dense(self._ready_table, torch.ones(1))
        log.info("worker %d: initialised %r (%d values)", self.client.worker, self.table,
                 self.numel)

    def _wait_initialized(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._initialized():
            if time.monotonic() >= deadline:
                raise InitializationTimeoutError(
                    f"worker {self.client.worker}: {self.table!r} was not initialised within "
                    f"{timeout_s:g} s; start the initialising worker (worker 0, or the one "
                    "built with initialize=True)"
                )
            _delay(_INIT_POLL_S)

    def _flat_values(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).cpu() for p in self._params])

    @property
    def device(self) -> torch.device:
        return self._params[0].device

    def load(self) -> None:
        """Loads the servers' values into the parameters, unless done already this step.

        Blocks on the pull (or the one asked for ahead). Called by forward.
        """
        clock = self._clock()
        if clock is not None and self._loaded_clock == clock:
            return
        pipeline = self._pipeline
        if pipeline is None or clock is None:
            flat = self.client.pull_dense(self.table, clock=clock)
        else:
            pipeline.forward_started()
            ticket = self._ticket_for(clock, None) or pipeline.ask(
                _Ticket(self.table, clock, self.device)
            )
            flat = pipeline.wait(ticket)
        values = _to_device(flat, self.device)
        # The parameters become views of the pulled tensor, which is this step's alone:
        # no copy, and nothing else writes to it.
        offset = 0
        for p in self._params:
            n = p.numel()
            p.data = values[offset : offset + n].view_as(p)
            offset += n
        self._loaded_clock = clock

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.load()
        return self.module(*args, **kwargs)

    def _take_gradients(self) -> list[_Gradient]:
        grads = [p.grad for p in self._params]
        if all(g is None for g in grads):
            return []
        flat = torch.cat([
            (torch.zeros_like(p) if g is None else g).detach().reshape(-1)
            for p, g in zip(self._params, grads, strict=True)
        ])
        # Sent means consumed: the next step starts from no gradient, as after zero_grad().
        for p in self._params:
            p.grad = None
        return [_Gradient(self.table, "dense", _to_host(flat))]

    def _zero_grad(self) -> None:
        for p in self._params:
            p.grad = None

    def extra_repr(self) -> str:
        return f"table={self.table!r}, numel={self.numel}"


class PSOptimizer:
    """The training loop's handle on the servers' optimizers for every PS module of `model`.

    `step()` pushes the step's gradients (the gradients of lookups of one table in a step
    are summed) and ends the iteration on every shard, in one exchange per shard that also
    carries the pulls asked for the next step (prefetches, and every PSDense's values).
    `overlap` (default: allowed by every table's mode, i.e. async or ssp with bound >= 1)
    defers that exchange to the next step's first forward, which sends it in the
    background: at most one step's pushes are in flight. `overlap=True` with a sync (or
    ssp:0) table raises PSModuleError: those modes promise exact reads.

    `prefetch_depth` d > 1 (overlap only) asks for pulls d steps ahead and lets d exchanges
    travel at once, so a round trip longer than a step of compute still hides behind
    compute; reads are then up to d steps stale, so every ssp table's bound must be at
    least d. Feed `prefetch()` the batch d steps ahead (`lookahead(batches,
    ps.prefetch_depth)`). `prefetch_depth="auto"` picks 2 (AUTO_PREFETCH_DEPTH) where
    overlap is on, every ssp bound allows it and some server is reached without a request
    lane (round trips of a millisecond or more); else 1.

    Construction may ask the servers for their default mode (blocks briefly). Methods are
    meant for the training thread and are not thread-safe; the exchange thread they start
    is joined by `close()`.
    """

    def __init__(
        self, model: nn.Module, *, overlap: bool | None = None,
        prefetch_depth: int | Literal["auto"] = 1,
    ) -> None:
        modules = [m for m in model.modules() if isinstance(m, _PSModule)]
        if not modules:
            raise PSModuleError(
                "the model has no PSEmbedding, PSEmbeddingBag or PSDense: nothing to push"
            )
        clients = {id(m.client) for m in modules}
        if len(clients) != 1:
            raise PSModuleError("every PS module of one model must share one PSClient")
        for m in modules:
            m._check_free()
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
            short = all(self.client.exchange_lanes())
            prefetch_depth = (min([AUTO_PREFETCH_DEPTH, *bounds])
                              if self.overlap and not short else 1)
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
        dense = [m for m in modules if isinstance(m, PSDense)]
        self._pipeline = _Pipeline(self.client, self.overlap, dense, prefetch_depth)
        for m in modules:
            m._attach(self._pipeline)
        log.info("worker %d: PSOptimizer over %d tables, overlap %s", self.client.worker,
                 len({m.table for m in modules}), self.overlap)

    def _staleness(self, modules: Sequence[_PSModule]) -> dict[str, int | None]:
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
            m.table: _overlap_staleness(m.consistency, default_mode, default_staleness)
            for m in modules
        }

    @property
    def clock(self) -> int:
        """The clock of the step being computed (the servers' clock may lag under overlap)."""
        return self._pipeline.clock

    def zero_grad(self) -> None:
        """Clears the gradients of the lookups and parameters of this step, as
        torch.optim.Optimizer.zero_grad(set_to_none=True) does. Does not block.
        """
        for m in self._modules:
            m._zero_grad()

    def step(self) -> None:
        """Pushes this step's gradients and ends the iteration on every shard.

        Without overlap it blocks until both are done (and the next step's pulls with
        them). With overlap it returns at once: this step's gradients leave with the next
        forward, or with `flush()`, each of which first waits for the exchange before it
        (raising its error, if any), so the round trip also hides behind the loading of
        the next batch.
        """
        grads = [g for m in self._modules for g in m._take_gradients()]
        event = None
        if torch.cuda.is_available() and any(g.grad.is_pinned() for g in grads):
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
        pipeline = self._pipeline
        pushes = [_push_of(table, items) for table, items in _by_table(grads)]
        if not self.overlap:
            clock = self.client.clock
            pipeline.outbox = _Outbox(clock, pushes, event)
            pipeline.ask_dense(clock + 1)
            pipeline.dispatch(outbox=True, up_to=clock + 1)
            pipeline.drain()
            return
        if pipeline.outbox is not None:
            # No PS forward ran in this step to send the last one's gradients: send them.
            pipeline.forward_started()
        clock = pipeline.step_clock
        pipeline.outbox = _Outbox(clock, pushes, event)
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
        for m in self._modules:
            if isinstance(m, PSDense):
                # Pulled while the last gradients travelled: the next forward pulls afresh.
                m._tickets.clear()

    def close(self) -> None:
        """Flushes, stops the exchange thread and releases the modules. Idempotent."""
        try:
            self.flush()
        finally:
            self._pipeline.shutdown()
            for m in self._modules:
                m._detach()

    def __enter__(self) -> PSOptimizer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _push_of(table: str, items: list[_Gradient]) -> Push:
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


def _by_table(grads: list[_Gradient]) -> Iterator[tuple[str, list[_Gradient]]]:
    tables: dict[str, list[_Gradient]] = {}
    for g in grads:
        tables.setdefault(g.table, []).append(g)
    yield from tables.items()
