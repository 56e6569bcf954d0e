"""Serving an exported model (`pstrain export`) in a plain PyTorch process, with no
parameter server: load the tables, look ids up, fill dense modules.

    export = serving.load("model/")                       # checks every file's sha256
    fields = serving.ServingEmbedding(export.tables["user"])        # like PSEmbedding
    genres = serving.ServingEmbeddingBag(export.tables["genres"], mode="mean")
    mlp = make_mlp(); serving.load_dense(mlp, export.tables["mlp"]) # like PSDense

A sparse lookup finds each id in the table's sorted keys with `torch.searchsorted` and
returns the table's default row (zeros, see protos/exported.py) for an id the export does
not hold. Modules are ordinary `nn.Module`s with the table in buffers: `.to(device)` moves
them, and they hold no parameters. `apply_delta` turns an export and a delta export made
against it into the next full export. Only torch, safetensors, the standard library and the
format module (protos/exported.py) are imported: never `ps`.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from protos.exported import (
    MANIFEST_NAME,
    DenseTable,
    Export,
    ExportFormatError,
    SparseTable,
    Table,
    read_export,
    read_published,
    sha256_file,
    write_export,
)

__all__ = [
    "DenseTable", "Export", "ExportFormatError", "ServingEmbedding", "ServingEmbeddingBag",
    "SparseTable", "apply_delta", "load", "load_dense", "load_published", "save",
    "trainable_parameters",
]

_BAG_MODES = ("sum", "mean", "max")


def load(path: str | Path) -> Export:
    """The export at `path` (its directory or manifest.json), every file checked against the
    manifest's sha256. Blocks on reading it; ExportFormatError naming a bad file."""
    return read_export(path)


def load_published(path: str | Path) -> Export:
    """The newest model a publisher (``pstrain export --publish-every``) wrote to directory
    `path`: the full export its published.json names with every delta after it applied in
    order, each checked against the one before. ExportFormatError when the directory holds
    no readable published.json or an export it names is missing or bad."""
    path = Path(path)
    full, deltas = read_published(path)
    model: Export | Path = path / full
    for name in deltas:
        model = apply_delta(model, path / name)
    return model if isinstance(model, Export) else read_export(model)


def save(path: str | Path, export: Export) -> Path:
    """Writes `export` to the new directory `path` (atomically, deterministically: the bytes
    `pstrain export` would write for the same tables). Returns the manifest's path."""
    return write_export(path, export)


class _SparseServing(nn.Module):
    """Holds a sparse table as buffers: the sorted keys, and the rows with the default row
    appended (row ``len(keys)``), so a lookup is one searchsorted and one gather."""

    keys: torch.Tensor
    weight: torch.Tensor

    def __init__(self, table: SparseTable) -> None:
        super().__init__()
        if not isinstance(table, SparseTable):
            raise ExportFormatError(f"a serving embedding needs a sparse table, got "
                                    f"{type(table).__name__}")
        self.embedding_dim = table.dim
        self.register_buffer("keys", table.keys.contiguous())
        self.register_buffer("weight", torch.cat([table.values, table.default.view(1, -1)]))

    def index(self, ids: torch.Tensor) -> torch.Tensor:
        """The row of each id (any shape, int64): its position in the keys, or the default
        row's for an id not held."""
        if ids.dtype != torch.int64:
            raise ExportFormatError(f"ids must be int64, got {ids.dtype}")
        flat = ids.reshape(-1).to(self.keys.device)
        missing = self.keys.numel()
        if missing == 0:
            return torch.full_like(flat, 0).view(ids.shape)
        pos = torch.searchsorted(self.keys, flat)
        found = self.keys[pos.clamp(max=missing - 1)] == flat
        return torch.where(found, pos, torch.full_like(pos, missing)).view(ids.shape)


class ServingEmbedding(_SparseServing):
    """`PSEmbedding`'s lookup over an exported table: `forward(ids)` gives
    `[*ids.shape, dim]`. Pure; thread-safe for concurrent forwards."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(self.index(ids), self.weight)

    def extra_repr(self) -> str:
        return f"rows={self.keys.numel()}, embedding_dim={self.embedding_dim}"


class ServingEmbeddingBag(_SparseServing):
    """`PSEmbeddingBag`'s pooling over an exported table: `forward(input, offsets=None,
    per_sample_weights=None)` as nn.EmbeddingBag (include_last_offset=False), by `mode`
    ("sum", "mean", "max"); an empty bag gives zeros. Thread-safe for concurrent forwards."""

    def __init__(self, table: SparseTable, mode: str = "mean") -> None:
        if mode not in _BAG_MODES:
            raise ExportFormatError(f"mode must be one of {_BAG_MODES}, got {mode!r}")
        super().__init__(table)
        self.pooling = mode

    def forward(self, input: torch.Tensor, offsets: torch.Tensor | None = None,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        index = self.index(input)
        if offsets is not None:
            offsets = offsets.to(device=index.device, dtype=torch.int64)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.to(self.weight.device, self.weight.dtype)
        return F.embedding_bag(index, self.weight, offsets, mode=self.pooling,
                               per_sample_weights=per_sample_weights)

    def extra_repr(self) -> str:
        return (f"rows={self.keys.numel()}, embedding_dim={self.embedding_dim}, "
                f"mode={self.pooling!r}")


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters PSDense keeps in its flat table, in its order: those with
    requires_grad, in `module.parameters()` order."""
    return [p for p in module.parameters() if p.requires_grad]


@torch.no_grad()
def load_dense(module: nn.Module, table: Table) -> nn.Module:
    """Copies an exported PSDense table (one flat tensor) into `module`'s trainable
    parameters, in PSDense's order, and returns `module`. ExportFormatError when the sizes or
    the dtype differ (the module is then unchanged)."""
    if not isinstance(table, DenseTable):
        raise ExportFormatError(f"load_dense needs a dense table, got {type(table).__name__}")
    params = trainable_parameters(module)
    numel = sum(p.numel() for p in params)
    flat = table.value.reshape(-1)
    if flat.numel() != numel:
        raise ExportFormatError(f"the table holds {flat.numel()} values, the module's "
                                f"trainable parameters {numel}: not the module it was trained as")
    if any(p.dtype != flat.dtype for p in params):
        raise ExportFormatError(f"the table is {flat.dtype}, the module's parameters "
                                f"{sorted({str(p.dtype) for p in params})}")
    offset = 0
    for p in params:
        p.copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()
    return module


def apply_delta(base: Export | str | Path, delta: Export | str | Path) -> Export:
    """The full export that `delta` (made by ``pstrain export --delta --since BASE``) leads
    to from `base`. Given paths, reads them and checks that `delta` was made against this
    base (the sha256 of its manifest); given exports, checks the checkpoint id. Pure on
    in-memory exports; ExportFormatError for a mismatch."""
    base_sha = None
    if not isinstance(base, Export):
        base_sha = sha256_file(Path(base) / MANIFEST_NAME)
        base = read_export(base)
    if not isinstance(delta, Export):
        delta = read_export(delta)
    if base.kind != "full" or delta.kind != "delta" or delta.base is None:
        raise ExportFormatError(f"apply_delta needs a full export and a delta, got "
                                f"{base.kind} and {delta.kind}")
    if delta.base.checkpoint_id != base.checkpoint_id or (
            base_sha is not None and delta.base.manifest_sha256 != base_sha):
        raise ExportFormatError(
            f"the delta was made against export of checkpoint {delta.base.checkpoint_id!r} "
            f"(manifest sha256 {delta.base.manifest_sha256}), not this base (checkpoint "
            f"{base.checkpoint_id!r}{f', manifest sha256 {base_sha}' if base_sha else ''})")
    tables = {n: t for n, t in base.tables.items() if n not in delta.dropped_tables}
    for name, change in delta.tables.items():
        old = tables.get(name)
        if isinstance(change, DenseTable) or old is None:
            tables[name] = change if isinstance(change, DenseTable) else SparseTable(
                change.keys, change.values, change.default, spec=change.spec)
            continue
        if not isinstance(old, SparseTable):
            raise ExportFormatError(f"table {name!r} is dense in the base, sparse in the delta")
        keep = ~(torch.isin(old.keys, change.removed) | torch.isin(old.keys, change.keys))
        keys = torch.cat([old.keys[keep], change.keys])
        values = torch.cat([old.values[keep], change.values])
        keys, order = torch.sort(keys)
        tables[name] = SparseTable(keys, values[order], change.default, spec=change.spec)
    return Export(job=delta.job, checkpoint_id=delta.checkpoint_id, clock=delta.clock,
                  tables=dict(sorted(tables.items())))
