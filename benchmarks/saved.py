"""Where a benchmark saves its figures: `--json PATH` when given, else a new file under
benchmarks/results/ named for the run, never one an earlier run wrote."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def result_path(stem: str, given: str | None) -> Path:
    """`given`, or results/STEM.json, or STEM-2.json, STEM-3.json... (the first free)."""
    if given:
        return Path(given)
    RESULTS.mkdir(parents=True, exist_ok=True)
    path, n = RESULTS / f"{stem}.json", 1
    while path.exists():
        n += 1
        path = RESULTS / f"{stem}-{n}.json"
    return path


def save(results: dict[str, Any], stem: str, given: str | None) -> Path:
    """Writes `results` as JSON where `result_path` says; prints and returns the path."""
    path = result_path(stem, given)
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}")
    return path
