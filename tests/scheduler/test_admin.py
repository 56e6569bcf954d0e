"""`pstrain health`: the standard gRPC health service of a real server, as probes use it; and
how `pstrain checkpoint` asks a job's servers for a checkpoint."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Any

import pytest
from procs import REPO, Procs, free_port

from scheduler.admin import SYNC_RETRY_S, clock_to_aim, health, take_checkpoint
from scheduler.spec import JobSpec
from scheduler.store import JobStore


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


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_checkpoint_a_shard_skipped_is_asked_again_at_once_in_sync_and_refused_in_async(
        procs: Procs, tmp_path: Any, mode: str) -> None:
    # A thread in the place of a server's heartbeat thread, on a real Redis: it beats, and
    # skips the first request it reads (as a shard past the clock aimed at, or one that gave
    # up a cut, says in an event), then records the next.
    store = JobStore.connect(procs.redis().address, "skips")
    store.create_job(JobSpec("skips", mode=mode, heartbeat_interval_s=0.05,
                             checkpoint_dir=str(tmp_path)), adopt=False)
    store.event("checkpoint_skipped", "server", 0, checkpoint="older", reason="before")
    asked: list[dict[str, Any]] = []
    stop = threading.Event()

    def server() -> None:
        while not stop.is_set():
            store.beat("server", 0, {"open_clock": 10}, ttl_s=5)
            request = store.checkpoint_request()
            if request is not None and request["id"] not in [a["id"] for a in asked]:
                asked.append(request)
                if len(asked) == 1:
                    store.event("checkpoint_skipped", "server", 0, checkpoint=request["id"],
                                reason="shard 0 was past clock 12 (at 13) when it was asked")
                else:
                    store.record_checkpoint(request["id"], 0, {"clock": request["clock"]})
            time.sleep(0.02)

    beating = threading.Thread(target=server, daemon=True)
    beating.start()
    try:
        started = time.monotonic()
        taken = take_checkpoint(store, wait_s=30)
        took = time.monotonic() - started
    finally:
        stop.set()
        beating.join(5)
    if mode == "sync":
        assert isinstance(taken, tuple), taken
        assert [a["id"] for a in asked] == [asked[0]["id"], taken[0]]
        assert took < SYNC_RETRY_S / 2, took  # not after the retry's wait
    else:
        assert taken == (f"{asked[0]['id']} was not taken: shard 0 was past clock 12 (at 13) "
                         "when it was asked"), taken
        assert len(asked) == 1 and took < SYNC_RETRY_S / 2, took
