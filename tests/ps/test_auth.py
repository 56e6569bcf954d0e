"""ps/auth.py: who may call what. The rule as a table of cases, then real servers with mutual
TLS and a job secret, called by clients holding each kind of credential."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import pstrain_pb2 as pb
from protos import rpc
from protos.rpc import Stubs
from protos.security import Role, Security, SecurityError
from ps.auth import Caller, Verdict, _Throttled, decide
from scheduler.certs import JobCerts, make_job_certs
from tests.procs import Procs
from worker.client import PSClient
from worker.errors import PSClientError

DATA = f"/{rpc.SERVICE}/Exchange"
ADMIN = f"/{rpc.ADMIN_SERVICE}/SetMembership"
HEALTH = "/grpc.health.v1.Health/Check"
W, A, S = Role.WORKER, Role.ADMIN, Role.SERVER


@pytest.mark.parametrize(
    ("method", "caller", "tls", "verdict"),
    [
        # With TLS the certificate's role decides.
        (DATA, Caller(W, None), True, None),
        (DATA, Caller(A, None), True, None),
        (DATA, Caller(S, None), True, Verdict.PERMISSION_DENIED),
        (ADMIN, Caller(A, None), True, None),
        (ADMIN, Caller(W, None), True, Verdict.PERMISSION_DENIED),
        (ADMIN, Caller(S, None), True, Verdict.PERMISSION_DENIED),
        (HEALTH, Caller(S, None), True, None),
        (HEALTH, Caller(W, None), True, None),
        ("/some.Other/Call", Caller(A, None), True, Verdict.PERMISSION_DENIED),
        (DATA, Caller(None, None), True, Verdict.UNAUTHENTICATED),
        # A secret's token is checked before the role, with or without TLS.
        (ADMIN, Caller(A, False), True, Verdict.UNAUTHENTICATED),
        (ADMIN, Caller(A, True), True, None),
        (ADMIN, Caller(W, True), True, Verdict.PERMISSION_DENIED),
        (DATA, Caller(None, False), False, Verdict.UNAUTHENTICATED),
        # Without TLS there are no roles: the token admits to everything.
        (ADMIN, Caller(None, True), False, None),
        (DATA, Caller(None, None), False, None),
    ],
)
def test_the_rule(method: str, caller: Caller, tls: bool, verdict: Verdict | None) -> None:
    refusal = decide(method, caller, tls)
    assert (refusal and refusal.verdict) == verdict
    if refusal is not None:
        assert method in refusal.message


def test_a_permission_refusal_names_the_role_and_who_may() -> None:
    refusal = decide(ADMIN, Caller(W, None), True)
    assert refusal is not None
    assert "the worker role may not call pstrain.v1.ParameterServerAdmin" in refusal.message
    assert "(allowed: admin)" in refusal.message


# ---- real servers ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> JobCerts:
    return make_job_certs(tmp_path_factory.mktemp("certs") / "job", "authjob", workers=2)


@pytest.fixture(scope="module")
def other_certs(tmp_path_factory: pytest.TempPathFactory) -> JobCerts:
    return make_job_certs(tmp_path_factory.mktemp("certs") / "other", "authjob")


def _flags(certs: JobCerts, role: str = "server", secret: bool = True) -> list[str]:
    flags = ["--tls-cert", str(certs.cert(role)), "--tls-key", str(certs.key(role)),
             "--tls-ca", str(certs.ca())]
    return flags + (["--secret-file", str(certs.secret())] if secret else [])


def _as(certs: JobCerts, role: str, secret: Path | None = None) -> Security:
    """Credentials of `role`, or of one worker rank ("worker-R")."""
    if role.startswith("worker-"):
        rank = int(role.split("-")[1])
        cert, key = certs.rank_cert(rank), certs.rank_key(rank)
    else:
        cert, key = certs.cert(role), certs.key(role)
    return Security(str(cert), str(key), str(certs.ca()),
                    str(certs.secret() if secret is None else secret))


@pytest.fixture(scope="module")
def tls_server(module_procs: Procs, certs: JobCerts) -> str:
    server = module_procs.server(extra=["--workers", "2", *_flags(certs)])
    return server.address


def _call(security: Security, address: str, method: rpc.Rpc[Any, Any],
          request: bytes = b"") -> grpc.StatusCode:
    """The status `method` ends with when `security`'s holder calls it (OK if answered)."""
    with security.channel(address) as channel:
        stubs = Stubs(channel, security.call_metadata())
        try:
            if method.streams_in:
                for _ in stubs.stream(method, iter([request]), 5.0):
                    pass
            else:
                stubs.unary(method, request, 5.0)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def _health(security: Security, address: str) -> grpc.StatusCode:
    with security.channel(address) as channel:
        try:
            health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5.0,
                metadata=security.call_metadata() or None)
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def _stats(certs: JobCerts, address: str) -> pb.StatsResponse:
    admin = _as(certs, "admin")
    with admin.channel(address) as channel:
        frame = Stubs(channel, admin.call_metadata()).unary(
            rpc.GET_STATS, pb.StatsRequest().SerializeToString(), 5.0)
    return frame.msg


def _live(certs: JobCerts, address: str) -> list[int]:
    return [c.worker for c in _stats(certs, address).clocks if c.live]


@pytest.fixture
def wrong_secret(tmp_path: Path) -> Path:
    path = tmp_path / "wrong-secret"
    path.write_text("0" * 64 + "\n")
    return path


@pytest.mark.timeout(120)
def test_every_method_refuses_a_client_without_the_jobs_credentials(
    tls_server: str, certs: JobCerts, other_certs: JobCerts, wrong_secret: Path
) -> None:
    declared = pb.DeclareTablesRequest(tables=[pb.TableSpec(
        name="w", dense=pb.DenseSpec(shape=[4], dtype=pb.FLOAT32),
        optimizer=pb.OptimizerSpec(name="sgd", params={"lr": 1.0}))]).SerializeToString()
    assert _call(_as(certs, "worker"), tls_server, rpc.DECLARE_TABLES, declared) == (
        grpc.StatusCode.OK)
    before = _stats(certs, tls_server)
    no_tls = Security(secret_path=str(certs.secret()))
    # No client certificate, or one of another job's CA: TLS itself refuses the connection.
    # The right certificate with a wrong secret: the call is refused as unauthenticated.
    strangers = {
        "no certificate": (no_tls, grpc.StatusCode.UNAVAILABLE),
        "another CA": (_as(other_certs, "admin"), grpc.StatusCode.UNAVAILABLE),
        "wrong secret": (_as(certs, "admin", wrong_secret), grpc.StatusCode.UNAUTHENTICATED),
        "no secret": (Security(str(certs.cert("admin")), str(certs.key("admin")),
                               str(certs.ca())), grpc.StatusCode.UNAUTHENTICATED),
    }
    for who, (security, code) in strangers.items():
        for method in rpc.METHODS:
            assert _call(security, tls_server, method, declared) == code, (who, method.name)
        assert _health(security, tls_server) == code, who
    after = _stats(certs, tls_server)
    assert [t.name for t in after.tables] == [t.name for t in before.tables] == ["w"]
    assert after.info.workers == before.info.workers == 2


@pytest.mark.timeout(60)
def test_a_worker_may_not_change_membership_or_restore_and_an_admin_may(
    tls_server: str, certs: JobCerts
) -> None:
    worker = _as(certs, "worker")
    membership = pb.MembershipRequest(live_workers=[1]).SerializeToString()
    for method, request in ((rpc.SET_MEMBERSHIP, membership),
                            (rpc.RESTORE, pb.RestoreRequest().SerializeToString())):
        with worker.channel(tls_server) as channel, pytest.raises(grpc.RpcError) as refused:
            Stubs(channel, worker.call_metadata()).unary(method, request, 5.0)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "the worker role may not call pstrain.v1.ParameterServerAdmin" in (
            refused.value.details())
    assert _live(certs, tls_server) == [0, 1]
    # The server's own certificate is no worker's either.
    assert _call(_as(certs, "server"), tls_server, rpc.GET_SERVER_INFO) == (
        grpc.StatusCode.PERMISSION_DENIED)
    assert _call(_as(certs, "admin"), tls_server, rpc.SET_MEMBERSHIP, membership) == (
        grpc.StatusCode.OK)
    assert _live(certs, tls_server) == [1]
    assert _call(_as(certs, "admin"), tls_server, rpc.SET_MEMBERSHIP,
                 pb.MembershipRequest(live_workers=[0, 1]).SerializeToString()) == (
        grpc.StatusCode.OK)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_a_worker_with_the_jobs_certificate_trains(procs: Procs, certs: JobCerts,
                                                   transport: str) -> None:
    server = procs.server(extra=_flags(certs))
    with PSClient([server.address], worker=0, security=_as(certs, "worker"),
                  transport=transport) as client:
        client.join()
        client.declare_dense("w", (1000,), optimizer="sgd", lr=1.0)
        client.assign_dense("w", torch.ones(1000))
        client.push_dense("w", torch.full((1000,), 0.25))
        assert torch.equal(client.pull_dense("w"), torch.full((1000,), 0.75))
        assert client.links[0].peer.transport == transport


@pytest.mark.timeout(60)
def test_a_worker_without_a_certificate_is_told_it_cannot_connect(
    tls_server: str, certs: JobCerts
) -> None:
    with pytest.raises(PSClientError, match="cannot reach shard 0"):
        PSClient([tls_server], worker=0, connect_timeout_s=2.0,
                 security=Security(secret_path=str(certs.secret())))


@pytest.mark.timeout(60)
def test_a_secret_without_tls_admits_only_its_holders(procs: Procs, certs: JobCerts,
                                                      wrong_secret: Path) -> None:
    server = procs.server(extra=["--secret-file", str(certs.secret())])
    holder = Security(secret_path=str(certs.secret()))
    assert _call(holder, server.address, rpc.GET_SERVER_INFO) == grpc.StatusCode.OK
    assert _health(holder, server.address) == grpc.StatusCode.OK
    for stranger in (Security(), Security(secret_path=str(wrong_secret))):
        for method in rpc.METHODS:
            assert _call(stranger, server.address, method) == (
                grpc.StatusCode.UNAUTHENTICATED), method.name
        assert _health(stranger, server.address) == grpc.StatusCode.UNAUTHENTICATED
    with holder.channel(server.address) as channel, pytest.raises(grpc.RpcError) as refused:
        Stubs(channel).unary(rpc.GET_SERVER_INFO, b"", 5.0)
    assert "no job token" in refused.value.details()
    assert "PSTRAIN_SECRET_FILE" in refused.value.details()


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"cert_path": "a.pem"}, "--tls-key, --tls-ca .*PSTRAIN_TLS_KEY, PSTRAIN_TLS_CA"),
        ({"cert_path": "/nonexistent/a.pem", "key_path": "k", "ca_path": "c"},
         "cannot read certificate '/nonexistent/a.pem'"),
        ({"secret_path": "/nonexistent/s"}, "cannot read job secret '/nonexistent/s'"),
    ],
)
def test_bad_credentials_are_named(fields: dict[str, str], match: str) -> None:
    with pytest.raises(SecurityError, match=match):
        Security(**fields)


def test_a_short_secret_or_a_file_that_is_no_pem_is_refused(tmp_path: Path,
                                                            certs: JobCerts) -> None:
    short = tmp_path / "short"
    short.write_text("abc\n")
    with pytest.raises(SecurityError, match="holds 3 bytes; use at least 16"):
        Security(secret_path=str(short))
    with pytest.raises(SecurityError, match="is not a PEM file"):
        Security(str(short), str(certs.key("worker")), str(certs.ca()))


def test_server_flags_name_a_bad_file(procs: Procs, tmp_path: Path) -> None:
    proc = procs.spawn([sys.executable, "-m", "ps", "--bind", "127.0.0.1:0",
                        "--tls-cert", str(tmp_path / "missing.pem")], "badtls")
    assert proc.popen.wait(timeout=60) == 2
    assert "--tls-key, --tls-ca" in proc.log()


def test_refusals_are_logged_at_most_once_per_interval(caplog: pytest.LogCaptureFixture
                                                      ) -> None:
    now = [0.0]
    throttled = _Throttled(10.0, lambda: now[0])
    with caplog.at_level("WARNING", logger="ps.auth"):
        for t in (0.0, 1.0, 2.0, 9.9, 10.0, 10.5, 25.0):
            now[0] = t
            throttled.warning("refused %s", "call")
    assert [r.getMessage() for r in caplog.records] == [
        "refused call",
        "refused call (and 3 more refusals in the last 10 s)",
        "refused call (and 1 more refusals in the last 10 s)",
    ]


@pytest.mark.timeout(60)
def test_a_rank_certificate_may_act_as_its_rank_only(tls_server: str, certs: JobCerts) -> None:
    rank1 = _as(certs, "worker-1")
    join = {w: pb.JoinRequest(worker=w, incarnation=7).SerializeToString() for w in (0, 1)}
    exchange = {w: pb.ExchangeRequest(worker=w, incarnation=7).SerializeToString()
                for w in (0, 1)}
    handshake = pb.HandshakeRequest(worker=0, incarnation=7).SerializeToString()
    with rank1.channel(tls_server) as channel:
        stubs = Stubs(channel, rank1.call_metadata())
        for method, request in ((rpc.JOIN, join[0]), (rpc.EXCHANGE, exchange[0]),
                                (rpc.HANDSHAKE, handshake)):
            with pytest.raises(grpc.RpcError) as refused:
                stubs.unary(method, request, 5.0)
            assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED, method.name
            assert "certificate is worker rank 1's; it may not act as worker 0" in (
                refused.value.details())
        with pytest.raises(grpc.RpcError) as refused:
            list(stubs.stream(rpc.EXCHANGE_STREAM, iter([pb.ExchangePart(
                request=pb.ExchangeRequest(worker=0, incarnation=7),
                payload_bytes=0).SerializeToString()]), 5.0))
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert stubs.unary(rpc.JOIN, join[1], 5.0).msg.clock == 0
        stubs.unary(rpc.EXCHANGE, exchange[1], 5.0)
    # The generic worker certificate may act as any rank.
    assert _call(_as(certs, "worker"), tls_server, rpc.JOIN, join[0]) == grpc.StatusCode.OK


@pytest.mark.timeout(120)
def test_a_lane_carries_only_its_sessions_worker(procs: Procs, certs: JobCerts) -> None:
    server = procs.server(extra=_flags(certs))
    with PSClient([server.address], worker=1, security=_as(certs, "worker-1"),
                  transport="shm") as client:
        client.join()
        client.declare_dense("w", (4,), optimizer="sgd", lr=1.0)
        client.push_dense("w", torch.ones(4))
        assert torch.equal(client.pull_dense("w"), -torch.ones(4))
        lane = client.links[0].peer.lane
        assert lane is not None
        forged = pb.ExchangeRequest(worker=0, incarnation=7)
        forged.pulls.add(table="w", dense=True)
        with pytest.raises(grpc.RpcError) as refused:
            lane.call(forged.SerializeToString(), 5.0)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "this lane's session belongs to worker 1" in refused.value.details()
    with pytest.raises(PSClientError, match="may not act as worker 0"):
        PSClient([server.address], worker=0, security=_as(certs, "worker-1"),
                 connect_timeout_s=5.0)


def _assign(worker: int) -> bytes:
    request = pb.ExchangeRequest(worker=worker, incarnation=1, push_clock=0)
    request.pushes.add(table="w", dense=True, assign=True, seq=1)
    return request.SerializeToString()


# The attacks of the trust issue that one call makes, each as the request that makes it.
ATTACKS = {
    "overwrite a table (ASSIGN)": (rpc.EXCHANGE, _assign(0)),
    "wipe every table (Restore of no checkpoint)": (rpc.RESTORE, pb.RestoreRequest(
        generation=1).SerializeToString()),
    "lock every worker out (Restore, generation 2**62-1)": (rpc.RESTORE, pb.RestoreRequest(
        generation=2**62 - 1).SerializeToString()),
    "lock rank 0 out (Join, incarnation 2**64-1)": (rpc.JOIN, pb.JoinRequest(
        worker=0, incarnation=2**64 - 1).SerializeToString()),
    "pre-play a push id": (rpc.EXCHANGE, _assign(1)),
    "evict the workers (SetMembership([999]))": (rpc.SET_MEMBERSHIP, pb.MembershipRequest(
        live_workers=[999]).SerializeToString()),
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("attack", list(ATTACKS), ids=str)
def test_each_attack_by_a_stranger_is_refused_and_changes_nothing(
    tls_server: str, certs: JobCerts, other_certs: JobCerts, wrong_secret: Path, attack: str
) -> None:
    method, request = ATTACKS[attack]
    before = _stats(certs, tls_server)
    assert _call(Security(secret_path=str(certs.secret())), tls_server, method, request) == (
        grpc.StatusCode.UNAVAILABLE)
    assert _call(_as(other_certs, "admin"), tls_server, method, request) == (
        grpc.StatusCode.UNAVAILABLE)
    assert _call(_as(certs, "admin", wrong_secret), tls_server, method, request) == (
        grpc.StatusCode.UNAUTHENTICATED)
    if method.service == rpc.ADMIN_SERVICE:
        assert _call(_as(certs, "worker"), tls_server, method, request) == (
            grpc.StatusCode.PERMISSION_DENIED)
    after = _stats(certs, tls_server)
    assert after.tables == before.tables and after.clocks == before.clocks
    assert _health(_as(certs, "server"), tls_server) == grpc.StatusCode.OK
