"""PyTorch modules whose parameters live on the parameter servers.

`PSEmbedding` and `PSEmbeddingBag` look up rows of server-side sparse tables (ids are any
int64, rows are created on first touch); `PSDense` keeps an ordinary `nn.Module`'s
parameters in one flat dense table on the servers. None of them owns an `nn.Parameter` that
a local optimizer should step: the servers run the optimizer. `PSOptimizer`
(worker/optimizer.py) plays the local optimizer's part in the training loop: its `step()`
pushes every gradient of the step and ends the iteration, through the exchange pipeline
(worker/pipeline.py), so a loop reads like plain PyTorch::

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
of at least 1), that exchange leaves during the next step, in the background, and its pulls
are ready by the step after: the network time hides behind a step of compute, and reads are
one step stale. (With pulls asked two steps ahead it leaves once that step's forward is
done, at `zero_grad()` or `step()`, as in the loop above.) Under `sync` (and ssp with bound
0) `step()` sends it and waits, and the pulls in it wait for the iteration to close on the
servers, so the same loop keeps sync's exact semantics while still paying one round trip per
step.

GPU workers. Give the sparse modules `device="cuda"` (or move the model with `.to()`), and
put the module wrapped by `PSDense` on the GPU. Pulled rows are staged in pinned host
memory and copied with `non_blocking=True`; gradients come back the same way and the
background pusher waits for that copy before sending.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from protos import modes
from worker.client import PSClient
from worker.errors import PSModuleError
from worker.pipeline import Gradient, Pipeline, Pulled, Ticket, to_device, to_host
from worker.serving import trainable_parameters

log = logging.getLogger(__name__)

__all__ = [
    "PSDense",
    "PSEmbedding",
    "PSEmbeddingBag",
    "PSModule",
    "PSModuleError",
]

Init = tuple[str, float, float]

_BAG_MODES = ("sum", "mean", "max")


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
    """`ids` as an int64 CPU tensor of their shape: themselves, or a copy when they live on a
    GPU or hold int32. (Integer tensors carry no gradient: nothing to detach.)"""
    if not isinstance(ids, torch.Tensor):
        raise PSModuleError(f"{what} must be a torch.Tensor of int64 ids, got {type(ids).__name__}")
    if ids.dtype not in (torch.int64, torch.int32):
        raise PSModuleError(f"{what} must hold int64 (or int32) ids, got {ids.dtype}")
    if ids.dtype != torch.int64 or ids.device.type != "cpu":
        ids = ids.to(device="cpu", dtype=torch.int64)
    return ids


@dataclass
class _Lookup:
    """One forward's pulled rows (a leaf tensor) waiting for their gradient."""

    table: str
    keys: torch.Tensor
    rows: torch.Tensor


class PSModule(nn.Module):
    """A module whose parameters live on the servers: what PSOptimizer needs of it (the
    `ps_*` methods, for PSOptimizer only)."""

    def __init__(self, client: PSClient, name: str, mode: str) -> None:
        super().__init__()
        if not name:
            raise PSModuleError("a PS module needs a non-empty table name")
        self.client = client
        self.table = name
        # The table's own mode; None keeps the servers' default.
        self.consistency = _parse_consistency(mode)
        self._pipeline: Pipeline | None = None

    def ps_check_free(self) -> None:
        if self._pipeline is not None:
            raise PSModuleError(
                f"table {self.table!r} already belongs to another PSOptimizer; use one "
                "PSOptimizer per model (close the old one first)"
            )

    def ps_attach(self, pipeline: Pipeline) -> None:
        self._pipeline = pipeline

    def ps_detach(self) -> None:
        self._pipeline = None

    def _clock(self) -> int | None:
        return None if self._pipeline is None else self._pipeline.clock

    def ps_gradients(self) -> list[Gradient]:
        """This step's gradients to push; they count as sent (cleared here)."""
        raise NotImplementedError

    def ps_zero_grad(self) -> None:
        raise NotImplementedError


_COMPACT = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class _RowOptions:
    """A sparse table's admission and eviction options, as declare_sparse takes them."""

    admit: str = "always"
    admit_default: float = 0.0
    ttl_clocks: int = 0
    ttl_s: float = 0.0
    max_rows: int = 0


class _SparseLookup(PSModule):
    """Shared by PSEmbedding and PSEmbeddingBag: pulls, prefetches, pending gradients."""

    _anchor: torch.Tensor

    def __init__(
        self, client: PSClient, name: str, embedding_dim: int, *, optimizer: str, lr: float,
        init: Init, seed: int, mode: str, dtype: torch.dtype,
        device: torch.device | str | None, hyper: dict[str, float],
        rows: _RowOptions = _RowOptions(),
    ) -> None:
        super().__init__(client, name, mode)
        _check_hyper(hyper)
        if embedding_dim < 1:
            raise PSModuleError(f"embedding_dim must be >= 1, got {embedding_dim}")
        self.embedding_dim = embedding_dim
        self.dtype = dtype
        client.declare_sparse(
            name, embedding_dim, dtype=dtype, optimizer=optimizer, init=init, seed=seed,
            mode=self.consistency, admit=rows.admit, admit_default=rows.admit_default,
            ttl_clocks=rows.ttl_clocks, ttl_s=rows.ttl_s, max_rows=rows.max_rows, lr=lr,
            **_kwargs(hyper),
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
        keys = _as_ids(ids, "ids")
        # The ticket keeps its own copy (the caller may reuse `ids`): one copy, which
        # _as_ids has made already for ids on a GPU or of int32.
        self.ask_ahead(keys.clone() if keys is ids else keys)

    def ask_ahead(self, keys: torch.Tensor) -> None:
        """As prefetch, for int64 CPU `keys` (of any shape) that nobody changes afterwards
        (they are kept, not copied)."""
        pipeline = self._pipeline
        if pipeline is None:
            return
        ahead = pipeline.depth if pipeline.overlap else 1
        pipeline.ask_ahead(self, Ticket(self.table, pipeline.clock + ahead, self.device, keys))

    def _pull(self, ids: torch.Tensor, clock: int | None) -> Pulled:
        pipeline = self._pipeline
        if pipeline is None or clock is None:
            keys, inverse = torch.unique(ids, return_inverse=True)
            rows = self.client.pull_sparse(self.table, keys, clock=clock, assume_unique=True)
            return Pulled(keys, inverse, rows)
        ticket = pipeline.ask(Ticket(self.table, clock, self.device, ids))
        rows = pipeline.wait(ticket)
        return ticket.pulled(rows)

    def _lookup(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(index of each id into the unique rows, shaped as `ids`, on the output device;
        those rows)."""
        host_ids = _as_ids(ids, "ids")
        clock = self._clock()
        pipeline = self._pipeline
        if host_ids.numel() == 0:
            empty = torch.empty((0, self.embedding_dim), dtype=self.dtype)
            pulled = Pulled(host_ids.reshape(-1), host_ids, empty)
        else:
            if pipeline is not None:
                pipeline.forward_started()
            ticket = (pipeline.ticket_for(self, clock, host_ids)
                      if clock is not None and pipeline is not None else None)
            if ticket is not None and pipeline is not None:
                rows = pipeline.wait(ticket)
                pulled = ticket.pulled(rows)
            else:
                pulled = self._pull(host_ids, clock)
        device = self.device
        rows = to_device(pulled.rows, device)
        inverse = to_device(pulled.inverse, device)  # unique's inverse has the ids' shape
        # Only a module with a PSOptimizer records gradients: nothing else would push them.
        if pipeline is not None and torch.is_grad_enabled() and pulled.keys.numel():
            rows.requires_grad_(True)
            self._pending.append(_Lookup(self.table, pulled.keys, rows))
        # Compact rows compute in float32, as the servers' optimizers do; the cast is part
        # of the graph, so the gradient reaches the rows (and the servers) in their dtype.
        return inverse, rows.float() if rows.dtype in _COMPACT else rows

    def ps_gradients(self) -> list[Gradient]:
        # Emptied in place: setting a module's attribute costs more than this whole list.
        pending = list(self._pending)
        self._pending.clear()
        return [
            Gradient(self.table, "sparse", to_host(p.rows.grad), p.keys)
            for p in pending
            if p.rows.grad is not None
        ]

    def ps_zero_grad(self) -> None:
        for p in self._pending:
            p.rows.grad = None

    def ps_detach(self) -> None:
        super().ps_detach()
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

    A float16 or bfloat16 table (`dtype`) stores compact rows; outputs are float32 all the
    same. Which ids get a row and which rows stay: `admit` ("always", "count:K": on the
    K-th pull of the id, "prob:P": a fixed share P of ids chosen by hash; until
    then the id reads `admit_default` in every element and its gradients are dropped),
    `ttl_clocks` / `ttl_s` (rows untouched that many clocks / seconds are evicted; 0: never)
    and `max_rows` (per server; past it the least recently touched rows are evicted; 0: no
    limit). An evicted id that comes back starts from its initial row. The servers refuse
    bad values (PSClientError naming them).

    Construction declares the table (blocks on every shard; declaring the same table again,
    from any worker, is harmless). A forward blocks on its pull unless the rows were
    prefetched. Gradients are recorded only when a PSOptimizer owns the module and grad
    mode is on; its `step()` pushes them. Not thread-safe: use a module from one thread.
    """

    def __init__(
        self, client: PSClient, name: str, embedding_dim: int, *, optimizer: str = "adagrad",
        lr: float = 0.01, init: Init = ("uniform", -0.05, 0.05), seed: int = 0,
        consistency: str = "", dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None, admit: str = "always",
        admit_default: float = 0.0, ttl_clocks: int = 0, ttl_s: float = 0.0,
        max_rows: int = 0, **hyper: float,
    ) -> None:
        super().__init__(
            client, name, embedding_dim, optimizer=optimizer, lr=lr, init=init, seed=seed,
            mode=consistency, dtype=dtype, device=device, hyper=hyper,
            rows=_RowOptions(admit, admit_default, ttl_clocks, ttl_s, max_rows),
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
        device: torch.device | str | None = None, admit: str = "always",
        admit_default: float = 0.0, ttl_clocks: int = 0, ttl_s: float = 0.0,
        max_rows: int = 0, **hyper: float,
    ) -> None:
        if mode not in _BAG_MODES:
            raise PSModuleError(f"PSEmbeddingBag mode must be one of {_BAG_MODES}, got {mode!r}")
        super().__init__(
            client, name, embedding_dim, optimizer=optimizer, lr=lr, init=init, seed=seed,
            mode=consistency, dtype=dtype, device=device, hyper=hyper,
            rows=_RowOptions(admit, admit_default, ttl_clocks, ttl_s, max_rows),
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


class PSDense(PSModule):
    """Wraps an `nn.Module` whose trainable parameters live on the servers, in ONE flat
    dense table `name` (one request per shard and step, however many tensors).

    Construction declares the table and offers the module's own initial values to the
    servers, which take them only where the table was never written (an assign if absent,
    decided by each shard): of several workers starting at once, the first to reach a shard
    writes its rows, and a restarted worker never overwrites trained values. Nobody waits
    for anybody; the first forward loads whatever the servers hold, so every worker trains
    from the same values (which may mix workers' initial values, one shard's rows each).
    Construction blocks on the declaration and the assign. With `initialize=False` this
    worker offers nothing and only pulls: if no other worker wrote the table first, its
    values are then the servers' own initial ones (zeros).

    `forward(*args, **kwargs)` first loads the servers' values into the module's parameters
    (once per step: a pull that blocks, unless PSOptimizer prefetched it), then calls the
    module. The parameters stay ordinary `nn.Parameter`s so autograd fills their `.grad`;
    do not give them to a local optimizer: PSOptimizer.step() pushes their gradient and the
    servers run `optimizer`. Buffers (e.g. BatchNorm statistics) and parameters with
    requires_grad=False stay local. Not thread-safe: use it from one thread.
    """

    def __init__(
        self, client: PSClient, module: nn.Module, name: str, *, optimizer: str = "adam",
        lr: float = 1e-3, consistency: str = "", initialize: bool = True, **hyper: float,
    ) -> None:
        super().__init__(client, name, consistency)
        _check_hyper(hyper)
        self.module = module
        params = trainable_parameters(module)
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
        self._flat: torch.Tensor | None = None  # see _flat_storage
        dtype = params[0].dtype
        client.declare_dense(name, (self.numel,), dtype=dtype, optimizer=optimizer,
                             mode=self.consistency, lr=lr, **_kwargs(hyper))
        if initialize:
            took = client.assign_dense(name, self._flat_values(), if_absent=True)
            log.info("worker %d: %s %r (%d values)", client.worker,
                     "initialised" if took else "found values in", name, self.numel)

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
            ticket = pipeline.ticket_for(self, clock, None) or pipeline.ask(
                Ticket(self.table, clock, self.device)
            )
            flat = pipeline.wait(ticket)
        with torch.no_grad():
            self._flat_storage().copy_(flat, non_blocking=True)
        self._loaded_clock = clock

    def _flat_storage(self) -> torch.Tensor:
        """One flat tensor whose slices are the parameters' data, made on first use and
        again after the parameters moved (model.to(), say). A step's values are copied into
        it: one copy, where pointing each parameter at a slice of the pulled tensor costs
        more per parameter in autograd's bookkeeping than the whole copy."""
        first = self._params[0]
        if self._flat is None or first.data_ptr() != self._flat.data_ptr():
            self._flat = torch.empty(self.numel, dtype=first.dtype, device=first.device)
            offset = 0
            for p in self._params:
                n = p.numel()
                p.data = self._flat[offset : offset + n].view_as(p)
                offset += n
        return self._flat

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.load()
        return self.module(*args, **kwargs)

    def ps_gradients(self) -> list[Gradient]:
        grads = [p.grad for p in self._params]
        if all(g is None for g in grads):
            return []
        # to_host detaches the result when the gradients carry a graph (create_graph=True).
        flat = torch.cat([
            (torch.zeros_like(p) if g is None else g).reshape(-1)
            for p, g in zip(self._params, grads, strict=True)
        ])
        # Sent means consumed: the next step starts from no gradient, as after zero_grad().
        for p in self._params:
            p.grad = None
        return [Gradient(self.table, "dense", to_host(flat))]

    def ps_zero_grad(self) -> None:
        for p in self._params:
            p.grad = None

    def extra_repr(self) -> str:
        return f"table={self.table!r}, numel={self.numel}"


