"""`make_job_certs` and `pstrain certs`: files, modes, names, and a real mutual-TLS gRPC call."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import stat
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from scheduler import cli
from scheduler.certs import DEFAULT_HOSTS, ROLES, JobCerts, make_job_certs
from scheduler.errors import ConfigError

FILES = {"ca.pem": 0o644, "ca.key": 0o600, "server.pem": 0o644, "server.key": 0o600,
         "worker.pem": 0o644, "worker.key": 0o600, "admin.pem": 0o644, "admin.key": 0o600,
         "secret": 0o600}


def load(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def contents(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_writes_every_file_with_its_mode_even_under_a_strict_umask(tmp_path: Path) -> None:
    old = os.umask(0o077)  # would narrow the certificates to 0600 if modes came from it
    try:
        certs = make_job_certs(tmp_path / "new" / "certs", "job1")
    finally:
        os.umask(old)
    assert stat.S_IMODE(certs.directory.stat().st_mode) == 0o700
    # Exactly these names: no temporary file is left behind.
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in certs.directory.iterdir()} == FILES
    assert [p.name for p in certs.files()] == list(FILES)
    secret = certs.secret().read_text()
    assert len(secret) == 65 and secret.endswith("\n") and int(secret, 16) >= 0
    assert certs.ca() == certs.directory / "ca.pem"
    assert (certs.cert("worker"), certs.key("worker")) == (
        certs.directory / "worker.pem", certs.directory / "worker.key")
    assert make_job_certs(tmp_path / "other", "job1").secret().read_text() != secret
    with pytest.raises(ConfigError, match="'scheduler'"):
        certs.cert("scheduler")


def test_leaves_verify_against_their_ca_only(tmp_path: Path) -> None:
    certs = make_job_certs(tmp_path / "a", "job1")
    # Same job, so the issuer names match and only the signature tells the CAs apart.
    stranger = load(make_job_certs(tmp_path / "b", "job1").ca())
    ca = load(certs.ca())
    ca.verify_directly_issued_by(ca)
    for role in ROLES:
        leaf = load(certs.cert(role))
        leaf.verify_directly_issued_by(ca)
        with pytest.raises(InvalidSignature):
            leaf.verify_directly_issued_by(stranger)


@pytest.mark.parametrize(("role", "usages", "uri"), [
    ("server", [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH], None),
    ("worker", [ExtendedKeyUsageOID.CLIENT_AUTH], "pstrain://job1/worker"),
    ("admin", [ExtendedKeyUsageOID.CLIENT_AUTH], "pstrain://job1/admin"),
])
def test_leaf_names_and_extensions(
    tmp_path: Path, role: str, usages: list[x509.ObjectIdentifier], uri: str | None,
) -> None:
    before = datetime.datetime.now(datetime.UTC)
    certs = make_job_certs(tmp_path, "job1", days=30)
    ca, leaf = load(certs.ca()), load(certs.cert(role))
    assert ca.subject.rfc4514_string() == "O=pstrain,CN=pstrain CA for job job1"
    ca_basic = ca.extensions.get_extension_for_class(x509.BasicConstraints)
    assert ca_basic.critical and ca_basic.value.ca and ca_basic.value.path_length == 0
    ca_usage = ca.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ca_usage.key_cert_sign and ca_usage.crl_sign and not ca_usage.digital_signature

    assert leaf.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == role
    assert leaf.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)[0].value == "job1"
    assert leaf.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)[0].value == "pstrain"
    assert leaf.issuer == ca.subject
    assert not leaf.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    usage = leaf.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.digital_signature and not usage.key_cert_sign
    assert list(leaf.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == usages
    aki = leaf.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value
    ski = ca.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    assert aki.key_identifier == ski.digest
    assert leaf.extensions.get_extension_for_class(x509.SubjectKeyIdentifier)
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    if uri is not None:
        assert san.get_values_for_type(x509.UniformResourceIdentifier) == [uri]
    key = leaf.public_key()
    assert isinstance(key, ec.EllipticCurvePublicKey) and key.curve.name == "secp256r1"

    after = datetime.datetime.now(datetime.UTC)
    minute = datetime.timedelta(minutes=1)
    for cert in (ca, leaf):
        start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
        # Truncated to whole seconds on the way into the certificate.
        assert before - 5 * minute - minute / 60 <= start <= after - 5 * minute
        assert before + datetime.timedelta(days=30) - minute / 60 <= end
        assert end <= after + datetime.timedelta(days=30)


def test_server_san_holds_exactly_the_hosts(tmp_path: Path) -> None:
    hosts = ["ps-0.example.com", "10.1.2.3", "fe80::1", "localhost", "10.1.2.3"]
    san = load(make_job_certs(tmp_path, "job1", hosts=hosts).cert("server")).extensions \
        .get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["ps-0.example.com", "localhost"]
    assert san.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("10.1.2.3"), ipaddress.ip_address("fe80::1")]
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == []
    default = load(make_job_certs(tmp_path / "d", "job1").cert("server")).extensions \
        .get_extension_for_class(x509.SubjectAlternativeName).value
    assert default.get_values_for_type(x509.DNSName) == ["localhost"]
    assert default.get_values_for_type(x509.IPAddress) == [
        ipaddress.ip_address("127.0.0.1"), ipaddress.ip_address("::1")]
    assert len(DEFAULT_HOSTS) == 3


def test_refuses_to_overwrite_and_changes_nothing(tmp_path: Path) -> None:
    make_job_certs(tmp_path, "job1")
    before = contents(tmp_path)
    with pytest.raises(ConfigError, match=r"ca\.pem' exists; pass --force .* another --out"):
        make_job_certs(tmp_path, "job1")
    assert contents(tmp_path) == before

    # One file of the set is enough to refuse, and then none of the others appears.
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "secret").write_text("mine\n")
    with pytest.raises(ConfigError, match="secret' exists"):
        make_job_certs(lone, "job1")
    assert contents(lone) == {"secret": b"mine\n"}


def test_force_replaces_every_file(tmp_path: Path) -> None:
    make_job_certs(tmp_path, "job1")
    before = contents(tmp_path)
    certs = make_job_certs(tmp_path, "job2", force=True)
    after = contents(tmp_path)
    assert after.keys() == before.keys() == FILES.keys()
    assert all(after[name] != before[name] for name in FILES)
    assert "job2" in load(certs.ca()).subject.rfc4514_string()
    load(certs.cert("server")).verify_directly_issued_by(load(certs.ca()))


def test_keep_leaves_a_whole_set_as_it_is_and_refuses_a_part(tmp_path: Path) -> None:
    fresh = make_job_certs(tmp_path / "new", "job1", keep=True)  # nothing there: made
    assert contents(fresh.directory).keys() == FILES.keys()
    before = contents(fresh.directory)
    make_job_certs(fresh.directory, "job1", keep=True)
    assert contents(fresh.directory) == before
    fresh.secret().unlink()
    with pytest.raises(ConfigError, match="holds some of a job's files but not secret"):
        make_job_certs(fresh.directory, "job1", keep=True)
    assert "secret" not in contents(fresh.directory)


@pytest.mark.parametrize(("job", "hosts", "days", "quoted"), [
    ("", DEFAULT_HOSTS, 365, "''"),
    ("no spaces", DEFAULT_HOSTS, 365, "'no spaces'"),
    ("j" * 46, DEFAULT_HOSTS, 365, "'" + "j" * 46 + "'"),  # the CA's name would pass 64
    ("job1", ["bad host"], 365, "'bad host'"),
    ("job1", ["ps/0"], 365, "'ps/0'"),
    ("job1", ["-ps.example"], 365, "'-ps.example'"),
    ("job1", ["10.0.1"], 365, "'10.0.1'"),  # a mistyped address, not a name
    ("job1", ["localhost", ""], 365, "''"),
    ("job1", [], 365, "--host"),
    ("job1", DEFAULT_HOSTS, 0, "--days 0"),
    ("job1", DEFAULT_HOSTS, -3, "--days -3"),
])
def test_bad_values_are_refused_before_anything_is_written(
    tmp_path: Path, job: str, hosts: list[str], days: int, quoted: str,
) -> None:
    with pytest.raises(ConfigError) as caught:
        make_job_certs(tmp_path / "out", job, hosts=hosts, days=days)
    assert quoted in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_a_job_name_of_45_characters_fits(tmp_path: Path) -> None:
    certs = make_job_certs(tmp_path, "j" * 45)
    assert load(certs.ca()).subject.rfc4514_string().endswith("j" * 45)


def test_cli_writes_the_files_and_says_who_needs_which(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PSTRAIN_JOB", "from-env")
    out = tmp_path / "certs"
    assert cli.main(["certs", "--out", str(out), "--host", "ps-0.example", "--host", "10.0.0.5",
                     "--days", "7"]) == 0
    printed = capsys.readouterr().out
    assert set(contents(out)) == set(FILES)
    assert "OU=from-env" in load(out / "worker.pem").subject.rfc4514_string()
    san = load(out / "server.pem").extensions.get_extension_for_class(
        x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["ps-0.example"]
    assert all(name in printed for name in FILES)
    assert "server needs: ca.pem server.pem server.key secret" in printed
    assert "worker needs: ca.pem worker.pem worker.key secret" in printed
    assert "admin/scheduler needs: ca.pem admin.pem admin.key secret" in printed
    assert "ca.key stays with whoever makes certificates" in printed

    # Again without --force: refused, exit status 2.
    assert cli.main(["certs", "--out", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert cli.main(["certs", "--out", str(out), "--force"]) == 0


def test_cli_names_a_bad_host(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "certs"
    assert cli.main(["certs", "--out", str(out), "--job", "j", "--host", "bad host"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pstrain certs: ") and "'bad host'" in err
    assert not out.exists()


def test_cli_help_names_the_default_hosts(capsys: pytest.CaptureFixture[str]) -> None:
    # The CLI spells the default out (it does not import scheduler.certs to build its parser).
    with pytest.raises(SystemExit) as exited:
        cli.main(["certs", "--help"])
    assert exited.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "default: localhost, 127.0.0.1 and ::1" in shown
    assert DEFAULT_HOSTS == ("localhost", "127.0.0.1", "::1")


# ---- mutual TLS over real gRPC ---------------------------------------------------------------

def _common_name(request: bytes, context: grpc.ServicerContext) -> bytes:
    """Answers the common name of the peer's certificate, as gRPC saw it."""
    return bytes(context.auth_context()["x509_common_name"][0])


def _auth_context(request: bytes, context: grpc.ServicerContext) -> bytes:
    """Answers what gRPC knows of the peer, as JSON (the PEM certificate left out)."""
    seen = {key: [v.decode() for v in values] for key, values in context.auth_context().items()
            if key != "x509_pem_cert"}
    seen["peer_identity_key"] = [context.peer_identity_key() or ""]
    return json.dumps(seen).encode()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[JobCerts, int]]:
    """A gRPC server on a free loopback port that requires a client certificate of the job."""
    certs = make_job_certs(tmp_path / "job", "job1")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    try:
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            "pstrain.test.Who",
            {"CommonName": grpc.unary_unary_rpc_method_handler(_common_name),
             "AuthContext": grpc.unary_unary_rpc_method_handler(_auth_context)})])
        credentials = grpc.ssl_server_credentials(
            [(certs.key("server").read_bytes(), certs.cert("server").read_bytes())],
            root_certificates=certs.ca().read_bytes(), require_client_auth=True)
        port = server.add_secure_port("127.0.0.1:0", credentials)
        server.start()
        yield certs, port
    finally:
        server.stop(grace=None).wait(timeout=10)


def _call(port: int, credentials: grpc.ChannelCredentials, method: str = "CommonName") -> bytes:
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials,
                             options=[("grpc.enable_http_proxy", 0)]) as channel:
        return bytes(channel.unary_unary(f"/pstrain.test.Who/{method}")(b"", timeout=10))


@pytest.mark.parametrize("role", ["worker", "admin", "server"])
def test_grpc_peer_with_a_job_certificate_is_named_by_its_role(
    served: tuple[JobCerts, int], role: str,
) -> None:
    certs, port = served
    credentials = grpc.ssl_channel_credentials(
        certs.ca().read_bytes(), certs.key(role).read_bytes(), certs.cert(role).read_bytes())
    assert _call(port, credentials) == role.encode()


def test_grpc_auth_context_of_a_worker_peer(served: tuple[JobCerts, int]) -> None:
    # What a server can check a caller's role against: the common name, and the SAN URI,
    # which gRPC makes the peer's identity.
    certs, port = served
    credentials = grpc.ssl_channel_credentials(
        certs.ca().read_bytes(), certs.key("worker").read_bytes(),
        certs.cert("worker").read_bytes())
    seen = json.loads(_call(port, credentials, "AuthContext"))
    assert seen["transport_security_type"] == ["ssl"]
    assert seen["x509_common_name"] == ["worker"]
    assert seen["x509_subject"] == ["OU=job1,O=pstrain,CN=worker"]
    assert seen["x509_subject_alternative_name"] == ["pstrain://job1/worker"]
    assert seen["peer_uri"] == ["pstrain://job1/worker"]
    assert seen["peer_identity_key"] == ["x509_subject_alternative_name"]
    assert seen["security_level"] == ["TSI_PRIVACY_AND_INTEGRITY"]


def test_grpc_refuses_a_certificate_of_another_ca(
    served: tuple[JobCerts, int], tmp_path: Path,
) -> None:
    certs, port = served
    other = make_job_certs(tmp_path / "other", "job1")
    credentials = grpc.ssl_channel_credentials(
        certs.ca().read_bytes(), other.key("worker").read_bytes(),
        other.cert("worker").read_bytes())
    with pytest.raises(grpc.RpcError) as caught:
        _call(port, credentials)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_grpc_refuses_a_client_without_a_certificate(served: tuple[JobCerts, int]) -> None:
    certs, port = served
    with pytest.raises(grpc.RpcError) as caught:
        _call(port, grpc.ssl_channel_credentials(certs.ca().read_bytes()))
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE

