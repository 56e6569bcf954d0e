"""pstrain as users get it: a wheel built from the checkout, installed into a fresh virtual
environment with no editable install and no source tree on the path, runs every command's
help and a real one-server one-worker job with the PyTorch modules."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from scheduler.cli import _parser

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("ps", "worker", "scheduler", "protos")

# A small click model trained through the public API; it reports where its modules came
# from, so the test can tell the wheel's code from the checkout's.
SCRIPT = '''
import json, sys
import torch, torch.nn.functional as F
import ps, protos, scheduler, worker
from worker.modules import PSDense, PSEmbedding
from worker.optimizer import PSOptimizer

ctx = worker.init()
gen = torch.Generator().manual_seed(7)
ids = torch.randint(0, 50, (512,), generator=gen)
labels = (ids % 2).float()

class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = PSEmbedding(ctx.client, "ids", 8, optimizer="adagrad", lr=0.3)
        self.mlp = PSDense(ctx.client, torch.nn.Linear(8, 1), "mlp", optimizer="adam",
                           lr=0.05)

    def forward(self, x):
        return self.mlp(self.emb(x)).squeeze(1)

model = Model()
opt = PSOptimizer(model)
losses = []
for epoch in range(8):
    for start in range(0, len(ids), 64):
        x, y = ids[start:start + 64], labels[start:start + 64]
        loss = F.binary_cross_entropy_with_logits(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
opt.flush()
files = {m.__name__: m.__file__ for m in (ps, protos, scheduler, worker)}
print(json.dumps({"first_loss": losses[0], "last_loss": losses[-1], "files": files}))
ctx.close()
'''


def _copy_sources(target: Path) -> None:
    """The files a source distribution holds: build files, README and the packages."""
    target.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO / name, target / name)
    for package in PACKAGES:
        shutil.copytree(REPO / package, target / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Path]]:
    """(the built wheel, a fresh venv with torch 2.13.0 and that wheel installed)."""
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler here to build ps._index and ps._rows")
    root = tmp_path_factory.mktemp("wheel")
    _copy_sources(root / "src")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(root / "dist"), str(root / "src")],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (root / "dist").glob("pstrain-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q",
           "--disable-pip-version-check"]
    # torch first and pinned, as the README's set-up does: a range left to pip may pick a
    # build with gigabytes of CUDA packages.
    for requirement in (["torch==2.13.0"], [str(wheel)]):
        done = subprocess.run([*pip, *requirement], capture_output=True, text=True,
                              timeout=900, check=False)
        assert done.returncode == 0, done.stdout + done.stderr
    yield wheel, venv


def _clean_env(venv: Path) -> dict[str, str]:
    """This environment less anything that would put the checkout on the path."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def test_the_wheel_holds_every_package_its_extensions_protos_and_type_markers(
    installed: tuple[Path, Path],
) -> None:
    wheel, _ = installed
    names = set(zipfile.ZipFile(wheel).namelist())
    found = sorted(
        path.relative_to(REPO).as_posix()
        for package in PACKAGES for path in (REPO / package).rglob("__init__.py")
        if "__pycache__" not in path.parts
    )
    assert found, "no packages found in the checkout"
    for init in found:
        assert init in names, f"{init} is missing from the wheel"
    for extension in ("_index", "_rows"):
        assert any(re.fullmatch(rf"ps/{extension}\.[\w.-]+\.so", n) for n in names), extension
    for package in PACKAGES:
        assert f"{package}/py.typed" in names, package
    assert {"protos/pstrain_pb2.py", "protos/pstrain_pb2_grpc.py", "protos/pstrain_pb2.pyi",
            "protos/pstrain.proto"} <= names


def test_every_command_answers_help_from_the_installed_wheel(
    installed: tuple[Path, Path], tmp_path: Path,
) -> None:
    _, venv = installed
    commands = next(
        action.choices for action in _parser()._actions if action.dest == "command"
    )
    assert commands, "the CLI has no commands"
    for command in ["", *commands]:
        args = [str(venv / "bin" / "pstrain"), *([command] if command else []), "--help"]
        done = subprocess.run(args, capture_output=True, text=True, timeout=120,
                              cwd=tmp_path, env=_clean_env(venv), check=False)
        assert done.returncode == 0, (command, done.stdout + done.stderr)
        assert "usage:" in done.stdout, (command, done.stdout)


def test_a_real_job_trains_from_the_installed_wheel(
    installed: tuple[Path, Path], tmp_path: Path,
) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (bash scripts/setup.sh does it)")
    _, venv = installed
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [str(venv / "bin" / "pstrain"), "up", "--servers", "1", "--workers", "1", "--mode",
         "sync", "--no-view", str(script)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=_clean_env(venv),
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    # up prints each worker's last JSON line as "worker R: {...}".
    lines = [json.loads(line.split(": ", 1)[1]) for line in done.stdout.splitlines()
             if line.startswith("worker 0: {")]
    assert len(lines) == 1, done.stdout
    result = lines[0]
    site = venv.resolve()
    for module, path in result["files"].items():
        assert Path(path).resolve().is_relative_to(site), f"{module} came from {path}"
    assert result["last_loss"] < 0.5 * result["first_loss"], result
