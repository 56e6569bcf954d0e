"""`pstrain up` as a user runs it: a whole job, interruption, restarts."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
import torch
from beats import live_server_pid, server_pid, worker_clock
from procs import REPO, Proc, Procs, free_port, wait_until
from scrape import scrape, value

from protos import rpc
from protos.partition import shard_of_keys
from protos.rpc import Stubs
from ps.checkpoint import ShardState, latest_complete, read_manifest, read_resolved
from ps.coordination import find_checkpoint
from scheduler.errors import CoordinationError
from scheduler.launcher import failing_checkpoints, render_view
from scheduler.spec import JobSpec
from scheduler.store import Event, JobStore

JOB_WORKER = str(REPO / "tests" / "job_worker.py")
sys.path.insert(0, str(REPO / "tests"))

from job_worker import local_sync_run  # noqa: E402


def children_of(pid: int) -> set[int]:
    """Pids whose parent is `pid` (from /proc)."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.add(int(entry))
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state != "Z"


def test_up_runs_a_sync_job_to_the_single_process_result(procs: Procs) -> None:
    out = procs.workdir / "out"
    up = procs.pstrain(["up", "--servers", "2", "--workers", "3", "--mode", "sync",
                        "--no-view", JOB_WORKER, "--", "--steps", "25", "--out", str(out)], "up")
    assert up.popen.wait(timeout=180) == 0, up.log()
    summary = json.loads(up.log().strip().splitlines()[-1])
    assert summary["exit_status"] == 0
    expected = local_sync_run(3, 25)
    for r in range(3):
        result = json.loads((out / f"worker{r}.json").read_text())
        torch.testing.assert_close(torch.tensor(result["w"]), expected, atol=1e-6, rtol=0)


def test_up_turns_on_tls_and_the_job_token_and_guards_its_redis(procs: Procs) -> None:
    out = procs.workdir / "out"
    up = procs.pstrain(["up", "--servers", "2", "--workers", "2", "--mode", "sync",
                        "--log-dir", str(procs.workdir / "logs"), "--no-view", JOB_WORKER,
                        "--", "--steps", "400", "--sleep-ms", "20", "--out", str(out)], "up")
    logs = procs.workdir / "logs"
    wait_until(lambda: all("serving on" in _read(logs / f"server{k}.log") for k in range(2)),
               120, "both servers to serve")
    for k in range(2):
        line = next(x for x in _read(logs / f"server{k}.log").splitlines() if "serving on" in x)
        assert "TLS with client certificates, a job secret" in line
        address = re.search(r"serving on (\S+) ", line).group(1)  # type: ignore[union-attr]
        # A client without the run's certificate cannot even connect.
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as refused:
            Stubs(channel).unary(rpc.GET_SERVER_INFO, b"", 5.0)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    # The private Redis asks for a password, which no command line shows.
    redis_cmd = next(c for pid in children_of(up.pid)
                     if "redis-server" in (c := _cmdline(pid)))
    # redis-server shows itself as "redis-server HOST:PORT".
    port = int(re.search(r"127\.0\.0\.1:(\d+)", redis_cmd).group(1))  # type: ignore[union-attr]
    with pytest.raises(CoordinationError, match=r"refused the credentials|NOAUTH|Authentication"):
        JobStore.connect(f"redis://127.0.0.1:{port}/0", "local", timeout_s=3)
    assert all("redis://:" not in _cmdline(pid) for pid in children_of(up.pid))
    assert up.popen.wait(timeout=240) == 0, up.log()
    expected = local_sync_run(2, 400)
    for r in range(2):
        result = json.loads((out / f"worker{r}.json").read_text())
        torch.testing.assert_close(torch.tensor(result["w"]), expected, atol=1e-6, rtol=0)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def test_interrupted_up_leaves_no_process_behind(procs: Procs) -> None:
    out = procs.workdir / "out"
    up = procs.pstrain(["up", "--servers", "2", "--workers", "2", "--no-view", JOB_WORKER,
                        "--", "--steps", "1000000", "--sleep-ms", "10", "--out", str(out)], "up")
    # redis, scheduler, 2 servers and 2 workers, all started by up
    def all_started() -> set[int] | None:
        found = children_of(up.pid)
        return found if len(found) >= 6 else None

    started = wait_until(all_started, 90, "every process to start")
    time.sleep(1.0)
    os.kill(up.pid, signal.SIGINT)
    time.sleep(0.2)
    os.kill(up.pid, signal.SIGINT)  # a second Ctrl-C while it stops: noted, no traceback
    assert up.popen.wait(timeout=60) == 130
    left = [p for p in started if alive(p)]  # type: ignore[union-attr]
    assert not left, f"still running: {left}"
    assert "Traceback" not in up.log(), up.log()


def test_worker_exit_status_is_returned(procs: Procs) -> None:
    script = procs.workdir / "fails.py"
    script.write_text("import sys\nimport worker\nctx = worker.init()\nsys.exit(3 if ctx.rank "
                      "== 1 else 0)\n")
    up = procs.pstrain(["up", "--workers", "2", "--no-view", str(script)], "up")
    assert up.popen.wait(timeout=120) == 3
    assert "worker1 exited with status 3" in up.log()
    # The log the message points at is still there, and so is the note saying where.
    pointed = re.search(r"last lines of (\S+):", up.log())
    assert pointed is not None, up.log()
    assert Path(pointed.group(1)).is_file()
    kept = re.search(r"the processes' logs are kept in (\S+)", up.log())
    assert kept is not None and Path(pointed.group(1)).parent == Path(kept.group(1))
    shutil.rmtree(Path(kept.group(1)).parent)


def test_a_worker_killed_by_a_signal_is_named_and_up_exits_as_a_shell_would(
    procs: Procs,
) -> None:
    script = procs.workdir / "killed.py"
    script.write_text("import os, signal\nimport worker\nctx = worker.init()\n"
                      "if ctx.rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n")
    up = procs.pstrain(["up", "--workers", "2", "--no-view", str(script)], "up")
    assert up.popen.wait(timeout=120) == 128 + signal.SIGKILL
    assert "worker1 was killed by SIGKILL" in up.log()
    kept = re.search(r"the processes' logs are kept in (\S+)", up.log())
    if kept is not None:
        shutil.rmtree(Path(kept.group(1)).parent)


@pytest.mark.parametrize("log_dir", [True, False], ids=["log-dir", "no-log-dir"])
def test_a_run_that_ends_well_leaves_no_temporary_directory(procs: Procs, log_dir: bool) -> None:
    job = f"tidy{os.getpid()}{int(log_dir)}"
    logs = procs.workdir / "logs"
    up = procs.pstrain(["up", "--job", job, "--no-view",
                        *(["--log-dir", str(logs)] if log_dir else []), JOB_WORKER, "--",
                        "--steps", "3", "--out", str(procs.workdir / "out")], "up")
    assert up.popen.wait(timeout=120) == 0, up.log()
    assert procs.tmp.is_dir() and not list(procs.tmp.glob(f"pstrain-{job}-*"))
    assert (logs / "worker0.log").is_file() == log_dir


def test_up_refuses_a_bad_value_naming_it() -> None:
    done = subprocess.run([sys.executable, "-m", "scheduler.cli", "up", "--workers", "2",
                           "--backups", "2", "--no-view", JOB_WORKER], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 2
    assert "backups must be in [0, workers=2), got 2" in done.stderr


def test_killed_server_restarts_restores_and_the_job_finishes(procs: Procs) -> None:
    redis = procs.redis().address
    out = procs.workdir / "out"
    checkpoints = procs.workdir / "ckpt"
    up = procs.pstrain(["up", "--redis", redis, "--job", "srv", "--servers", "2", "--workers",
                        "2", "--mode", "async", "--restart", "--checkpoint-dir",
                        str(checkpoints), "--checkpoint-every-s", "1", "--no-view", JOB_WORKER,
                        "--", "--steps", "400", "--sleep-ms", "10", "--out", str(out)], "up")
    store = JobStore.connect(redis, "srv")
    wait_until(lambda: worker_clock(store, 0) >= 50, 90, "training to run")
    after = time.time()
    wait_until(lambda: any(e.type == "checkpoint" and e.time_s > after and e.member == "0"
                           for e in store.events()) and store.latest_checkpoint(2), 60,
               "a checkpoint taken mid-training")
    old = live_server_pid(store, 0)
    killed_at = time.time()
    os.kill(old, signal.SIGKILL)
    wait_until(lambda: (p := server_pid(store, 0)) is not None and p != old, 60,
               "the server to come back")
    restored = store.members("server")[0]["restored"]
    assert restored.startswith("time-")  # it restored a checkpoint, not an empty shard
    # Restarted before its heartbeat lapsed, it shows as a new incarnation ("restored");
    # restarted later, as "dead" then "joined".
    wait_until(lambda: any(e.type in ("restored", "dead") and e.role == "server"
                           and e.member == "0" and e.time_s >= killed_at
                           for e in store.events()), 10, "the scheduler to see the restart")
    # The workers went on from their own clocks; the restored shard's clock follows them
    # past where they were when it came back (it does not wait for the iterations it lost).
    ahead = max(worker_clock(store, r) for r in range(2)) + 1
    seen = [0]

    def caught_up() -> bool:
        beat = store.heartbeats("server", [0])[0]
        seen[0] = max(seen[0], int(beat["open_clock"]) if beat else 0)
        return seen[0] >= ahead

    wait_until(caught_up, 30, f"server 0's clock to pass {ahead}")
    assert up.popen.wait(timeout=180) == 0, up.log()
    for r in range(2):
        assert json.loads((out / f"worker{r}.json").read_text())["clock"] == 400


def test_checkpoints_that_fail_to_write_are_reported_when_the_job_ends(procs: Procs) -> None:
    # The job's checkpoint directory becomes a file mid-run: every later write fails, the
    # job trains on, and `up` says so at the end (stderr, and its last JSON line).
    redis = procs.redis().address
    out = procs.workdir / "out"
    checkpoints = procs.workdir / "ckpt"
    port = free_port()
    up = procs.pstrain(["up", "--redis", redis, "--job", "full", "--servers", "1", "--workers",
                        "1", "--mode", "async", "--checkpoint-dir", str(checkpoints),
                        "--checkpoint-every-s", "1", "--metrics-base-port", str(port),
                        "--no-view", JOB_WORKER, "--", "--steps", "800", "--sleep-ms", "10",
                        "--out", str(out)], "up")
    store = JobStore.connect(redis, "full")
    started = time.time()
    written = wait_until(lambda: store.latest_checkpoint(1), 90, "a checkpoint")
    shutil.move(checkpoints / "full", procs.workdir / "moved")
    (checkpoints / "full").write_text("not a directory")
    failed = wait_until(lambda: next((e for e in store.events()
                                      if e.type == "checkpoint_failed"), None), 60,
                        "a checkpoint that fails")
    # Monitoring sees it too: the server's metrics count both.
    text = scrape(port)
    assert value(text, "pstrain_checkpoints_written_total", kind="full") >= 1
    assert value(text, "pstrain_checkpoints_failed_total") >= 1
    assert value(text, "pstrain_checkpoint_bytes_total") > 0
    assert value(text, "pstrain_checkpoint_last_written_timestamp_seconds") >= started - 1
    assert up.popen.wait(timeout=180) == 0, up.log()
    assert json.loads((out / "worker0.json").read_text())["clock"] == 800
    summary = json.loads(up.log().strip().splitlines()[-1])
    assert summary["checkpoints_failed"] >= 1, summary
    assert summary["latest_checkpoint"] is not None, summary
    last = summary["last_checkpoint_error"]
    assert last["shard"] == "0" and "Not a directory" in last["error"], last
    assert failed.detail["checkpoint"] != written[0]  # type: ignore[attr-defined]
    assert (f"pstrain up: {summary['checkpoints_failed']} checkpoint write(s) failed; the "
            f"last, {last['checkpoint']} on server 0: ") in up.log()


def test_sync_server_kill_rolls_back_and_matches_an_uninterrupted_run(procs: Procs) -> None:
    redis = procs.redis().address
    out = procs.workdir / "out"
    steps, dim = 120, 20_000  # 80 KB of weights: split across both shards
    up = procs.pstrain(["up", "--redis", redis, "--job", "roll", "--servers", "2", "--workers",
                        "2", "--mode", "sync", "--restart", "--checkpoint-dir",
                        str(procs.workdir / "ckpt"), "--checkpoint-every-clocks", "20",
                        "--no-view", JOB_WORKER, "--", "--steps", str(steps), "--dim", str(dim),
                        "--sleep-ms", "20", "--out", str(out)], "up")
    store = JobStore.connect(redis, "roll")
    wait_until(lambda: worker_clock(store, 0) >= 25, 120, "training to pass a checkpoint")
    wait_until(lambda: store.latest_checkpoint(2), 120, "a complete checkpoint")
    victim = live_server_pid(store, 0)
    os.kill(victim, signal.SIGKILL)
    rollback = wait_until(
        lambda: next((e for e in store.events() if e.type == "rollback"), None), 90,
        "the rollback")
    assert rollback.detail["checkpoint"].startswith("clock-")  # type: ignore[attr-defined]
    assert up.popen.wait(timeout=240) == 0, up.log()
    expected = local_sync_run(2, steps, dim)
    for r in range(2):
        result = json.loads((out / f"worker{r}.json").read_text())
        torch.testing.assert_close(torch.tensor(result["w"]), expected, atol=1e-6, rtol=0)


def test_checkpoint_on_demand_then_resume_from_it(procs: Procs) -> None:
    redis = procs.redis().address
    ckpt = procs.workdir / "ckpt"
    out = procs.workdir / "out"
    up = procs.pstrain(["up", "--redis", redis, "--job", "again", "--workers", "1", "--mode",
                        "sync", "--checkpoint-dir", str(ckpt), "--no-view", JOB_WORKER, "--",
                        "--steps", "1000000", "--sleep-ms", "5", "--out", str(out)], "up")
    store = JobStore.connect(redis, "again")
    wait_until(lambda: worker_clock(store, 0) >= 20, 90, "training to run")
    # A request for a clock already passed is skipped, and the server says so.
    store.request_checkpoint("passed", 0)
    skipped = wait_until(lambda: next((e for e in store.events() if e.type ==
                                       "checkpoint_skipped"), None), 30, "the skip")
    assert skipped.detail["checkpoint"] == "passed", skipped  # type: ignore[attr-defined]
    assert skipped.detail["reason"].startswith(  # type: ignore[attr-defined]
        "shard 0 was past clock 0 (at "), skipped
    done = subprocess.run([sys.executable, "-m", "scheduler.cli", "checkpoint", "--redis",
                           redis, "--job", "again"], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    made = json.loads(done.stdout)
    clock = int(made["shards"]["0"]["clock"])
    assert clock >= 20
    os.kill(up.pid, signal.SIGINT)
    assert up.popen.wait(timeout=60) == 130
    # A new cluster (its own private Redis) resumes from the newest checkpoint on disk.
    again = procs.pstrain(["up", "--job", "again", "--workers", "1", "--mode", "sync",
                           "--checkpoint-dir", str(ckpt), "--resume", "--no-view", JOB_WORKER,
                           "--", "--steps", str(clock + 10), "--out", str(out)], "up-again")
    assert again.popen.wait(timeout=120) == 0, again.log()
    result = json.loads((out / "worker0.json").read_text())
    assert result["clock"] == clock + 10
    torch.testing.assert_close(torch.tensor(result["w"]), local_sync_run(1, clock + 10),
                               atol=1e-6, rtol=0)


LIFECYCLE_WORKER = str(REPO / "tests" / "lifecycle_worker.py")


def _checkpoint_now(redis: str, job: str) -> str:
    done = subprocess.run([sys.executable, "-m", "scheduler.cli", "checkpoint", "--redis",
                           redis, "--job", job], cwd=REPO, capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    return str(json.loads(done.stdout)["checkpoint"])


def test_an_async_checkpoint_is_one_cut_and_the_resumed_job_trains_each_sample_once(
        procs: Procs) -> None:
    ckpt, out, hold = procs.workdir / "ckpt", procs.workdir / "out", procs.workdir / "go"
    samples, epochs, batch = 1200, 2, 10
    common = ["--job", "cut", "--servers", "2", "--workers", "2", "--mode", "async",
              "--checkpoint-dir", str(ckpt), "--no-view", LIFECYCLE_WORKER, "--",
              "--samples", str(samples), "--epochs", str(epochs), "--batch", str(batch),
              "--out", str(out)]
    redis = procs.redis().address
    up = procs.pstrain(["up", "--redis", redis, *common, "--sleep-ms", "40"], "up")
    store = JobStore.connect(redis, "cut")
    wait_until(lambda: min(worker_clock(store, r) for r in range(2)) >= 10, 90,
               "training to run")
    cut = _checkpoint_now(redis, "cut")  # while both workers train
    wait_until(lambda: min(worker_clock(store, r) for r in range(2)) >= 25, 60,
               "training to go on past the cut")
    os.kill(up.pid, signal.SIGINT)
    assert up.popen.wait(timeout=60) == 130, up.log()
    first_run = {r: (out / f"seen-{r}.jsonl").read_text().splitlines() for r in range(2)}

    taken = _shards(ckpt, "cut", cut)
    positions = taken[0].meta["positions"]
    assert taken[1].meta["positions"] == positions  # every shard cut each worker alike
    assert taken[1].meta["clocks"] == taken[0].meta["clocks"]
    # Resumed under a fresh Redis: the workers wait (pulling) until told to go, so a
    # checkpoint of the restored servers can be taken before any step.
    redis2 = procs.redis().address
    again = procs.pstrain(["up", "--redis", redis2, "--resume", *common, "--hold", str(hold)],
                          "up-again")
    store2 = JobStore.connect(redis2, "cut")
    wait_until(lambda: all(store2.heartbeats("worker", [0, 1]).values()), 90, "the workers")
    restored = _shards(ckpt, "cut", _checkpoint_now(redis2, "cut"))
    for before, after in zip(taken, restored, strict=True):
        assert after.meta["positions"] == positions
        assert [t.name for t in after.tables] == [t.name for t in before.tables]
        for b, a in zip(before.tables, after.tables, strict=True):
            assert sorted(a.tensors) == sorted(b.tensors), b.name
            for name, tensor in b.tensors.items():  # values and optimizer state, bit for bit
                assert a.tensors[name].dtype == tensor.dtype, (b.name, name)
                assert torch.equal(a.tensors[name], tensor), (b.name, name)
    hold.touch()
    assert again.popen.wait(timeout=120) == 0, again.log()

    for r in range(2):
        at = json.loads(positions[str(r)])
        cut_at = (at["epoch"], at["batch"])
        lines = [json.loads(line) for line in (out / f"seen-{r}.jsonl").read_text().splitlines()]
        before_cut = [s for s in lines[: len(first_run[r])] if (s["epoch"], s["batch"]) < cut_at]
        lost = len(first_run[r]) - len(before_cut)
        assert lost > 0  # the first run trained past the cut: that work was void
        share = set(range(r, samples, 2))
        for epoch in range(epochs):
            ids = [i for s in before_cut + lines[len(first_run[r]):] if s["epoch"] == epoch
                   for i in s["ids"]]
            assert len(ids) == len(share) and set(ids) == share, (r, epoch)


def _shards(ckpt: Path, job: str, checkpoint_id: str) -> list[ShardState]:
    """Every shard of a complete checkpoint, read and verified (a delta through its chain)."""
    manifest = read_manifest(ckpt / job / checkpoint_id)
    assert manifest.complete, manifest
    return [read_resolved(f.path, f.sha256) for _, f in sorted(manifest.shards.items())]


def _tensors(state: ShardState, table: str) -> dict[str, torch.Tensor]:
    return next(t for t in state.tables if t.name == table).tensors


def assert_same_rows(old: list[ShardState], new: list[ShardState]) -> None:
    """Every sparse row with its optimizer state and step, by key, and every dense row with
    its optimizer state, by global row, as in `old`; each where the new count puts it."""
    def by_key(states: list[ShardState]) -> dict[int, list[torch.Tensor]]:
        rows: dict[int, list[torch.Tensor]] = {}
        for state in states:
            emb = _tensors(state, "emb")
            assert (shard_of_keys(emb["keys"].numpy(), state.num_shards) == state.shard).all()
            names = ["value", "state.exp_avg", "state.exp_avg_sq", "step"]
            for i, key in enumerate(emb["keys"].tolist()):
                rows[key] = [emb[n][i] for n in names]
        return rows

    before, after = by_key(old), by_key(new)
    assert before.keys() == after.keys() and len(before) > 40
    for key, row in before.items():
        assert all(torch.equal(a, b) for a, b in zip(after[key], row, strict=True)), key
    for table in ("v", "w"):
        for name in _tensors(old[0], table):
            if name in ("step", "written"):
                steps = {int(_tensors(s, table)["step"]) for s in old + new
                         if _tensors(s, table)["value"].numel()}
                assert len(steps) == 1 and steps != {0}, (table, steps)  # sync: alike
                continue
            joined = [torch.cat([_tensors(s, table)[name] for s in states])
                      for states in (old, new)]
            assert torch.equal(*joined), (table, name)


@pytest.mark.timeout(180)
def test_a_job_resumed_on_three_servers_restores_every_row_and_trains_on(procs: Procs) -> None:
    ckpt = procs.workdir / "ckpt"

    def up(servers: int, steps: int, name: str, *flags: str) -> Proc:
        return procs.pstrain([
            "up", "--job", "rescaled", "--servers", str(servers), "--workers", "1", "--mode",
            "sync", "--checkpoint-dir", str(ckpt), "--checkpoint-every-clocks", "10",
            "--no-view", *flags, JOB_WORKER, "--", "--steps", str(steps), "--tables",
            "--sleep-ms", "2", "--out", str(procs.workdir / name)], name)

    # Two servers run to the end, checkpointing every 10 clocks.
    first = up(2, 25, "first")
    assert first.popen.wait(timeout=120) == 0, first.log()[-3000:]
    before = latest_complete(ckpt, "rescaled")
    assert before is not None and before.num_shards == 2
    # Resumed on three (in a Redis that outlives the run, to read what the servers said).
    redis = procs.redis().address
    second = up(3, before.clock + 25, "second", "--redis", redis, "--resume")
    assert second.popen.wait(timeout=120) == 0, second.log()[-3000:]
    written = f"{before.checkpoint_id}.on-3"
    restored = JobStore.connect(redis, "rescaled").members("server")
    assert {k: m["restored"] for k, m in restored.items()} == dict.fromkeys(range(3), written)
    assert all(m["resharded_from"] == {"checkpoint": before.checkpoint_id, "servers": 2}
               for m in restored.values())
    # What the servers restored they wrote at once, as a checkpoint of their own count.
    assert_same_rows(_shards(ckpt, "rescaled", before.checkpoint_id),
                     _shards(ckpt, "rescaled", written))
    # The weights trained on as one uninterrupted run would: the clocks carried over.
    result = json.loads((procs.workdir / "second" / "worker0.json").read_text())
    assert result["clock"] == before.clock + 25
    torch.testing.assert_close(torch.tensor(result["w"]), local_sync_run(1, result["clock"]),
                               atol=1e-6, rtol=0)
    # And back onto two servers: each one's share of the three servers' newest checkpoint
    # (in this process: another job's worth of start-ups would double the test's time).
    three = latest_complete(ckpt, "rescaled")
    assert three is not None and three.num_shards == 3 and three.clock > before.clock
    spec = JobSpec(job="rescaled", servers=2, checkpoint_dir=str(ckpt))
    found = [find_checkpoint(None, spec, k, 2, "rescaled", str(ckpt), from_disk=True)
             for k in range(2)]
    assert all(f is not None and f.resharded_from == 3 for f in found)
    assert_same_rows(_shards(ckpt, "rescaled", three.checkpoint_id),
                     [f.state for f in found if f is not None])


def _event(kind: str, member: str, checkpoint: str, role: str = "server") -> Event:
    return Event("0-1", 0.0, kind, role, member, {"checkpoint": checkpoint, "error": "disk full"})


def test_the_view_shows_each_server_s_checkpoint_failure_until_it_writes_one_again() -> None:
    events = [
        _event("checkpoint_failed", "1", "c1"), _event("checkpoint", "1", "c2"),  # recovered
        _event("checkpoint_failed", "0", "c2"), _event("checkpoint_failed", "0", "c3"),
        _event("checkpoint", "0", "c3", role="worker"),  # not a server's write
    ]
    assert [(e.member, e.detail["checkpoint"]) for e in failing_checkpoints(events)] == [
        ("0", "c3")]
    assert failing_checkpoints(events[:2]) == []


def test_the_live_view_names_a_failing_checkpoint(procs: Procs) -> None:
    store = JobStore.connect(procs.redis().address, "viewed")
    spec = store.create_job(JobSpec("viewed", servers=2, workers=1), adopt=False)
    store.event("checkpoint_failed", "server", 1, checkpoint="time-7", clock=3,
                error="writing /ckpt/x failed: [Errno 28] No space left on device")
    lines = render_view(store, spec, [])
    assert lines[-1] == ("checkpoint time-7 failed on server 1: writing /ckpt/x failed: "
                         "[Errno 28] No space left on device")
    store.event("checkpoint", "server", 1, checkpoint="time-8", clock=4, nbytes=1)
    assert not any("failed on server" in line for line in render_view(store, spec, []))
