"""`pstrain health`: the standard gRPC health service of a real server, as probes use it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from procs import REPO, Procs, free_port

from scheduler.admin import clock_to_aim, health


def pstrain(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "scheduler.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)


def test_health_of_a_serving_server_and_of_nothing(procs: Procs) -> None:
    server = procs.server()
    done = pstrain("health", server.address)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{server.address}: SERVING"
    assert health(server.address, "pstrain.v1.ParameterServer") == "SERVING"
    unknown = pstrain("health", server.address, "--service", "no.such.Service")
    assert unknown.returncode == 1 and "NOT_FOUND" in unknown.stdout
    nobody = f"127.0.0.1:{free_port()}"
    done = pstrain("health", nobody, "--timeout-s", "1")
    assert done.returncode == 1
    assert done.stdout.startswith(f"{nobody}: UNAVAILABLE")
    procs.kill(server)
    assert health(server.address, timeout_s=1).startswith("UNAVAILABLE")


@pytest.mark.parametrize(("args", "message"), [
    (["localhost"], "address must be HOST:PORT with a port in [1, 65535], got 'localhost'"),
    (["127.0.0.1:70000"], "got '127.0.0.1:70000'"),
    ([":7000"], "got ':7000'"),
    (["127.0.0.1:7000", "--timeout-s", "0"], "--timeout-s must be > 0, got 0"),
])
def test_health_refuses_bad_input_naming_it(args: list[str], message: str) -> None:
    done = pstrain("health", *args)
    assert done.returncode == 2
    assert message in done.stderr


@pytest.mark.parametrize(("first", "second", "aim"), [
    (0, 0, 2),  # an idle or new job: two clocks on
    (40, 50, 62),  # ten clocks ran between the looks: ten more, and two
    (60, 40, 42),  # rolled back between the looks: never behind the clock now open
])
def test_a_sync_checkpoint_aims_at_a_clock_still_ahead(first: int, second: int,
                                                       aim: int) -> None:
    assert clock_to_aim(first, second) == aim
