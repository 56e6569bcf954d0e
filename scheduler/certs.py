"""A job's certificate authority and per-role certificates, for mutual TLS between roles.

`make_job_certs` writes, into one directory:

| file | mode | who holds it |
| --- | --- | --- |
| ``ca.pem`` | 0644 | every role: the job's CA, the only root a role trusts |
| ``ca.key`` | 0600 | whoever makes certificates; no role needs it |
| ``server.pem``, ``server.key`` | 0644, 0600 | parameter servers (serverAuth and clientAuth) |
| ``worker.pem``, ``worker.key`` | 0644, 0600 | workers (clientAuth) |
| ``admin.pem``, ``admin.key`` | 0644, 0600 | the scheduler and admin commands (clientAuth) |
| ``secret`` | 0600 | every role: 32 random bytes as 64 hex characters |

A leaf names its role twice: as its subject's common name ("server", "worker", "admin") and,
for workers and admins, as the URI ``pstrain://<job>/<role>`` in its subjectAltName. gRPC
takes a certificate's SAN as the peer's identity where there is one, so a check that reads
either finds the role. The server certificate's SAN lists the hosts clients dial instead.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from scheduler.errors import ConfigError

# JobSpec's rule for job names; certificates must name the same jobs.
from scheduler.spec import _JOB_NAME

ROLES: tuple[str, ...] = ("server", "worker", "admin")
DEFAULT_HOSTS = ("localhost", "127.0.0.1", "::1")

# Slack for clocks that run behind the one of the machine that made the certificates.
_BACKDATE = datetime.timedelta(minutes=5)
# X.509 allows common names of up to 64 characters (RFC 5280, ub-common-name).
_MAX_CN = 64
_CA_CN = "pstrain CA for job {job}"
# A hundred years: past any job, and far inside the dates X.509 can hold.
_MAX_DAYS = 36500
_DNS_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")

# Rank certificates one call may make (a job's workers, and far more than any has).
_MAX_RANKS = 100_000
_CERT_MODE = 0o644
_KEY_MODE = 0o600


@dataclass(frozen=True)
class JobCerts:
    """Where a job's certificate files lie (see the module docstring); reads nothing."""

    directory: Path

    def __post_init__(self) -> None:
        # Accept a str too (a frozen dataclass cannot assign in the ordinary way).
        object.__setattr__(self, "directory", Path(self.directory))

    def ca(self) -> Path:
        return self.directory / "ca.pem"

    def ca_key(self) -> Path:
        return self.directory / "ca.key"

    def cert(self, role: str) -> Path:
        return self.directory / f"{_role(role)}.pem"

    def key(self, role: str) -> Path:
        return self.directory / f"{_role(role)}.key"

    def secret(self) -> Path:
        return self.directory / "secret"

    def needed_by(self, role: str) -> tuple[Path, Path, Path, Path]:
        """The files a process of `role` needs: the CA, its certificate and key, the secret."""
        return (self.ca(), self.cert(role), self.key(role), self.secret())

    def rank_cert(self, rank: int) -> Path:
        """The certificate of the worker of one rank: it may act as that rank only."""
        return self.directory / f"worker-{rank}.pem"

    def rank_key(self, rank: int) -> Path:
        return self.directory / f"worker-{rank}.key"

    def files(self, workers: int = 0) -> tuple[Path, ...]:
        """Every file `make_job_certs` writes (with `workers` rank certificates), in the order
        it writes them."""
        leaves = [p for role in ROLES for p in (self.cert(role), self.key(role))]
        ranks = [p for r in range(workers) for p in (self.rank_cert(r), self.rank_key(r))]
        return (self.ca(), self.ca_key(), *leaves, *ranks, self.secret())


def _role(role: str) -> str:
    if role not in ROLES:
        raise ConfigError(f"role {role!r} has no certificate; use one of {', '.join(ROLES)}")
    return role


def make_job_certs(
    directory: str | Path, job: str, hosts: Sequence[str] = DEFAULT_HOSTS,
    days: int = 365, force: bool = False, keep: bool = False, workers: int = 0,
) -> JobCerts:
    """Makes a new CA for `job` and a key and certificate for each role, and a new secret;
    with `workers`, also a certificate for each rank 0..workers-1 (`worker-R.pem`, a worker
    that may act as rank R only, where the generic `worker.pem` may act as any rank).

    Every value is checked, and no file is written, before anything is made: ConfigError
    quoting the bad value (an empty or invalid job, a host that is neither an IP address nor
    a DNS name, `days` out of range, or a file already there without `force`). `directory`
    is created with mode 0700 if missing. Each file is written atomically (a temporary file
    in the directory, fsync, rename), keys and the secret created 0600, so a reader sees an
    old file or a whole new one; with `force` a crash part-way can leave a mix of old and
    new files, which the next run with `force` replaces. With `keep`, a directory that
    already holds every file is left as it is (a service that runs again keeps the job's
    certificates); one that holds only some of them is refused. Blocks on disk writes;
    thread-safe as far as different directories go.
    """
    _check_job(job)
    names = _check_hosts(hosts)
    if isinstance(days, bool) or not isinstance(days, int) or not 1 <= days <= _MAX_DAYS:
        raise ConfigError(f"--days {days!r}: give a whole number of days from 1 to {_MAX_DAYS}")
    if not 0 <= workers <= _MAX_RANKS:
        raise ConfigError(f"--workers {workers}: give 0 to {_MAX_RANKS} rank certificates")
    certs = JobCerts(Path(directory))
    if certs.directory.exists() and not certs.directory.is_dir():
        raise ConfigError(f"--out {str(certs.directory)!r} is not a directory; choose another")
    files = certs.files(workers)
    if keep and not force:
        present = [p for p in files if p.exists()]
        if len(present) == len(files):
            return certs
        if present:
            missing = [p.name for p in files if not p.exists()]
            raise ConfigError(
                f"{str(certs.directory)!r} holds some of a job's files but not "
                f"{', '.join(missing)}; pass --force to make them all anew"
            )
    if not force:
        for path in files:
            if path.exists() or path.is_symlink():
                raise ConfigError(
                    f"{str(path)!r} exists; pass --force to replace every file, or choose "
                    "another --out"
                )

    now = datetime.datetime.now(datetime.UTC)
    start, end = now - _BACKDATE, now + datetime.timedelta(days=days)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([
        x509.NameAttribute(NameOID.COMMON_NAME, _CA_CN.format(job=job)),
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pstrain"),
    ])
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(ca_ski, critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    made: dict[Path, tuple[bytes, int]] = {
        certs.ca(): (_pem(ca_cert), _CERT_MODE),
        certs.ca_key(): (_key_pem(ca_key), _KEY_MODE),
    }
    def leaf(role: str, usages: list[x509.ObjectIdentifier],
             san: x509.SubjectAlternativeName) -> tuple[bytes, bytes]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([
                x509.NameAttribute(NameOID.COMMON_NAME, role),
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pstrain"),
                x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, job),
            ]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(_key_usage(cert_sign=False), critical=True)
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(san, critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                           critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski),
                critical=False)
            .sign(ca_key, hashes.SHA256())
        )
        return _pem(cert), _key_pem(key)

    def uri(path: str) -> x509.SubjectAlternativeName:
        return x509.SubjectAlternativeName(
            [x509.UniformResourceIdentifier(f"pstrain://{job}/{path}")])

    client = [ExtendedKeyUsageOID.CLIENT_AUTH]
    for role in ROLES:
        if role == "server":
            cert_pem, key_pem = leaf(role, [ExtendedKeyUsageOID.SERVER_AUTH, *client],
                                     x509.SubjectAlternativeName(names))
        else:
            cert_pem, key_pem = leaf(role, client, uri(role))
        made[certs.cert(role)] = (cert_pem, _CERT_MODE)
        made[certs.key(role)] = (key_pem, _KEY_MODE)
    for rank in range(workers):
        cert_pem, key_pem = leaf("worker", client, uri(f"worker/{rank}"))
        made[certs.rank_cert(rank)] = (cert_pem, _CERT_MODE)
        made[certs.rank_key(rank)] = (key_pem, _KEY_MODE)
    made[certs.secret()] = ((secrets.token_hex(32) + "\n").encode(), _KEY_MODE)

    # Only after everything is made, so a failure above leaves the directory as it was.
    certs.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    for path in files:
        data, mode = made[path]
        _write_atomically(path, data, mode)
    _fsync_directory(certs.directory)
    return certs


def _check_job(job: str) -> None:
    if not job:
        raise ConfigError("job name '' is empty; pass --job NAME (or set PSTRAIN_JOB)")
    if not _JOB_NAME.match(job):
        raise ConfigError(
            f"job name {job!r} must be 1-64 letters, digits, '_', '-' or '.', starting with a "
            "letter or digit"
        )
    if len(_CA_CN.format(job=job)) > _MAX_CN:
        raise ConfigError(
            f"job name {job!r} is too long for the CA's common name "
            f"{_CA_CN.format(job='<job>')!r} (at most {_MAX_CN - len(_CA_CN.format(job=''))} "
            "characters); certificates need a shorter job name"
        )


def _check_hosts(hosts: Sequence[str]) -> list[x509.GeneralName]:
    """The server certificate's subjectAltName entries for `hosts`, duplicates dropped."""
    if isinstance(hosts, str):
        # A lone string would otherwise be taken character by character.
        hosts = [hosts]
    if not hosts:
        raise ConfigError("no --host given; the server certificate needs at least one name")
    names: list[x509.GeneralName] = []
    for host in hosts:
        name: x509.GeneralName
        try:
            name = x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            if not _is_dns_name(host):
                raise ConfigError(
                    f"--host {host!r} is neither an IP address nor a DNS name (letters, digits "
                    "and '-' in labels separated by dots); give the name or address clients "
                    "dial to reach the servers"
                ) from None
            name = x509.DNSName(host)
        if name not in names:
            names.append(name)
    return names


def _is_dns_name(host: str) -> bool:
    labels = host.split(".")
    # An all-digit last label would be a mistyped address (such as "10.0.1"), not a name.
    return (0 < len(host) <= 253 and all(_DNS_LABEL.match(label) for label in labels)
            and not labels[-1].isdigit())


def _key_usage(*, cert_sign: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=not cert_sign, content_commitment=False, key_encipherment=False,
        data_encipherment=False, key_agreement=False, key_cert_sign=cert_sign,
        crl_sign=cert_sign, encipher_only=False, decipher_only=False,
    )


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    # PKCS#8 ("BEGIN PRIVATE KEY"): what gRPC, OpenSSL (so Redis) and Python's ssl all read.
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _write_atomically(path: Path, data: bytes, mode: int) -> None:
    """Writes `data` to `path` through a temporary file created with `mode` (never wider)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode)
    try:
        # The umask may have narrowed the mode; set it exactly before anyone can see the name.
        os.fchmod(fd, mode)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise


def _fsync_directory(directory: Path) -> None:
    """Makes the renames durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
