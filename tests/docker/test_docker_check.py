"""scripts/docker-check.sh under a real Docker engine: the image built, the compose cluster
trained to completion, a server container killed and the job recovered, and the CUDA
variant's build stage on a Debian base without Python headers.

It takes many minutes (a base image, two image builds, two training runs), so it runs only
when asked: PSTRAIN_DOCKER_CHECK=1 runs it, installing Docker where it is missing (Debian,
root); unset, it runs where a Docker engine answers outside CI (the CI variable unset);
PSTRAIN_DOCKER_CHECK=0 skips it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "docker-check.sh"


def _engine_answers() -> bool:
    docker = shutil.which("docker")
    if docker is None:
        return False
    try:
        done = subprocess.run([docker, "info"], capture_output=True, timeout=30, check=False)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


def _skip_reason() -> str | None:
    asked = os.environ.get("PSTRAIN_DOCKER_CHECK", "")
    if asked == "1":
        return None
    if asked == "0":
        return "PSTRAIN_DOCKER_CHECK=0"
    if not _engine_answers():
        return ("no Docker engine answers here; PSTRAIN_DOCKER_CHECK=1 runs the check anyway "
                "(it installs docker.io on Debian)")
    if os.environ.get("CI"):
        return ("a Docker engine answers, but the check takes many minutes: in CI it runs "
                "with PSTRAIN_DOCKER_CHECK=1 only")
    return None


def _images() -> set[str]:
    docker = shutil.which("docker")
    assert docker is not None
    done = subprocess.run([docker, "image", "ls", "--format", "{{.Repository}}:{{.Tag}}"],
                          capture_output=True, text=True, timeout=60, check=True)
    return set(done.stdout.split())


@pytest.mark.timeout(3600)
def test_the_image_trains_recovers_and_builds_for_cuda(tmp_path: Path) -> None:
    reason = _skip_reason()
    if reason is not None:
        pytest.skip(reason)
    results = tmp_path / "docker-check.json"
    before = _images() if _engine_answers() else set()
    done = subprocess.run(
        ["bash", str(SCRIPT), "--cuda-check", "--results", str(results)],
        capture_output=True, text=True, timeout=3300, check=False, cwd=REPO,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    got = json.loads(results.read_text())

    assert got["build"]["size_bytes"] > 0 and got["build"]["uid"] == 10001
    assert got["build"]["torch"].startswith("2.13.0"), got["build"]
    floor = got["train"]["settings"]["min_auc"]
    for run in ("train", "recovery"):
        workers = got[run]["workers"]
        assert len(workers) == 2, workers
        for result in workers.values():
            assert result["test_auc"] >= floor, (run, result)
            assert result["epochs"] == got["train"]["settings"]["epochs"], result
    recovery = got["recovery"]
    assert recovery["server1_restarts"] == 1, recovery
    assert recovery["rollback_to_clock"] <= recovery["worker_clock_at_kill"], recovery
    assert recovery["auc_gap_to_run_1"] <= got["train"]["settings"]["max_auc_gap"], recovery
    cuda = got["cuda_check"]
    assert cuda["python3.11_dev_installed"] and cuda["python3.11_venv_installed"], cuda
    assert cuda["import"].startswith("2.13.0"), cuda

    # What the script made is gone: its compose projects and its images (where the engine
    # still answers: a daemon the script started, it stops again).
    if not _engine_answers():
        return
    docker = shutil.which("docker")
    assert docker is not None
    left = subprocess.run(
        [docker, "ps", "-a", "--format", '{{.Label "com.docker.compose.project"}}'],
        capture_output=True, text=True, timeout=60, check=True,
    )
    assert not [p for p in left.stdout.split() if p.startswith("pstrain-check-")], left.stdout
    made = {got["build"]["image"]}
    if got["base"]["how"] == "debootstrap":
        made.add(got["base"]["image"])
    assert not (made - before) & _images(), made
