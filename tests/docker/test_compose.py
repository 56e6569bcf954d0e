"""docker/docker-compose.yml without a Docker engine: its commands run as local processes.

Each service (each replica of a scaled one) gets its own loopback address 127.A.B.N, so the
compose file's fixed ports are reused as they are. In a service's command and environment,
0.0.0.0, 127.0.0.1 and localhost become its own address, other services' names their
addresses, and named volumes directories of the test. Metrics ports are the exception: a
metrics endpoint listens on every interface, so each process gets a free port instead.
Restart policies, health checks and start-up conditions are followed as Docker would.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import yaml
from beats import live_beats
from deployment import executable, last_json
from procs import Proc, Procs, free_port, wait_until

from protos import rpc
from protos.rpc import Stubs
from scheduler.store import JobStore

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker" / "docker-compose.yml"
PROMETHEUS = REPO / "docker" / "prometheus.yml"

_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_]\w*)(?:(?P<op>:?-)(?P<default>[^}]*))?\}"
    r"|(?P<bare>[A-Za-z_]\w*))"
)


def interpolate(value: Any, env: dict[str, str], used: set[str]) -> Any:
    """Compose's variable interpolation ($$, $VAR, ${VAR}, ${VAR:-default}, ${VAR-default})
    over every string of a parsed compose file. A variable without a default that `env`
    lacks fails the test: the file must run with no environment at all."""
    if isinstance(value, dict):
        return {k: interpolate(v, env, used) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env, used) for v in value]
    if not isinstance(value, str):
        return value

    def substitute(m: re.Match[str]) -> str:
        if m["escaped"]:
            return "$"
        name = m["braced"] or m["bare"]
        used.add(name)
        got = env.get(name)
        if m["op"] == ":-" and not got:
            return str(m["default"])
        if m["op"] == "-" and got is None:
            return str(m["default"])
        assert got is not None, f"${{{name}}} has no default in the compose file"
        return got

    return _VARIABLE.sub(substitute, value)


def load_compose(env: dict[str, str] | None = None) -> dict[str, Any]:
    used: set[str] = set()
    loaded: dict[str, Any] = interpolate(yaml.safe_load(COMPOSE.read_text()), env or {}, used)
    loaded["x-variables"] = sorted(used)
    return loaded


def command_of(service: dict[str, Any]) -> list[str]:
    command = service.get("command", [])
    return [str(c) for c in command] if isinstance(command, list) else command.split()


def pstrain_commands(compose: dict[str, Any]) -> dict[str, list[str]]:
    """Every `pstrain` command line of the file (services and health checks), by where."""
    found = {}
    for name, service in compose["services"].items():
        command = command_of(service)
        if command[:1] == ["pstrain"]:
            found[f"{name}.command"] = command
        test = service.get("healthcheck", {}).get("test", [])
        if test[:2] == ["CMD", "pstrain"]:
            found[f"{name}.healthcheck"] = [str(t) for t in test[1:]]
    return found


def flag_value(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


# ---- the file itself -------------------------------------------------------------------------


def test_every_flag_the_compose_file_uses_is_accepted(parse_command: Any) -> None:
    commands = pstrain_commands(load_compose())
    roles = {}
    for where, command in commands.items():
        roles[where] = parse_command(command).command if command[1] != "server" else "server"
    assert sorted(set(roles.values())) == ["certs", "health", "scheduler", "server",
                                           "worker"], roles
    # The servers' health checks probe the port they bind, and nobody is given a rank.
    compose = load_compose()
    for name in ("server0", "server1"):
        bind = flag_value(command_of(compose["services"][name]), "--bind")
        probe = compose["services"][name]["healthcheck"]["test"][-1]
        assert bind is not None and bind.rsplit(":", 1)[1] == probe.rsplit(":", 1)[1]
    assert "--rank" not in command_of(compose["services"]["worker"])


def test_sizes_come_from_the_environment_with_defaults() -> None:
    default = load_compose()
    assert {"PSTRAIN_WORKERS", "PSTRAIN_EPOCHS", "PSTRAIN_MAX_SAMPLES"} <= set(
        default["x-variables"])
    reduced = load_compose({"PSTRAIN_WORKERS": "3", "PSTRAIN_EPOCHS": "1"})
    worker = reduced["services"]["worker"]
    assert worker["deploy"]["replicas"] == "3"
    assert flag_value(command_of(worker), "--epochs") == "1"
    assert flag_value(command_of(reduced["services"]["scheduler"]), "--workers") == "3"
    assert flag_value(command_of(default["services"]["scheduler"]), "--workers") == \
        default["services"]["worker"]["deploy"]["replicas"]


def test_restart_policies_health_checks_and_the_volume() -> None:
    services = load_compose()["services"]
    assert services["worker"]["restart"] == "on-failure"  # a finished worker stays finished
    for name in ("redis", "scheduler", "server0", "server1"):
        assert services[name]["restart"] in ("always", "unless-stopped"), name
    for name in ("redis", "server0", "server1"):
        assert services[name]["healthcheck"]["test"][0] == "CMD", name
    checkpoint_dir = flag_value(command_of(services["scheduler"]), "--checkpoint-dir")
    for name in ("server0", "server1"):
        assert f"checkpoints:{checkpoint_dir}" in services[name]["volumes"]
    assert "checkpoints" in load_compose()["volumes"]
    assert services["prometheus"]["profiles"] == ["metrics"]


def test_redis_requires_the_password_every_role_is_given() -> None:
    for env, password in (({}, None), ({"PSTRAIN_REDIS_PASSWORD": "s3cret-2"}, "s3cret-2")):
        services = load_compose(env)["services"]
        service = services["redis"]
        command = command_of(service)
        assert "--protected-mode" not in command
        required = flag_value(command, "--requirepass")
        assert required, command
        assert password is None or required == password
        # The health check authenticates (REDISCLI_AUTH) and fails on a refused command (-e):
        # without -e, redis-cli exits 0 on a NOAUTH reply.
        assert service["environment"]["REDISCLI_AUTH"] == required
        assert "-e" in service["healthcheck"]["test"]
        roles = [n for n, s in services.items() if command_of(s)[:1] == ["pstrain"]]
        assert sorted(roles) == ["certs", "scheduler", "server0", "server1", "worker"], roles
        for name in roles:
            url = services[name]["environment"]["PSTRAIN_REDIS"]
            assert url == f"redis://:{required}@redis:6379/0", (name, url)


def test_every_role_is_given_its_own_certificate_made_for_the_hosts_it_is_dialled_at() -> None:
    services = load_compose()["services"]
    certs = command_of(services["certs"])
    out = flag_value(certs, "--out")
    assert "--keep" in certs and services["certs"]["restart"] == "no"
    hosts = {certs[i + 1] for i, arg in enumerate(certs) if arg == "--host"}
    role_of = {"scheduler": "admin", "server0": "server", "server1": "server", "worker": "worker"}
    for name, role in role_of.items():
        service = services[name]
        env = service["environment"]
        assert env["PSTRAIN_TLS_CERT"] == f"{out}/{role}.pem", name
        assert env["PSTRAIN_TLS_KEY"] == f"{out}/{role}.key", name
        assert env["PSTRAIN_TLS_CA"] == f"{out}/ca.pem", name
        assert env["PSTRAIN_SECRET_FILE"] == f"{out}/secret", name
        assert f"certs:{out}:ro" in service["volumes"], name
        if role == "server":
            advertised = flag_value(command_of(service), "--advertise") or ""
            probe = service["healthcheck"]["test"][-1]
            assert {advertised.rsplit(":", 1)[0], probe.rsplit(":", 1)[0]} <= hosts, name
    # Every role waits for the certificates (workers through the servers' health).
    for name in ("scheduler", "server0", "server1"):
        assert services[name]["depends_on"]["certs"] == {
            "condition": "service_completed_successfully"}, name


def test_prometheus_scrapes_every_metrics_port() -> None:
    services = load_compose()["services"]
    exported = {(name, flag_value(command_of(s), "--metrics-port")) for name, s in services.items()
                if flag_value(command_of(s), "--metrics-port")}
    assert {name for name, _ in exported} == {"server0", "server1", "worker"}
    config = yaml.safe_load(PROMETHEUS.read_text())
    scraped = set()
    for job in config["scrape_configs"]:
        for static in job.get("static_configs", []):
            scraped |= {tuple(t.rsplit(":", 1)) for t in static["targets"]}
        for dns in job.get("dns_sd_configs", []):
            scraped |= {(n, str(dns["port"])) for n in dns["names"]}
    assert scraped == exported
    mounts = services["prometheus"]["volumes"]
    assert any(m.startswith("./prometheus.yml:") for m in mounts)  # beside the compose file


def _compose_cli() -> list[str] | None:
    """Compose v2 (the plugin, or a standalone v2 binary); v1 lacks `config --format`."""
    for cli in (["docker", "compose"], ["docker-compose"]):
        if shutil.which(cli[0]) is None:
            continue
        done = subprocess.run([*cli, "version", "--short"], capture_output=True, text=True,
                              timeout=30, check=False)
        if done.returncode == 0 and int(done.stdout.strip().lstrip("v").split(".")[0]) >= 2:
            return cli
    return None


def test_docker_compose_config_agrees_where_compose_is_installed() -> None:
    cli = _compose_cli()
    if cli is None:
        pytest.skip("Docker Compose v2 is not installed here (the Docker client has no compose "
                    "plugin and there is no docker-compose v2)")
    env = {**os.environ, "PSTRAIN_WORKERS": "3", "PSTRAIN_EPOCHS": "1"}
    done = subprocess.run([*cli, "-f", str(COMPOSE), "config", "--format", "json"],
                          capture_output=True, text=True, timeout=60, check=False, env=env,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr
    config = json.loads(done.stdout)
    ours = load_compose({"PSTRAIN_WORKERS": "3", "PSTRAIN_EPOCHS": "1"})
    for name in ("scheduler", "server0", "server1", "worker"):
        assert config["services"][name]["command"] == command_of(ours["services"][name])
    assert int(config["services"]["worker"]["deploy"]["replicas"]) == 3


# ---- running it ------------------------------------------------------------------------------


@dataclass
class Replica:
    service: str
    name: str
    address: str
    proc: Proc | None = None
    restarts: int = 0
    exit_codes: list[int] = field(default_factory=list)
    metrics_port: int = 0


class LocalCompose:
    """The compose file's services as local processes on loopback addresses."""

    def __init__(self, compose: dict[str, Any], procs: Procs) -> None:
        self.compose = compose
        self.procs = procs
        self.services = {name: s for name, s in compose["services"].items()
                         if not s.get("profiles")}
        # 127.A.B.0/24, A and B from the pid so that concurrent runs do not collide.
        base = f"127.{os.getpid() % 200 + 20}.{os.getpid() // 200 % 250 + 1}"
        self.replicas: dict[str, list[Replica]] = {}
        n = 2
        for name in sorted(self.services):
            count = int(self.services[name].get("deploy", {}).get("replicas", 1))
            self.replicas[name] = []
            for i in range(count):
                self.replicas[name].append(Replica(name, f"{name}-{i + 1}", f"{base}.{n}"))
                n += 1
        self.hosts = {name: reps[0].address for name, reps in self.replicas.items()}
        self._host = re.compile(r"(?<![\w.-])(" + "|".join(map(re.escape, self.hosts))
                                + r")(?=:\d)")
        self.volume_root = procs.workdir / "volumes"

    def _localize(self, text: str, own: str, volumes: dict[str, Path]) -> str:
        for target, path in volumes.items():
            if text == target or text.startswith(target + "/"):
                text = str(path) + text[len(target):]
        text = re.sub(r"(?<![\w.])(0\.0\.0\.0|127\.0\.0\.1|localhost)(?![\w.])", own, text)
        return self._host.sub(lambda m: self.hosts[m.group(1)], text)

    def _volume_paths(self) -> dict[str, Path]:
        """Named volumes by mount point. A path names the same volume in every service (a
        server writes where the scheduler's spec says), so one mount point, one volume."""
        out: dict[str, Path] = {}
        named = set(self.compose.get("volumes") or {})
        for name, service in self.services.items():
            for mount in service.get("volumes", []):
                source, target = mount.split(":")[:2]
                if source not in named:
                    continue
                path = self.volume_root / source
                assert out.setdefault(target, path) == path, f"{name}: {target} differs"
                path.mkdir(parents=True, exist_ok=True)
        return out

    def argv(self, replica: Replica, command: list[str]) -> list[str]:
        volumes = self._volume_paths()
        args = [self._localize(a, replica.address, volumes) for a in command]
        # A service named alone: a host of the server certificate (pstrain certs --host).
        args = [self.hosts.get(a, a) if i and args[i - 1] == "--host" else a
                for i, a in enumerate(args)]
        if "--metrics-port" in args and args[args.index("--metrics-port") + 1] != "0":
            replica.metrics_port = replica.metrics_port or free_port()
            args[args.index("--metrics-port") + 1] = str(replica.metrics_port)
        for arg in args[1:]:
            # Nothing outside the test's directories: an unmapped path would land on this host.
            assert not arg.startswith("/") or arg.startswith(str(self.volume_root)), arg
        args[0] = executable(args[0], f"service {replica.service}")
        return args

    def env(self, replica: Replica) -> dict[str, str]:
        service = self.services[replica.service]
        volumes = self._volume_paths()
        return {k: self._localize(str(v), replica.address, volumes)
                for k, v in (service.get("environment") or {}).items()}

    def start(self, replica: Replica) -> None:
        command = command_of(self.services[replica.service])
        replica.proc = self.procs.spawn(self.argv(replica, command), replica.name,
                                        self.env(replica))

    def healthy(self, name: str, env: dict[str, str] | None = None) -> bool:
        """Runs `name`'s health check as Docker would (with `env` over the service's)."""
        check = self.services[name]["healthcheck"]
        assert check["test"][0] == "CMD", check
        replica = self.replicas[name][0]
        done = subprocess.run(self.argv(replica, [str(t) for t in check["test"][1:]]),
                              capture_output=True, timeout=30, check=False,
                              env={**os.environ, **self.env(replica), **(env or {})})
        return done.returncode == 0

    def _order(self) -> list[str]:
        order: list[str] = []

        def visit(name: str) -> None:
            if name not in order:
                for dep in self.services[name].get("depends_on", {}):
                    visit(dep)
                order.append(name)

        for name in sorted(self.services):
            visit(name)
        return order

    def up(self, timeout_s: float = 120.0) -> None:
        """Starts every service once its dependencies meet their conditions. Blocks."""
        for name in self._order():
            depends = self.services[name].get("depends_on", {})
            for dep, rule in (depends.items() if isinstance(depends, dict) else []):
                if rule.get("condition") == "service_healthy":
                    wait_until(lambda dep=dep: self.supervise() or self.healthy(dep), timeout_s,
                               f"{dep} to be healthy (for {name})")
                if rule.get("condition") == "service_completed_successfully":
                    wait_until(lambda dep=dep: self.finished(dep), timeout_s,
                               f"{dep} to complete (for {name})")
                    codes = [r.exit_codes[-1] for r in self.replicas[dep]]
                    assert codes == [0] * len(codes), (dep, codes,
                                                       self.replicas[dep][0].proc.log())
            for replica in self.replicas[name]:
                self.start(replica)

    def supervise(self) -> bool:
        """Applies each service's restart policy to replicas that exited. Returns False."""
        for name, replicas in self.replicas.items():
            policy = str(self.services[name].get("restart", "no"))
            for replica in replicas:
                if replica.proc is None or replica.proc.popen.poll() is None:
                    continue
                code = replica.proc.popen.returncode
                if len(replica.exit_codes) == replica.restarts:
                    replica.exit_codes.append(code)
                    again = policy in ("always", "unless-stopped") or (
                        policy == "on-failure" and code != 0)
                    if again:
                        replica.restarts += 1
                        self.start(replica)
        return False

    def finished(self, name: str) -> bool:
        """Every replica of `name` has exited and its policy does not start it again."""
        self.supervise()
        return all(r.proc is not None and r.proc.popen.poll() is not None
                   and len(r.exit_codes) > r.restarts for r in self.replicas[name])


def scrape(replica: Replica) -> str:
    """The replica's metrics, at its own address: a server's listen where it binds."""
    url = f"http://{replica.address}:{replica.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as reply:
        return str(reply.read().decode())


def claimant(store: JobStore, pid: int) -> int | None:
    """The rank a `pstrain worker` process claimed, from the job's events."""
    return next((int(e.member) for e in store.events()
                 if e.type == "claimed" and e.detail.get("pid") == pid), None)


def test_compose_cluster_trains_to_completion_through_a_killed_server_and_worker(
    procs: Procs,
) -> None:
    job = f"compose{os.getpid()}"
    compose = load_compose({
        # Long enough (625 clocks) that the kills below land while it trains, on a fast
        # machine too: 4 epochs ended within a second of starting on one.
        "PSTRAIN_JOB": job, "PSTRAIN_EPOCHS": "20", "PSTRAIN_BATCH_SIZE": "256",
        "PSTRAIN_MAX_SAMPLES": "20000", "PSTRAIN_CHECKPOINT_EVERY_CLOCKS": "20",
    })
    cluster = LocalCompose(compose, procs)
    workers = cluster.replicas["worker"]
    assert len(workers) == 2
    cluster.up()
    url = cluster.env(workers[0])["PSTRAIN_REDIS"]
    assert url.startswith("redis://:") and f"@{cluster.hosts['redis']}:6379/" in url, url
    store = JobStore.connect(url, job)
    # Without the password Redis refuses, and so does its health check.
    anonymous = redis.Redis(host=cluster.hosts["redis"], port=6379, socket_timeout=5)
    with pytest.raises(redis.AuthenticationError):
        anonymous.ping()
    anonymous.close()
    assert cluster.healthy("redis")
    assert not cluster.healthy("redis", {"REDISCLI_AUTH": "not-the-password"})
    # The servers take only clients with a certificate of the job's CA, and the job's token.
    server_address = f"{cluster.hosts['server0']}:7000"
    with grpc.insecure_channel(server_address) as channel, pytest.raises(grpc.RpcError) as no:
        Stubs(channel).unary(rpc.GET_SERVER_INFO, b"", 5.0)
    assert no.value.code() == grpc.StatusCode.UNAVAILABLE
    assert not cluster.healthy("server0", {"PSTRAIN_SECRET_FILE": ""})

    def open_clock() -> int:
        cluster.supervise()
        beat = store.heartbeats("server", [0])[0]
        return int(beat["open_clock"]) if beat else -1

    def events(kind: str, after: float) -> list[Any]:
        cluster.supervise()
        return [e for e in store.events() if e.type == kind and e.time_s > after]

    wait_until(lambda: open_clock() >= 30 and store.latest_checkpoint(2), 90,
               "training past the first checkpoint")
    server0, server1 = cluster.replicas["server0"][0], cluster.replicas["server1"][0]
    assert "pstrain_table_rows" in scrape(server0)
    assert "pstrain_worker_clock" in scrape(workers[0])

    # A server dies: its policy starts it again, it restores the newest checkpoint, the job
    # rolls back, and each `pstrain worker` starts its script again in place.
    assert server1.proc is not None
    before = {r: b["incarnation"] for r, b in live_beats(store, "worker", [0, 1]).items()}
    killed_at = time.time()
    os.kill(server1.proc.pid, signal.SIGKILL)
    rollback = wait_until(lambda: events("rollback", killed_at), 60, "the rollback")
    back_to = int(rollback[0].detail["clock"])  # type: ignore[index]

    def resumed() -> bool:
        cluster.supervise()
        beats = store.heartbeats("worker", [0, 1])
        return all(b is not None and b["incarnation"] != before[r]
                   and int(b["clock"]) >= back_to + 10 for r, b in beats.items())

    wait_until(resumed, 60, "both scripts to restart and train past the checkpoint")
    assert server1.exit_codes == [-signal.SIGKILL] and server1.restarts == 1
    assert all(r.restarts == 0 for r in workers)  # the rollback restarted scripts, not workers
    for replica in workers:
        assert replica.proc is not None
        assert "the job rolled back; starting the script again" in replica.proc.log()

    # A worker dies: its policy starts it again, and it claims the rank it had.
    victim = workers[1]
    assert victim.proc is not None
    rank = claimant(store, victim.proc.pid)
    assert rank is not None
    killed_at = time.time()
    os.kill(victim.proc.pid, signal.SIGKILL)
    wait_until(lambda: any(e.member == str(rank) for e in events("claimed", killed_at)), 30,
               "the restarted worker's claim")
    assert victim.restarts == 1
    wait_until(lambda: cluster.finished("worker"), 150, "every worker to finish")
    assert victim.exit_codes == [-signal.SIGKILL, 0]
    assert workers[0].exit_codes == [0] and workers[0].restarts == 0
    assert store.finished_ranks() == {0, 1}
    for replica in workers:
        assert replica.proc is not None
        result = last_json(replica.proc)
        assert result["train_samples"] == 8000 and result["epochs"] == 20, result
        assert result["test_auc"] > 0.6, result
    # Checkpoints are in the named volume: both shards of each clock (a delta's directory
    # also links the files of its chain, `shard-<k>-of-2.base-<id>.safetensors`).
    written = [p.relative_to(cluster.volume_root / "checkpoints" / job) for p in
               (cluster.volume_root / "checkpoints" / job).glob("*/shard-?-of-2.safetensors")]
    by_clock: dict[str, set[str]] = {}
    for path in written:
        by_clock.setdefault(path.parent.name, set()).add(path.name)
    assert by_clock and all(names == {"shard-0-of-2.safetensors", "shard-1-of-2.safetensors"}
                            for names in by_clock.values()), by_clock
    # What keeps running is still up and healthy.
    for name in ("server0", "server1", "redis"):
        assert cluster.healthy(name), name
    assert all(r.proc is not None and r.proc.popen.poll() is None
               for r in cluster.replicas["scheduler"])
