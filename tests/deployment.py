"""Helpers shared by the deployment tests (tests/docker, tests/deploy): parsing `pstrain ...`
command lines with the real parsers, and reading a worker's result line."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from procs import Proc

from ps.__main__ import parser as server_parser
from scheduler.cli import _parser as cli_parser

REPO = Path(__file__).resolve().parents[1]

ParseCommand = Callable[[list[str]], argparse.Namespace]


def _parse(parser: argparse.ArgumentParser, args: list[str], what: str) -> argparse.Namespace:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            return parser.parse_args(args)
    except SystemExit as exc:
        raise AssertionError(f"{what} {args} is refused by its parser:\n{err.getvalue()}") from exc


def _script_parser(script: str) -> Callable[[list[str]], argparse.Namespace]:
    path = REPO / script
    assert path.is_file(), f"training script {script} does not exist in the repository"
    spec = importlib.util.spec_from_file_location(f"_script_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    parse: Callable[[list[str]], argparse.Namespace] = module.parse_args
    return parse


def parse_pstrain(argv: list[str]) -> argparse.Namespace:
    """Parses `pstrain ARGS...` (argv[0] is the pstrain executable) as the CLI would: the
    server's flags with the server's parser, others with the CLI's, and a worker's script
    arguments with the script's own parser. AssertionError with argparse's message if any of
    them refuses a flag."""
    assert Path(argv[0]).name == "pstrain", argv
    args = argv[1:]
    if args[:1] == ["server"]:
        return _parse(server_parser(), args[1:], "pstrain server")
    parsed = _parse(cli_parser(), args, "pstrain")
    if parsed.command == "worker":
        script_args = parsed.args[1:] if parsed.args[:1] == ["--"] else parsed.args
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                _script_parser(parsed.script)(list(script_args))
        except SystemExit as exc:
            raise AssertionError(
                f"{parsed.script} refuses {script_args}:\n{err.getvalue()}") from exc
    return parsed


def last_json(proc: Proc) -> dict[str, Any]:
    """The last JSON line a process printed (a worker's result)."""
    lines = [line for line in proc.log().splitlines() if line.startswith("{")]
    assert lines, proc.log()
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def executable(name: str, where: str) -> str:
    """The path a container's command runs here: `pstrain` from this interpreter's
    environment, anything else from PATH; fails naming `where` (the pod or service) when
    it is not installed."""
    if name == "pstrain":
        return str(Path(sys.executable).parent / "pstrain")
    found = shutil.which(name)
    assert found is not None, f"{name} ({where}) is not installed"
    return found
