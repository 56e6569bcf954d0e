"""The on-disk format of an exported model (`pstrain export`): the contract between the
exporter (ps/export.py, which reads checkpoints) and the serving loader (worker/serving.py).

Layout of an export directory::

    <out>/manifest.json                 format, version, kind, job, checkpoint id, clock, tables
    <out>/<quoted table name>.safetensors   one per table

A sparse table's file holds ``keys`` (int64, strictly increasing), ``values`` (``[rows,
dim]``, the rows in key order, in the table's dtype) and ``default`` (``[dim]``, the row
served for an id the export does not hold: zeros; the manifest records the table's init rule
and seed for a caller who wants the row the server would have created). A dense table's
file holds ``value``, the whole tensor. A delta export (``kind: delta``) has the same layout:
a sparse table's file then holds the rows added or changed since its base export and
``removed`` (int64, strictly increasing), the keys the base held that are gone; a dense table
appears only if any of its values changed, whole; ``dropped_tables`` names tables the base
had and the new export has not. The manifest of a delta names its base by checkpoint id and
by the sha256 of the base's ``manifest.json`` (which holds every file's sha256).

Every file is written once, into a hidden temporary directory that is renamed to ``<out>``
when complete, so a directory under its final name is always a whole export. Writing is
deterministic: the same tables give the same bytes. Reading checks each file's sha256
against the manifest. Only torch, safetensors and the standard library are used, so the
serving side needs nothing else of pstrain.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import secrets
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final, Literal
from urllib.parse import quote

import torch
from safetensors import SafetensorError
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

FORMAT: Final = "pstrain.export"
FORMAT_VERSION: Final = 1
MANIFEST_NAME: Final = "manifest.json"
# A publisher's directory (``pstrain export --publish-every``): this file names the newest
# full export in it and the deltas after it, in order ({"format", "job", "full", "deltas",
# "checkpoint_id", "clock"}), and is replaced atomically after each export.
PUBLISHED_NAME: Final = "published.json"
PUBLISHED_FORMAT: Final = "pstrain.published"

ExportKind = Literal["full", "delta"]

_DTYPES: Final = {"float32": torch.float32, "float64": torch.float64,
                  "float16": torch.float16, "bfloat16": torch.bfloat16}


class ExportFormatError(ValueError):
    """An export directory is missing, incomplete, corrupt, or not of this format; or tables
    given for writing do not fit the format. The message names the file."""


@dataclass(frozen=True, eq=False)
class SparseTable:
    """A sparse table: `keys` strictly increasing int64, `values[i]` the row of `keys[i]`,
    `default` the row for any other id. In a delta, `removed` holds the keys gone since the
    base (empty in a full export). `spec` is informative JSON (init rule, seed, optimizer)."""

    keys: torch.Tensor
    values: torch.Tensor
    default: torch.Tensor
    removed: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    spec: dict[str, object] = field(default_factory=dict)

    @property
    def dim(self) -> int:
        return int(self.values.shape[1])

    @property
    def dtype(self) -> torch.dtype:
        return self.values.dtype


@dataclass(frozen=True, eq=False)
class DenseTable:
    """A dense table: the whole tensor."""

    value: torch.Tensor
    spec: dict[str, object] = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype:
        return self.value.dtype


Table = SparseTable | DenseTable


@dataclass(frozen=True)
class BaseRef:
    """The export a delta applies to: its checkpoint id and its manifest's sha256."""

    checkpoint_id: str
    manifest_sha256: str


@dataclass(frozen=True, eq=False)
class Export:
    """An export in memory: what `write_export` writes and `read_export` returns."""

    job: str
    checkpoint_id: str
    clock: int
    tables: dict[str, Table]
    kind: ExportKind = "full"
    base: BaseRef | None = None
    dropped_tables: tuple[str, ...] = ()


def table_file_name(table: str) -> str:
    """``<table>.safetensors`` with the name percent-encoded (no safe characters), so any
    table name is one plain file name."""
    encoded = quote(table, safe="")
    if encoded.startswith("."):
        encoded = "%2E" + encoded[1:]  # never a hidden file
    return f"{encoded}.safetensors"


def sha256_file(path: Path) -> str:
    """The sha256 of the file at `path`, hex. Blocks on reading it."""
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            sha.update(chunk)
    return sha.hexdigest()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def write_export(out: Path | str, export: Export) -> Path:
    """Writes `export` to the new directory `out` and returns the manifest's path.

    All files go to a hidden temporary directory beside `out`, are fsynced, and the
    directory is renamed to `out` at the end: `out` appears whole or not at all. Refuses an
    existing `out` (ExportFormatError; nothing is changed) and tables that do not fit the
    format. Blocks on file I/O; safe to call from several threads for different `out`s.
    """
    out = Path(out)
    if out.exists():
        raise ExportFormatError(f"{out} exists; export to a new directory (or remove it)")
    blobs: dict[str, bytes] = {}
    entries: dict[str, dict[str, object]] = {}
    for name, table in sorted(export.tables.items()):
        tensors, entry = _table_tensors(name, table, export.kind)
        # One metadata key: safetensors keeps metadata in a hash map, so several keys would
        # come out in any order and the same tables would not give the same bytes.
        data = st_save(tensors, metadata={FORMAT: json.dumps(
            {"table": name, "kind": entry["kind"]}, sort_keys=True)})
        file_name = table_file_name(name)
        blobs[file_name] = data
        entries[name] = {**entry, "file": file_name, "sha256": hashlib.sha256(data).hexdigest()}
    manifest = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kind": export.kind,
        "job": export.job, "checkpoint_id": export.checkpoint_id, "clock": export.clock,
        "base": None if export.base is None else {
            "checkpoint_id": export.base.checkpoint_id,
            "manifest_sha256": export.base.manifest_sha256},
        "default_row": "zeros", "dropped_tables": list(export.dropped_tables),
        "tables": entries,
    }
    blobs[MANIFEST_NAME] = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        for file_name, data in blobs.items():
            with open(tmp / file_name, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        _fsync_dir(tmp)
        os.rename(tmp, out)
        _fsync_dir(out.parent)
    except OSError as exc:
        raise ExportFormatError(f"writing export {out} failed: {exc}") from exc
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out / MANIFEST_NAME


def read_export(path: Path | str) -> Export:
    """Reads the export directory `path` (or its manifest.json), checking every table file
    against the sha256 the manifest records. Blocks on file I/O; thread-safe. Raises
    ExportFormatError naming the file for anything missing, corrupt or malformed."""
    path = Path(path)
    directory = path.parent if path.name == MANIFEST_NAME else path
    manifest_path = directory / MANIFEST_NAME
    try:
        raw = manifest_path.read_bytes()
    except OSError as exc:
        raise ExportFormatError(
            f"{manifest_path} cannot be read ({exc}); is {directory} an export?") from exc
    try:
        manifest = json.loads(raw)
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise ValueError(f"not a {FORMAT!r} manifest")
        if manifest.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"format version {manifest.get('format_version')!r}; this build "
                             f"reads {FORMAT_VERSION}")
        kind = manifest["kind"]
        if kind not in ("full", "delta"):
            raise ValueError(f"kind {kind!r}")
        base = manifest["base"]
        tables_json = manifest["tables"]
        if not isinstance(tables_json, dict):
            raise TypeError("tables is not an object")
    except (ValueError, KeyError, TypeError) as exc:
        raise ExportFormatError(f"{manifest_path} is malformed: {exc}") from exc
    tables: dict[str, Table] = {}
    for name, entry in sorted(tables_json.items()):
        tables[name] = _read_table(directory, name, entry, kind)
    return Export(
        job=str(manifest["job"]), checkpoint_id=str(manifest["checkpoint_id"]),
        clock=int(manifest["clock"]), tables=tables, kind=kind,
        base=None if base is None else BaseRef(str(base["checkpoint_id"]),
                                               str(base["manifest_sha256"])),
        dropped_tables=tuple(str(t) for t in manifest.get("dropped_tables", [])),
    )


def check_sparse(name: str, table: SparseTable, kind: ExportKind = "full") -> None:
    """ExportFormatError unless `table` fits the format: int64 keys strictly increasing,
    values ``[len(keys), dim]`` of a float dtype, default ``[dim]`` of that dtype."""
    def bad(why: str) -> ExportFormatError:
        return ExportFormatError(f"sparse table {name!r}: {why}")

    keys, values, default = table.keys, table.values, table.default
    for what, k in (("keys", keys), ("removed", table.removed)):
        if k.dtype != torch.int64 or k.dim() != 1:
            raise bad(f"{what} must be a 1-D int64 tensor, got {k.dtype} {list(k.shape)}")
        if k.numel() > 1 and not bool((k[1:] > k[:-1]).all()):
            raise bad(f"{what} are not strictly increasing")
    if values.dim() != 2 or values.shape[0] != keys.numel() or values.dtype not in _DTYPES.values():
        raise bad(f"values must be [{keys.numel()}, dim] of a float dtype, got "
                  f"{values.dtype} {list(values.shape)}")
    if default.shape != (values.shape[1],) or default.dtype != values.dtype:
        raise bad(f"default must be [{values.shape[1]}] {values.dtype}, got {default.dtype} "
                  f"{list(default.shape)}")
    if kind == "full" and table.removed.numel():
        raise bad("a full export removes no keys")


# ---- helpers ----------------------------------------------------------------------------------


def _table_tensors(name: str, table: Table, kind: ExportKind
                   ) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    if isinstance(table, SparseTable):
        check_sparse(name, table, kind)
        tensors = {"keys": table.keys, "values": table.values, "default": table.default}
        entry: dict[str, object] = {"kind": "sparse", "dim": table.dim,
                                    "dtype": dtype_name(table.dtype), "rows": table.keys.numel()}
        if kind == "delta":
            tensors["removed"] = table.removed
            entry["removed"] = table.removed.numel()
    else:
        if table.dtype not in _DTYPES.values():
            raise ExportFormatError(f"dense table {name!r}: dtype {table.dtype} is not a float")
        tensors = {"value": table.value}
        shape = list(table.value.shape)
        entry = {"kind": "dense", "shape": shape, "dtype": dtype_name(table.dtype),
                 "rows": shape[0] if shape else 1}
    entry["spec"] = table.spec
    return {k: v.detach().cpu().contiguous() for k, v in tensors.items()}, entry


def _read_table(directory: Path, name: str, entry: object, kind: ExportKind) -> Table:
    where = directory / MANIFEST_NAME
    try:
        if not isinstance(entry, dict):
            raise TypeError("entry is not an object")
        file_name, expected, table_kind = entry["file"], entry["sha256"], entry["kind"]
        dtype = _DTYPES[entry["dtype"]]
        if not isinstance(file_name, str) or Path(file_name).name != file_name \
                or file_name.startswith("."):
            raise ValueError(f"file {file_name!r} is not a plain file name")
    except (KeyError, TypeError, ValueError) as exc:
        raise ExportFormatError(f"{where}: table {name!r} has a malformed entry: {exc!r}") from exc
    path = directory / file_name
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ExportFormatError(f"export file {path} is missing or unreadable: {exc}") from exc
    actual = hashlib.sha256(data).hexdigest()
    if actual != expected:
        raise ExportFormatError(
            f"export file {path} fails its checksum: sha256 {actual}, the manifest says "
            f"{expected}; the export is corrupt, export again")
    try:
        tensors = st_load(data)
    except (SafetensorError, ValueError) as exc:
        raise ExportFormatError(f"export file {path} is not a safetensors file: {exc}") from exc
    spec = entry.get("spec") or {}
    try:
        table: Table
        if table_kind == "sparse":
            sparse = SparseTable(
                tensors["keys"], tensors["values"], tensors["default"],
                tensors["removed"] if kind == "delta" else torch.empty(0, dtype=torch.int64),
                spec)
            check_sparse(name, sparse, kind)
            if sparse.dtype != dtype or sparse.dim != entry["dim"]:
                raise ExportFormatError(f"holds {sparse.dtype} dim {sparse.dim}, the manifest "
                                        f"says {dtype} dim {entry['dim']}")
            table = sparse
        elif table_kind == "dense":
            table = DenseTable(tensors["value"], spec)
            if table.dtype != dtype or list(table.value.shape) != entry["shape"]:
                raise ExportFormatError(
                    f"holds {table.dtype} {list(table.value.shape)}, the manifest says "
                    f"{dtype} {entry['shape']}")
        else:
            raise ExportFormatError(f"unknown kind {table_kind!r}")
    except (KeyError, ExportFormatError) as exc:
        raise ExportFormatError(f"export file {path} (table {name!r}): {exc}") from exc
    return table


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):  # some filesystems refuse fsync on a directory
            os.fsync(fd)
    finally:
        os.close(fd)


def read_published(path: Path | str) -> tuple[str, list[str]]:
    """What a publisher's directory `path` says it holds: the newest full export's name and
    the deltas after it, in order (see PUBLISHED_NAME). ExportFormatError when its listing
    cannot be read."""
    listing_path = Path(path) / PUBLISHED_NAME
    try:
        listing = json.loads(listing_path.read_text())
        if listing.get("format") != PUBLISHED_FORMAT:
            raise ValueError(f"format {listing.get('format')!r}, not {PUBLISHED_FORMAT!r}")
        return str(listing["full"]), [str(d) for d in listing["deltas"]]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ExportFormatError(f"{listing_path} cannot be read: {exc}") from exc
