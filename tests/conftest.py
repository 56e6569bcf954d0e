"""Fixtures shared by every test: real processes, always ended by pid."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import Procs


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    """Starts processes for one test and ends each of them, by pid, when it finishes."""
    started = Procs(tmp_path)
    try:
        yield started
    finally:
        started.close()


@pytest.fixture(scope="module")
def module_procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Procs]:
    """Like `procs`, shared by the tests of one module (each uses its own table names)."""
    started = Procs(tmp_path_factory.mktemp("procs"))
    try:
        yield started
    finally:
        started.close()
