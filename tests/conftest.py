"""Fixtures shared by every test: real processes, always ended by pid."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from procs import Procs

from protos.transport import available

# Every bulk transport the data-plane tests run over: (transport, UCX_TLS or "").
TRANSPORTS = [
    pytest.param(("grpc", ""), id="grpc"),
    pytest.param(("shm", ""), id="shm"),
    pytest.param(("ucx", "tcp"), id="ucx-tcp"),
    # Not "sm": its cma part (process_vm_readv) fails with EFAULT inside UCX on some VMs.
    pytest.param(("ucx", "posix,self"), id="ucx-shm"),
]


# Test files that bound how long something takes or lean on heartbeat deadlines. They carry
# the `alone` mark: scripts/test.sh runs every other test two at a time, then these one at a
# time, so that no neighbour's load pushes them past a bound. A single test elsewhere that
# bounds a duration carries the mark itself.
ALONE = (
    "tests/scheduler/test_detector.py",  # suspect and dead deadlines under pauses and a CPU hog
    "tests/scheduler/test_heartbeat.py",  # beats within a bound through a Redis stall
    "tests/worker/test_context.py",  # a barrier answered within a second
    "tests/worker/test_lane.py",  # linger and timeouts of a fraction of a second
    "tests/ps/test_concurrency.py",  # waits for a thread within bounds
    "tests/ps/test_consistency_processes.py",  # ssp waits and answers within bounds
    "tests/protos/test_ucx.py",  # a transfer cut within a bound
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.split("::")[0] in ALONE:
            item.add_marker(pytest.mark.alone)


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Forces one bulk transport on this test's servers and clients (through the
    environment they inherit); skips, with the reason, where it cannot work."""
    name, tls = request.param
    ok, reason = available(name)
    if not ok:
        pytest.skip(f"transport {name} is not available here: {reason}")
    monkeypatch.setenv("PSTRAIN_TRANSPORT", name)
    if tls:
        monkeypatch.setenv("UCX_TLS", tls)
    return str(name)


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    """Starts processes for one test and ends each of them, by pid, when it finishes."""
    started = Procs(tmp_path)
    try:
        yield started
    finally:
        started.close()


@pytest.fixture(scope="module")
def module_procs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Procs]:
    """Like `procs`, shared by the tests of one module (each uses its own table names)."""
    started = Procs(tmp_path_factory.mktemp("procs"))
    try:
        yield started
    finally:
        started.close()
