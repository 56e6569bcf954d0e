"""Bare metal: one role per machine, as the README's section shows, on hosts made of network
namespaces; and the README's and the systemd unit's command lines against the real parsers.

The hosts are network namespaces joined by veth pairs to a bridge in a namespace of their
own, each with its own address and no route anywhere else, so nothing leaves them:

    A 10.47.0.10   redis-server (with a password) and the scheduler
    B 10.47.0.11   servers 0 and 1 (ports 7000 and 7001)
    C0 10.47.0.12  a worker          C1 10.47.0.13  a worker

The test reads the job's Redis through a unix socket, which no network namespace hides.
Creating namespaces needs root (CAP_NET_ADMIN) and `ip`; where the test may not, it skips.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from procs import Proc, Procs, wait_until

from scheduler.store import JobStore

REPO = Path(__file__).resolve().parents[2]
JOB_WORKER = str(REPO / "tests" / "job_worker.py")
PSTRAIN = str(Path(sys.executable).parent / "pstrain")
PASSWORD = "change-me"
ADDRESSES = {"a": "10.47.0.10", "b": "10.47.0.11", "c0": "10.47.0.12", "c1": "10.47.0.13"}

ParseCommand = Callable[[list[str]], argparse.Namespace]

sys.path.insert(0, str(REPO / "tests"))
from job_worker import local_sync_run  # noqa: E402


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30,
                          check=False)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


@dataclass
class Hosts:
    """The namespaces of one test module, and the hub-side end of each host's link."""

    hub: str
    namespaces: dict[str, str]
    links: dict[str, str]

    def run(self, procs: Procs, host: str, args: list[str], name: str) -> Proc:
        """Starts `args` on `host`, under the host's own hostname (so the data plane sees
        separate machines, never one host sharing memory); `ip netns exec`, `unshare` and
        the shell all exec, so the pid is the command's."""
        return procs.spawn(
            ["ip", "netns", "exec", self.namespaces[host], "unshare", "--uts", "sh", "-c",
             'hostname "$0" && exec "$@"', f"pstrain-{host}", *args],
            name,
        )

    def cut(self, host: str) -> None:
        ip("-n", self.hub, "link", "set", self.links[host], "down")


def _create(tag: str, made: list[str]) -> Hosts:
    hub = f"pstrain{tag}-hub"
    ip("netns", "add", hub)
    made.append(hub)
    ip("-n", hub, "link", "add", "br0", "type", "bridge")
    ip("-n", hub, "link", "set", "br0", "up")
    namespaces, links = {}, {}
    for i, (host, address) in enumerate(ADDRESSES.items()):
        ns = f"pstrain{tag}-{host}"
        ip("netns", "add", ns)
        made.append(ns)
        inner, outer = f"pv{tag}{i}h", f"pv{tag}{i}b"
        # Created inside the host's namespace, so a failure below leaves nothing in the root.
        ip("-n", ns, "link", "add", inner, "type", "veth", "peer", "name", outer, "netns", hub)
        ip("-n", hub, "link", "set", outer, "master", "br0", "up")
        ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", ns, "addr", "add", f"{address}/24", "dev", inner)
        ip("-n", ns, "link", "set", inner, "up")
        namespaces[host], links[host] = ns, outer
    return Hosts(hub, namespaces, links)


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    """Four hosts on one bridge. Skips where namespaces cannot be made; deletes every
    namespace it made (and with them their veth pairs and the bridge), even on failure."""
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CAP_NET_ADMIN); this runs as uid "
                    f"{os.geteuid()}")
    try:
        probe = ip("netns", "list", check=False)
    except FileNotFoundError:
        pytest.skip("the `ip` command (iproute2) is not installed")
    if probe.returncode != 0:
        pytest.skip(f"`ip netns` does not work here: {probe.stderr.strip()}")
    tag = str(os.getpid() % 100000)
    made: list[str] = []
    try:
        try:
            topology = _create(tag, made)
        except RuntimeError as exc:
            if "Operation not permitted" in str(exc) or "Permission denied" in str(exc):
                pytest.skip(f"this test may not create network namespaces here: {exc}")
            raise
        yield topology
    finally:
        for ns in reversed(made):
            ip("netns", "del", ns, check=False)
        left = ip("netns", "list", check=False).stdout
        assert not any(ns in left for ns in made), left


@dataclass
class Job:
    name: str
    redis_url: str  # as the hosts reach it
    store: JobStore  # through the unix socket
    servers: list[Proc]


def start_job(hosts: Hosts, procs: Procs, name: str) -> Job:
    """Redis and the scheduler on A, two servers on B: the README's commands."""
    socket_path = procs.workdir / "redis.sock"
    a = ADDRESSES["a"]
    hosts.run(procs, "a", [
        "redis-server", "--bind", a, "--port", "6379", "--requirepass", PASSWORD,
        "--protected-mode", "no", "--save", "", "--appendonly", "no",
        "--unixsocket", str(socket_path), "--unixsocketperm", "700", "--dir", str(procs.workdir),
    ], "redis")
    wait_until(socket_path.exists, 10, "redis-server's socket")
    store = JobStore.connect(f"unix://{socket_path}?db=0&password={PASSWORD}", name)
    url = f"redis://:{PASSWORD}@{a}:6379/0"
    hosts.run(procs, "a", [PSTRAIN, "scheduler", "--redis", url, "--job", name, "--mode", "sync",
                           "--servers", "2", "--workers", "2"], "scheduler")
    wait_until(store.leader, 30, "the scheduler to lead")
    b = ADDRESSES["b"]
    servers = [hosts.run(procs, "b", [
        PSTRAIN, "server", "--redis", url, "--job", name, "--shard", str(k),
        "--bind", f"0.0.0.0:{7000 + k}", "--advertise", f"{b}:{7000 + k}",
    ], f"server{k}") for k in range(2)]
    wait_until(lambda: all(store.heartbeats("server", [0, 1]).values()), 60, "both servers")
    return Job(name, url, store, servers)


def start_worker(hosts: Hosts, procs: Procs, job: Job, host: str, steps: int) -> Proc:
    return hosts.run(procs, host, [
        PSTRAIN, "worker", "--redis", job.redis_url, "--job", job.name, JOB_WORKER,
        "--steps", str(steps), "--out", str(procs.workdir / "out"), "--sleep-ms", "10",
    ], f"worker-{host}")


def claimant(store: JobStore, pid: int) -> int | None:
    return next((int(e.member) for e in store.events()
                 if e.type == "claimed" and e.detail.get("pid") == pid), None)


def test_roles_on_separate_hosts_train_to_the_single_process_result(
    hosts: Hosts, procs: Procs,
) -> None:
    job = start_job(hosts, procs, "hosts")
    # The servers advertise B's address, and B's ports answer health probes from C0.
    addresses = sorted(m["address"] for m in job.store.members("server").values())
    assert addresses == ["10.47.0.11:7000", "10.47.0.11:7001"]
    probe = subprocess.run(["ip", "netns", "exec", hosts.namespaces["c0"], PSTRAIN, "health",
                            addresses[1]], capture_output=True, text=True, timeout=60,
                           check=False)
    assert probe.returncode == 0 and "SERVING" in probe.stdout, probe.stdout + probe.stderr
    steps = 60
    workers = [start_worker(hosts, procs, job, host, steps) for host in ("c0", "c1")]
    for proc in workers:
        assert proc.popen.wait(timeout=120) == 0, proc.log()
    assert job.store.finished_ranks() == {0, 1}
    finals = [json.loads((procs.workdir / "out" / f"worker{r}.json").read_text())
              for r in range(2)]
    assert [f["clock"] for f in finals] == [steps, steps]
    expected = local_sync_run(2, steps)
    for final in finals:
        assert torch.allclose(torch.tensor(final["w"]), expected, atol=1e-5), final
    # Separate hosts share no memory: every worker's bulk data crossed the network (gRPC).
    for server in job.servers:
        log = server.log()
        assert log.count("uses transport grpc") >= 2 and "uses transport shm" not in log, log


def test_a_worker_whose_link_is_cut_is_declared_dead_and_the_job_carries_on(
    hosts: Hosts, procs: Procs,
) -> None:
    job = start_job(hosts, procs, "cut")
    store = job.store
    steps = 500
    workers = {host: start_worker(hosts, procs, job, host, steps) for host in ("c0", "c1")}

    def open_clock() -> int:
        beat = store.heartbeats("server", [0])[0]
        return int(beat["open_clock"]) if beat else -1

    wait_until(lambda: open_clock() >= 20, 90, "training on both workers")
    ranks = {host: claimant(store, proc.pid) for host, proc in workers.items()}
    assert sorted(r for r in ranks.values() if r is not None) == [0, 1], ranks
    cut_at = time.time()
    hosts.cut("c1")

    def events(kind: str) -> list[Any]:
        return [e for e in store.events()
                if e.type == kind and e.member == str(ranks["c1"]) and e.time_s > cut_at]

    # A host cut off closes no connection, so it cannot be told from a paused process: its
    # worker is suspect once its heartbeat lapses, and dead after the suspect timeout
    # (--suspect-timeout-s, 10 s by default; README, Failure and recovery).
    suspected = wait_until(lambda: events("suspect"), 10, "C1's worker to be suspect")
    assert suspected[0].time_s - cut_at < 5.0  # type: ignore[index]
    dead = wait_until(lambda: events("dead"), 30, "the scheduler to declare C1's worker dead")
    declared_at = dead[0].time_s  # type: ignore[index]
    assert declared_at - cut_at < 1.5 + 10.0 + 3.0  # the heartbeat's life, the timeout, polls
    clock = open_clock()
    wait_until(lambda: open_clock() >= clock + 20, 30, "clocks to close without C1's worker")
    survivor = workers["c0"]
    assert survivor.popen.wait(timeout=120) == 0, survivor.log()
    final = json.loads((procs.workdir / "out" / f"worker{ranks['c0']}.json").read_text())
    assert final["clock"] == steps
    assert store.finished_ranks() == {ranks["c0"]}
    # The cut-off worker is stuck, not crashed; the test ends it (by pid) like every other.
    assert workers["c1"].popen.poll() is None
    procs.kill(workers["c1"], signal.SIGTERM)


# ---- the README's and the unit's command lines -----------------------------------------------


def readme_section(title: str) -> str:
    """The README's `### title` section, up to the next heading of level 2 or 3."""
    text = (REPO / "README.md").read_text()
    start = text.index(f"\n### {title}\n") + 1
    following = re.search(r"^#{2,3} ", text[start + 4:], flags=re.M)
    return text[start:] if following is None else text[start:start + 4 + following.start()]


def command_lines(block: str) -> list[list[str]]:
    """The `pstrain ...` commands of a text's bash code blocks: continuations joined, comments
    dropped, and lines split at `&`, `&&`, `||` and `;`."""
    out = []
    for code in re.findall(r"```bash\n(.*?)```", block, flags=re.S):
        for line in code.replace("\\\n", " ").splitlines():
            segment: list[str] = []
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            for word in [*lexer, ";"]:
                if word in ("&", "&&", "||", ";"):
                    if segment and Path(segment[0]).name == "pstrain":
                        out.append(segment)
                    segment = []
                else:
                    segment.append(word)
    return out


def test_every_bare_metal_command_in_the_readme_is_accepted(parse_command: ParseCommand) -> None:
    commands = command_lines(readme_section("Bare metal"))
    roles = {(c[1] if c[1] == "server" else parse_command(c).command) for c in commands}
    for command in commands:
        if command[1] == "server":
            parse_command(command)
    assert {"scheduler", "server", "worker", "health"} <= roles, commands
    servers = [c for c in commands if c[1] == "server"]
    assert servers and all("--bind" in c and "--advertise" in c for c in servers)


def test_the_systemd_unit_runs_a_server_from_its_environment_file(
    parse_command: ParseCommand, monkeypatch: pytest.MonkeyPatch,
) -> None:
    unit = (REPO / "docker" / "systemd" / "pstrain-server@.service").read_text()
    exec_start = re.search(r"^ExecStart=(.+)$", unit, flags=re.M)
    assert exec_start is not None
    command = shlex.split(exec_start.group(1))
    assert Path(command[0]).name == "pstrain" and command[1] == "server"
    settings = dict(re.findall(r"^#\s+(PSTRAIN_[A-Z_]+)=(\S+)$", unit, flags=re.M))
    assert {"PSTRAIN_REDIS", "PSTRAIN_JOB", "PSTRAIN_SHARD", "PSTRAIN_BIND",
            "PSTRAIN_ADVERTISE"} <= set(settings)
    for name, value in settings.items():  # the server's parser takes its defaults from them
        monkeypatch.setenv(name, value)
    parsed = parse_command(command)
    assert (parsed.shard, parsed.bind, parsed.advertise) == (
        int(settings["PSTRAIN_SHARD"]), settings["PSTRAIN_BIND"], settings["PSTRAIN_ADVERTISE"])
    assert parsed.redis == settings["PSTRAIN_REDIS"] and parsed.job == settings["PSTRAIN_JOB"]
    assert re.search(r"^Restart=on-failure$", unit, flags=re.M)
    # The README shows the unit: every setting it shows is the file's.
    shown = re.findall(r"```ini\n(.*?)```", readme_section("Bare metal"), flags=re.S)
    assert shown, "the README's bare-metal section shows no unit"
    lines = {line.strip() for line in unit.splitlines()}
    for line in shown[0].splitlines():
        assert not line.strip() or line.strip() in lines, line
