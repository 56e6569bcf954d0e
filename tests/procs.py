"""Starting and ending real pstrain processes for tests.

Servers bind port 0 and report their address through a ready file, so tests never race
for ports. Every process started here is ended by its pid when the test ends.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Proc:
    """A started process with its log file."""

    popen: subprocess.Popen[bytes]
    log_path: Path
    address: str = ""
    info: dict[str, object] = field(default_factory=dict)
    ready_file: Path | None = None  # where a server writes its address once it serves
    port: int = 0  # a redis-server's, to start it again on the same port

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""


class Procs:
    """Starts processes and ends them all (by pid) on `close`."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.started: list[Proc] = []
        self._count = 0
        self.tmp = workdir / "tmp"  # the TMPDIR of every process started here

    def spawn(self, args: list[str], name: str, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> Proc:
        """Starts `args` in its own session, in `cwd` (default: the repository root), with
        stdout and stderr in a log file."""
        self._count += 1
        log_path = self.workdir / f"{name}-{self._count}.log"
        # Temporary files (a failed `pstrain up` keeps its logs in one) stay in the test's
        # directory, not in the host's /tmp.
        self.tmp.mkdir(exist_ok=True)
        full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "TMPDIR": str(self.tmp),
                    **(env or {})}
        with open(log_path, "wb") as log:
            popen = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, cwd=cwd or REPO, env=full_env,
                start_new_session=True,
            )
        proc = Proc(popen, log_path)
        self.started.append(proc)
        return proc

    def server(
        self, shard: int = 0, num_shards: int = 1, extra: list[str] | None = None,
        timeout_s: float = 60.0,
    ) -> Proc:
        """Starts `python -m ps` on a free loopback port and waits until it serves."""
        return self._ready(self._start_server(shard, num_shards, extra), timeout_s)

    def servers(self, n: int, extra: list[str] | None = None) -> list[Proc]:
        """Starts the `n` shards of a job at once (their start-ups overlap), then waits for
        each to serve."""
        return [self._ready(p, 60.0) for p in
                [self._start_server(k, n, extra) for k in range(n)]]

    def _start_server(self, shard: int, num_shards: int, extra: list[str] | None) -> Proc:
        ready = self.workdir / f"server-{shard}-{self._count + 1}.ready"
        proc = self.spawn(
            [sys.executable, "-m", "ps", "--bind", "127.0.0.1:0", "--shard", str(shard),
             "--num-shards", str(num_shards), "--ready-file", str(ready), *(extra or [])],
            f"server{shard}",
        )
        proc.ready_file = ready
        return proc

    @staticmethod
    def _ready(proc: Proc, timeout_s: float) -> Proc:
        assert proc.ready_file is not None
        proc.info = wait_ready(proc, proc.ready_file, timeout_s)
        proc.address = str(proc.info["address"])
        return proc

    def redis(self, port: int = 0, password: str = "") -> Proc:
        """Starts a private redis-server on a free loopback port; its URL is `.address`."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (bash scripts/setup.sh does it)")
        for _ in range(5):
            chosen = port or free_port()
            args = [binary, "--port", str(chosen), "--bind", "127.0.0.1", "--save", "",
                    "--appendonly", "no", "--dir", str(self.workdir)]
            if password:
                args += ["--requirepass", password]
            proc = self.spawn(args, "redis")
            auth = f":{password}@" if password else ""
            proc.address = f"redis://{auth}127.0.0.1:{chosen}/0"
            proc.port = chosen
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and proc.popen.poll() is None:
                with socket.socket() as s:
                    if s.connect_ex(("127.0.0.1", chosen)) == 0:
                        return proc
                time.sleep(0.05)
            self.kill(proc)
        raise RuntimeError("could not start redis-server")

    def pstrain(self, args: list[str], name: str, env: dict[str, str] | None = None) -> Proc:
        """Starts `pstrain ARGS` (the CLI, through the entry point the script runs) as a
        process."""
        return self.spawn([sys.executable, "-m", "scheduler.entry", *args], name, env)

    def kill(self, proc: Proc, sig: int = signal.SIGKILL) -> None:
        """Sends `sig` to the process by pid and reaps it."""
        if proc.popen.poll() is None:
            os.kill(proc.pid, sig)
        try:
            proc.popen.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.popen.wait(timeout=10)

    def close(self) -> None:
        for proc in reversed(self.started):
            if proc.popen.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.started:
            try:
                proc.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.popen.wait(timeout=10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: Callable[[], object], timeout_s: float, what: str) -> object:
    """Polls `predicate` until it returns something truthy; TimeoutError naming `what`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")


def run_in_threads(target: Callable[[int], None], count: int, timeout_s: float = 60.0) -> None:
    """Runs target(0) .. target(count - 1) on as many threads at once and joins them; fails
    the test with the errors they raised, or when one is still running after `timeout_s`."""
    errors: list[BaseException] = []

    def run(k: int) -> None:
        try:
            target(k)
        except BaseException as exc:  # handed to the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads)


def wait_ready(proc: Proc, ready: Path, timeout_s: float) -> dict[str, object]:
    """Waits for a ready file; fails with the process's log if it exits first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready.exists():
            info: dict[str, object] = json.loads(ready.read_text())
            return info
        if proc.popen.poll() is not None:
            raise RuntimeError(
                f"process {proc.pid} exited with {proc.popen.returncode}:\n{proc.log()}"
            )
        time.sleep(0.02)
    raise TimeoutError(f"process {proc.pid} not ready after {timeout_s} s:\n{proc.log()}")
