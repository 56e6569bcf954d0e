"""Which ids of a sparse table get a row (admission) and which rows go (eviction).

Pure policies over numpy arrays; the table (ps/tables.py) holds their state under its own
lock and does all the work around them.

Admission, declared per table in one grammar (`parse_admit`):
  ``always``   every id gets a row on first touch (the default);
  ``count:K``  an id gets a row on its K-th sight (a pull naming it; a push is no sight, as a
               training step pushes the ids it pulled), counted in a
               count-min sketch of saturating 8-bit counters, so an id not yet admitted costs
               a few bits of a fixed-size array instead of a row;
  ``prob:P``   an id gets a row iff hash(seed, id) < P: the same ids in every run.

Eviction (`EvictRule`): a row untouched for ``ttl_clocks`` clocks or ``ttl_s`` seconds goes,
and past ``max_rows`` rows the least recently touched go first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from ps.errors import InvalidArgumentError

__all__ = [
    "SKETCH_DEPTH", "SKETCH_WIDTH", "AdmitRule", "CountMinSketch", "EvictRule",
    "admitted_by_probability", "expired", "hash_keys", "least_recent", "parse_admit",
]

AdmitKind = Literal["always", "count", "prob"]

# Rows and buckets per row of a table's count-min sketch: 4 MiB of uint8 counters per table
# and shard. With n distinct ids not yet admitted, an id's estimate is off by more than
# e * n * (mean sights) / width with probability at most e ** -depth.
SKETCH_DEPTH = 4
SKETCH_WIDTH = 1 << 20
# The largest count:K, as counters saturate at 255.
MAX_ADMIT_COUNT = 255

_U64 = np.uint64
# Salts that make one seed into independent hash functions (sketch rows, probability).
_SALT_PROB = 0x9E3779B97F4A7C15
_SALT_ROW = 0xD1B54A32D192ED03


@dataclass(frozen=True)
class AdmitRule:
    """An admission rule; `str()` is its grammar, which `parse_admit` reads back."""

    kind: AdmitKind = "always"
    count: int = 0  # count: sights an id needs
    probability: float = 1.0  # prob: the share of ids admitted

    def __str__(self) -> str:
        if self.kind == "count":
            return f"count:{self.count}"
        if self.kind == "prob":
            return f"prob:{self.probability!r}"
        return "always"


def parse_admit(text: str, table: str = "") -> AdmitRule:
    """The rule `text` names; InvalidArgumentError quoting a value outside the grammar
    ``always | count:K (1 <= K <= 255) | prob:P (0 < P <= 1)``. Pure."""
    where = f"table {table!r}: " if table else ""
    grammar = "use 'always', 'count:K' with 1 <= K <= 255, or 'prob:P' with 0 < P <= 1"
    kind, _, arg = text.strip().partition(":")
    if kind in ("", "always") and not arg:
        return AdmitRule()
    if kind == "count":
        try:
            count = int(arg)
        except ValueError:
            count = -1
        if not 1 <= count <= MAX_ADMIT_COUNT:
            raise InvalidArgumentError(f"{where}admit {text!r} is not a valid count; {grammar}")
        return AdmitRule("count", count=count)
    if kind == "prob":
        try:
            probability = float(arg)
        except ValueError:
            probability = math.nan
        if not 0 < probability <= 1:
            raise InvalidArgumentError(
                f"{where}admit {text!r} is not a valid probability; {grammar}"
            )
        return AdmitRule("prob", probability=probability)
    raise InvalidArgumentError(f"{where}admit {text!r} is not an admission rule; {grammar}")


def hash_keys(keys: npt.NDArray[np.int64], salt: int) -> npt.NDArray[np.uint64]:
    """splitmix64 of each key xor `salt`: every input bit reaches every output bit. Pure."""
    with np.errstate(over="ignore"):
        z = keys.view(_U64) ^ _U64(salt & 0xFFFFFFFFFFFFFFFF)
        z = (z ^ (z >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _U64(27))) * _U64(0x94D049BB133111EB)
        return z ^ (z >> _U64(31))


def _salt(seed: int, salt: int) -> int:
    return ((seed & 0xFFFFFFFFFFFFFFFF) * 0x2545F4914F6CDD1D + salt) & 0xFFFFFFFFFFFFFFFF


def admitted_by_probability(
    keys: npt.NDArray[np.int64], seed: int, probability: float
) -> npt.NDArray[np.bool_]:
    """Whether each key is admitted under prob:`probability`: its hash, read as a fraction
    of 2**64, is below `probability`. The same answer for a key in every run. Pure."""
    if probability >= 1:
        return np.ones(len(keys), dtype=bool)
    fraction = (hash_keys(keys, _salt(seed, _SALT_PROB)) >> _U64(11)).astype(np.float64)
    return fraction < probability * float(1 << 53)


class CountMinSketch:
    """Estimated sights per key in `depth` x `width` saturating uint8 counters.

    Estimates never undercount (below 255); they overcount when keys share buckets. Not
    thread-safe: the table calls it under its index lock. `counters` is the whole state, as
    a checkpoint stores it.
    """

    def __init__(self, seed: int, depth: int = SKETCH_DEPTH, width: int = SKETCH_WIDTH) -> None:
        if width < 1 or width & (width - 1):
            raise InvalidArgumentError(f"sketch width must be a power of two, got {width}")
        self.counters = np.zeros((depth, width), dtype=np.uint8)
        self._salts = [_salt(seed, _SALT_ROW + d) for d in range(depth)]
        self._mask = _U64(width - 1)

    @property
    def nbytes(self) -> int:
        return self.counters.nbytes

    def _buckets(self, keys: npt.NDArray[np.int64]) -> list[npt.NDArray[np.intp]]:
        return [(hash_keys(keys, s) & self._mask).astype(np.intp) for s in self._salts]

    def estimate(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.uint8]:
        """Each key's estimated sights. Changes nothing."""
        if not len(keys):
            return np.zeros(0, dtype=np.uint8)
        return _least([self.counters[d, b] for d, b in enumerate(self._buckets(keys))])

    def add(self, keys: npt.NDArray[np.int64]) -> npt.NDArray[np.uint8]:
        """Counts one sight of each of `keys` (distinct); returns their new estimates."""
        if not len(keys):
            return np.zeros(0, dtype=np.uint8)
        seen = []
        for d, buckets in enumerate(self._buckets(keys)):
            row = self.counters[d]
            # Keys sharing a bucket in this batch add up, as they would one at a time.
            where, hits = np.unique(buckets, return_counts=True)
            row[where] = np.minimum(row[where].astype(np.int64) + hits, 255).astype(np.uint8)
            seen.append(row[buckets])
        return _least(seen)

    def load(self, counters: npt.NDArray[np.uint8]) -> None:
        """Replaces the counters with a checkpoint's; InvalidArgumentError on another shape."""
        if counters.shape != self.counters.shape or counters.dtype != np.uint8:
            raise InvalidArgumentError(
                f"a sketch of shape {list(counters.shape)} ({counters.dtype}) cannot replace "
                f"one of shape {list(self.counters.shape)} (uint8)"
            )
        self.counters[...] = counters


def _least(rows: list[npt.NDArray[np.uint8]]) -> npt.NDArray[np.uint8]:
    out = rows[0]
    for row in rows[1:]:
        out = np.minimum(out, row)
    return out


@dataclass(frozen=True)
class EvictRule:
    """When rows go: untouched for `ttl_clocks` clocks or `ttl_s` seconds, or past
    `max_rows` rows (least recently touched first). Zero turns each off."""

    ttl_clocks: int = 0
    ttl_s: float = 0.0
    max_rows: int = 0

    def __post_init__(self) -> None:
        if self.ttl_clocks < 0:
            raise InvalidArgumentError(f"ttl_clocks must be >= 0 (0: off), got {self.ttl_clocks}")
        if not (math.isfinite(self.ttl_s) and self.ttl_s >= 0):
            raise InvalidArgumentError(f"ttl_s must be finite and >= 0 (0: off), got {self.ttl_s}")
        if self.max_rows < 0:
            raise InvalidArgumentError(f"max_rows must be >= 0 (0: no limit), got {self.max_rows}")

    @property
    def active(self) -> bool:
        return bool(self.ttl_clocks or self.ttl_s or self.max_rows)


def expired(
    rule: EvictRule, touched_clock: npt.NDArray[np.signedinteger[Any]],
    touched_s: npt.NDArray[np.floating[Any]], now_clock: int, now_s: float,
) -> npt.NDArray[np.bool_]:
    """Which rows (live ones have touched_clock >= 0) the TTLs evict at (now_clock, now_s):
    those touched `ttl_clocks` or more clocks ago, or more than `ttl_s` seconds ago. Pure."""
    live = touched_clock >= 0
    out = np.zeros(len(touched_clock), dtype=bool)
    if rule.ttl_clocks:
        out |= touched_clock <= now_clock - rule.ttl_clocks
    if rule.ttl_s:
        out |= touched_s < np.float64(now_s - rule.ttl_s)  # float64: stamps may be float32
    return out & live


def least_recent(
    touched_clock: npt.NDArray[np.signedinteger[Any]], touched_s: npt.NDArray[np.floating[Any]],
    n: int,
) -> npt.NDArray[np.intp]:
    """Positions of the `n` least recently touched live rows (touched_clock >= 0), by clock
    and then by seconds; fewer when fewer are live. Pure."""
    live = np.flatnonzero(touched_clock >= 0)
    if n <= 0 or not len(live):
        return np.zeros(0, dtype=np.intp)
    if n >= len(live):
        return live
    # A partial selection, not a sort: O(live) whatever n is. The n-th oldest clock splits
    # the rows; those tied at it go by their seconds.
    clocks = touched_clock[live]
    cut = np.partition(clocks, n - 1)[n - 1]
    older = live[clocks < cut]
    tied = live[clocks == cut]
    need = n - len(older)
    if need < len(tied):
        tied = tied[np.argpartition(touched_s[tied], need - 1)[:need]]
    return np.sort(np.concatenate([older, tied]))
