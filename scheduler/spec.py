"""The job spec: what every process of a job must agree on, stored once in Redis."""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import TypeVar

from protos import modes
from scheduler.errors import SpecError, SpecMismatchError

# A worker exits with this status to be started again at once: its job rolled back.
RESTART_EXIT_CODE = 75
# A worker, and `pstrain up`, exit with this status when the job was stopped because
# recovery found no checkpoint that verifies (the reason is in Redis, `pstrain status`).
STOPPED_EXIT_CODE = 76
N = TypeVar("N", int, float)
_JOB_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class JobSpec:
    """A job's shape and policies. Validated on construction; compared field by field."""

    job: str
    mode: str = "async"  # the kind only: "sync", "ssp" or "async"
    staleness: int = 0
    servers: int = 1
    workers: int = 1
    backups: int = 0
    heartbeat_interval_s: float = 0.5
    heartbeat_misses: int = 3
    # How long a process may stay silent (suspect) once its heartbeat lapsed before it is
    # declared dead without proof that it exited (its Redis connection closed): load, GC or a
    # SIGSTOP may pause it that long. See scheduler/detector.py for how the value was chosen.
    suspect_timeout_s: float = 10.0
    checkpoint_dir: str = ""
    checkpoint_every_s: float = 0.0  # async and ssp: 0 turns periodic checkpoints off
    checkpoint_every_clocks: int = 0  # sync: 0 turns periodic checkpoints off
    # A full checkpoint every this many, the others deltas of the one before; 1: all full.
    checkpoint_full_every: int = 10
    # Retention: the newest this many full checkpoints (and those after them) are kept, older
    # ones of the run removed once a newer full one is complete; 0 keeps every one.
    checkpoint_keep: int = 3
    # Each server writes a checkpoint at most this fast (MB/s, 1e6 bytes), so that writing
    # one beside training leaves the training its CPU and memory bandwidth; 0: no limit.
    checkpoint_write_mb_s: float = 64.0
    created_s: float = 0.0  # when the job was created (set by JobStore.create_job)
    run_id: str = ""  # this run of the job (set by JobStore.create_job; see store.new_run_id)

    def __post_init__(self) -> None:
        if not _JOB_NAME.match(self.job):
            raise SpecError(
                f"job name {self.job!r} must be 1-64 letters, digits, '_', '-' or '.', "
                "starting with a letter or digit"
            )
        try:
            parsed = modes.parse(self.mode)
        except modes.ModeError as exc:
            raise SpecError(f"job {self.job!r}: {exc}") from exc
        if parsed.staleness is not None:
            raise SpecError(
                f"mode {self.mode!r}: a job keeps the ssp bound apart; give mode 'ssp' and "
                f"staleness {parsed.staleness}"
            )
        checks = [
            ("staleness", self.staleness >= 0, ">= 0"),
            ("servers", self.servers >= 1, ">= 1"),
            ("workers", self.workers >= 1, ">= 1"),
            ("backups", 0 <= self.backups < self.workers, f"in [0, workers={self.workers})"),
            ("heartbeat_interval_s", self.heartbeat_interval_s > 0, "> 0"),
            ("heartbeat_misses", self.heartbeat_misses >= 1, ">= 1"),
            ("suspect_timeout_s", self.suspect_timeout_s >= 0, ">= 0"),
            ("checkpoint_every_s", self.checkpoint_every_s >= 0, ">= 0"),
            ("checkpoint_every_clocks", self.checkpoint_every_clocks >= 0, ">= 0"),
            ("checkpoint_full_every", self.checkpoint_full_every >= 1, ">= 1 (1: all full)"),
            ("checkpoint_keep", self.checkpoint_keep >= 0, ">= 0 (0: keep all)"),
            ("checkpoint_write_mb_s", self.checkpoint_write_mb_s >= 0, ">= 0 (0: no limit)"),
        ]
        for name, ok, rule in checks:
            if not ok:
                raise SpecError(f"{name} must be {rule}, got {getattr(self, name)!r}")

    @property
    def heartbeat_ttl_s(self) -> float:
        """How long a heartbeat lives: a process is suspect after `heartbeat_misses` misses
        (dead once it has exited, or after `suspect_timeout_s` more)."""
        return self.heartbeat_interval_s * self.heartbeat_misses

    @property
    def consistency(self) -> modes.Mode:
        """The job's default consistency mode, its ssp bound filled in."""
        return modes.parse(self.mode).with_default(self.staleness)

    @property
    def quorum(self) -> int:
        return self.workers - self.backups

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> JobSpec:
        try:
            raw = json.loads(text)
            known = {f.name for f in fields(cls)}
            return cls(**{k: v for k, v in raw.items() if k in known})
        except (ValueError, TypeError) as exc:
            raise SpecError(f"the job spec stored in Redis is unreadable: {exc}") from exc

    def check_agrees(self, **given: object) -> None:
        """SpecMismatchError listing every field where `given` (not None) differs."""
        clashes = [
            f"{name}: the job has {getattr(self, name)!r}, this process was given {value!r}"
            for name, value in given.items()
            if value is not None and getattr(self, name) != value
        ]
        if clashes:
            raise SpecMismatchError(
                f"this process disagrees with job {self.job!r}:\n  " + "\n  ".join(clashes)
                + "\nDrop the flag to take the job's value, or start a job under another name"
            )


def at_least(low: int, note: str = "") -> Callable[[str], int]:
    """An argparse type for a spec's count flags: an int >= `low` (`note` says what the
    bound means); argparse names the flag and the value it refuses."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        return _check_low(value, low, note)

    return parse


def at_least_float(low: float, note: str = "") -> Callable[[str], float]:
    """As `at_least`, for a finite number (a rate, a time)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
        return _check_low(value, low, note)

    return parse


def _check_low(value: N, low: float, note: str) -> N:
    if value < low:
        raise argparse.ArgumentTypeError(
            f"must be >= {low}{f' ({note})' if note else ''}, got {value}")
    return value
