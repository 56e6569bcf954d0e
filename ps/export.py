"""`python -m ps.export` (and `pstrain export`): turn a checkpoint into a model that a plain
PyTorch process serves without a parameter server (format: protos/exported.py; loader:
worker/serving.py).

A checkpoint is found on disk, without Redis: ``<checkpoint-dir>/<job>/<id>``, the given id
or the newest complete one (ps/checkpoint.py's order). Every shard file is hashed against its
manifest entry before anything is written, and a delta checkpoint is resolved through its
chain as a restore resolves it; a missing, incomplete or corrupt checkpoint (or a file of its
chain) is refused with a message naming the file. Dense tables are reassembled from their
shards' row ranges (the placement workers route by), sparse tables from their hash shards
into one key-sorted table. Optimizer state, steps and the written flags are left out; dtypes are
kept (a float16 or bfloat16 table exports as such).

Unknown ids: the server would create a never-seen id's row from the table's init rule; a
served model cannot grow, so an export serves zeros for it (``default`` in each sparse file)
and records the init rule and seed in the manifest, for a caller that wants the rule.

With ``--delta --since PREV`` the output holds only what changed since the export PREV: per
sparse table the rows whose key is new or whose values differ bit for bit, and the keys gone;
each dense table that changed at all, whole; and the tables dropped.
`worker.serving.apply_delta(PREV, delta)` gives the full export again.

With ``--publish-every T`` it keeps publishing while the job trains (`Publisher`): every T
seconds the newest complete checkpoint (with ``--redis``, one it asks the job for then) is
exported into ``OUT/<n>-full-<id>`` or, as a delta against the export published before it,
``OUT/<n>-delta-<id>``, a full one every ``--full-every``; after each, ``OUT/published.json``
(written atomically) names the newest full export and the deltas after it, in order:
`worker.serving.load_published(OUT)` builds the newest model from them, and an online store
applies each new delta to what it serves.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from protos.exported import (
    MANIFEST_NAME,
    PUBLISHED_FORMAT,
    PUBLISHED_NAME,
    BaseRef,
    DenseTable,
    Export,
    ExportFormatError,
    SparseTable,
    Table,
    read_export,
    sha256_file,
    write_export,
)
from protos.partition import dense_placement
from ps.checkpoint import (
    CheckpointError,
    Manifest,
    ShardState,
    checkpoint_dir,
    latest_complete,
    read_manifest,
    read_resolved,
)
from ps.errors import PSError
from ps.tables import TableSpec

log = logging.getLogger(__name__)

# The tensors of a checkpointed table that an export holds (ps/tables.py's snapshot names).
_EXPORTED = frozenset({"value", "keys"})


class ExportError(PSError):
    """A checkpoint cannot be exported: none found, incomplete, or tables that disagree."""


def find(directory: str | Path, job: str, checkpoint_id: str | None = None) -> Manifest:
    """The manifest of checkpoint `checkpoint_id` of `job` under `directory`, or of the newest
    complete one. ExportError (or CheckpointError from reading) when there is none, or when
    it is incomplete (naming the missing shard files). Blocks on small file reads."""
    if checkpoint_id is None:
        found = latest_complete(directory, job)
        if found is None:
            raise ExportError(f"no complete checkpoint of job {job!r} under {directory}; "
                              "check --job and --checkpoint-dir")
        return found
    manifest = read_manifest(checkpoint_dir(directory, job, checkpoint_id))
    if not manifest.complete:
        missing = sorted(set(range(manifest.num_shards)) - set(manifest.shards))
        files = ", ".join(f"shard-{k}-of-{manifest.num_shards}.safetensors" for k in missing)
        raise ExportError(f"checkpoint {manifest.directory} is incomplete: no manifest entry "
                          f"(shard-<k>.json) for {files}; export a complete checkpoint")
    return manifest


def read_states(manifest: Manifest) -> list[ShardState]:
    """Every shard of `manifest`, each hashed against its recorded sha256 while read, a
    delta resolved through its chain as a restore does (`read_resolved`; blocks on reading
    the whole checkpoint), with only the tensors an export holds (values and keys).
    CheckpointCorruptError names a file that fails."""
    states = []
    for shard in range(manifest.num_shards):
        recorded = manifest.shards[shard]
        state = read_resolved(recorded.path, recorded.sha256)
        if (state.job, state.checkpoint_id, state.shard, state.num_shards) != (
                manifest.job, manifest.checkpoint_id, shard, manifest.num_shards):
            raise ExportError(f"{recorded.path} holds shard {state.shard}/{state.num_shards} of "
                              f"{state.job!r} {state.checkpoint_id!r}, not what its manifest "
                              "entry says; the checkpoint is corrupt")
        # Only values and keys are exported: dropping the optimizer state now keeps one
        # shard's state in memory at a time, not the whole checkpoint's.
        states.append(dataclasses.replace(state, tables=[
            dataclasses.replace(t, tensors={k: v for k, v in t.tensors.items()
                                            if k in _EXPORTED})
            for t in state.tables]))
    return states


def export_states(states: list[ShardState], clock: int) -> Export:
    """The served model of one checkpoint's shards (all of them, in shard order). Pure."""
    first = states[0]
    names = [t.name for t in first.tables]
    by_shard = [{t.name: t for t in s.tables} for s in states]
    tables: dict[str, Table] = {}
    for name in names:
        parts = []
        for shard, found in enumerate(by_shard):
            if name not in found:
                raise ExportError(f"table {name!r} is in shard 0 of checkpoint "
                                  f"{first.checkpoint_id!r} but not in shard {shard}")
            parts.append(found[name])
        spec = TableSpec.from_dict(parts[0].spec)
        info: dict[str, object] = {k: v for k, v in parts[0].spec.items()
                                   if k in ("init", "seed", "optimizer")}
        if spec.kind == "dense":
            tables[name] = _dense(spec, [p.tensors["value"] for p in parts], info)
        else:
            tables[name] = _sparse(spec, [(p.tensors["keys"], p.tensors["value"]) for p in parts],
                                   info)
    return Export(job=first.job, checkpoint_id=first.checkpoint_id, clock=clock, tables=tables)


def delta(base: Export, new: Export, base_manifest_sha256: str) -> Export:
    """What changed from `base` to `new`, as a delta export (see the module docstring). Pure.
    ExportError for a sparse table whose dim or dtype changed (make a full export)."""
    tables: dict[str, Table] = {}
    for name, table in new.tables.items():
        old = base.tables.get(name)
        if isinstance(table, DenseTable):
            if not (isinstance(old, DenseTable) and _same_bits(old.value, table.value)):
                tables[name] = table
            continue
        if old is None:
            tables[name] = table
            continue
        if not isinstance(old, SparseTable) or (old.dim, old.dtype) != (table.dim, table.dtype):
            raise ExportError(f"table {name!r} changed kind, dim or dtype since the base export; "
                              "make a full export")
        pos = torch.searchsorted(old.keys, table.keys).clamp_(max=max(len(old.keys) - 1, 0))
        if len(old.keys):
            present = old.keys[pos] == table.keys
            same = present & _rows_equal(old.values[pos], table.values)
        else:
            same = torch.zeros(len(table.keys), dtype=torch.bool)
        changed = ~same
        removed = old.keys[~torch.isin(old.keys, table.keys)]
        tables[name] = SparseTable(table.keys[changed], table.values[changed], table.default,
                                   removed, table.spec)
    return Export(
        job=new.job, checkpoint_id=new.checkpoint_id, clock=new.clock, tables=tables,
        kind="delta", base=BaseRef(base.checkpoint_id, base_manifest_sha256),
        dropped_tables=tuple(sorted(set(base.tables) - set(new.tables))),
    )


def export(directory: str | Path, job: str, out: str | Path, checkpoint_id: str | None = None,
           since: str | Path | None = None) -> Path:
    """Exports a checkpoint (see `find`) to the new directory `out`; with `since`, a delta
    against the export there. Returns the manifest's path. Blocks on reading the checkpoint
    and writing the export; raises ExportError, CheckpointError or ExportFormatError."""
    manifest = find(directory, job, checkpoint_id)
    full = export_states(read_states(manifest), manifest.clock)
    if since is None:
        result = full
    else:
        base = read_export(since)
        if base.kind != "full":
            raise ExportError(f"{since} is a delta export; --since needs a full export")
        result = delta(base, full, sha256_file(Path(since) / MANIFEST_NAME))
    written = write_export(out, result)
    log.info("job %s checkpoint %s clock %d: exported %d tables (%s) to %s", job,
             manifest.checkpoint_id, manifest.clock, len(result.tables), result.kind, out)
    return written


class Publisher:
    """Publishes a training job's model into `out` as it trains: a full export of the newest
    complete checkpoint first, then each newer checkpoint as a delta against the export
    published before it (every `full_every`-th a full one again), and after each
    ``published.json`` (atomically): the newest full export and the deltas after it, in the
    order to apply them, with the checkpoint id and clock of the last. Exports of the
    checkpoint before the previous full one are removed. `request`, when given, asks the job
    for a checkpoint and returns its id (or None when it could not be taken): each publish
    then exports that one. Not thread-safe; blocks on file I/O."""

    def __init__(self, directory: str | Path, job: str, out: str | Path, full_every: int = 10,
                 request: Callable[[], str | None] | None = None) -> None:
        if full_every < 1:
            raise ExportError(f"--full-every must be >= 1 (1: every export full), got "
                              f"{full_every}")
        self.directory, self.job, self.out = directory, job, Path(out)
        self.full_every, self.request = full_every, request
        self.out.mkdir(parents=True, exist_ok=True)
        self._base: Export | None = None  # the newest model published (deltas applied)
        self._chain: list[str] = []  # the newest full export's name, then its deltas'
        self._seq = 0
        self._published = ""  # the checkpoint id published last

    def publish_once(self) -> Path | None:
        """Publishes the newest checkpoint if it is newer than the last one published; returns
        the new export's directory (None: nothing new)."""
        checkpoint_id = self.request() if self.request is not None else None
        manifest = find(self.directory, self.job, checkpoint_id)
        if manifest.checkpoint_id == self._published:
            return None
        full = export_states(read_states(manifest), manifest.clock)
        whole = self._base is None or len(self._chain) >= self.full_every
        kind = "full" if whole else "delta"
        name = f"{self._seq:06d}-{kind}-{manifest.checkpoint_id}"
        if whole:
            result = full
        else:
            previous = self.out / self._chain[-1] / MANIFEST_NAME
            assert self._base is not None
            result = delta(self._base, full, sha256_file(previous))
        write_export(self.out / name, result)
        dropped = self._chain if whole else []
        self._chain = [name] if whole else [*self._chain, name]
        self._base, self._published, self._seq = full, manifest.checkpoint_id, self._seq + 1
        self._write_published(manifest.checkpoint_id, manifest.clock)
        self._remove_before(dropped)
        log.info("published %s: checkpoint %s, clock %d, %d tables", name,
                 manifest.checkpoint_id, manifest.clock, len(result.tables))
        return self.out / name

    def run(self, every_s: float, stop: threading.Event, count: int = 0) -> int:
        """Publishes every `every_s` seconds until `stop` is set (or `count` publishes, when
        > 0); returns how many it published. A checkpoint that cannot be exported (none yet,
        one being written) is logged and tried again at the next turn."""
        done = 0
        while not stop.is_set():
            try:
                if self.publish_once() is not None:
                    done += 1
            except (PSError, ExportFormatError) as exc:
                log.warning("nothing published this turn: %s", exc)
            if count and done >= count:
                break
            stop.wait(every_s)
        return done

    def _write_published(self, checkpoint_id: str, clock: int) -> None:
        data = json.dumps({"format": PUBLISHED_FORMAT, "job": self.job, "full": self._chain[0],
                           "deltas": self._chain[1:], "checkpoint_id": checkpoint_id,
                           "clock": clock}, indent=2).encode()
        tmp = self.out / f".{PUBLISHED_NAME}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.out / PUBLISHED_NAME)

    def _remove_before(self, chain: list[str]) -> None:
        """Removes the exports published before `chain` (the chain a new full export ended):
        a reader that read the previous published.json still finds that chain whole."""
        keep = set(chain) | set(self._chain)
        for entry in self.out.iterdir():
            if entry.is_dir() and entry.name[:6].isdigit() and entry.name not in keep:
                shutil.rmtree(entry, ignore_errors=True)


# ---- helpers ----------------------------------------------------------------------------------


def _dense(spec: TableSpec, values: list[torch.Tensor], info: dict[str, object]) -> DenseTable:
    ranges = dense_placement(spec.name, spec.shape, spec.itemsize, len(values))
    tail = spec.shape[1:]
    blocks = []
    for where in ranges:
        block = values[where.shard]
        if block.numel() != where.rows * math.prod(tail):
            raise ExportError(f"dense table {spec.name!r}: shard {where.shard} holds "
                              f"{list(block.shape)}, its placement is rows "
                              f"[{where.start}, {where.end}) of {list(spec.shape)}")
        if where.rows:
            blocks.append((where.start, block.reshape(where.rows, *tail)))
    blocks.sort(key=lambda b: b[0])
    whole = (torch.cat([b for _, b in blocks]) if blocks
             else torch.empty((0, *tail), dtype=spec.dtype))
    return DenseTable(whole.reshape(spec.shape).contiguous(), info)


def _sparse(spec: TableSpec, parts: list[tuple[torch.Tensor, torch.Tensor]],
            info: dict[str, object]) -> SparseTable:
    keys = torch.cat([k.reshape(-1).to(torch.int64) for k, _ in parts])
    values = torch.cat([v.reshape(-1, spec.dim) for _, v in parts])
    order = torch.argsort(keys)
    keys, values = keys[order], values[order]
    if keys.numel() > 1 and not bool((keys[1:] > keys[:-1]).all()):
        raise ExportError(f"sparse table {spec.name!r}: a key is held by two shards; the "
                          "checkpoint is corrupt")
    return SparseTable(keys.contiguous(), values.contiguous(),
                       torch.zeros(spec.dim, dtype=spec.dtype), spec=info)


_INT_OF = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t` as integers of its width: equality of these is equality of the bits (NaN and -0.0
    included), which is what a delta must preserve."""
    return t.contiguous().view(_INT_OF[t.element_size()])


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _rows_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (_bits(a) == _bits(b)).all(dim=1)


# ---- command line -----------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pstrain export",
        description="Export a checkpoint as a model served without parameter servers: one "
                    "safetensors file per table and a manifest.json (see worker/serving.py).")
    p.add_argument("--job", required=True, help="the job whose checkpoint to export")
    p.add_argument("--checkpoint-dir", required=True,
                   help="the job's checkpoint directory (holds <job>/<checkpoint id>/)")
    p.add_argument("--checkpoint", default=None, metavar="ID",
                   help="the checkpoint id (default: the newest complete one)")
    p.add_argument("--out", required=True, help="the new directory to write the export to")
    p.add_argument("--delta", action="store_true",
                   help="write only what changed since the export given by --since")
    p.add_argument("--since", default=None, metavar="EXPORT_DIR",
                   help="with --delta: the earlier full export to compare against")
    p.add_argument("--publish-every", type=float, default=0.0, metavar="SECONDS",
                   help="keep publishing while the job trains: every SECONDS the newest "
                        "checkpoint goes to OUT as a full export or a delta against the one "
                        "before, named in OUT/published.json (stop with Ctrl-C or SIGTERM)")
    p.add_argument("--full-every", type=int, default=10, metavar="N",
                   help="with --publish-every: every N-th export a full one (default 10)")
    p.add_argument("--redis", default="", metavar="URL",
                   help="with --publish-every: ask the job (in this Redis) for a checkpoint "
                        "at each turn, instead of taking the newest one the job wrote")
    p.add_argument("--count", type=int, default=0,
                   help="with --publish-every: stop after this many exports (0: never)")
    p.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    a = p.parse_args(sys.argv[1:] if argv is None else argv)
    if a.delta != (a.since is not None):
        p.error("--delta and --since EXPORT_DIR go together")
    if a.publish_every < 0 or a.count < 0:
        p.error(f"--publish-every and --count must be >= 0, got {a.publish_every:g} and "
                f"{a.count}")
    if a.publish_every and (a.delta or a.checkpoint):
        p.error("--publish-every takes the newest checkpoints: leave out --delta, --since "
                "and --checkpoint")
    if not a.publish_every and (a.redis or a.count):
        p.error("--redis and --count go with --publish-every")
    logging.basicConfig(level=a.log_level.upper(),
                        format="%(asctime)s %(levelname)s export %(name)s: %(message)s")
    if a.publish_every:
        return _publish(a)
    try:
        written = export(a.checkpoint_dir, a.job, a.out, a.checkpoint, a.since)
    except (PSError, CheckpointError, ExportFormatError) as exc:
        print(f"pstrain export: {exc}", file=sys.stderr)
        return 2
    print(written)
    return 0


def _publish(a: argparse.Namespace) -> int:
    request: Callable[[], str | None] | None = None
    if a.redis:
        # Here, not at the top: only a publisher that asks the job needs Redis.
        from scheduler.admin import take_checkpoint  # noqa: PLC0415
        from scheduler.store import JobStore  # noqa: PLC0415

        store = JobStore.connect(a.redis, a.job)

        def request() -> str | None:
            taken = take_checkpoint(store, max(30.0, 2 * a.publish_every), prefix="publish")
            if isinstance(taken, str):
                log.warning("no checkpoint this turn: %s", taken)
                return None
            return taken[0]

    try:
        publisher = Publisher(a.checkpoint_dir, a.job, a.out, a.full_every, request)
    except PSError as exc:
        print(f"pstrain export: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    published = publisher.run(a.publish_every, stop, a.count)
    print(json.dumps({"published": published, "out": str(a.out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
