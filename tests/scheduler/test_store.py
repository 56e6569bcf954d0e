"""JobStore.connect against a real redis-server with a password, an ACL user, and TLS."""

from __future__ import annotations

import dataclasses
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import pytest
from procs import Procs, free_port, wait_until
from redis.connection import parse_url

from scheduler.certs import JobCerts, make_job_certs
from scheduler.errors import RedisUnavailableError, SpecMismatchError
from scheduler.spec import JobSpec
from scheduler.store import JobStore, redact


def start_redis(procs: Procs, *args: str, tls: bool = False) -> int:
    """Starts redis-server with `args` on a free loopback port (its TLS port, with `tls`, and
    no plain one); returns the port once it accepts connections. Ended by `procs`."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed (bash scripts/setup.sh does it)")
    port = free_port()
    ports = ["--port", "0", "--tls-port", str(port)] if tls else ["--port", str(port)]
    proc = procs.spawn([binary, *ports, "--bind", "127.0.0.1", "--save", "", "--appendonly",
                        "no", "--dir", str(procs.workdir), *args], "redis")

    def up() -> bool:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"redis-server exited:\n{proc.log()}")
        with socket.socket() as s:
            return s.connect_ex(("127.0.0.1", port)) == 0

    wait_until(up, 10, f"redis-server on port {port}")
    return port


def round_trip(url: str, job: str) -> JobStore:
    """Connects, stores a new job's spec and reads it back."""
    store = JobStore.connect(url, job, timeout_s=5)
    store.create_job(JobSpec(job, workers=3), adopt=False)
    spec = store.spec()
    assert spec is not None and (spec.job, spec.workers) == (job, 3)
    return store


def refused(url: str, timeout_s: float = 1.0) -> str:
    """The message of the RedisUnavailableError JobStore.connect raises for `url`."""
    with pytest.raises(RedisUnavailableError) as caught:
        JobStore.connect(url, "refused", timeout_s=timeout_s)
    return str(caught.value)


# ---- a password and an ACL user -----------------------------------------------------------------


def test_password_in_the_url(procs: Procs) -> None:
    url = procs.redis(password="s3cret-pw").address
    assert url.startswith("redis://:s3cret-pw@127.0.0.1:")
    round_trip(url, "pw")

    wrong = refused(url.replace("s3cret-pw", "n0pe-pw"))
    assert "refused the credentials" in wrong and "redis://:***@127.0.0.1:" in wrong
    assert "n0pe-pw" not in wrong and "s3cret-pw" not in wrong
    assert "refused the credentials" in refused(url.replace(":s3cret-pw@", ""))


def test_acl_user_in_the_url(procs: Procs) -> None:
    # The default user is off, so only alice gets in.
    port = start_redis(procs, "--user", "default", "off",
                       "--user", "alice", "on", ">alice-pw", "~*", "&*", "+@all")
    store = round_trip(f"redis://alice:alice-pw@127.0.0.1:{port}/0", "acl")
    assert store.redis.acl_whoami() == "alice"

    for user, password in [("alice", "wrong-pw"), ("bob", "alice-pw")]:
        message = refused(f"redis://{user}:{password}@127.0.0.1:{port}/0")
        assert f"redis://{user}:***@127.0.0.1:{port}/0 refused the credentials" in message
        assert password not in message
    assert "refused the credentials" in refused(f"redis://127.0.0.1:{port}/0")


# ---- TLS ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls(module_procs: Procs, tmp_path_factory: pytest.TempPathFactory
        ) -> Iterator[tuple[JobCerts, int]]:
    """A redis-server that speaks only TLS and wants a client certificate of the job's CA,
    with the server certificate and EC key `make_job_certs` writes."""
    certs = make_job_certs(tmp_path_factory.mktemp("certs"), "tls")
    port = start_redis(module_procs, "--tls-cert-file", str(certs.cert("server")),
                       "--tls-key-file", str(certs.key("server")),
                       "--tls-ca-cert-file", str(certs.ca()), "--tls-auth-clients", "yes",
                       tls=True)
    yield certs, port


def tls_url(host: str, port: int, ca: Path, cert: Path | None, key: Path | None) -> str:
    query = f"ssl_ca_certs={quote(str(ca))}"
    if cert is not None and key is not None:
        query += f"&ssl_certfile={quote(str(cert))}&ssl_keyfile={quote(str(key))}"
    return f"rediss://{host}:{port}/0?{query}"


@pytest.mark.parametrize(("host", "role"), [("127.0.0.1", "worker"), ("localhost", "worker"),
                                            ("127.0.0.1", "admin")])
def test_tls_with_a_client_certificate(tls: tuple[JobCerts, int], host: str, role: str) -> None:
    certs, port = tls
    url = tls_url(host, port, certs.ca(), certs.cert(role), certs.key(role))
    round_trip(url, f"tls-{host}-{role}")


def test_tls_without_a_client_certificate_is_refused(tls: tuple[JobCerts, int]) -> None:
    certs, port = tls
    message = refused(tls_url("127.0.0.1", port, certs.ca(), None, None))
    assert f"cannot reach Redis at rediss://127.0.0.1:{port}/0?ssl_ca_certs=" in message
    assert "ssl_certfile and ssl_keyfile" in message


def test_tls_with_a_certificate_of_another_ca_is_refused(
    tls: tuple[JobCerts, int], tmp_path: Path,
) -> None:
    certs, port = tls
    other = make_job_certs(tmp_path, "tls")
    # The client's certificate is a stranger to the server ...
    assert "cannot reach Redis" in refused(
        tls_url("127.0.0.1", port, certs.ca(), other.cert("worker"), other.key("worker")))
    # ... and the server's to a client trusting only the other CA.
    message = refused(
        tls_url("127.0.0.1", port, other.ca(), certs.cert("worker"), certs.key("worker")))
    assert "CERTIFICATE_VERIFY_FAILED" in message


def test_plain_redis_to_the_tls_port_is_refused(tls: tuple[JobCerts, int]) -> None:
    _, port = tls
    message = refused(f"redis://127.0.0.1:{port}/0")
    assert f"cannot reach Redis at redis://127.0.0.1:{port}/0" in message
    assert "(a TLS port needs rediss://)" in message


# ---- TLS parameters, without a server (nothing listens on the discard port 9) -------------------


def test_the_url_carries_tls_files_as_paths(tmp_path: Path) -> None:
    ca = tmp_path / "a dir+x" / "ca.pem"
    url = (f"rediss://:pw@10.0.0.1:6380/2?ssl_ca_certs={quote(str(ca))}"
           "&ssl_certfile=/c/worker.pem&ssl_keyfile=/c/worker.key"
           "&ssl_cert_reqs=required&ssl_check_hostname=false")
    kwargs = parse_url(url)
    assert kwargs["ssl_ca_certs"] == str(ca)  # percent-decoded once: ' ' and '+' survive
    assert (kwargs["ssl_certfile"], kwargs["ssl_keyfile"]) == ("/c/worker.pem", "/c/worker.key")
    # A string SSLConnection maps to ssl.CERT_REQUIRED; the flag a real bool.
    assert kwargs["ssl_cert_reqs"] == "required" and kwargs["ssl_check_hostname"] is False
    assert (kwargs["host"], kwargs["port"], kwargs["db"], kwargs["password"]) == (
        "10.0.0.1", 6380, 2, "pw")
    assert kwargs["connection_class"].__name__ == "SSLConnection"


def test_a_missing_tls_file_is_named_at_once(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("not used\n")
    message = refused(f"rediss://:s3cret-pw@127.0.0.1:9/0?ssl_ca_certs={ca}"
                      f"&ssl_certfile={tmp_path}/gone.pem&ssl_keyfile={ca}", timeout_s=30)
    assert f"ssl_certfile='{tmp_path}/gone.pem' in Redis URL" in message
    assert ":***@" in message and "s3cret-pw" not in message


@pytest.mark.parametrize(("url", "says"), [
    ("redis://127.0.0.1:9/0?ssl_ca_certs=/ca.pem", "has ssl_* parameters but no TLS"),
    ("rediss://127.0.0.1:9/0?ssl_cert_reqs=sometimes", "cannot use Redis URL"),
    ("redis://127.0.0.1:9/0?no_such_option=1", "cannot use Redis URL"),
])
def test_a_url_redis_py_cannot_use_is_refused_at_once(url: str, says: str) -> None:
    # A long timeout: these must fail without waiting for Redis.
    assert says in refused(url, timeout_s=30)


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://:pw@h:1/0", "redis://:***@h:1/0"),
        ("redis://alice:pw@h:1/0", "redis://alice:***@h:1/0"),
        ("unix:///run/r.sock?db=0&password=pw", "unix:///run/r.sock?db=0&password=***"),
        ("redis://h:1/0", "redis://h:1/0"),
    ],
)
def test_redact_hides_a_password_wherever_the_url_holds_it(url: str, shown: str) -> None:
    assert redact(url) == shown


# ---- adopting a job ------------------------------------------------------------------------------


def test_a_stopped_job_adopted_with_another_server_count_takes_it(procs: Procs) -> None:
    store = JobStore.connect(procs.redis().address, "rescaled")
    held = store.create_job(JobSpec("rescaled", servers=2, workers=3, checkpoint_dir="/ck"),
                            adopt=False)
    store.record_checkpoint("c1", 0, {"sha256": "0" * 64, "clock": 5})
    store.record_checkpoint("c1", 1, {"sha256": "1" * 64, "clock": 5})
    store.register("server", 1, {"address": "127.0.0.1:1", "restored": "c1"})
    store.record_served({0: 5, 1: 6})
    # A live job keeps its count: a process of it still heartbeats, or a scheduler leads.
    assert store.acquire_lease("scheduler-a", 30)
    with pytest.raises(SpecMismatchError, match="servers: the job has 2, this process was "
                                                  "given 3"):
        store.create_job(JobSpec("rescaled", servers=3), adopt=True, given={"servers": 3})
    assert store.spec() == held and store.checkpoint_ids() == ["c1"]
    store.redis.delete(store.keys.leader())
    # Stopped: the count is taken, the rest of the spec (and the run) kept; the checkpoints
    # listed for two servers go from Redis (their files stay, for the servers to reshard).
    with pytest.raises(SpecMismatchError, match="workers: the job has 3"):
        store.create_job(JobSpec("rescaled"), adopt=True, given={"servers": 3, "workers": 4})
    adopted = store.create_job(JobSpec("rescaled", servers=3), adopt=True,
                               given={"servers": 3, "workers": 3})
    assert adopted == store.spec() == dataclasses.replace(held, servers=3)
    assert store.checkpoint_ids() == [] and store.checkpoint("c1") == {}
    assert store.members("server") == {} and store.served_incarnations() == {}
    # Without a count, adopting keeps the job's.
    assert store.create_job(JobSpec("rescaled", servers=1), adopt=True) == adopted


def test_the_servers_incarnations_accounted_for_are_kept_until_a_new_run(
        procs: Procs) -> None:
    # What a leader records for the next one: each shard's newest record stands, the other
    # shards' stay; a new run under the name starts with none.
    store = JobStore.connect(procs.redis().address, "served", timeout_s=5)
    store.create_job(JobSpec("served", servers=2), adopt=False)
    assert store.served_incarnations() == {}
    store.record_served({0: 11, 1: 12})
    store.record_served({0: 13})
    store.record_served({})
    assert store.served_incarnations() == {0: 13, 1: 12}
    assert store.create_job(JobSpec("served"), adopt=True).servers == 2
    assert store.served_incarnations() == {0: 13, 1: 12}
    store.create_job(JobSpec("served", servers=2), adopt=False)
    assert store.served_incarnations() == {}


def test_the_record_of_worker_changes_is_appended_to_and_put_back_whole(procs: Procs) -> None:
    # A leader appends each change; one rebuilding the job after Redis came back puts back
    # the whole record it remembers, and doing so again changes nothing.
    store = JobStore.connect(procs.redis().address, "changes", timeout_s=5)
    dead = {"time": 1.0, "clock": 4, "worker": 1, "change": "dead", "incarnation": 7}
    joined = {"time": 2.0, "clock": 9, "worker": 1, "change": "joined", "incarnation": 8}
    store.record_membership(dead)
    assert store.membership_changes() == [dead]
    for _ in range(2):
        store.put_membership([dead, joined])
        assert store.membership_changes() == [dead, joined]
    store.put_membership([])
    assert store.membership_changes() == []


def test_departures_read_a_finish_and_an_exit_together(procs: Procs) -> None:
    # finish_worker records the rank and the clock it finished at; mark_finished (the
    # script exited 0 without ctx.finish()) the rank alone.
    store = JobStore.connect(procs.redis().address, "departures", timeout_s=5)
    assert store.departures() == (set(), {})
    store.finish_worker(1, incarnation=4, clock=12)
    store.mark_finished(0)
    finished, left = store.departures()
    assert finished == {0, 1}
    assert {rank: (r["incarnation"], r["clock"]) for rank, r in left.items()} == {1: (4, 12)}


def test_an_exit_without_finish_is_recorded_at_the_clock_of_the_last_beat(
    procs: Procs,
) -> None:
    store = JobStore.connect(procs.redis().address, "exited", timeout_s=5)
    big = 1796301826452398  # a microsecond incarnation, kept exact through the record
    store.beat("worker", 0, {"incarnation": big, "clock": 41, "exiting": True}, ttl_s=30)
    store.finish_worker(1, incarnation=7, clock=12)
    store.beat("worker", 1, {"incarnation": 7, "clock": 13, "exiting": True}, ttl_s=30)
    store.mark_finished(0)
    store.mark_finished(1)
    finished, left = store.departures()
    assert finished == {0, 1}
    assert {rank: (r["incarnation"], r["clock"]) for rank, r in left.items()} == {
        0: (big, 41), 1: (7, 12)}  # rank 1's own ctx.finish() record stands
    assert store.heartbeats("worker", [0, 1]) == {0: None, 1: None}


def test_a_voided_finish_is_gone_and_that_incarnation_cannot_record_it_again(
    procs: Procs,
) -> None:
    store = JobStore.connect(procs.redis().address, "voided", timeout_s=5)
    big = 1796301826452398  # incarnations are microsecond times: past a Lua integer's print
    assert store.finish_worker(1, incarnation=big, clock=30)
    assert store.finish_worker(2, incarnation=5, clock=30)
    assert not store.void_finish(1, big + 1)  # another incarnation's record: left alone
    assert not store.void_finish(3, 5)  # no record
    assert store.departures()[0] == {1, 2}
    assert store.void_finish(1, big)
    finished, left = store.departures()
    assert finished == {2} and set(left) == {2}
    assert store.finished_ranks() == {2}
    assert not store.finish_worker(1, incarnation=big, clock=30)  # the voided one, again
    assert store.departures()[0] == {2}
    assert store.finish_worker(1, incarnation=big + 1, clock=30)  # its restarted process
    assert store.departures()[0] == {1, 2}
