"""The layout rules of DESIGN.md, checked on the source: `ps` and `worker` never import each
other, no transport is named outside `protos/transport/`, and the environment is read only
at entry points."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("ps", "worker", "scheduler", "protos")

# Where the environment may be read: the command lines and `worker.init()` (entry points),
# the launchers that hand it on to the processes they start, and the UCX module, which sets
# a variable for the UCX library when it first loads it.
ENVIRONMENT_READERS = {
    "ps/__main__.py", "scheduler/cli.py", "worker/context.py", "worker/training.py",
    "scheduler/launcher.py", "scheduler/runner.py", "protos/transport/ucx.py",
}
TRANSPORT_NAMES = re.compile(r"\b(shm|ucx|ucxx)\b", re.IGNORECASE)


def sources(*packages: str) -> list[Path]:
    return sorted(p for pkg in packages for p in (REPO / pkg).rglob("*.py")
                  if not p.name.endswith(("_pb2.py", "_pb2_grpc.py")))


def imported(path: Path) -> set[str]:
    """Top-level packages `path` imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


def environment_reads(path: Path) -> list[int]:
    """Lines of `path` that touch os.environ or call os.getenv."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id == "os" and node.attr in ("environ", "getenv", "environb")):
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize(("package", "other"), [("ps", "worker"), ("worker", "ps")])
def test_ps_and_worker_never_import_each_other(package: str, other: str) -> None:
    offenders = [str(p.relative_to(REPO)) for p in sources(package) if other in imported(p)]
    assert offenders == [], f"{package} imports {other} in {offenders}"


def test_no_transport_is_named_outside_protos_transport() -> None:
    found = [
        f"{p.relative_to(REPO)}:{n}: {line.strip()}"
        for p in sources("ps", "worker", "scheduler", "protos")
        if "transport" not in p.relative_to(REPO).parts
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if TRANSPORT_NAMES.search(line)
    ]
    assert found == [], "transport names outside protos/transport/:\n" + "\n".join(found)


def test_the_environment_is_read_only_at_entry_points() -> None:
    found = [
        f"{rel}:{line}"
        for p in sources(*PACKAGES)
        if (rel := str(p.relative_to(REPO))) not in ENVIRONMENT_READERS
        for line in environment_reads(p)
    ]
    assert found == [], "os.environ read below the entry points: " + ", ".join(found)


def test_the_checks_see_what_they_look_for(tmp_path: Path) -> None:
    """The scanners find an import, a transport name and an environment read."""
    probe = tmp_path / "probe.py"
    probe.write_text("import os\nfrom worker.client import PSClient\nX = os.environ['A']\n"
                     "# over shm\n")
    assert "worker" in imported(probe)
    assert environment_reads(probe) == [3]
    assert TRANSPORT_NAMES.search(probe.read_text().splitlines()[3])
