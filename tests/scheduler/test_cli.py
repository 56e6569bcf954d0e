"""The pstrain command line, run as a user runs it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from procs import REPO, Procs, wait_ready

from protos import modes
from ps.__main__ import parser
from scheduler import cli


def _pstrain(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "scheduler.cli", *args], cwd=REPO, capture_output=True, check=False,
        text=True, timeout=60,
    )


def test_help_lists_commands() -> None:
    out = _pstrain("--help")
    assert out.returncode == 0 and "server" in out.stdout


def test_server_help() -> None:
    out = _pstrain("server", "--help")
    assert out.returncode == 0
    for flag in ("--bind", "--shard", "--num-shards"):
        assert flag in out.stdout


def test_unknown_command_names_it() -> None:
    out = _pstrain("serve")
    assert out.returncode == 2 and "invalid choice: 'serve'" in out.stderr


def test_a_server_started_by_hand_listens_on_this_host_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PSTRAIN_BIND", raising=False)
    assert parser().parse_args([]).bind == "127.0.0.1:7000"
    monkeypatch.setenv("PSTRAIN_BIND", "0.0.0.0:7001")
    assert parser().parse_args([]).bind == "0.0.0.0:7001"


def test_bad_server_flags_name_the_value() -> None:
    out = _pstrain("server", "--bind", "localhost")
    assert out.returncode == 2 and "got 'localhost'" in out.stderr
    out = _pstrain("server", "--bind", "127.0.0.1:0", "--shard", "3", "--num-shards", "2")
    assert out.returncode == 2 and "shard must be in [0, 2), got 3" in out.stderr


def test_server_runs_and_stops_on_sigterm(procs: Procs) -> None:
    ready = procs.workdir / "cli.ready"
    proc = procs.spawn(
        [sys.executable, "-m", "scheduler.cli", "server", "--bind", "127.0.0.1:0",
         "--ready-file", str(ready)],
        "cli-server",
    )
    info = wait_ready(proc, ready, 60)
    assert info["pid"] == proc.pid  # the CLI replaced itself with the server
    proc.popen.terminate()
    assert proc.popen.wait(timeout=20) == 0


def test_bad_transport_is_named() -> None:
    for command in (["worker", "--redis", "redis://127.0.0.1:1/0", "--job", "j", "--transport",
                     "rdma", "script.py"], ["up", "--transport", "rdma", "script.py"],
                    ["server", "--bind", "127.0.0.1:0", "--transport", "rdma"]):
        out = _pstrain(*command)
        assert out.returncode == 2, out
        assert "unknown transport 'rdma'" in out.stderr, out.stderr


@pytest.mark.parametrize(
    ("command", "message"),
    [
        (["server", "--bind", "127.0.0.1:0", "--mode", "bsp"],
         f"--mode: unknown consistency mode 'bsp'; choose {modes.CHOICES}"),
        (["server", "--bind", "127.0.0.1:0", "--mode", "ssp:3", "--staleness", "2"],
         "--mode ssp:3 and --staleness 2 disagree; give the bound once"),
        (["up", "--mode", "ssp:x", "script.py"],
         f"argument --mode: unknown consistency mode 'ssp:x'; choose {modes.CHOICES}"),
        (["up", "--mode", "ssp:3", "--staleness", "2", "script.py"],
         "--mode ssp:3 and --staleness 2 disagree; give the bound once"),
        (["scheduler", "--redis", "redis://127.0.0.1:1/0", "--job", "j", "--mode", "bsp"],
         "argument --mode: unknown consistency mode 'bsp'"),
    ],
)
def test_bad_modes_are_named_with_the_choices(command: list[str], message: str) -> None:
    out = _pstrain(*command)
    assert out.returncode == 2 and message in out.stderr, out.stderr


@pytest.mark.parametrize(
    ("flags", "mode", "staleness"),
    [
        ([], "async", 0),
        (["--mode", "sync"], "sync", 0),
        (["--mode", "ssp"], "ssp", 0),
        (["--mode", "ssp", "--staleness", "2"], "ssp", 2),
        (["--mode", "ssp:3"], "ssp", 3),  # the bound kept apart in the job's spec
        (["--mode", "ssp:3", "--staleness", "3"], "ssp", 3),
    ],
)
def test_up_takes_the_mode_grammar_into_the_job_spec(
    flags: list[str], mode: str, staleness: int
) -> None:
    spec = cli._spec("j", cli._parser().parse_args(["up", *flags, "script.py"]))
    assert (spec.mode, spec.staleness) == (mode, staleness)
