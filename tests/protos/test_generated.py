"""The committed generated modules must match what the pinned generator makes of the .proto."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
GENERATED = ["pstrain_pb2.py", "pstrain_pb2.pyi", "pstrain_pb2_grpc.py"]


def test_generated_modules_are_fresh(tmp_path: Path) -> None:
    subprocess.run(
        ["bash", str(REPO / "scripts" / "gen_protos.sh"), str(tmp_path)],
        check=True, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    stale = [
        name for name in GENERATED
        if (tmp_path / "protos" / name).read_bytes() != (REPO / "protos" / name).read_bytes()
    ]
    assert not stale, f"{stale} are stale: run `bash scripts/gen_protos.sh` and commit them"
