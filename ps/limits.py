"""What a server may be asked to hold, and sizes as flags give them and people read them.

Pure and light (no torch): `pstrain server` parses its flags with these before it loads the
shard, so that a wrong flag or an unreachable Redis fails in a moment.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ps.errors import InvalidArgumentError

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class Limits:
    """What one request may make a shard hold or build. Defaults no real job meets; each is
    a `pstrain server` flag (README: Limits)."""

    max_table_bytes: int = 16 * GiB  # a dense table's values, whole
    max_dim: int = 1 << 16  # a sparse table's row width
    max_tables: int = 10_000  # tables on one shard
    max_declare: int = 1_000  # tables in one declare
    max_answer_bytes: int = 4 * GiB  # the pulled bytes of one exchange's answer
    max_new_rows: int = 1 << 24  # sparse rows one exchange may create, over all its tables
    # What all tables together may hold (Shard.memory_bytes); 0: no budget.
    memory_budget_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("max_table_bytes", "max_dim", "max_tables", "max_declare",
                     "max_answer_bytes", "max_new_rows"):
            if getattr(self, name) < 1:
                raise InvalidArgumentError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.memory_budget_bytes < 0:
            raise InvalidArgumentError(
                f"memory_budget_bytes must be >= 0 (0: no budget), got {self.memory_budget_bytes}"
            )


_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*")
# Decimal units are powers of 1000, binary ones (and a bare K, M, G, T) powers of 1024.
_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
    "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}


def parse_size(text: str, what: str = "a size") -> int:
    """Bytes from "1073741824", "512MiB", "8GiB", "1.5GB" or "64k" (units in any case).

    Pure. InvalidArgumentError quoting `text` and naming `what` (a flag) for anything else.
    """
    match = _SIZE.fullmatch(text)
    unit = _UNITS.get(match.group(2).lower()) if match else None
    if match is None or unit is None:
        raise InvalidArgumentError(
            f"{what}: {text!r} is not a size; give bytes, or a number with a unit such as "
            "512MiB, 8GiB or 1.5GB (KB, MB, GB, TB are powers of 1000; KiB, MiB, GiB, TiB "
            "and K, M, G, T powers of 1024)"
        )
    number = match.group(1)
    # Whole numbers stay exact however large; only fractions go through a float.
    return int(number) * unit if number.isdigit() else round(float(number) * unit)


def format_size(nbytes: int) -> str:
    """"8.3 GiB", "512 MiB", "900 B": a size for a person, two decimals at most. Pure."""
    units = ("B", "KiB", "MiB", "GiB", "TiB")
    value, step = float(nbytes), 0
    while abs(value) >= 1024 and step < len(units) - 1:
        value, step = value / 1024, step + 1
    return f"{value:.2f}".rstrip("0").rstrip(".") + f" {units[step]}"
