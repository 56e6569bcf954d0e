"""The pstrain command line, run as a user runs it."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from procs import REPO, Procs, wait_ready

from protos import modes
from ps.__main__ import build, parser
from ps.errors import InvalidArgumentError
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


@pytest.mark.parametrize("command", [
    ["up", "--no-view"], ["worker", "--redis", "redis://127.0.0.1:1/0", "--job", "j"]])
def test_a_missing_script_is_named_before_anything_starts(command: list[str]) -> None:
    # No Redis answers at that address, and `up` would start one: the refusal comes first.
    out = _pstrain(*command, "examples/no-such-script.py", "--", "--epochs", "1")
    assert out.returncode == 2, out.stderr
    assert (f"pstrain {command[0]}: training script 'examples/no-such-script.py' not found "
            f"(relative to {REPO})") in out.stderr
    assert "pstrain up: job" not in out.stdout


def test_a_metrics_port_in_use_is_named(procs: Procs) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _pstrain("server", "--bind", "127.0.0.1:0", "--metrics-port", str(port))
    assert out.returncode == 2, out.stderr
    assert (f"pstrain server: cannot serve metrics on 127.0.0.1:{port}: Address already in "
            "use; choose another --metrics-port") in out.stderr


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


@pytest.mark.parametrize(("command", "message"), [
    (["up", "--checkpoint-full-every", "0", "script.py"],
     "argument --checkpoint-full-every: must be >= 1 (1: every checkpoint full), got 0"),
    (["up", "--checkpoint-keep", "-1", "script.py"],
     "argument --checkpoint-keep: must be >= 0 (0: keep every checkpoint), got -1"),
    (["scheduler", "--job", "j", "--checkpoint-full-every", "x"],
     "argument --checkpoint-full-every: 'x' is not an integer"),
    (["up", "--checkpoint-write-mb-s", "-5", "script.py"],
     "argument --checkpoint-write-mb-s: must be >= 0.0 (0: no limit), got -5.0"),
    (["up", "--checkpoint-write-mb-s", "fast", "script.py"],
     "argument --checkpoint-write-mb-s: 'fast' is not a number"),
    (["up", "--checkpoint-write-mb-s", "inf", "script.py"],
     "argument --checkpoint-write-mb-s: must be a finite number, got 'inf'"),
])
def test_bad_checkpoint_retention_flags_are_refused_naming_flag_and_value(
        command: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        cli._parser().parse_args(command)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


def test_checkpoint_retention_flags_go_into_the_job_spec() -> None:
    spec = cli._spec("j", cli._parser().parse_args(["up", "script.py"]))
    assert (spec.checkpoint_full_every, spec.checkpoint_keep) == (10, 3)
    spec = cli._spec("j", cli._parser().parse_args([
        "up", "--checkpoint-full-every", "1", "--checkpoint-keep", "0", "script.py"]))
    assert (spec.checkpoint_full_every, spec.checkpoint_keep) == (1, 0)
    assert cli._parser().parse_args(["checkpoint", "--job", "j", "--full"]).full
    assert spec.checkpoint_write_mb_s == 64.0
    paced = cli._spec("j", cli._parser().parse_args(
        ["up", "--checkpoint-write-mb-s", "0", "script.py"]))
    assert paced.checkpoint_write_mb_s == 0.0


def test_a_server_refuses_retention_flags_it_cannot_use(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["--checkpoint-full-every", "0"])
    assert ("argument --checkpoint-full-every: must be >= 1 (1: every checkpoint full), got 0"
            in capsys.readouterr().err)
    with pytest.raises(InvalidArgumentError, match="--checkpoint-keep 2: a standalone server "
                                                   "writes no checkpoints"):
        build(["--bind", "127.0.0.1:0", "--checkpoint-keep", "2"])
