"""Damage done to a checkpoint's files, as the tests of failed verification do it."""

from __future__ import annotations

from pathlib import Path


def corrupt(path: Path) -> None:
    """Flips the last bytes (tensor data: only the digest tells)."""
    data = bytearray(path.read_bytes())
    data[-8:] = bytes(b ^ 0xFF for b in data[-8:])
    path.write_bytes(data)
