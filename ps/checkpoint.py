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

Integrity: each entry records the sha256 and size of its shard file. `read_manifest` checks
that every recorded file exists with its recorded size (cheap; catches truncation and
deletion); `read_shard(path, sha256)` checks the digest, computed while reading. A checkpoint
whose file fails that check when a server restores it is marked bad: ``<checkpoint_id>/BAD``
holds the reason (written atomically, by `load_checkpoint`), and `list_checkpoints` and
`latest_complete` pass over it from then on. Writing a shard into the directory again (a new
checkpoint under the same id) removes the mark.

Runs: each entry records the run of the job that wrote it (``run``; "" before run ids), so a
restore picks checkpoints of the current run only, unless the user resumes another.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import logging
import math
import os
import queue
import re
import secrets
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Final
from urllib.parse import quote

import torch

from protos.exported import sha256_file
from ps.errors import PSError

log = logging.getLogger(__name__)

StrPath = str | os.PathLike[str]

FORMAT: Final = "pstrain.shard"
FORMAT_VERSION: Final = 1
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
# Reads in flight while restoring; more than one keeps the disk's queue from running dry.
READ_THREADS: Final = 4
# Temporary files older than this are a crashed writer's leftovers; younger ones may be live.
STALE_TMP_AGE_S: Final = 3600.0

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_ENTRY_RE = re.compile(r"shard-(\d+)\.json")
_TMP_RE = re.compile(r"\..+\.tmp-\d+-[0-9a-f]{8}")

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


class CheckpointUnsignedError(CheckpointError):
    """A checkpoint's entry in Redis is not signed with the job's secret: someone changed
    Redis, or the job's secret changed."""


@dataclass(frozen=True, eq=False)
class TableState:
    """One table of a shard snapshot.

    `spec` is opaque JSON (round-tripped exactly). `tensors` may use any names and any
    supported dtype; tensors may be empty or 0-d. ``eq=False``: comparing tensors with ``==``
    is elementwise, so dataclass equality would raise rather than answer.
    """

    name: str
    spec: dict[str, object]
    tensors: dict[str, torch.Tensor]


@dataclass(frozen=True, eq=False)
class ShardState:
    """A snapshot of one shard: what `write_shard` writes and `read_shard` returns."""

    job: str
    shard: int
    num_shards: int
    checkpoint_id: str
    clock: int
    meta: dict[str, object]
    tables: list[TableState]


@dataclass(frozen=True)
class ShardFile:
    """A written shard file: its final path, the sha256 of its bytes, and its size."""

    path: str
    sha256: str
    nbytes: int


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


# ---- public API -----------------------------------------------------------------------------


def shard_file_name(shard: int, num_shards: int) -> str:
    """The file name of shard `shard` of `num_shards`: ``shard-<k>-of-<n>.safetensors``."""
    return f"shard-{shard}-of-{num_shards}.safetensors"


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
    """Shard `shard` of `num_shards`'s file of checkpoint `checkpoint_id`, looked up by name
    inside `directory` (never a path given from outside) and hashed against `sha256` (the
    digest its manifest or Redis recorded) while it is read.

    CheckpointError when there is no directory, a name is unsafe or the digest malformed,
    or the file cannot be read; CheckpointCorruptError when it does not match. Blocks on
    file I/O.
    """
    if not str(directory):
        raise CheckpointError(
            f"this server has no checkpoint directory (the job's, or --checkpoint-dir), so it "
            f"cannot load checkpoint {checkpoint_id!r}"
        )
    check_reference(checkpoint_id, sha256)
    _check_shard_numbers(shard, num_shards)
    path = checkpoint_dir(directory, job, checkpoint_id) / shard_file_name(shard, num_shards)
    state = read_shard(path, sha256)
    if (state.job, state.checkpoint_id) != (job, checkpoint_id):
        raise CheckpointCorruptError(
            f"{path} holds checkpoint {state.checkpoint_id!r} of job {state.job!r}, not "
            f"{checkpoint_id!r} of {job!r}"
        )
    return state


def load_checkpoint(directory: StrPath, job: str, checkpoint_id: str, shard: int,
                    num_shards: int, sha256: str) -> ShardState:
    """`read_checkpoint` for a restore: a file that fails verification (truncated, malformed,
    or not matching its digest) also marks the checkpoint bad on disk (`mark_bad`) before
    the CheckpointCorruptError goes on, so no later restore tries it again. Blocks on file
    I/O."""
    try:
        return read_checkpoint(directory, job, checkpoint_id, shard, num_shards, sha256)
    except CheckpointCorruptError as exc:
        mark_bad(directory, job, checkpoint_id, f"shard {shard}: {exc}")
        raise


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


def write_shard(directory: StrPath, state: ShardState) -> ShardFile:
    """Writes `state` atomically to ``<directory>/<job>/<checkpoint_id>/shard-<k>-of-<n>...``.

    Blocks until the file and its directory entry are on disk (fsync), then returns its path,
    sha256 and size for `write_manifest`. Replaces an existing file of the same shard and
    checkpoint id. Thread-safe and process-safe (no shared state; concurrent writers of one
    file leave one whole file). The tensors must not change during the call: their memory is
    written directly, without a snapshot copy. Raises CheckpointError on bad input (names,
    dtypes, JSON that does not round-trip) or I/O failure; no final-named file is then left.
    """
    start = time.perf_counter()
    _check_shard_numbers(state.shard, state.num_shards)
    if isinstance(state.clock, bool) or not isinstance(state.clock, int):
        raise CheckpointError(f"clock must be an int, got {state.clock!r}")
    ckpt_dir = checkpoint_dir(directory, state.job, state.checkpoint_id)
    header, tensors = _build_header(state)
    _ensure_dir(ckpt_dir)
    _remove_stale_temps(ckpt_dir)
    final = ckpt_dir / shard_file_name(state.shard, state.num_shards)
    hasher = _BackgroundSha256()
    try:
        with _atomic_file(final) as fd:
            hasher.update(header)
            _write_all(fd, memoryview(header))
            offset = len(header)
            for tensor in tensors:
                view = _byte_view(tensor)
                for begin in range(0, len(view), CHUNK_BYTES):
                    chunk = view[begin : begin + CHUNK_BYTES]
                    hasher.update(chunk)
                    _write_all(fd, chunk)
                    # Starting writeback now lets the disk work while we fill the page cache,
                    # so the final fsync waits for the last chunks only.
                    _start_writeback(fd, offset, len(chunk))
                    offset += len(chunk)
    finally:
        digest = hasher.hexdigest()
    elapsed = time.perf_counter() - start
    log.info(
        "job %s shard %d/%d checkpoint %s clock %d: wrote %s (%d bytes, %.0f MB/s)",
        state.job, state.shard, state.num_shards, state.checkpoint_id, state.clock, final,
        offset, offset / 1e6 / max(elapsed, 1e-9),
    )
    return ShardFile(path=str(final), sha256=digest, nbytes=offset)


def read_shard(path: StrPath, sha256: str | None = None) -> ShardState:
    """Reads a shard file written by `write_shard`.

    Blocks on file I/O. Thread-safe. With `sha256`, hashes the file while reading it (one
    pass) and raises CheckpointCorruptError naming the file and both digests on a mismatch;
    without it, only the structure is checked. Returned tensors are fresh, writable memory
    owned by the caller (not views of a mapping of the file). Raises CheckpointCorruptError
    for a truncated or malformed file and CheckpointError if it cannot be opened.
    """
    path = Path(path)
    try:
        # Non-blocking, so that opening a FIFO or a device cannot hang; refused below.
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise CheckpointError(
            f"cannot open checkpoint shard {path}: {exc}; check the path and permissions"
        ) from exc
    hasher = _BackgroundSha256() if sha256 is not None else None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise CheckpointError(f"checkpoint shard {path} is not a regular file")
        os.set_blocking(fd, True)
        with contextlib.suppress(AttributeError, OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        size = info.st_size
        head = _read_exact(fd, 8, path, 0)
        (header_len,) = struct.unpack("<Q", head)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise CheckpointCorruptError(  # names no byte of the file: it may not be ours
                f"checkpoint shard {path} is truncated or not a safetensors file (its header "
                "does not fit in it); restore from another checkpoint"
            )
        header_bytes = _read_exact(fd, header_len, path, 8)
        if hasher is not None:
            hasher.update(head)
            hasher.update(header_bytes)
        entries, meta = _parse_header(header_bytes, size - 8 - header_len, path)
        tensors: dict[str, torch.Tensor] = {}
        chunks: list[tuple[int, memoryview]] = []
        offset = 8 + header_len
        for key, dtype, shape, nbytes in entries:
            tensor = torch.empty(shape, dtype=dtype)
            if nbytes:
                view = _byte_view(tensor)
                chunks.extend(
                    (offset + begin, view[begin : begin + CHUNK_BYTES])
                    for begin in range(0, nbytes, CHUNK_BYTES)
                )
            offset += nbytes
            tensors[key] = tensor
        _read_chunks(fd, chunks, path, hasher)
    except OSError as exc:
        raise CheckpointError(f"reading checkpoint shard {path} failed: {exc}") from exc
    finally:
        os.close(fd)
        actual = hasher.hexdigest() if hasher is not None else None
    if sha256 is not None and actual != sha256.lower():
        raise CheckpointCorruptError(
            f"checkpoint shard {path} fails its checksum: sha256 {actual}, manifest says "
            f"{sha256}; the file is corrupt, restore from another checkpoint"
        )
    return _state_from_meta(meta, tensors, path)


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
        file_path = Path(shard_file.path)
        if file_path.parent.resolve() != ckpt_dir.resolve():
            raise CheckpointError(
                f"shard {shard} file {file_path} is not in checkpoint directory {ckpt_dir}; "
                "record the ShardFile that write_shard returned for this checkpoint"
            )
        _check_file_size(file_path, shard_file.nbytes)
    _check_agrees_with_recorded(ckpt_dir, job, checkpoint_id, num_shards)
    _ensure_dir(ckpt_dir)
    _remove_stale_temps(ckpt_dir)
    stamp = now_ns()
    for shard, shard_file in sorted(shards.items()):
        entry = {
            "format": ENTRY_FORMAT,
            "format_version": FORMAT_VERSION,
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
        try:
            _check_file_size(file_path, nbytes)
        except CheckpointError as exc:
            raise CheckpointCorruptError(f"checkpoint {ckpt_dir}: {exc}") from exc
        shards[shard] = ShardFile(path=str(file_path), sha256=str(entry["sha256"]), nbytes=nbytes)
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
    with a warning, and those marked bad (`mark_bad`) at debug level.
    Ordered by (time of the newest entry, checkpoint id). Blocks on file I/O;
    thread-safe. Raises CheckpointError only for a bad job name or an unreadable job directory.
    """
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
        if (ckpt_dir / BAD_NAME).exists():
            log.debug("job %s: skipping checkpoint %s: marked bad", job, name)
            continue
        try:
            manifest = read_manifest(ckpt_dir)
        except CheckpointCorruptError as exc:
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
    files). With `verify_checksums`, also hashes every shard file of a candidate and skips it
    on a mismatch: this reads the whole checkpoint, so it is off by default and `read_shard`
    with the recorded sha256 catches the same damage at restore time. Blocks on file I/O;
    thread-safe.
    """
    for manifest in reversed(list_checkpoints(directory, job)):
        if not manifest.complete:
            continue
        if verify_checksums:
            bad = [f for f in manifest.shards.values() if _hash_file(Path(f.path)) != f.sha256]
            if bad:
                log.warning(
                    "job %s: skipping checkpoint %s: %s fails its checksum",
                    job, manifest.checkpoint_id, bad[0].path,
                )
                continue
        return manifest
    return None


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


def _build_header(state: ShardState) -> tuple[bytes, list[torch.Tensor]]:
    """The padded header, and the tensors in the order their bytes follow it."""
    tables_meta: list[dict[str, object]] = []
    items: list[tuple[str, torch.Tensor]] = []
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
        for tensor_name, tensor in table.tensors.items():
            if not isinstance(tensor_name, str):
                raise CheckpointError(
                    f"tensor name {tensor_name!r} in table {table.name!r} must be a str"
                )
            key = _tensor_key(table.name, tensor_name)
            items.append((key, _plain_tensor(tensor, f"{table.name!r}/{tensor_name!r}")))
            pairs.append([tensor_name, key])
        tables_meta.append({"name": table.name, "spec": table.spec, "tensors": pairs})
    metadata = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "job": state.job,
        "shard": str(state.shard),
        "num_shards": str(state.num_shards),
        "checkpoint_id": state.checkpoint_id,
        "clock": str(state.clock),
        "meta": _json_round_trips("meta", state.meta),
        "tables": json.dumps(tables_meta, ensure_ascii=False, separators=(",", ":")),
    }
    # Widest elements first keeps every tensor aligned to its element size (the header is
    # padded to 8), as safetensors itself does, so readers that map the file can use it in place.
    items.sort(key=lambda kv: (-kv[1].element_size(), kv[0]))
    header: dict[str, object] = {"__metadata__": metadata}
    offset = 0
    for key, tensor in items:
        nbytes = tensor.numel() * tensor.element_size()
        header[key] = {
            "dtype": _DTYPE_TO_ST[tensor.dtype],
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)
    if len(text) > MAX_HEADER_BYTES:
        raise CheckpointError(
            f"checkpoint header of shard {state.shard} is {len(text)} bytes, over the "
            f"safetensors limit of {MAX_HEADER_BYTES}; move bulk data from meta/specs into tensors"
        )
    return struct.pack("<Q", len(text)) + text, [t for _, t in items]


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
        if version != FORMAT_VERSION:
            raise ValueError(
                f"format version {version}; this build reads version {FORMAT_VERSION}"
            )
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
            tables.append(TableState(name=str(table["name"]), spec=spec, tensors=named))
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
        )
    except (ValueError, TypeError, KeyError) as exc:
        raise CheckpointCorruptError(
            f"checkpoint shard {path} has malformed metadata ({exc!r}); the file is corrupt or "
            "from an incompatible version"
        ) from exc


# ---- manifest entries -----------------------------------------------------------------------


def _read_entry(path: Path, shard: int) -> dict[str, object]:
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
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointCorruptError(
            f"manifest entry {path} is unreadable or malformed ({exc}); the checkpoint is corrupt"
        ) from exc
    return entry


def _manifest_json(manifest: Manifest) -> dict[str, object]:
    return {
        "format": MANIFEST_FORMAT,
        "format_version": FORMAT_VERSION,
        "job": manifest.job,
        "checkpoint_id": manifest.checkpoint_id,
        "clock": manifest.clock,
        "num_shards": manifest.num_shards,
        "complete": manifest.complete,
        "written_at_ns": manifest.written_at_ns,
        "shards": {
            str(k): {"file": Path(f.path).name, "sha256": f.sha256, "nbytes": f.nbytes}
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


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        written = os.write(fd, data)
        data = data[written:]


def _read_exact(fd: int, n: int, path: Path, offset: int) -> bytes:
    buf = bytearray(n)
    _readinto_exact(fd, memoryview(buf), path, offset)
    return bytes(buf)


def _read_chunks(
    fd: int, chunks: list[tuple[int, memoryview]], path: Path, hasher: _BackgroundSha256 | None
) -> None:
    """Fills each (file offset, buffer) chunk, READ_THREADS at a time, hashing them in order.

    One synchronous reader leaves the disk idle between its requests and faults in the fresh
    tensor pages on one core; several preads in flight keep the device queue full and spread
    the faults. Blocks until every chunk is read or one read fails (then raises its error).
    """
    pool = ThreadPoolExecutor(max_workers=READ_THREADS, thread_name_prefix="checkpoint-read")
    try:
        futures = [pool.submit(_readinto_exact, fd, buf, path, off) for off, buf in chunks]
        for future, (_, buf) in zip(futures, chunks, strict=True):
            future.result()  # local disk I/O: it ends or fails, so no timeout
            if hasher is not None:
                hasher.update(buf)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


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


def _hash_file(path: Path) -> str:
    """The file's sha256, hex; "" (logged) when it cannot be read."""
    try:
        return sha256_file(path)
    except OSError as exc:
        log.warning("cannot hash %s: %s", path, exc)
        return ""


class _BackgroundSha256:
    """sha256 of a byte stream, computed on a helper thread so hashing overlaps file I/O.

    hashlib releases the GIL for large buffers, so hashing and I/O really run in parallel.
    Chunks are queued by reference (no copies): the caller must not change a chunk's memory
    until `hexdigest` returns. One producer thread only; `hexdigest` must be called exactly
    once, and waits for the queued chunks (CPU work on memory, so it cannot hang).
    """

    def __init__(self) -> None:
        self._sha = hashlib.sha256()
        self._queue: queue.SimpleQueue[bytes | memoryview | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="checkpoint-sha256", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (chunk := self._queue.get()) is not None:
            self._sha.update(chunk)

    def update(self, chunk: bytes | memoryview) -> None:
        self._queue.put(chunk)

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
