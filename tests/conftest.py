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
