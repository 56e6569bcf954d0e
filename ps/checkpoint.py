"""The on-disk checkpoint of a parameter-server shard, and the manifest that ties shards together.

Layout, under a checkpoint root directory::

    <root>/<job>/<checkpoint_id>/shard-<k>-of-<n>.safetensors   one per shard
    <root>/<job>/<checkpoint_id>/shard-<k>.json                 manifest entry of shard k
    <root>/<job>/<checkpoint_id>/manifest.json                  summary, once all n are there

Shard files are safetensors (https://github.com/huggingface/safetensors): an 8-byte
little-endian header length, a JSON header, then the raw bytes of every tensor. Nothing is
pickled, so reading a checkpoint cannot run code. This module writes the format itself, so
that tensor bytes go from tensor memory straight to the file (no serialised copy) and are
hashed as they are written; `safetensors.torch.load_file` reads the result (the tests check).
The rows of a table with keys (every tensor one row per key) are written in the order of
their keys' routing hash (`protos.partition.route_hash`), so the rows any shard of any
shard count owns are one run of the file (see Integrity).
Tensor keys are ``<table>/<tensor>`` with both names percent-encoded (`urllib.parse.quote`
with no safe characters), so any string is a valid name and no key can contain a stray
``/``. Everything that is not a tensor (job, shard, checkpoint id, clock, `meta`, table specs
and the exact table -> tensor name map) is JSON in the header's ``__metadata__``; the reader
uses that map, never the keys, to rebuild the tables.

Atomicity: every file is written to a hidden temporary file in its final directory
(``.<name>.tmp-<pid>-<random>``), flushed, fsynced, renamed over the final name, and then
the directory is fsynced. A crash leaves at most a temporary file, which readers never look
at and later writes in that directory remove once it is an hour old. A file under a final
name is always complete.

Manifests and concurrent writers: shards are usually written by different processes, so
the manifest is not one file that each of them reads, changes and writes back (two writers
at once would lose one entry). Each shard's entry is its own file, ``shard-<k>.json``,
written atomically by that shard's `write_manifest` call and never touched by another
shard; `read_manifest` assembles the entries it finds. Two processes recording different
shards therefore write different files and cannot lose each other's entry; two recording
the same shard leave one whole entry (the last rename). A checkpoint is complete when
entries for all ``num_shards`` shards are present. The writer that finds every entry
present also writes ``manifest.json``, a summary for people and tools; this module never
reads it back, so a stale or missing summary cannot mislead a restore.

Order: each entry records the wall-clock time it was written; a checkpoint's time is that of
its newest entry (when it became complete, for a complete one). `list_checkpoints` and
`latest_complete` order checkpoints by (that time, checkpoint id). Wall time rather than the
id, because ids of different kinds ("c000042", "t1732170000") do not sort against each other.

Integrity: each entry records the digest and size of its shard file. Every tensor's bytes
are cut into blocks of whole rows, about BLOCK_BYTES each, and the header lists the sha256
of each block (``blocks`` in ``__metadata__``); the file's digest is the sha256 of its
header (length and JSON), which so covers every byte. `read_manifest` checks that every
recorded file exists with its recorded size (cheap; catches truncation and deletion);
`read_shard(path, sha256)` checks the header against the digest before anything else, then
each block it reads against the header, several at once on the reading threads. A read that
keeps some rows (resharding) reads, and checks, only the blocks that hold them: a block it
does not read cannot change what it returns. Files of versions 1 and 2 (before blocks)
have one sha256 of the whole file, checked while reading all of it. A checkpoint
whose file fails that check when a server restores it is marked bad: ``<checkpoint_id>/BAD``
holds the reason (written atomically, by `load_checkpoint`), and `list_checkpoints` and
`latest_complete` pass over it from then on. Writing a shard into the directory again (a new
checkpoint under the same id) removes the mark.

Runs: each entry records the run of the job that wrote it (``run``; "" before run ids), so a
restore picks checkpoints of the current run only, unless the user resumes another.

Full and delta checkpoints: a shard file is of one of two kinds (``ShardState.kind``). A full
file holds every table whole. A delta file holds what changed since the snapshot it builds
on (``base``, whose file's sha256 it records as ``base_sha256``): each sparse table as a row
delta (a `TableState` of kind ``rows``: the keys of the rows changed or created, their values,
optimizer state, steps and touch stamps, the keys evicted since (``evicted_keys``), and the
small whole-table items that changed, ``sketch`` and ``evicted_bits``), each table that had
to be written whole (a dense table that changed, a table declared since the base) as in a
full file, and no entry at all for a table that did not change. Files of both kinds are
written in format version 3 (blocks), which older builds refuse rather than misread;
version 1 (full) and 2 (delta) files of older builds are still read. Which kind a snapshot
is, the shard decides (ps/deltas.py).

A delta's directory holds hard links to every file its chain needs, full file first:
``shard-<k>-of-<n>.base-<id>.safetensors`` for each checkpoint ``<id>`` it builds on. So a
checkpoint directory is whole on its own: removing or rewriting an older checkpoint (a later
run under the same id, retention) never breaks a delta, as its links keep the bytes it needs.
A delta's manifest entry records its ``kind``, ``base`` and that ``chain`` (id, link name,
sha256 and size of each link, checked like the file itself). `load_checkpoint` and
`read_resolved` follow the chain (each file hashed against the digest the next one
records), apply the deltas in order (`apply_deltas`) and return the full state. A file of a
chain that fails verification marks the checkpoint being read bad, and the checkpoint the
file was a link to as well while it still holds that same file; `list_checkpoints` (and so
`latest_complete`) passes over every checkpoint whose chain holds one marked bad.

Retention: `prune` removes the checkpoints of the current run older than its `keep` newest
complete full checkpoints (older both in time and in clock). It only ever removes whole
directories (renamed away first, so readers never see half of one), so concurrent pruners
and writers cannot break a kept checkpoint, and a delta never needs an older directory.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import dataclasses
import hashlib
import json
import logging
import math
import os
import queue
import re
import secrets
import shutil
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Final, Protocol
from urllib.parse import quote

import numpy as np
import torch

from protos.exported import sha256_file
from protos.partition import route_hash
from ps.errors import PSError
from ps.index import KeyIndex

log = logging.getLogger(__name__)

StrPath = str | os.PathLike[str]
# Given a sparse table's int64 keys, one bool per key: the rows to keep (read_shard's `keep`).
KeyFilter = Callable[[np.ndarray], np.ndarray]
# Where read_shard puts the kept rows of a tensor: (table, tensor, dtype, shape) -> a tensor.
Into = Callable[[str, str, torch.dtype, tuple[int, ...]], "torch.Tensor | None"]

FORMAT: Final = "pstrain.shard"
# Shard files are written in version 3 (either kind; a sha256 per block, see the module
# docstring). Versions 1 (full) and 2 (delta), one sha256 of the whole file, are still read.
FORMAT_VERSION: Final = 3
FLAT_FULL_VERSION: Final = 1
FLAT_DELTA_VERSION: Final = 2
MANIFEST_VERSION: Final = 1
# The kinds of a shard file, and of the tables in a delta: written whole, or changed rows.
FULL: Final = "full"
DELTA: Final = "delta"
ROWS: Final = "rows"
_KINDS_OF_VERSION: Final = {FLAT_FULL_VERSION: (FULL,), FLAT_DELTA_VERSION: (DELTA,),
                            FORMAT_VERSION: (FULL, DELTA)}
# A row delta's tensors that are not one row per key: the keys evicted since its base, and
# whole-table items that replace the base's.
EVICTED_KEYS: Final = "evicted_keys"
WHOLE_TABLE_TENSORS: Final = frozenset({"sketch", "evicted_bits"})
# A chain longer than this is refused as corrupt (a shard writes a full file every
# --checkpoint-full-every snapshots, far fewer).
MAX_CHAIN: Final = 100_000
ENTRY_FORMAT: Final = "pstrain.manifest-entry"
MANIFEST_FORMAT: Final = "pstrain.manifest"
MANIFEST_NAME: Final = "manifest.json"
# The marker of a checkpoint that failed verification: its content is the reason.
BAD_NAME: Final = "BAD"

# safetensors readers refuse headers larger than this (its MAX_HEADER_SIZE).
MAX_HEADER_BYTES: Final = 100_000_000
# Unit of file I/O and of hashing: large enough that per-call overhead is noise, small enough
# that hashing one chunk overlaps writing the next and writeback starts early.
CHUNK_BYTES: Final = 16 * 1024 * 1024
# The unit of a paced write (write_shard's max_bytes_per_s): small, so that each burst of
# copying and hashing between two pauses is short. At 64 MB/s beside training on 2 cores,
# 256 KiB made the p99 step 4.8-7.3x the median, 64 KiB 7.1-8.3x, 1 MiB 10.1-10.6x.
PACED_CHUNK_BYTES: Final = 256 * 1024
# A shard file's tensors are hashed in blocks of about this size (whole rows of a table),
# each block's sha256 in the header: a read checks the blocks it reads, several at once.
BLOCK_BYTES: Final = 4 * 1024 * 1024
# Keys a write orders at a time (see `_route_order`): each piece is a short burst of CPU.
ORDER_CHUNK_KEYS: Final = 64 * 1024
# Blocks a writer may be ahead of its hashing thread (their memory is held until hashed).
HASHING_AHEAD: Final = 8
# Reads in flight while restoring; more than one keeps the disk's queue from running dry.
READ_THREADS: Final = 4
# A read that keeps some rows of a table (read_shard's `keep`) passes the file through this
# many reused buffers of this size: its memory beside the rows kept.
STAGED_CHUNK_BYTES: Final = 4 * 1024 * 1024
STAGING_BUFFERS: Final = READ_THREADS + 2
# Temporary files older than this are a crashed writer's leftovers; younger ones may be live.
STALE_TMP_AGE_S: Final = 3600.0

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_ENTRY_RE = re.compile(r"shard-(\d+)\.json")
_TMP_RE = re.compile(r"\..+\.tmp-\d+-[0-9a-f]{8}")
# A checkpoint directory being removed by `prune` (renamed first, then deleted).
_PRUNED_RE = re.compile(r"\..+\.pruned-\d+-[0-9a-f]{8}")

_DTYPE_TO_ST: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
}
for _torch_name, _st_name in [
    ("uint64", "U64"),
    ("uint32", "U32"),
    ("uint16", "U16"),
    ("float8_e4m3fn", "F8_E4M3"),
    ("float8_e5m2", "F8_E5M2"),
    ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
    ("float8_e5m2fnuz", "F8_E5M2FNUZ"),
]:
    _dtype = getattr(torch, _torch_name, None)
    if isinstance(_dtype, torch.dtype):
        _DTYPE_TO_ST[_dtype] = _st_name
_ST_TO_DTYPE: dict[str, torch.dtype] = {v: k for k, v in _DTYPE_TO_ST.items()}


class CheckpointError(PSError):
    """A checkpoint cannot be written or read: bad input, an I/O failure, or a bad file."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file on disk is truncated, malformed, or fails its checksum."""


class CheckpointNotFoundError(CheckpointError):
    """No checkpoint has the id (or run id) that was asked for."""


class CheckpointLinkError(CheckpointError):
    """A delta's base files cannot be hard-linked into its directory: the file system has no
    hard links (or refuses them), so this directory can hold full checkpoints only."""


class CheckpointUnsignedError(CheckpointError):
    """A checkpoint's entry in Redis is not signed with the job's secret: someone changed
    Redis, or the job's secret changed."""


class LaterRows(Protocol):
    """A tensor of a snapshot whose rows are read as they are written (a copy-on-write
    snapshot of a live table: `ps.tables.SparseTable.snapshot_later`). Thread-safe."""

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def shape(self) -> tuple[int, ...]: ...

    def gather(self, rows: torch.Tensor) -> torch.Tensor:
        """A new tensor of the snapshot's rows `rows` (int64 indices), in that order."""
        ...


@dataclass(frozen=True, eq=False)
class TableState:
    """One table of a shard snapshot.

    `spec` is opaque JSON (round-tripped exactly). `tensors` may use any names and any
    supported dtype; tensors may be empty or 0-d. `later` (a snapshot about to be written
    only; `read_shard` never makes one) holds more tensors, by name, whose rows are read
    when written; `materialized` copies them into `tensors`. ``eq=False``: comparing tensors
    with ``==`` is elementwise, so dataclass equality would raise rather than answer.
    """

    name: str
    spec: dict[str, object]
    tensors: dict[str, torch.Tensor]
    # FULL: the table whole; ROWS (in a delta only): the rows of a sparse table that changed
    # since the base (see the module docstring).
    kind: str = FULL
    later: dict[str, LaterRows] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class ShardState:
    """A snapshot of one shard: what `write_shard` writes and `read_shard` returns.

    A DELTA holds the changes since checkpoint `base`, whose file of this shard has the
    sha256 `base_sha256` (filled in by `write_shard` and read back by `read_shard`);
    `apply_delta` turns base and delta into the full state.
    """

    job: str
    shard: int
    num_shards: int
    checkpoint_id: str
    clock: int
    meta: dict[str, object]
    tables: list[TableState]
    kind: str = FULL
    base: str = ""
    base_sha256: str = ""


def materialized(state: ShardState) -> ShardState:
    """`state` with every tensor in its tables' `tensors` (the rows of `later` copied out:
    each a new tensor); `state` itself when none has any. For what reads a live snapshot
    in memory rather than writing it (a restore from it, tests)."""
    if not any(table.later for table in state.tables):
        return state
    tables = [
        dataclasses.replace(table, later={}, tensors={**table.tensors, **{
            name: rows.gather(torch.arange(rows.shape[0]))
            for name, rows in table.later.items()}})
        for table in state.tables
    ]
    return dataclasses.replace(state, tables=tables)


@dataclass(frozen=True)
class ChainFile:
    """A file a delta builds on, as linked into the delta's directory: the checkpoint it
    belongs to, the link's path, and the file's sha256 and size."""

    checkpoint_id: str
    path: str
    sha256: str
    nbytes: int


@dataclass(frozen=True)
class ShardFile:
    """A written shard file: its final path, its digest (`sha256`: of its header, which lists
    the sha256 of every block; of all its bytes in a file of version 1 or 2), and its size;
    for a delta, the checkpoint it builds on and every file of its chain, full file first."""

    path: str
    sha256: str
    nbytes: int
    kind: str = FULL
    base: str = ""
    chain: tuple[ChainFile, ...] = ()


@dataclass(frozen=True)
class Manifest:
    """A checkpoint as assembled from its manifest entries.

    `shards` holds the shards recorded so far (absolute paths); `complete` is true when all
    `num_shards` are recorded. `clock` is the smallest clock the entries recorded (shards of
    an async job may snapshot at different clocks). `written_at_ns` is the wall time of the
    newest entry, the order of `list_checkpoints`.
    """

    job: str
    checkpoint_id: str
    clock: int
    num_shards: int
    shards: dict[int, ShardFile]
    complete: bool
    directory: Path
    written_at_ns: int
    run: str = ""  # the run of the job that wrote it ("" before run ids)

    @property
    def kind(self) -> str:
        """FULL when every shard recorded so far is a full file, else DELTA."""
        return DELTA if any(f.kind == DELTA for f in self.shards.values()) else FULL

    @property
    def chain_ids(self) -> frozenset[str]:
        """The checkpoints any shard of this one builds on (its chain's ids)."""
        return frozenset(c.checkpoint_id for f in self.shards.values() for c in f.chain)


# ---- public API -----------------------------------------------------------------------------


def shard_file_name(shard: int, num_shards: int) -> str:
    """The file name of shard `shard` of `num_shards`: ``shard-<k>-of-<n>.safetensors``."""
    return f"shard-{shard}-of-{num_shards}.safetensors"


def link_file_name(shard: int, num_shards: int, base: str) -> str:
    """The name of the link, in a delta's directory, to the file of shard `shard` of
    checkpoint `base` that it builds on: ``shard-<k>-of-<n>.base-<base>.safetensors``."""
    return f"shard-{shard}-of-{num_shards}.base-{base}.safetensors"


def checkpoint_dir(directory: StrPath, job: str, checkpoint_id: str) -> Path:
    """``<directory>/<job>/<checkpoint_id>``, after checking both names are safe path parts."""
    _check_name("job", job)
    _check_name("checkpoint_id", checkpoint_id)
    return Path(directory) / job / checkpoint_id


_SHA256_RE = re.compile(r"[0-9a-f]{64}")


def check_reference(checkpoint_id: str, sha256: str) -> None:
    """CheckpointError unless `checkpoint_id` can name a directory and `sha256` is a digest
    (64 lowercase hex digits, as manifests record them)."""
    _check_name("checkpoint id", checkpoint_id)
    if not isinstance(sha256, str) or not _SHA256_RE.fullmatch(sha256):
        raise CheckpointError(
            f"checkpoint {checkpoint_id!r}: the shard's sha256 must be 64 lowercase hex "
            f"digits, as its manifest records it; got {sha256[:80]!r}"
        )


def read_checkpoint(directory: StrPath, job: str, checkpoint_id: str, shard: int,
                    num_shards: int, sha256: str) -> ShardState:
    """The full state of shard `shard` of `num_shards` in checkpoint `checkpoint_id`: its
    file, looked up by name inside `directory` (never a path given from outside) and hashed
    against `sha256` (the digest its manifest or Redis recorded) while it is read, with a
    delta's chain followed and applied (`read_resolved`).

    CheckpointError when there is no directory, a name is unsafe or the digest malformed,
    or a file of the chain cannot be read; CheckpointCorruptError when one does not match.
    Blocks on file I/O.
    """
    return _read_by_id(directory, job, checkpoint_id, shard, num_shards, sha256, None)


def load_checkpoint(directory: StrPath, job: str, checkpoint_id: str, shard: int,
                    num_shards: int, sha256: str, keep: KeyFilter | None = None,
                    into: Into | None = None) -> ShardState:
    """`read_checkpoint` for a restore: a file that fails verification (truncated, malformed,
    or not matching its digest) also marks the checkpoint bad on disk (`mark_bad`) before
    the CheckpointCorruptError goes on, so no later restore tries it again. When the file is
    a link of the delta's chain, the checkpoint it links to is marked bad too while its own
    file is that same file (so every delta built on it is passed over). With `keep`, every
    file of the chain keeps only the rows it selects (`read_shard`), so the result is the
    full state's rows of those keys, read in place through `into` when the file is a full
    one (`read_shard`). Blocks on file I/O."""

    def failed(base: str, link: Path, exc: CheckpointError) -> None:
        if not isinstance(exc, CheckpointCorruptError):
            return
        with contextlib.suppress(CheckpointError, OSError):
            own = checkpoint_dir(directory, job, base) / shard_file_name(shard, num_shards)
            if os.path.samefile(link, own):
                mark_bad(directory, job, base, f"shard {shard}: {exc}")

    try:
        return _read_by_id(directory, job, checkpoint_id, shard, num_shards, sha256, failed,
                           keep, into)
    except CheckpointCorruptError as exc:
        mark_bad(directory, job, checkpoint_id, f"shard {shard}: {exc}")
        raise


def read_resolved(path: StrPath, sha256: str | None = None) -> ShardState:
    """The full state of the shard file at `path`: the file itself when it is a full one;
    for a delta, its chain read from the links beside it (each hashed against the digest the
    file after it records), applied in order. `sha256` is checked as `read_shard` does.

    CheckpointError naming the file when one cannot be opened (a link removed by hand);
    CheckpointCorruptError naming it when one is corrupt, fails its digest, or is not the
    checkpoint the chain says. Blocks on reading every file of the chain; thread-safe.
    """
    return _resolve(Path(path), sha256, None)


def _read_by_id(
    directory: StrPath, job: str, checkpoint_id: str, shard: int, num_shards: int,
    sha256: str, failed: Callable[[str, Path, CheckpointError], None] | None,
    keep: KeyFilter | None = None, into: Into | None = None,
) -> ShardState:
    if not str(directory):
        raise CheckpointError(
            f"this server has no checkpoint directory (the job's, or --checkpoint-dir), so it "
            f"cannot load checkpoint {checkpoint_id!r}"
        )
    check_reference(checkpoint_id, sha256)
    _check_shard_numbers(shard, num_shards)
    path = checkpoint_dir(directory, job, checkpoint_id) / shard_file_name(shard, num_shards)
    state = _resolve(path, sha256, failed, (job, checkpoint_id, shard, num_shards), keep, into)
    return state


def _resolve(
    path: Path, sha256: str | None, failed: Callable[[str, Path, CheckpointError], None] | None,
    expect: tuple[str, str, int, int] | None = None, keep: KeyFilter | None = None,
    into: Into | None = None,
) -> ShardState:
    """Reads the file at `path` and, for a delta, its chain from the links beside it;
    `failed(base, link, error)` hears of a link that cannot be read before the error goes on.
    `expect` is the (job, checkpoint id, shard, shard count) the file must hold; `keep` cuts
    every file of the chain alike (`read_shard`), which commutes with applying the deltas:
    they change rows by key. `into` serves the file at `path` alone (read_shard uses it only
    for a full file)."""
    top = read_shard(path, sha256, keep, into)
    if expect is not None and (top.job, top.checkpoint_id) != expect[:2]:
        raise CheckpointCorruptError(
            f"{path} holds checkpoint {top.checkpoint_id!r} of job {top.job!r}, not "
            f"{expect[1]!r} of {expect[0]!r}"
        )
    if expect is not None and (top.shard, top.num_shards) != expect[2:]:
        raise CheckpointCorruptError(
            f"{path} holds shard {top.shard} of {top.num_shards}, not shard {expect[2]} of "
            f"{expect[3]}; the file is corrupt"
        )
    chain = [top]
    while chain[-1].kind == DELTA:
        later = chain[-1]
        if len(chain) > MAX_CHAIN or later.base in {s.checkpoint_id for s in chain}:
            raise CheckpointCorruptError(
                f"checkpoint shard {path}: its chain of deltas does not end in a full file "
                f"(at {later.checkpoint_id!r}, building on {later.base!r}); the file is corrupt"
            )
        link = path.parent / link_file_name(top.shard, top.num_shards, later.base)
        try:
            base = read_shard(link, later.base_sha256, keep)
            if (base.job, base.checkpoint_id, base.shard, base.num_shards) != (
                    top.job, later.base, top.shard, top.num_shards):
                raise CheckpointCorruptError(
                    f"{link} holds shard {base.shard}/{base.num_shards} of checkpoint "
                    f"{base.checkpoint_id!r} of job {base.job!r}, not the base "
                    f"{later.base!r} that {later.checkpoint_id!r} builds on"
                )
        except CheckpointError as exc:
            if failed is not None:
                failed(later.base, link, exc)
            raise type(exc)(
                f"checkpoint {top.checkpoint_id!r} (a delta) builds on {later.base!r}: {exc}"
            ) from exc
        chain.append(base)
    if len(chain) == 1:
        return top
    return apply_deltas(chain[-1], chain[-2::-1])


def kept_rows(path: StrPath, keep: KeyFilter) -> dict[str, int] | None:
    """Per table with keys, how many rows `read_shard(path, keep=keep)` would keep; None for
    a delta file (its rows are not the state's). Reads the header and the keys only, and
    checks no digest: what it says is a plan, and the read that follows verifies the file.
    CheckpointError / CheckpointCorruptError as read_shard. Blocks on file I/O."""
    path = Path(path)
    fd = _open_shard(path)
    try:
        prefix, entries, meta = _read_header(fd, path)
        if meta.get("kind", FULL) != FULL:
            return None
        shapes = {key: shape for key, _, shape, _ in entries}
        counts: dict[str, int] = {}
        for key, cut in _row_cuts(fd, entries, meta, keep, path, len(prefix), None).items():
            if cut.name == "keys":
                counts[cut.table] = shapes[key][0] if cut.rows is None else len(cut.rows)
        return counts
    except OSError as exc:
        raise CheckpointError(f"reading checkpoint shard {path} failed: {exc}") from exc
    finally:
        os.close(fd)


def mark_bad(directory: StrPath, job: str, checkpoint_id: str, reason: str) -> None:
    """Writes ``<directory>/<job>/<checkpoint_id>/BAD`` with `reason`, atomically: the
    checkpoint failed verification and restores pass over it. Best effort (a directory that
    is gone or read-only is logged, not raised): the mark in Redis does the same job inside
    a running job. Thread-safe."""
    try:
        ckpt_dir = checkpoint_dir(directory, job, checkpoint_id)
        if not ckpt_dir.is_dir():
            return
        _atomic_write_bytes(ckpt_dir / BAD_NAME, (reason.strip() + "\n").encode("utf-8"))
    except CheckpointError as exc:
        log.warning("job %s: cannot mark checkpoint %s bad on disk: %s", job, checkpoint_id, exc)
        return
    log.warning("job %s: marked checkpoint %s bad (%s)", job, checkpoint_id, ckpt_dir / BAD_NAME)


def bad_reason(directory: StrPath, job: str, checkpoint_id: str) -> str | None:
    """The reason checkpoint `checkpoint_id` was marked bad on disk, or None if it was not."""
    try:
        path = checkpoint_dir(directory, job, checkpoint_id) / BAD_NAME
        return path.read_text(encoding="utf-8", errors="replace").strip() or "marked bad"
    except (CheckpointError, OSError):
        return None


def write_shard(directory: StrPath, state: ShardState, base: ShardFile | None = None,
                *, max_bytes_per_s: float = 0.0) -> ShardFile:
    """Writes `state` atomically to ``<directory>/<job>/<checkpoint_id>/shard-<k>-of-<n>...``.

    A delta needs `base`: the ShardFile that `write_shard` returned for (or `read_manifest`
    found of) this shard's file of checkpoint `state.base`. Its sha256 goes into the new
    file's header, and it and its own chain are hard-linked beside the new file first (see
    the module docstring). Blocks until the file and its directory entry are on disk (fsync),
    then returns its path, digest, size, kind and chain for `write_manifest`. Replaces an
    existing file of the same shard and checkpoint id. Thread-safe and process-safe (no
    shared state; concurrent writers of one file leave one whole file). The rows of a table
    with keys are written in routing order (module docstring). The tensors must not
    change during the call: their memory is written directly, without a snapshot copy.
    `max_bytes_per_s` (> 0) paces the write to that rate on average (`Pace`), in chunks of
    PACED_CHUNK_BYTES; 0 writes as fast as it can.
    Raises CheckpointError on bad input (names, dtypes, JSON that does not round-trip, a
    delta without its base) or I/O failure, CheckpointLinkError when the base cannot be
    hard-linked; no final-named shard file is then left.
    """
    start = time.perf_counter()
    _check_shard_numbers(state.shard, state.num_shards)
    if isinstance(state.clock, bool) or not isinstance(state.clock, int):
        raise CheckpointError(f"clock must be an int, got {state.clock!r}")
    ckpt_dir = checkpoint_dir(directory, state.job, state.checkpoint_id)
    chain = _check_kind(state, base)
    if base is not None and chain:
        state = dataclasses.replace(state, base_sha256=base.sha256)
    pace = Pace(max_bytes_per_s)
    header, items = _build_header(state, pace)
    placeholder = _encode_header(header, items, None, state.shard)
    _ensure_dir(ckpt_dir)
    _remove_stale_temps(ckpt_dir)
    final = ckpt_dir / shard_file_name(state.shard, state.num_shards)
    try:
        linked = _link_chain(ckpt_dir, state, chain)
        written = _write_file(final, state, header, items, placeholder, pace)
    except BaseException:
        if not final.exists():
            # Links of a shard file never written would keep its chain's files on disk
            # after retention removes them (nothing reads a directory without a manifest).
            for link in chain:
                with contextlib.suppress(OSError):
                    os.unlink(ckpt_dir / link_file_name(state.shard, state.num_shards,
                                                        link.checkpoint_id))
        raise
    prefix, offset = written
    digest = hashlib.sha256(prefix).hexdigest()
    elapsed = time.perf_counter() - start
    log.info(
        "job %s shard %d/%d checkpoint %s clock %d: wrote %s (%d bytes, %.0f MB/s)",
        state.job, state.shard, state.num_shards, state.checkpoint_id, state.clock, final,
        offset, offset / 1e6 / max(elapsed, 1e-9),
    )
    return ShardFile(path=str(final), sha256=digest, nbytes=offset, kind=state.kind,
                     base=state.base, chain=linked)


def _write_file(final: Path, state: ShardState, header: dict[str, object],
                items: list[_Item], placeholder: bytes, pace: Pace) -> tuple[bytes, int]:
    """Writes the shard file `final` atomically: the header (`placeholder` until the blocks'
    digests are known), then every item's blocks, paced. Returns the final header and the
    file's size."""
    step = PACED_CHUNK_BYTES if pace.bytes_per_s > 0 else CHUNK_BYTES
    # One helper thread hashes the chunks, in order, while this one writes them; a chunk's
    # memory (a view of the tensor, or rows gathered into their order) lives until hashed.
    hashing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint-sha256")
    digests: list[Future[bytes]] = []
    try:
        with _atomic_file(final) as fd:
            _write_all(fd, memoryview(placeholder))
            offset = len(placeholder)
            for item in items:
                for block in _blocks_to_write(item, step):
                    sha = hashlib.sha256()
                    for chunk in block:
                        hashing.submit(sha.update, chunk)  # one thread: in order
                        _write_all(fd, chunk)
                        # Starting writeback now lets the disk work while we fill the page
                        # cache, so the final fsync waits for the last chunks only.
                        _start_writeback(fd, offset, len(chunk))
                        offset += len(chunk)
                        pace.wrote(len(chunk))
                    digests.append(hashing.submit(sha.digest))
                    if len(digests) > HASHING_AHEAD:
                        digests[-HASHING_AHEAD].result()
            prefix = _encode_header(header, items, [d.result() for d in digests], state.shard)
            if len(prefix) != len(placeholder):
                raise AssertionError("a header's digests changed its length")
            _pwrite_all(fd, prefix, 0)
    finally:
        hashing.shutdown(wait=True, cancel_futures=True)
    return prefix, offset


def _check_kind(state: ShardState, base: ShardFile | None) -> tuple[ChainFile, ...]:
    """The chain a delta `state` builds on (`base`'s chain and `base` itself; () for a full
    one), after checking kind, base and table kinds agree. CheckpointError otherwise."""
    where = f"checkpoint {state.checkpoint_id!r} shard {state.shard}"
    if state.kind == FULL:
        if state.base or base is not None:
            raise CheckpointError(f"{where} is full: it builds on no base (got {state.base!r})")
        rows = [t.name for t in state.tables if t.kind != FULL]
        if rows:
            raise CheckpointError(
                f"{where} is full, but tables {rows[:5]} are not whole; make it a delta"
            )
        return ()
    if state.kind != DELTA:
        raise CheckpointError(f"{where}: kind must be {FULL!r} or {DELTA!r}, got {state.kind!r}")
    bad_tables = [t.name for t in state.tables if t.kind not in (FULL, ROWS)]
    if bad_tables:
        raise CheckpointError(
            f"{where}: tables {bad_tables[:5]} have a kind other than {FULL!r} and {ROWS!r}"
        )
    _check_name("base checkpoint id", state.base)
    if state.base == state.checkpoint_id:
        raise CheckpointError(f"{where} is a delta of itself; a delta builds on an older one")
    if base is None or Path(base.path).parent.name != state.base:
        raise CheckpointError(
            f"{where} is a delta of {state.base!r}: pass the ShardFile of this shard's file "
            f"of {state.base!r} as `base` (got {base and base.path!r})"
        )
    if state.base_sha256 and state.base_sha256 != base.sha256:
        raise CheckpointError(
            f"{where}: base_sha256 {state.base_sha256} is not the sha256 of {base.path} "
            f"({base.sha256})"
        )
    own = ChainFile(state.base, base.path, base.sha256, base.nbytes)
    return (*base.chain, own)


def _link_chain(ckpt_dir: Path, state: ShardState, chain: tuple[ChainFile, ...]
                ) -> tuple[ChainFile, ...]:
    """Hard-links each file of `chain` into `ckpt_dir` under its link name (replacing a link
    of an earlier write under this id); returns the chain as linked there. The directory is
    fsynced by the write that follows."""
    linked = []
    for link in chain:
        final = ckpt_dir / link_file_name(state.shard, state.num_shards, link.checkpoint_id)
        source = Path(link.path)
        if source != final:
            tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
            try:
                os.link(source, tmp)
                os.replace(tmp, final)
            except OSError as exc:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise CheckpointLinkError(
                    f"checkpoint {state.checkpoint_id!r} (a delta) cannot hard-link the file "
                    f"{source} of {link.checkpoint_id!r} it builds on as {final}: {exc}; "
                    "deltas need a file system with hard links (set --checkpoint-full-every 1 "
                    "to write full checkpoints only)"
                ) from exc
        try:
            size = final.stat().st_size
        except OSError as exc:
            raise CheckpointError(f"linked base file {final} is unreadable: {exc}") from exc
        if size != link.nbytes:
            raise CheckpointError(
                f"base file {source} of {link.checkpoint_id!r} has {size} bytes, {link.nbytes} "
                "when it was written: it was replaced meanwhile; write a full checkpoint"
            )
        linked.append(dataclasses.replace(link, path=str(final)))
    return tuple(linked)


def _open_shard(path: Path) -> int:
    """A blocking read-only descriptor of the shard file at `path` (opened without blocking,
    so that a FIFO or a device cannot hang it; refused). CheckpointError."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise CheckpointError(
            f"cannot open checkpoint shard {path}: {exc}; check the path and permissions"
        ) from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise CheckpointError(f"checkpoint shard {path} is not a regular file")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_header(fd: int, path: Path) -> tuple[bytes, list[tuple[str, torch.dtype, list[int],
                                                                 int]], dict[str, str]]:
    """The file's bytes before its tensors (length and header: hashed first), the tensors
    (`_parse_header`) and the metadata. CheckpointCorruptError; OSError from reading."""
    size = os.fstat(fd).st_size
    head = _read_exact(fd, 8, path, 0)
    (header_len,) = struct.unpack("<Q", head)
    if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
        raise CheckpointCorruptError(  # names no byte of the file: it may not be ours
            f"checkpoint shard {path} is truncated or not a safetensors file (its header "
            "does not fit in it); restore from another checkpoint"
        )
    header_bytes = _read_exact(fd, header_len, path, 8)
    entries, meta = _parse_header(header_bytes, size - 8 - header_len, path)
    return head + header_bytes, entries, meta


def read_shard(path: StrPath, sha256: str | None = None, keep: KeyFilter | None = None,
               into: Into | None = None) -> ShardState:
    """Reads a shard file written by `write_shard`.

    Blocks on file I/O. Thread-safe. With `sha256` (the digest its manifest records), checks
    the header against it and each block read against the header (a file of version 1 or 2:
    hashes the whole file while reading it), and raises CheckpointCorruptError naming the
    file and the digests on a mismatch; without it, only the structure is checked. Returned
    tensors are fresh, writable memory owned by the caller (not views of a mapping of the
    file). Raises CheckpointCorruptError for a truncated or malformed file and
    CheckpointError if it cannot be opened.

    With `keep`, every table that has a ``keys`` tensor (a sparse table, or a row delta)
    holds only the rows whose keys `keep` selects, in their order in the file: ``keys`` and
    each tensor of one row per key are cut, ``evicted_keys`` by its own keys, whole-table
    items (`WHOLE_TABLE_TENSORS`) and tables without keys are read whole. The keys are read
    (and checked) first; a block whose rows are all kept is then read straight into the
    result, one that keeps some passes through a small reused buffer, and one that keeps none
    is not read (in a version 1 or 2 file it passes through a buffer, to be hashed). Rows
    kept by `protos.partition` routing are one run of the file, so a shard reads little more
    than its rows. A tensor that does not have one row per key is CheckpointCorruptError.

    `into` (with `keep`, for a full file) says where the kept rows of each cut tensor go:
    called with (table, tensor name, dtype, kept shape), it returns a contiguous CPU tensor
    of that dtype and shape to fill (say, a slice of a larger one), or None for fresh memory;
    anything else it returns is passed over for fresh memory too.
    """
    path = Path(path)
    fd = _open_shard(path)
    hasher = None
    try:
        with contextlib.suppress(AttributeError, OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        prefix, entries, meta = _read_header(fd, path)
        blocks = _blocks_of(meta, entries, path, checked=sha256 is not None)
        if sha256 is not None and blocks is not None:
            _check_digest(path, hashlib.sha256(prefix).hexdigest(), sha256)
        elif sha256 is not None:
            hasher = _BackgroundSha256()
            hasher.update(prefix)
        cuts = ({} if keep is None
                else _row_cuts(fd, entries, meta, keep, path, len(prefix), blocks))
        tensors: dict[str, torch.Tensor] = {}
        chunks: list[_Chunk] = []
        offset = len(prefix)
        for key, dtype, shape, nbytes in entries:
            cut = cuts.get(key)
            kept = shape if cut is None or cut.rows is None else [len(cut.rows), *shape[1:]]
            tensor = None
            if cut is not None and into is not None and meta.get("kind", FULL) == FULL:
                tensor = _target(into(cut.table, cut.name, dtype, tuple(kept)), dtype, kept)
            if tensor is None:
                tensor = torch.empty(kept, dtype=dtype)
            block = None if blocks is None else blocks.get(key)
            if cut is None or cut.rows is None:
                chunks.extend(_whole_chunks(tensor, offset, nbytes, block))
            else:
                chunks.extend(_cut_chunks(tensor, cut.rows, offset, shape[0], nbytes, block,
                                          path))
            offset += nbytes
            tensors[key] = tensor
        _read_chunks(fd, chunks, path, hasher)
    except OSError as exc:
        raise CheckpointError(f"reading checkpoint shard {path} failed: {exc}") from exc
    except _BlockMismatch as exc:
        raise CheckpointCorruptError(f"{exc} (the manifest records sha256 {sha256} for the "
                                     "file)") from None
    finally:
        os.close(fd)
        actual = hasher.hexdigest() if hasher is not None else None
    if hasher is not None and sha256 is not None:
        _check_digest(path, actual or "", sha256)
    return _state_from_meta(meta, tensors, path)


def _check_digest(path: Path, actual: str, recorded: str) -> None:
    if actual != recorded.lower():
        raise CheckpointCorruptError(
            f"checkpoint shard {path} fails its checksum: sha256 {actual}, manifest says "
            f"{recorded}; the file is corrupt, restore from another checkpoint"
        )


# A tensor's blocks as the header lists them: (block size, sha256 of each; None: unchecked).
_Blocks = tuple[int, "list[bytes] | None"]


def _blocks_of(meta: dict[str, str], entries: list[tuple[str, torch.dtype, list[int], int]],
               path: Path, checked: bool = True) -> dict[str, _Blocks] | None:
    """The blocks of each tensor with bytes, from the header of a version-3 file (without
    their digests unless `checked`); None for a file of an older version (one sha256 of the
    whole file). CheckpointCorruptError."""
    try:
        if int(meta.get("format_version", "0")) != FORMAT_VERSION:
            return None
        listed = json.loads(meta["blocks"])
        if not isinstance(listed, dict):
            raise TypeError("blocks is not a JSON object")
        blocks: dict[str, _Blocks] = {}
        for key, _, _, nbytes in entries:
            if not nbytes:
                continue
            block_bytes, hexes = listed.pop(key)
            if isinstance(block_bytes, bool) or not isinstance(block_bytes, int) \
                    or block_bytes < 1 or not isinstance(hexes, str):
                raise ValueError(f"tensor {key!r} has blocks {block_bytes!r}")
            if len(hexes) != 64 * -(-nbytes // block_bytes):
                raise ValueError(f"tensor {key!r} of {nbytes} bytes lists {len(hexes) // 64} "
                                 f"digests of blocks of {block_bytes}")
            digests = bytes.fromhex(hexes)
            blocks[key] = (block_bytes, [digests[i : i + 32] for i in range(0, len(digests), 32)]
                           if checked else None)
        if listed:
            raise ValueError(f"blocks of tensors not in the file: {sorted(listed)[:5]}")
        return blocks
    except (ValueError, TypeError, KeyError) as exc:
        raise CheckpointCorruptError(
            f"checkpoint shard {path} has a malformed block list ({exc!r}); the file is corrupt"
        ) from exc


def write_manifest(
    directory: StrPath,
    checkpoint_id: str,
    job: str,
    clock: int,
    shards: dict[int, ShardFile],
    num_shards: int,
    *,
    now_ns: Callable[[], int] = time.time_ns,
    run: str = "",
) -> Path:
    """Records `shards` (written by `write_shard`) in the manifest of checkpoint `checkpoint_id`.

    Writes one entry file per shard atomically; blocks until they are on disk. Safe to call
    concurrently from threads and from processes on one filesystem, for different shards of
    one checkpoint (see the module docstring): no entry is lost. When every shard is then
    recorded, also writes the ``manifest.json`` summary. Returns the path of
    ``manifest.json``, which `read_manifest` accepts whether or not the summary exists yet.
    `now_ns` is the wall clock stamped on the entries (injectable for tests); `run` the
    job's run id, recorded in them. A bad mark (`mark_bad`) left by an earlier checkpoint
    under this id is removed: the checkpoint is being written again.
    Raises CheckpointError on bad input, a shard file that is missing or of another size,
    or an I/O failure.
    """
    if isinstance(clock, bool) or not isinstance(clock, int):
        raise CheckpointError(f"clock must be an int, got {clock!r}")
    if not shards:
        raise CheckpointError(
            f"write_manifest for checkpoint {checkpoint_id!r} got no shards; pass the "
            "ShardFile that write_shard returned"
        )
    ckpt_dir = checkpoint_dir(directory, job, checkpoint_id)
    for shard, shard_file in shards.items():
        _check_shard_numbers(shard, num_shards)
        for file_path, nbytes in [(Path(shard_file.path), shard_file.nbytes),
                                  *((Path(c.path), c.nbytes) for c in shard_file.chain)]:
            if file_path.parent.resolve() != ckpt_dir.resolve():
                raise CheckpointError(
                    f"shard {shard} file {file_path} is not in checkpoint directory "
                    f"{ckpt_dir}; record the ShardFile that write_shard returned for this "
                    "checkpoint"
                )
            _check_file_size(file_path, nbytes)
        if (shard_file.kind == DELTA) != bool(shard_file.chain) or shard_file.kind not in (
                FULL, DELTA):
            raise CheckpointError(
                f"shard {shard} file {shard_file.path}: kind {shard_file.kind!r} with a chain "
                f"of {len(shard_file.chain)}; record the ShardFile that write_shard returned"
            )
    _check_agrees_with_recorded(ckpt_dir, job, checkpoint_id, num_shards)
    _ensure_dir(ckpt_dir)
    _remove_stale_temps(ckpt_dir)
    stamp = now_ns()
    for shard, shard_file in sorted(shards.items()):
        entry = {
            "format": ENTRY_FORMAT,
            "format_version": MANIFEST_VERSION,
            "job": job,
            "checkpoint_id": checkpoint_id,
            "shard": shard,
            "num_shards": num_shards,
            "clock": clock,
            "file": Path(shard_file.path).name,
            "sha256": shard_file.sha256,
            "nbytes": shard_file.nbytes,
            "written_at_ns": stamp,
            "run": run,
        }
        if shard_file.kind != FULL:
            entry.update(kind=shard_file.kind, base=shard_file.base, chain=[
                {"checkpoint_id": c.checkpoint_id, "file": Path(c.path).name,
                 "sha256": c.sha256, "nbytes": c.nbytes} for c in shard_file.chain])
        _atomic_write_bytes(ckpt_dir / f"shard-{shard}.json", _json_bytes(entry), sync_dir=False)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(ckpt_dir / BAD_NAME)
    _fsync_dir(ckpt_dir)
    summary = ckpt_dir / MANIFEST_NAME
    try:
        manifest = read_manifest(ckpt_dir)
    except CheckpointError as exc:
        # Our entries are recorded; another shard's damage is for readers to skip, not a
        # failure of this call.
        log.warning("job %s checkpoint %s: not writing %s: %s", job, checkpoint_id, summary, exc)
        return summary
    if manifest.complete:
        _atomic_write_bytes(summary, _json_bytes(_manifest_json(manifest)))
        log.info(
            "job %s checkpoint %s clock %d: complete, %d shards",
            job, checkpoint_id, manifest.clock, num_shards,
        )
    return summary


def read_manifest(path: StrPath) -> Manifest:
    """Assembles the manifest of one checkpoint from its entry files.

    `path` is the checkpoint directory or any file in it (such as ``manifest.json``).
    Blocks on file I/O (small files and stats only; shard files are not hashed). Thread-safe.
    Raises CheckpointError if the directory has no entries yet, and CheckpointCorruptError if
    an entry is malformed, entries disagree on job, id or shard count, or a recorded shard
    file is missing or has another size than recorded.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    ckpt_dir = path if path.is_dir() else path.parent
    try:
        names = sorted(os.listdir(ckpt_dir))
    except OSError as exc:
        raise CheckpointError(f"cannot list checkpoint directory {ckpt_dir}: {exc}") from exc
    entries = [_read_entry(ckpt_dir / n, int(m.group(1)))
               for n in names if (m := _ENTRY_RE.fullmatch(n))]
    if not entries:
        raise CheckpointError(
            f"checkpoint directory {ckpt_dir} has no manifest entries (shard-<k>.json): it is "
            "being written, or it is not a checkpoint"
        )
    first = entries[0]
    shards: dict[int, ShardFile] = {}
    for entry in entries:
        for field_name in ("job", "checkpoint_id", "num_shards"):
            if entry[field_name] != first[field_name]:
                raise CheckpointCorruptError(
                    f"manifest entries in {ckpt_dir} disagree on {field_name}: "
                    f"{first[field_name]!r} (shard {first['shard']}) vs {entry[field_name]!r} "
                    f"(shard {entry['shard']}); remove the stray entry or the checkpoint"
                )
        shard = _as_int(entry["shard"])
        file_path = ckpt_dir / str(entry["file"])
        nbytes = _as_int(entry["nbytes"])
        chain = tuple(ChainFile(str(c["checkpoint_id"]), str(ckpt_dir / c["file"]),
                                str(c["sha256"]), _as_int(c["nbytes"]))
                      for c in entry.get("chain", []))
        try:
            _check_file_size(file_path, nbytes)
            for link in chain:
                _check_file_size(Path(link.path), link.nbytes)
        except CheckpointError as exc:
            raise CheckpointCorruptError(f"checkpoint {ckpt_dir}: {exc}") from exc
        shards[shard] = ShardFile(path=str(file_path), sha256=str(entry["sha256"]), nbytes=nbytes,
                                  kind=str(entry.get("kind", FULL)),
                                  base=str(entry.get("base", "")), chain=chain)
    num_shards = _as_int(first["num_shards"])
    return Manifest(
        job=str(first["job"]),
        checkpoint_id=str(first["checkpoint_id"]),
        clock=min(_as_int(e["clock"]) for e in entries),
        num_shards=num_shards,
        shards=shards,
        complete=len(shards) == num_shards,
        directory=ckpt_dir,
        written_at_ns=max(_as_int(e["written_at_ns"]) for e in entries),
        run=str(first.get("run") or ""),
    )


def list_checkpoints(directory: StrPath, job: str) -> list[Manifest]:
    """Every checkpoint of `job` under `directory` with at least one entry, oldest first.

    Complete and incomplete ones alike (see `Manifest.complete`); corrupt ones are skipped
    with a warning, and those marked bad (`mark_bad`), or built on one marked bad, at debug
    level. Ordered by (time of the newest entry, checkpoint id). Blocks on file I/O;
    thread-safe. Raises CheckpointError only for a bad job name or an unreadable job directory.
    """
    manifests = _scan(directory, job, with_bad=False)
    job_dir = Path(directory) / job
    bad: dict[str, bool] = {}

    def marked(checkpoint_id: str) -> bool:
        if checkpoint_id not in bad:
            bad[checkpoint_id] = (job_dir / checkpoint_id / BAD_NAME).exists()
        return bad[checkpoint_id]

    kept = []
    for manifest in manifests:
        on_bad = sorted(c for c in manifest.chain_ids if marked(c))
        if on_bad:
            log.debug("job %s: skipping checkpoint %s: it builds on %s, marked bad", job,
                      manifest.checkpoint_id, on_bad[0])
            continue
        kept.append(manifest)
    return kept


def _scan(directory: StrPath, job: str, *, with_bad: bool) -> list[Manifest]:
    """The checkpoints of `job` whose entries read, oldest first; those marked bad only
    `with_bad`."""
    _check_name("job", job)
    job_dir = Path(directory) / job
    try:
        names = os.listdir(job_dir)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise CheckpointError(f"cannot list checkpoints in {job_dir}: {exc}") from exc
    manifests: list[Manifest] = []
    for name in names:
        ckpt_dir = job_dir / name
        if name.startswith(".") or not ckpt_dir.is_dir():
            continue
        if not with_bad and (ckpt_dir / BAD_NAME).exists():
            log.debug("job %s: skipping checkpoint %s: marked bad", job, name)
            continue
        try:
            manifest = read_manifest(ckpt_dir)
        except CheckpointCorruptError as exc:
            if not ckpt_dir.exists():  # another shard's retention took it while it was read
                log.debug("job %s: checkpoint %s went while it was read", job, name)
                continue
            log.warning("job %s: skipping corrupt checkpoint %s: %s", job, name, exc)
            continue
        except CheckpointError as exc:
            log.debug("job %s: skipping checkpoint %s: %s", job, name, exc)
            continue
        if manifest.job != job or manifest.checkpoint_id != name:
            log.warning(
                "job %s: skipping checkpoint %s: its entries name job %s checkpoint %s",
                job, name, manifest.job, manifest.checkpoint_id,
            )
            continue
        manifests.append(manifest)
    manifests.sort(key=lambda m: (m.written_at_ns, m.checkpoint_id))
    return manifests


def latest_complete(
    directory: StrPath, job: str, *, verify_checksums: bool = False
) -> Manifest | None:
    """The newest complete checkpoint of `job` (order of `list_checkpoints`), or None.

    Skips incomplete and corrupt checkpoints (malformed entries, missing or resized shard
    files or chain links) and those built on one marked bad. With `verify_checksums`, also
    hashes every shard file of a candidate, and every file of its chains, and skips it on a
    mismatch: this reads the whole checkpoint, so it is off by default and `read_shard`
    with the recorded sha256 catches the same damage at restore time. Blocks on file I/O;
    thread-safe.
    """
    for manifest in reversed(list_checkpoints(directory, job)):
        if not manifest.complete:
            continue
        if verify_checksums:
            files = [(f.path, f.sha256) for f in manifest.shards.values()]
            files += [(c.path, c.sha256) for f in manifest.shards.values() for c in f.chain]
            bad = [path for path, sha256 in files if _file_digest(Path(path)) != sha256]
            if bad:
                log.warning(
                    "job %s: skipping checkpoint %s: %s fails its checksum",
                    job, manifest.checkpoint_id, bad[0],
                )
                continue
        return manifest
    return None


# ---- deltas ---------------------------------------------------------------------------------


def apply_delta(state: ShardState, delta: ShardState) -> ShardState:
    """The full state `delta` describes, given the full state of its base. Pure: the inputs
    are not changed (the result shares the tensors it takes from them unchanged). See
    `apply_deltas`."""
    return apply_deltas(state, [delta])


def apply_deltas(state: ShardState, deltas: Sequence[ShardState]) -> ShardState:
    """The full state after applying `deltas` in order to the full `state`: the first
    builds on `state`, each later one on the one before. Pure; costs about one copy of each
    changed table, however long the chain.

    Per table: a table a delta holds whole replaces what came before; a row delta's rows
    replace the rows of their keys (or are added), the keys it evicted go, and its
    whole-table items (``sketch``, ``evicted_bits``) replace the earlier ones; a table no
    delta holds is kept. Rows keep their order (a changed row its place), with the rows the
    deltas add after them. CheckpointError when a delta does not build on the state before
    it (or is of another job or shard); CheckpointCorruptError when a row delta does not fit
    its table (another spec, missing tensors, no whole copy of the table before it).
    """
    if state.kind != FULL:
        raise CheckpointError(
            f"apply_deltas needs a full state to start from; {state.checkpoint_id!r} is a "
            f"{state.kind} of {state.base!r}: resolve it first"
        )
    previous = state
    for delta in deltas:
        if delta.kind != DELTA or delta.base != previous.checkpoint_id:
            raise CheckpointError(
                f"checkpoint {delta.checkpoint_id!r} ({delta.kind}, base {delta.base!r}) "
                f"does not build on {previous.checkpoint_id!r}; apply deltas in order"
            )
        if (delta.job, delta.shard, delta.num_shards) != (state.job, state.shard,
                                                         state.num_shards):
            raise CheckpointError(
                f"checkpoint {delta.checkpoint_id!r} is shard {delta.shard}/{delta.num_shards} "
                f"of job {delta.job!r}; {state.checkpoint_id!r} is shard "
                f"{state.shard}/{state.num_shards} of {state.job!r}"
            )
        previous = delta
    names = [t.name for t in state.tables]
    for delta in deltas:
        names += [t.name for t in delta.tables if t.name not in names]
    tables = []
    for name in names:
        versions = [t for s in (state, *deltas) for t in s.tables if t.name == name]
        whole = max((i for i, t in enumerate(versions) if t.kind == FULL), default=None)
        if whole is None:
            raise CheckpointCorruptError(
                f"table {name!r} has a row delta in checkpoint {previous.checkpoint_id!r}'s "
                "chain but no whole copy before it; the chain is corrupt"
            )
        tables.append(_merge_rows(versions[whole], versions[whole + 1:]))
    return ShardState(
        job=previous.job, shard=previous.shard, num_shards=previous.num_shards,
        checkpoint_id=previous.checkpoint_id, clock=previous.clock, meta=previous.meta,
        tables=tables,
    )


def _merge_rows(whole: TableState, deltas: Sequence[TableState]) -> TableState:
    """`whole` with the row deltas `deltas` applied in order (see `apply_deltas`)."""
    if not deltas:
        return TableState(whole.name, whole.spec, dict(whole.tensors))
    name = whole.name
    per_row = [k for k in whole.tensors if k != "keys" and k not in WHOLE_TABLE_TENSORS]
    for delta in deltas:
        if delta.spec != whole.spec:
            raise CheckpointCorruptError(
                f"table {name!r}: a row delta with spec {delta.spec} builds on one with spec "
                f"{whole.spec}; the chain is corrupt"
            )
        missing = {"keys", *per_row} - set(delta.tensors)
        extra = set(delta.tensors) - {"keys", EVICTED_KEYS, *per_row, *WHOLE_TABLE_TENSORS}
        if "keys" not in whole.tensors or missing or extra:
            raise CheckpointCorruptError(
                f"table {name!r}: a row delta's tensors {sorted(delta.tensors)} do not fit "
                f"the table's {sorted(whole.tensors)}; the chain is corrupt"
            )
    # Every key a delta names, newest delta first and within one its rows before its
    # evictions (a key evicted and created again between two snapshots is held): each key's
    # first event there is its last in time, and says whether it is held, and where from.
    events: list[np.ndarray] = []
    sources: list[np.ndarray] = []
    for i in range(len(deltas) - 1, -1, -1):
        keys = _keys_of(deltas[i], "keys", name)
        gone = _keys_of(deltas[i], EVICTED_KEYS, name)
        events += [keys, gone]
        sources += [np.stack([np.full(len(keys), i), np.arange(len(keys))], axis=1),
                    np.stack([np.full(len(gone), i), np.full(len(gone), -1)], axis=1)]
    all_keys = np.concatenate(events)
    source = np.concatenate(sources)
    index = KeyIndex(len(all_keys))
    ids, _ = index.lookup_or_insert(all_keys)
    _, first = np.unique(ids, return_index=True)
    last = source[first]  # per key a delta names: (delta, its row there; -1: evicted)
    # Rows of `whole` keep their place (a row a delta changed takes the new values there),
    # less those evicted; rows for keys it did not hold follow, in delta and row order.
    base_keys = _keys_of(whole, "keys", name)
    event = index.lookup(base_keys)
    named = np.flatnonzero(event >= 0)
    in_base = np.zeros(len(last), dtype=bool)
    in_base[event[named]] = True
    evicted = named[last[event[named], 1] < 0]
    changed = named[last[event[named], 1] >= 0]
    changed_from = last[event[changed]]
    changed_at = changed - np.searchsorted(evicted, changed)  # after the evicted rows go
    kept = len(base_keys) - len(evicted)
    added_from = last[~in_base & (last[:, 1] >= 0)]
    added_from = added_from[np.lexsort((added_from[:, 1], added_from[:, 0]))]
    keep = None
    if len(evicted):
        keep = torch.from_numpy(np.delete(np.arange(len(base_keys)), evicted))
    writes = []  # per delta: (positions in the result, its rows)
    for i in range(len(deltas)):
        mine = changed_from[:, 0] == i
        new = np.flatnonzero(added_from[:, 0] == i)
        positions = np.concatenate([changed_at[mine], kept + new])
        rows = np.concatenate([changed_from[mine, 1], added_from[new, 1]])
        if len(rows):
            writes.append((i, torch.from_numpy(positions), torch.from_numpy(rows)))
    out: dict[str, torch.Tensor] = {}
    for tensor_name in ["keys", *per_row]:
        old = whole.tensors[tensor_name]
        for delta in deltas:
            part = delta.tensors[tensor_name]
            if part.dtype != old.dtype or part.shape[1:] != old.shape[1:]:
                raise CheckpointCorruptError(
                    f"table {name!r}: a row delta's {tensor_name!r} is {part.dtype} "
                    f"{list(part.shape)}, the table's {old.dtype} {list(old.shape)}; the chain "
                    "is corrupt"
                )
        merged = torch.empty((kept + len(added_from), *old.shape[1:]), dtype=old.dtype)
        if keep is None:
            merged[:kept].copy_(old)
        else:
            torch.index_select(old, 0, keep, out=merged[:kept])
        for i, where, taken in writes:
            merged[where] = deltas[i].tensors[tensor_name].index_select(0, taken)
        out[tensor_name] = merged
    for item in WHOLE_TABLE_TENSORS:
        newest = next((d.tensors[item] for d in reversed(deltas) if item in d.tensors),
                      whole.tensors.get(item))
        if newest is not None:
            out[item] = newest
    return TableState(name, whole.spec, out)


def _keys_of(table: TableState, tensor_name: str, name: str) -> np.ndarray:
    """A table's int64 key tensor as a contiguous numpy array (empty where it has none)."""
    keys = table.tensors.get(tensor_name)
    if keys is None:
        return np.zeros(0, dtype=np.int64)
    if keys.dtype != torch.int64 or keys.dim() != 1:
        raise CheckpointCorruptError(
            f"table {name!r}: {tensor_name!r} is {keys.dtype} {list(keys.shape)}, not 1-d int64"
        )
    return np.ascontiguousarray(keys.numpy())


# ---- retention ------------------------------------------------------------------------------


def prunable(checkpoints: Sequence[Manifest], keep: int, run: str, now_ns: int) -> list[str]:
    """The checkpoints that retention removes: of run `run` only, those older than its
    `keep` newest complete full checkpoints, older both in order (`list_checkpoints`') and in
    clock (a checkpoint of a higher clock may be one a shard still writes, or one of a
    timeline a rollback left, which training writes again under the same id); of those
    that are incomplete, only ones untouched for STALE_TMP_AGE_S (a crashed writer's).
    `checkpoints` are in `list_checkpoints` order. Nothing with `keep` 0, or before `keep`
    full checkpoints exist. Pure: deltas keep the files they need (hard links), so a
    checkpoint is never kept for another's sake.
    """
    if keep <= 0:
        return []
    ours = [m for m in checkpoints if m.run == run]
    full = [m for m in ours if m.complete and m.kind == FULL]
    if len(full) < keep:
        return []
    cutoff = full[-keep]
    order = (cutoff.written_at_ns, cutoff.checkpoint_id)
    stale_ns = int(STALE_TMP_AGE_S * 1e9)
    return [m.checkpoint_id for m in ours
            if (m.written_at_ns, m.checkpoint_id) < order and m.clock < cutoff.clock
            and (m.complete or now_ns - m.written_at_ns > stale_ns)]


def prune(directory: StrPath, job: str, keep: int, run: str = "",
          now_ns: Callable[[], int] = time.time_ns) -> list[str]:
    """Removes the checkpoints of `job` that `prunable` names (those marked bad too); returns
    their ids. Each directory is renamed to a hidden name first (readers never see part of
    one) and then deleted, so concurrent pruners and writers are safe: a kept checkpoint is
    never touched, and a directory another pruner took is skipped. Leftovers of a pruner
    that crashed go too. Blocks on file I/O; thread-safe and process-safe. CheckpointError
    only for a bad job name or an unreadable job directory."""
    job_dir = Path(directory) / job
    doomed = prunable(_scan(directory, job, with_bad=True), keep, run, now_ns())
    removed = []
    for checkpoint_id in doomed:
        hidden = job_dir / f".{checkpoint_id}.pruned-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            os.rename(job_dir / checkpoint_id, hidden)
        except OSError as exc:  # another pruner took it first, or it cannot be removed
            log.debug("job %s: not pruning checkpoint %s: %s", job, checkpoint_id, exc)
            continue
        removed.append(checkpoint_id)
    if keep > 0:
        for name in _abandoned(job_dir, now_ns()):
            hidden = job_dir / f".{name}.pruned-{os.getpid()}-{secrets.token_hex(4)}"
            with contextlib.suppress(OSError):
                os.rename(job_dir / name, hidden)
                log.info("job %s: removing %s, a checkpoint no shard finished writing",
                         job, job_dir / name)
    with contextlib.suppress(OSError):
        for name in os.listdir(job_dir):
            if _PRUNED_RE.fullmatch(name):
                shutil.rmtree(job_dir / name, ignore_errors=True)
    if removed:
        with contextlib.suppress(OSError):
            _fsync_dir(job_dir)
        log.info("job %s: pruned %d checkpoint(s) older than the %d newest full ones: %s",
                 job, len(removed), keep, ", ".join(removed))
    return removed


def _abandoned(job_dir: Path, now_ns: int) -> list[str]:
    """Checkpoint directories in `job_dir` that no shard finished writing (no manifest
    entry) and where nothing was written for STALE_TMP_AGE_S: a killed writer's links and
    temporary file, which would hold the files of a delta's chain on disk for good."""
    found = []
    cutoff_s = now_ns / 1e9 - STALE_TMP_AGE_S
    with contextlib.suppress(OSError):
        for name in os.listdir(job_dir):
            path = job_dir / name
            if name.startswith(".") or not path.is_dir():
                continue
            with contextlib.suppress(OSError):
                inside = os.listdir(path)
                if any(_ENTRY_RE.fullmatch(f) or f == MANIFEST_NAME for f in inside):
                    continue
                # A writer's activity: the directory's entries (links, the temporary file
                # made or renamed) and the temporary file's bytes; a link's own time is
                # its base's.
                newest = max([path.lstat().st_mtime,
                              *((path / f).lstat().st_mtime for f in inside
                                if _TMP_RE.fullmatch(f))])
                if newest < cutoff_s:
                    found.append(name)
    return found


# ---- the safetensors header -----------------------------------------------------------------


def _tensor_key(table: str, tensor: str) -> str:
    return f"{quote(table, safe='')}/{quote(tensor, safe='')}"


def _json_round_trips(what: str, value: object) -> str:
    """`value` as JSON, after checking it comes back equal (no tuples, int keys, NaN...)."""
    try:
        text = json.dumps(value, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError) as exc:
        raise CheckpointError(
            f"{what} is not JSON-serialisable ({exc}); keep it to dicts with str keys, lists, "
            "str, int, finite float, bool and None"
        ) from exc
    if json.loads(text) != value:
        raise CheckpointError(
            f"{what} would not round-trip through JSON exactly (tuples become lists, non-str "
            f"keys become str): {text[:200]}; convert it to plain JSON types first"
        )
    return text


def _build_header(state: ShardState, pace: Pace) -> tuple[dict[str, object], list[_Item]]:
    """The header (without its block digests) and the tensors in the order their bytes
    follow it, each with its block size and, for the rows of a keyed table, the order they
    are written in (found at `pace`)."""
    tables_meta: list[dict[str, object]] = []
    items: list[_Item] = []
    seen: set[str] = set()
    for table in state.tables:
        if not isinstance(table.name, str):
            raise CheckpointError(f"table name must be a str, got {table.name!r}")
        if table.name in seen:
            raise CheckpointError(
                f"table name {table.name!r} appears twice in shard {state.shard}; names must "
                "be unique"
            )
        seen.add(table.name)
        _json_round_trips(f"spec of table {table.name!r}", table.spec)
        pairs: list[list[str]] = []
        plain: dict[str, torch.Tensor | LaterRows] = {}
        both: list[tuple[str, object]] = [*table.tensors.items(), *table.later.items()]
        for tensor_name, tensor in both:
            if not isinstance(tensor_name, str) or tensor_name in plain:
                raise CheckpointError(
                    f"tensor name {tensor_name!r} in table {table.name!r} must be a str, "
                    "once in the table"
                )
            what = f"{table.name!r}/{tensor_name!r}"
            plain[tensor_name] = (_later_rows(tensor, what) if tensor_name in table.later
                                  else _plain_tensor(tensor, what))
            pairs.append([tensor_name, _tensor_key(table.name, tensor_name)])
        order = _route_order(plain, pace)
        for (tensor_name, key), tensor in zip(pairs, plain.values(), strict=True):
            rows = order if order is not None and _is_row_tensor(tensor_name) else None
            items.append(_Item(key, tensor, rows))
        described: dict[str, object] = {"name": table.name, "spec": table.spec, "tensors": pairs}
        if table.kind != FULL:
            described["kind"] = table.kind
        tables_meta.append(described)
    delta = state.kind == DELTA
    metadata: dict[str, str] = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "kind": state.kind,
        "job": state.job,
        "shard": str(state.shard),
        "num_shards": str(state.num_shards),
        "checkpoint_id": state.checkpoint_id,
        "clock": str(state.clock),
        "meta": _json_round_trips("meta", state.meta),
        "tables": json.dumps(tables_meta, ensure_ascii=False, separators=(",", ":")),
    }
    if delta:
        metadata.update(base=state.base, base_sha256=state.base_sha256)
    # Widest elements first keeps every tensor aligned to its element size (the header is
    # padded to 8), as safetensors itself does, so readers that map the file can use it in place.
    items.sort(key=lambda item: (-item.tensor.dtype.itemsize, item.key))
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for item in items:
        header[item.key] = {
            "dtype": _DTYPE_TO_ST[item.tensor.dtype],
            "shape": list(item.tensor.shape),  # a LaterRows' too
            "data_offsets": [offset, offset + item.nbytes],
        }
        offset += item.nbytes
    return header, items


def _encode_header(header: dict[str, object], items: Sequence[_Item],
                   digests: Sequence[bytes] | None, shard: int) -> bytes:
    """The file's bytes before its tensors: length and padded JSON header, with the sha256 of
    every block (`digests`, in file order; None: zeros, a placeholder of the same length)."""
    blocks: dict[str, list[object]] = {}
    given = iter(digests) if digests is not None else None
    for item in items:
        if item.nbytes:
            count = -(-item.nbytes // item.block_bytes)
            hexes = ("".join(next(given).hex() for _ in range(count)) if given is not None
                     else "0" * 64 * count)
            blocks[item.key] = [item.block_bytes, hexes]
    meta = dict(header["__metadata__"])  # type: ignore[call-overload]
    meta["blocks"] = json.dumps(blocks, separators=(",", ":"))
    text = json.dumps({**header, "__metadata__": meta}, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    if len(text) > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"checkpoint header of shard {shard} is {len(text)} bytes, over the "
            f"safetensors limit of {MAX_HEADER_BYTES}; move bulk data from meta/specs into tensors"
        )
    return struct.pack("<Q", len(text)) + text


@dataclass(frozen=True)
class _Item:
    """A tensor to write (or rows read as they are written): its file key, its bytes, and
    for the rows of a keyed table the order to write them in (indices into its rows; None:
    as they are)."""

    key: str
    tensor: torch.Tensor | LaterRows
    rows: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.tensor.shape) * self.tensor.dtype.itemsize

    @property
    def block_bytes(self) -> int:
        shape = self.tensor.shape
        return _block_bytes(self.nbytes, shape[0] if len(shape) else 1)


def _block_bytes(nbytes: int, rows: int) -> int:
    """The size of a tensor's blocks: whole rows, as many as fit BLOCK_BYTES (at least one),
    so a read that keeps a run of rows reads and checks whole blocks only."""
    row_bytes = nbytes // rows if rows else nbytes
    return max(1, row_bytes) * max(1, BLOCK_BYTES // max(1, row_bytes))


def _is_row_tensor(name: str) -> bool:
    """Whether tensor `name` of a table with keys has one row per key (`read_shard`'s cut)."""
    return name not in WHOLE_TABLE_TENSORS and name != EVICTED_KEYS


def _route_order(tensors: dict[str, torch.Tensor | LaterRows], pace: Pace
                 ) -> torch.Tensor | None:
    """For a table with keys, the order that sorts its rows by `route_hash` (stable), so
    each shard of any count finds its rows in one run (see `read_shard`); None when they
    already are sorted, or the table has no keys or a tensor not one row per key (written
    as it is).

    Sorted ORDER_CHUNK_KEYS keys at a time (a counting sort by the top 16 bits, then runs
    of whole buckets by all 32): each piece charges `pace` for its keys' bytes, so that
    ordering a large table beside training is paced like the write that follows, not one
    burst of CPU before it."""
    keys = tensors.get("keys")
    if (not isinstance(keys, torch.Tensor) or keys.dtype != torch.int64 or keys.dim() != 1
            or len(keys) < 2):
        return None
    count = len(keys)
    if any(not t.shape or t.shape[0] != count for n, t in tensors.items() if _is_row_tensor(n)):
        return None
    flat = keys.numpy()
    hashes = np.empty(count, dtype=np.uint32)
    for at in range(0, count, ORDER_CHUNK_KEYS):
        piece = flat[at : at + ORDER_CHUNK_KEYS]
        hashes[at : at + len(piece)] = route_hash(piece)
        pace.wrote(piece.nbytes)  # the keys' bytes, read
    if bool(np.all(hashes[1:] >= hashes[:-1])):
        return None
    # A stable counting sort by the top 16 bits, a piece at a time...
    buckets = (hashes >> 16).astype(np.uint16)
    sizes = np.bincount(buckets, minlength=1 << 16)
    ends = np.cumsum(sizes)
    next_free = ends - sizes  # where each bucket's next row goes
    order = np.empty(count, dtype=np.int64)
    for at in range(0, count, ORDER_CHUNK_KEYS):
        piece = buckets[at : at + ORDER_CHUNK_KEYS]
        local = np.argsort(piece, kind="stable")  # 16-bit keys: numpy sorts them by radix
        ranked = piece[local]
        run_starts = np.searchsorted(ranked, ranked, side="left")
        order[next_free[ranked] + np.arange(len(ranked)) - run_starts] = local + at
        next_free += np.bincount(piece, minlength=1 << 16)
        pace.wrote(len(piece) * flat.itemsize)  # the keys' bytes again, for the same CPU
    # ...then each run of whole buckets of about a piece's size by all 32 bits.
    start = 0
    while start < count:
        stop = int(ends[np.searchsorted(ends, min(start + ORDER_CHUNK_KEYS, count))])
        run = order[start:stop]
        order[start:stop] = run[np.argsort(hashes[run], kind="stable")]
        pace.wrote((stop - start) * flat.itemsize)
        start = stop
    return torch.from_numpy(order)


def _later_rows(rows: object, what: str) -> LaterRows:
    """`rows` (a TableState's `later` entry), after checking it has a dtype safetensors
    stores and at least one dimension."""
    dtype, shape = getattr(rows, "dtype", None), getattr(rows, "shape", None)
    if dtype not in _DTYPE_TO_ST or not shape or not callable(getattr(rows, "gather", None)):
        raise CheckpointError(
            f"tensor {what} is read when written, so needs a dtype safetensors stores, a "
            f"shape of at least one dimension and a gather method; got {type(rows).__name__} "
            f"of dtype {dtype} and shape {shape}"
        )
    return rows  # type: ignore[return-value]


def _plain_tensor(tensor: object, what: str) -> torch.Tensor:
    """`tensor` as a dense, contiguous CPU tensor (a copy only where it was not one already)."""
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointError(f"tensor {what} is a {type(tensor).__name__}, not a torch.Tensor")
    if tensor.layout != torch.strided:
        raise CheckpointError(
            f"tensor {what} has layout {tensor.layout}; convert it with .to_dense() first"
        )
    if tensor.dtype not in _DTYPE_TO_ST:
        raise CheckpointError(
            f"tensor {what} has dtype {tensor.dtype}, which safetensors cannot store; "
            f"use one of {sorted(str(d) for d in _DTYPE_TO_ST)}"
        )
    return tensor.detach().cpu().resolve_conj().resolve_neg().contiguous()


def _parse_header(
    header_bytes: bytes, data_len: int, path: Path
) -> tuple[list[tuple[str, torch.dtype, list[int], int]], dict[str, str]]:
    """Validates the header; returns (key, dtype, shape, nbytes) in file order, and metadata."""
    try:
        header = json.loads(header_bytes)
        if not isinstance(header, dict):
            raise TypeError("the header is not a JSON object")
        meta = header.pop("__metadata__", None)
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise ValueError(f"no {FORMAT!r} metadata: not a pstrain shard checkpoint")
        entries: list[tuple[int, int, str, torch.dtype, list[int]]] = []
        for key, info in header.items():
            dtype = _ST_TO_DTYPE[info["dtype"]]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(x) for x in info["data_offsets"])
            expected = math.prod(shape) * dtype.itemsize
            if min(shape, default=0) < 0 or end - begin != expected:
                raise ValueError(f"tensor {key!r}: shape {shape} does not fit offsets")
            entries.append((begin, end, key, dtype, shape))
    except (ValueError, TypeError, KeyError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(
            f"checkpoint shard {path} has a malformed header ({exc!r}); the file is corrupt or "
            "not a pstrain checkpoint"
        ) from exc
    entries.sort()
    position = 0
    for begin, end, key, _, _ in entries:
        if begin != position:
            raise CheckpointCorruptError(
                f"checkpoint shard {path}: tensor {key!r} starts at {begin}, expected "
                f"{position}; the file is corrupt"
            )
        position = end
    if position != data_len:
        raise CheckpointCorruptError(
            f"checkpoint shard {path} is truncated or padded: tensors need {position} data "
            f"bytes, the file has {data_len}; restore from another checkpoint"
        )
    return [(key, dtype, shape, end - begin) for begin, end, key, dtype, shape in entries], meta


def _state_from_meta(
    meta: dict[str, str], tensors: dict[str, torch.Tensor], path: Path
) -> ShardState:
    try:
        version = int(meta["format_version"])
        kind = meta.get("kind", FULL)
        kinds = _KINDS_OF_VERSION.get(version)
        if kinds is None:
            raise ValueError(
                f"format version {version}; this build reads versions "
                f"{sorted(_KINDS_OF_VERSION)}")
        if kind not in kinds:
            raise ValueError(f"kind {kind!r} in a file of format version {version}")
        base, base_sha256 = meta.get("base", ""), meta.get("base_sha256", "")
        if kind == DELTA and not (_NAME_RE.fullmatch(base) and _SHA256_RE.fullmatch(base_sha256)):
            raise ValueError(f"a delta with base {base!r} and base_sha256 {base_sha256!r}")
        tables: list[TableState] = []
        used: set[str] = set()
        for table in json.loads(meta["tables"]):
            named: dict[str, torch.Tensor] = {}
            for tensor_name, key in table["tensors"]:
                named[str(tensor_name)] = tensors[key]
                used.add(key)
            spec = table["spec"]
            if not isinstance(spec, dict):
                raise TypeError(f"spec of table {table['name']!r} is not a JSON object")
            table_kind = table.get("kind", FULL)
            if table_kind not in (FULL, ROWS) or (table_kind == ROWS and kind != DELTA):
                raise ValueError(f"table {table['name']!r} of kind {table_kind!r} in a {kind} file")
            tables.append(TableState(name=str(table["name"]), spec=spec, tensors=named,
                                     kind=table_kind))
        if used != set(tensors):
            raise ValueError(f"tensors not in any table: {sorted(set(tensors) - used)[:5]}")
        shard_meta = json.loads(meta["meta"])
        if not isinstance(shard_meta, dict):
            raise TypeError("meta is not a JSON object")
        return ShardState(
            job=meta["job"],
            shard=int(meta["shard"]),
            num_shards=int(meta["num_shards"]),
            checkpoint_id=meta["checkpoint_id"],
            clock=int(meta["clock"]),
            meta=shard_meta,
            tables=tables,
            kind=kind,
            base=base,
            base_sha256=base_sha256,
        )
    except (ValueError, TypeError, KeyError) as exc:
        raise CheckpointCorruptError(
            f"checkpoint shard {path} has malformed metadata ({exc!r}); the file is corrupt or "
            "from an incompatible version"
        ) from exc


# ---- manifest entries -----------------------------------------------------------------------


def _read_entry(path: Path, shard: int) -> dict[str, Any]:
    try:
        entry = json.loads(path.read_bytes())
        if not isinstance(entry, dict) or entry.get("format") != ENTRY_FORMAT:
            raise ValueError(f"not a {ENTRY_FORMAT!r} file")
        for field_name, kind in [
            ("job", str), ("checkpoint_id", str), ("shard", int), ("num_shards", int),
            ("clock", int), ("file", str), ("sha256", str), ("nbytes", int),
            ("written_at_ns", int),
        ]:
            if not isinstance(entry.get(field_name), kind):
                raise ValueError(f"field {field_name!r} is {entry.get(field_name)!r}")
        if entry["shard"] != shard or not 0 <= shard < entry["num_shards"]:
            raise ValueError(f"shard {entry['shard']} of {entry['num_shards']} in this file")
        if Path(entry["file"]).name != entry["file"] or entry["file"].startswith("."):
            raise ValueError(f"file {entry['file']!r} is not a plain file name")
        _check_entry_kind(entry)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(
            f"manifest entry {path} is unreadable or malformed ({exc}); the checkpoint is corrupt"
        ) from exc
    return entry


def _check_entry_kind(entry: dict[str, Any]) -> None:
    """ValueError unless the entry's kind, base and chain (where present) are well formed:
    a delta names its base, and a chain of links (plain names beside the file) ending in it."""
    kind, base, chain = entry.get("kind", FULL), entry.get("base", ""), entry.get("chain", [])
    if kind == FULL and not base and not chain:
        return
    if kind != DELTA or not isinstance(base, str) or not _NAME_RE.fullmatch(base):
        raise ValueError(f"kind {kind!r} with base {base!r}")
    if not isinstance(chain, list) or not chain:
        raise ValueError(f"a delta with chain {chain!r}")
    for link in chain:
        if not (isinstance(link, dict) and isinstance(link.get("checkpoint_id"), str)
                and isinstance(link.get("file"), str) and isinstance(link.get("sha256"), str)
                and isinstance(link.get("nbytes"), int)):
            raise ValueError(f"chain link {link!r}")
        if Path(link["file"]).name != link["file"] or link["file"].startswith("."):
            raise ValueError(f"chain file {link['file']!r} is not a plain file name")
    if chain[-1]["checkpoint_id"] != base:
        raise ValueError(f"a chain ending in {chain[-1]['checkpoint_id']!r}, not the base {base!r}")


def _manifest_json(manifest: Manifest) -> dict[str, object]:
    return {
        "format": MANIFEST_FORMAT,
        "format_version": MANIFEST_VERSION,
        "job": manifest.job,
        "checkpoint_id": manifest.checkpoint_id,
        "clock": manifest.clock,
        "num_shards": manifest.num_shards,
        "complete": manifest.complete,
        "written_at_ns": manifest.written_at_ns,
        "shards": {
            str(k): {"file": Path(f.path).name, "sha256": f.sha256, "nbytes": f.nbytes,
                     "kind": f.kind, **({"base": f.base} if f.base else {})}
            for k, f in sorted(manifest.shards.items())
        },
    }


def _json_bytes(value: object) -> bytes:
    return (json.dumps(value, indent=1, ensure_ascii=False) + "\n").encode("utf-8")


# ---- checks ---------------------------------------------------------------------------------


def _check_name(what: str, name: str) -> None:
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise CheckpointError(
            f"{what} {name!r} cannot name a directory: use 1-200 characters of letters, digits, "
            "'.', '_' and '-', starting with a letter or digit"
        )


def _check_shard_numbers(shard: int, num_shards: int) -> None:
    ok = all(isinstance(x, int) and not isinstance(x, bool) for x in (shard, num_shards))
    if not ok or num_shards < 1 or not 0 <= shard < num_shards:
        raise CheckpointError(
            f"shard {shard!r} of num_shards {num_shards!r}: need ints with 0 <= shard < "
            "num_shards"
        )


def _check_agrees_with_recorded(
    ckpt_dir: Path, job: str, checkpoint_id: str, num_shards: int
) -> None:
    """Refuses to record shards of another job or shard count beside existing entries.

    Best effort (a racing writer can still slip in): it catches a mistake, it is not a lock.
    """
    try:
        names = os.listdir(ckpt_dir)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise CheckpointError(f"cannot list checkpoint directory {ckpt_dir}: {exc}") from exc
    for name in sorted(names):
        if not (match := _ENTRY_RE.fullmatch(name)):
            continue
        try:
            entry = _read_entry(ckpt_dir / name, int(match.group(1)))
        except CheckpointCorruptError:
            continue  # a damaged entry says nothing; its shard's writer may be replacing it
        recorded = (entry["job"], entry["checkpoint_id"], entry["num_shards"])
        if recorded != (job, checkpoint_id, num_shards):
            raise CheckpointError(
                f"checkpoint {ckpt_dir} already records shard {entry['shard']} of job "
                f"{entry['job']!r} checkpoint {entry['checkpoint_id']!r} with num_shards "
                f"{entry['num_shards']}, but this call says job {job!r} checkpoint "
                f"{checkpoint_id!r} num_shards {num_shards}; use a new checkpoint id"
            )
        return


def _check_file_size(path: Path, nbytes: int) -> None:
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise CheckpointError(f"shard file {path} is missing or unreadable: {exc}") from exc
    if size != nbytes:
        raise CheckpointError(
            f"shard file {path} has {size} bytes, the manifest records {nbytes}; it was "
            "truncated or replaced"
        )


def _as_int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise CheckpointCorruptError(f"expected an int in a manifest entry, got {value!r}")
    return value


# ---- file I/O -------------------------------------------------------------------------------


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, sharing its memory (writable)."""
    if tensor.numel() == 0:
        # An empty tensor may have any strides, 0 among them (a sparse table's keys before
        # its first row), and view() to another element size refuses those.
        return memoryview(bytearray())
    # numpy has no bfloat16 or float8, so go through uint8; reshape first because view() to a
    # smaller dtype needs at least one dimension.
    flat = tensor.reshape(-1).view(torch.uint8)
    return flat.numpy().data.cast("B")


def _blocks_to_write(item: _Item, step: int) -> Iterator[Iterator[memoryview]]:
    """`item`'s bytes, block by block, each block in chunks of at most `step` bytes (whole
    rows, when its rows are gathered into their written order one chunk at a time): a paced
    write copies and hashes one short burst between two pauses."""
    nbytes, block_bytes, tensor = item.nbytes, item.block_bytes, item.tensor
    if item.rows is None and isinstance(tensor, torch.Tensor):
        view = _byte_view(tensor)
        for begin in range(0, nbytes, block_bytes):
            block = view[begin : min(begin + block_bytes, nbytes)]
            yield (block[at : at + step] for at in range(0, len(block), step))
        return
    if not nbytes:
        return
    rows = item.rows if item.rows is not None else torch.arange(tensor.shape[0])
    gather = (partial(tensor.index_select, 0) if isinstance(tensor, torch.Tensor)
              else tensor.gather)
    row_bytes = nbytes // len(rows)
    per_block, per_chunk = block_bytes // row_bytes, max(1, step // row_bytes)
    for first in range(0, len(rows), per_block):
        last = min(first + per_block, len(rows))
        yield (_byte_view(gather(rows[at : min(at + per_chunk, last)]))
               for at in range(first, last, per_chunk))


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _read_exact(fd: int, n: int, path: Path, offset: int) -> bytes:
    buf = bytearray(n)
    _readinto_exact(fd, memoryview(buf), path, offset)
    return bytes(buf)


@dataclass(frozen=True)
class _Chunk:
    """`nbytes` of a file at `offset`, read into `into` (a slice of a result tensor) or, when
    it is None, into a reused staging buffer that `gather` takes what it keeps from; with
    `digest`, checked against it."""

    offset: int
    nbytes: int
    into: memoryview | None = None
    gather: Callable[[memoryview], None] | None = None
    digest: bytes | None = None  # its sha256, checked as it is read (a block's)


@dataclass(frozen=True)
class _Cut:
    """A tensor of table `table` cut by key: the rows kept (None: all of them)."""

    table: str
    name: str
    rows: np.ndarray | None


def _row_cuts(fd: int, entries: list[tuple[str, torch.dtype, list[int], int]],
              meta: dict[str, str], keep: KeyFilter, path: Path,
              data_start: int, blocks: dict[str, _Blocks] | None) -> dict[str, _Cut]:
    """For `read_shard(keep=...)`: file key -> how it is cut, for every tensor cut by key.
    Reads each keys tensor once ahead of the hashed pass, checking its `blocks` (when they
    have digests) before it decides anything."""
    located: dict[str, tuple[int, torch.dtype, list[int], int]] = {}
    offset = data_start
    for key, dtype, shape, nbytes in entries:
        located[key] = (offset, dtype, shape, nbytes)
        offset += nbytes

    def rows_kept(file_key: str, what: str) -> np.ndarray | None:
        begin, dtype, shape, nbytes = located[file_key]
        if dtype != torch.int64 or len(shape) != 1:
            raise CheckpointCorruptError(
                f"checkpoint shard {path}: {what} is {dtype} {shape}, not 1-d int64; the file "
                "is corrupt")
        data = _read_exact(fd, nbytes, path, begin)
        block_bytes, digests = (blocks or {}).get(file_key, (0, None))
        if digests is not None:
            for (at, n), digest in zip(_spans(nbytes, block_bytes), digests, strict=True):
                _check_block(path, begin + at, memoryview(data)[at : at + n], digest)
        keys = np.frombuffer(data, dtype=np.int64)
        mask = np.asarray(keep(keys))
        if mask.dtype != np.bool_ or mask.shape != keys.shape:
            raise CheckpointError(f"a key filter returned {mask.dtype} {list(mask.shape)} for "
                                  f"{len(keys)} keys; it must return one bool per key")
        rows = np.flatnonzero(mask)
        return None if len(rows) == len(keys) else rows  # all kept: read in place

    cuts: dict[str, _Cut] = {}
    try:
        tables = json.loads(meta["tables"])
        for table in tables:
            names = {str(name): str(key) for name, key in table["tensors"]}
            if "keys" not in names:
                continue
            name_of = str(table["name"])
            rows = rows_kept(names["keys"], f"table {name_of!r}'s keys")
            count = located[names["keys"]][2][0]
            for name, key in names.items():
                if name in WHOLE_TABLE_TENSORS:
                    continue
                if name == EVICTED_KEYS:
                    cuts[key] = _Cut(name_of, name, rows_kept(key, f"table {name_of!r}'s {name}"))
                    continue
                shape = located[key][2]
                if not shape or shape[0] != count:
                    raise CheckpointCorruptError(
                        f"checkpoint shard {path}: tensor {name!r} of table {name_of!r} has "
                        f"shape {shape}, not one row for each of its {count} keys; the file is "
                        "corrupt")
                cuts[key] = _Cut(name_of, name, rows)
    except (ValueError, TypeError, KeyError) as exc:
        raise CheckpointCorruptError(
            f"checkpoint shard {path} has malformed metadata ({exc!r}); the file is corrupt or "
            "from an incompatible version") from exc
    return cuts


def _target(tensor: torch.Tensor | None, dtype: torch.dtype,
            shape: list[int]) -> torch.Tensor | None:
    """`into`'s answer when it is a contiguous CPU tensor of `dtype` and `shape`; None (so
    fresh memory) for anything else."""
    if (tensor is None or tensor.dtype != dtype or list(tensor.shape) != shape
            or tensor.device.type != "cpu" or not tensor.is_contiguous()):
        return None
    return tensor


def _whole_chunks(out: torch.Tensor, offset: int, nbytes: int,
                  blocks: _Blocks | None) -> Iterator[_Chunk]:
    """Chunks reading a tensor of `nbytes` at `offset` straight into `out`: its blocks, or
    CHUNK_BYTES at a time in a file without them."""
    view = _byte_view(out) if nbytes else memoryview(b"")
    step, digests = blocks if blocks is not None else (CHUNK_BYTES, None)
    for i, (begin, n) in enumerate(_spans(nbytes, step)):
        yield _Chunk(offset + begin, n, into=view[begin : begin + n],
                     digest=None if digests is None else digests[i])


def _spans(nbytes: int, step: int) -> Iterator[tuple[int, int]]:
    """(start, length) of each piece of `nbytes` bytes cut every `step` (a tensor's blocks)."""
    return ((begin, min(step, nbytes - begin)) for begin in range(0, nbytes, step))


def _cut_chunks(out: torch.Tensor, rows: np.ndarray, offset: int, count: int,
                nbytes: int, blocks: _Blocks | None, path: Path) -> Iterator[_Chunk]:
    """Chunks of a tensor of `count` rows at `offset` that put the `rows` it keeps (sorted
    indices) into their places in `out`: a chunk whose rows are all kept is read straight
    into `out`, one keeping some is staged and gathered from. In a file with blocks, chunks
    are its blocks and one keeping no row is not read at all (its digest covers it alone);
    without, every byte is read, for the file's one digest."""
    if not nbytes:
        return
    row_bytes = nbytes // count
    if blocks is None:
        per_chunk, digests = max(1, STAGED_CHUNK_BYTES // row_bytes), None
    else:
        block_bytes, digests = blocks
        if block_bytes % row_bytes:
            raise CheckpointCorruptError(
                f"checkpoint shard {path}: a tensor of rows of {row_bytes} bytes has blocks of "
                f"{block_bytes} bytes, not whole rows; the file is corrupt")
        per_chunk = block_bytes // row_bytes
    view = _byte_view(out) if out.numel() else memoryview(b"")
    bounds = np.searchsorted(rows, np.arange(0, count + per_chunk, per_chunk).clip(max=count))
    for i, first in enumerate(range(0, count, per_chunk)):
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        n = min(per_chunk, count - first)
        digest = None if digests is None else digests[i]
        where = offset + first * row_bytes
        if hi - lo == n:
            yield _Chunk(where, n * row_bytes, into=view[lo * row_bytes : hi * row_bytes],
                         digest=digest)
        elif hi > lo:
            yield _Chunk(where, n * row_bytes, digest=digest, gather=partial(
                _gather, out[lo:hi], torch.from_numpy(rows[lo:hi] - first)))
        elif blocks is None:
            yield _Chunk(where, n * row_bytes)


def _gather(out: torch.Tensor, rows: torch.Tensor, staged: memoryview) -> None:
    source = torch.frombuffer(staged, dtype=out.dtype).view(-1, *out.shape[1:])
    torch.index_select(source, 0, rows, out=out)


def _read_chunks(fd: int, chunks: list[_Chunk], path: Path,
                 hasher: _BackgroundSha256 | None) -> None:
    """Reads each chunk, READ_THREADS at a time, checking a chunk's digest (a block's) on
    its reading thread, and feeds `hasher` (a file without blocks) in file order; a staged
    chunk is gathered from, then its buffer goes back for reuse once it is hashed.

    One synchronous reader leaves the disk idle between its requests and faults in the fresh
    tensor pages on one core; several preads in flight keep the device queue full and spread
    the faults. Blocks until every chunk is read or one read fails (then raises its error).
    """
    staged_bytes = max((c.nbytes for c in chunks if c.into is None), default=0)
    spare: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
    for _ in range(STAGING_BUFFERS if staged_bytes else 0):
        spare.put(bytearray(staged_bytes))
    pool = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="checkpoint-read")
    pending = iter(chunks)
    flight: collections.deque[tuple[_Chunk, bytearray | None, memoryview, Future[None]]] = (
        collections.deque())

    def submit() -> None:
        chunk = next(pending, None)
        if chunk is None:
            return
        staging = None
        if chunk.into is None:
            staging = spare.get()  # freed by the hasher, which always moves on
            into = memoryview(staging)[: chunk.nbytes]
        else:
            into = chunk.into
        flight.append((chunk, staging, into,
                       pool.submit(_read_chunk, fd, into, path, chunk.offset, chunk.digest)))

    try:
        for _ in range(READ_THREADS):
            submit()
        while flight:
            chunk, staging, into, future = flight.popleft()
            future.result()  # local disk I/O: it ends or fails, so no timeout
            if chunk.gather is not None:
                chunk.gather(into)
            release = None if staging is None else partial(spare.put, staging)
            if hasher is not None:
                hasher.update(into, release)
            elif release is not None:
                release()
            submit()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def _read_chunk(fd: int, buf: memoryview, path: Path, offset: int,
                digest: bytes | None) -> None:
    _readinto_exact(fd, buf, path, offset)
    if digest is not None:
        _check_block(path, offset, buf, digest)


class _BlockMismatch(CheckpointCorruptError):
    """A block of a shard file does not match its digest in the file's header."""


def _check_block(path: Path, offset: int, data: memoryview, digest: bytes) -> None:
    actual = hashlib.sha256(data).digest()
    if actual != digest:
        raise _BlockMismatch(
            f"checkpoint shard {path} fails its checksum: the block of {len(data)} bytes at "
            f"offset {offset} has sha256 {actual.hex()}, its header says {digest.hex()}; the "
            "file is corrupt, restore from another checkpoint")


def _readinto_exact(fd: int, buf: memoryview, path: Path, offset: int) -> None:
    got = 0
    while got < len(buf):
        n = os.preadv(fd, [buf[got:]], offset + got)
        if n == 0:
            raise CheckpointCorruptError(
                f"checkpoint shard {path} ended early (file shrank while reading?); "
                "restore from another checkpoint"
            )
        got += n


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _ensure_dir(directory: Path) -> None:
    """Creates `directory` and missing parents, fsyncing each new entry's parent.

    Without the parent fsync a crash could forget the new directory, and with it the files
    fsynced inside it.
    """
    missing: list[Path] = []
    current = directory
    while not current.is_dir():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    try:
        for new in reversed(missing):
            with contextlib.suppress(FileExistsError):  # another shard's writer was first
                new.mkdir()
            _fsync_dir(new.parent)
    except OSError as exc:
        raise CheckpointError(
            f"cannot create checkpoint directory {directory}: {exc}; check the path and "
            "permissions"
        ) from exc


def _remove_stale_temps(directory: Path) -> None:
    cutoff = time.time() - STALE_TMP_AGE_S
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        if not _TMP_RE.fullmatch(name):
            continue
        with contextlib.suppress(OSError):  # a racing writer renamed or removed it
            st = os.lstat(directory / name)
            if stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff:
                os.unlink(directory / name)
                log.info("removed stale temporary checkpoint file %s", directory / name)


@contextlib.contextmanager
def _atomic_file(final: Path, *, sync_dir: bool = True) -> Iterator[int]:
    """Yields the fd of a temporary file that becomes `final` only if the block succeeds.

    On success: fsync, rename over `final`, and (with `sync_dir`) fsync the directory. On any
    failure the temporary file is removed and `final` is untouched; OSError becomes
    CheckpointError.
    """
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(tmp, flags, 0o644)
    except OSError as exc:
        raise CheckpointError(f"cannot create {tmp}: {exc}; check the path and space") from exc
    renamed = False
    try:
        try:
            yield fd
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, final)
        renamed = True
        if sync_dir:
            _fsync_dir(final.parent)
    except OSError as exc:
        raise CheckpointError(
            f"writing {final} failed: {exc}; check free space and permissions, then retry"
        ) from exc
    finally:
        if not renamed:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _atomic_write_bytes(final: Path, data: bytes, *, sync_dir: bool = True) -> None:
    with _atomic_file(final, sync_dir=sync_dir) as fd:
        _write_all(fd, memoryview(data))


def _file_digest(path: Path) -> str:
    """The digest a manifest records for the shard file at `path`, once its bytes check out:
    for a file with blocks, the sha256 of its header after every block matched its digest
    there; for an older file, the sha256 of the whole file. "" (logged) when a block does not
    match or the file cannot be read."""
    try:
        fd = _open_shard(path)
        try:
            prefix, entries, meta = _read_header(fd, path)
            blocks = _blocks_of(meta, entries, path)
            if blocks is None:
                return sha256_file(path)
            chunks, offset = [], len(prefix)
            for key, _, _, nbytes in entries:
                if nbytes:
                    block_bytes, digests = blocks[key]
                    chunks += [_Chunk(offset + begin, n, digest=digest) for (begin, n), digest
                               in zip(_spans(nbytes, block_bytes), digests or (), strict=True)]
                offset += nbytes
            _read_chunks(fd, chunks, path, None)  # staged, each block checked as it is read
            return hashlib.sha256(prefix).hexdigest()
        finally:
            os.close(fd)
    except (OSError, CheckpointError) as exc:
        log.warning("cannot verify %s: %s", path, exc)
        return ""


class Pace:
    """Holds a writer to at most `bytes_per_s` on average since it began (0: no limit), by
    sleeping after a chunk that ran ahead of that rate.

    A checkpoint written beside training takes CPU and memory bandwidth that the training's
    steps need: on a busy machine, even at the lowest priority, a write at full speed makes
    many steps several times slower for as long as it lasts. Paced, the write takes longer
    and the steps stay close to their usual time. `clock` and `sleep` are injectable for
    tests. One writer thread only.
    """

    def __init__(self, bytes_per_s: float, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if bytes_per_s < 0:
            raise CheckpointError(f"a write rate must be >= 0 bytes/s (0: no limit), got "
                                  f"{bytes_per_s!r}")
        self.bytes_per_s = bytes_per_s
        self._clock, self._sleep = clock, sleep
        self._started = clock()
        self._written = 0

    def wrote(self, nbytes: int) -> None:
        """`nbytes` more were written; sleeps while the writer is ahead of the rate."""
        if self.bytes_per_s <= 0:
            return
        self._written += nbytes
        ahead = self._written / self.bytes_per_s - (self._clock() - self._started)
        if ahead > 0:
            self._sleep(ahead)


class _BackgroundSha256:
    """sha256 of a byte stream, computed on a helper thread so hashing overlaps file I/O.

    hashlib releases the GIL for large buffers, so hashing and I/O really run in parallel.
    Chunks are queued by reference (no copies): the caller must not change a chunk's memory
    until it is hashed, which `release` (when given) announces, or `hexdigest` returns. One
    producer thread only; `hexdigest` must be called exactly once, and waits for the queued
    chunks (CPU work on memory, so it cannot hang).
    """

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self._queue: queue.SimpleQueue[
            tuple[bytes | memoryview, Callable[[], None] | None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="checkpoint-sha256", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            chunk, release = item
            self._sha.update(chunk)
            if release is not None:
                release()

    def update(self, chunk: bytes | memoryview,
               release: Callable[[], None] | None = None) -> None:
        self._queue.put((chunk, release))

    def hexdigest(self) -> str:
        self._queue.put(None)
        self._thread.join()
        return self._sha.hexdigest()


def _load_sync_file_range() -> Callable[[int, int, int], None] | None:
    """Linux sync_file_range(SYNC_FILE_RANGE_WRITE), or None where it is not available."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        func = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    func.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    func.restype = ctypes.c_int
    sync_file_range_write = 2

    def start(fd: int, offset: int, nbytes: int) -> None:
        # Only a hint: a failure here leaves the final fsync to do all the work.
        func(fd, offset, nbytes, sync_file_range_write)

    return start


_sync_file_range = _load_sync_file_range()


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    if _sync_file_range is not None:
        _sync_file_range(fd, offset, nbytes)
