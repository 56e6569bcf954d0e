"""Fixtures shared by every test: real processes, always ended by pid."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from fnmatch import fnmatchcase
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


# The long tier: rehearsals of whole deployments and installs, and variants of a behaviour
# that a test of the default tier already covers (another transport, another corruption,
# another way Redis fails), each a minute or more of processes on 2 cores. They carry the
# `long` mark: `scripts/test.sh` (CI) leaves them out, `scripts/test.sh --long` runs them
# (README: Tests). A pattern is a test id, a file or a folder; `*` matches anything.
LONG = (
    # Builds the wheel and installs it, torch included, into a fresh virtual environment.
    "tests/packaging/test_wheel.py",
    # Killed processes and a cut link in the clusters that the compose file, the bare-metal
    # guide (hosts in network namespaces) and the Kubernetes manifests describe, run as
    # written; their static checks, and a bare-metal job across hosts, run by default.
    "tests/docker/test_compose.py::test_compose_cluster_trains_*",
    "tests/docker/test_bare_metal.py::test_a_worker_whose_link_is_cut_*",
    "tests/deploy/test_kubernetes.py::test_the_manifests_train_*",
    # MovieLens runs beyond the one that pins the main job's result to plain PyTorch's.
    "tests/examples/test_examples.py::test_movielens_export_*",
    "tests/examples/test_examples.py::test_movielens_two_async_workers_*",
    "tests/examples/test_examples.py::test_movielens_device_cpu_*",
    "tests/examples/test_examples.py::test_movielens_after_a_sync_server_kill_*",
    "tests/examples/test_examples.py::test_movielens_async_workers_under_up_*",
    "tests/examples/test_examples.py::test_synthetic_ctr_within_a_row_budget_*",
    # The client's behaviour over UCX: the transports' own tests run UCX in the default tier.
    "tests/worker/test_client.py::*[ucx-*",
    # A second corruption, a second unsigned entry: the first of each runs by default.
    "tests/scheduler/test_scheduler.py::test_a_corrupt_newest_checkpoint_*[truncated]",
    "tests/scheduler/test_scheduler.py::test_a_rollback_skips_checkpoint_entries_*[older*",
    # Redis emptied, stalled, or leaderless around a restart: Redis wiped around a server
    # restart, an outage, and a Redis killed and restarted empty run by default.
    "tests/scheduler/test_scheduler.py::test_sync_job_rides_out_redis_restarted_empty",
    "tests/scheduler/test_scheduler.py::test_sync_job_rides_out_a_redis_stall_*",
    "tests/scheduler/test_scheduler.py::test_a_server_restarted_while_no_scheduler_leads_*",
    # Four runs under one job name (run ids), and a worker run 300 clocks ahead killed and
    # restarted: scenarios of several minutes of processes each.
    "tests/scheduler/test_scheduler.py::test_a_finished_job_s_name_reused_*",
    "tests/scheduler/test_scheduler.py::test_an_async_worker_that_ran_ahead_*",
    # A checkpoint on demand then resumed: the async cut's test resumes from one by default.
    "tests/scheduler/test_launcher.py::test_checkpoint_on_demand_then_resume_from_it",
    # A pause beside a CPU hog, a rollback that catches a finished worker, undone steps of
    # a script that returned without ctx.finish() and of a rollback that falls back.
    "tests/scheduler/test_detector.py::test_under_a_cpu_hog_*",
    "tests/worker/test_context.py::test_a_finished_worker_that_a_rollback_catches_*",
    "tests/worker/test_context.py::test_steps_a_rollback_undoes_*[returned]",
    "tests/worker/test_context.py::test_undone_steps_are_counted_from_the_checkpoint_*",
)


def matches(nodeid: str, pattern: str) -> bool:
    """Whether test id `nodeid` is `pattern`, lies under it (a file or folder), or fits it
    where it has `*` (anything, brackets included)."""
    glob = pattern.replace("[", "[[]")  # a bracket is part of a test id, not a set
    if "*" in pattern:
        return fnmatchcase(nodeid, glob)
    tails = ("*",) if pattern.endswith("/") else ("::*", "[[]*")
    return nodeid == pattern or any(fnmatchcase(nodeid, glob + tail) for tail in tails)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if any(matches(item.nodeid, pattern) for pattern in ALONE):
            item.add_marker(pytest.mark.alone)
        if any(matches(item.nodeid, pattern) for pattern in LONG):
            item.add_marker(pytest.mark.long)


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
