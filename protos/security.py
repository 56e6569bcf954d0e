"""Who a process is on the wire: mutual TLS with the job's certificates, and the job token.

A job with TLS gives every process three PEM files made for it (`pstrain certs`): the job's
CA certificate, and the process's own certificate and key, whose common name is its role
(`server`, `worker` or `admin`). A server accepts a connection only from a client whose
certificate the job's CA signed, and reads the caller's role from it; a client accepts a
server only if the job's CA signed the server's certificate for the host it dialled (its
subject alternative names). A job secret, when given, adds a token to every call, derived
from the secret (the secret itself never travels), which the server compares in constant
time. Servers, workers and the scheduler share this one description; each entry point
builds it from its flags or environment (`from_env`), and library code takes it as a value.
"""

from __future__ import annotations

import argparse
import enum
import hashlib
import hmac
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

ENV_CERT = "PSTRAIN_TLS_CERT"
ENV_KEY = "PSTRAIN_TLS_KEY"
ENV_CA = "PSTRAIN_TLS_CA"
ENV_SECRET_FILE = "PSTRAIN_SECRET_FILE"
# The call metadata that carries the job token.
TOKEN_KEY = "x-pstrain-token"
_TOKEN_CONTEXT = b"pstrain call token v1"
MIN_SECRET_BYTES = 16


class SecurityError(ValueError):
    """A process's TLS files or secret are missing, unreadable or malformed."""


class Role(enum.Enum):
    """What a certificate lets its holder do (its common name)."""

    SERVER = "server"
    WORKER = "worker"
    ADMIN = "admin"


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as exc:
        raise SecurityError(f"cannot read {what} {path!r}: {exc.strerror}") from exc


@dataclass(frozen=True)
class Security:
    """One process's credentials, read from the named files on construction.

    TLS is on when the certificate, key and CA are all given (a part of them is refused);
    the job secret is independent of it. The default value is a process with neither,
    which reaches and serves everything in the clear. Immutable; thread-safe.
    """

    cert_path: str = ""
    key_path: str = ""
    ca_path: str = ""
    secret_path: str = ""
    cert: bytes = field(default=b"", init=False, repr=False)
    key: bytes = field(default=b"", init=False, repr=False)
    ca: bytes = field(default=b"", init=False, repr=False)
    secret: bytes = field(default=b"", init=False, repr=False)

    def __post_init__(self) -> None:
        parts = {"--tls-cert": self.cert_path, "--tls-key": self.key_path,
                 "--tls-ca": self.ca_path}
        missing = [flag for flag, path in parts.items() if not path]
        if len(missing) < len(parts) and missing:
            raise SecurityError(
                f"TLS needs a certificate, its key and the job's CA; {', '.join(missing)} "
                f"(or {', '.join(_ENV_OF[m] for m in missing)}) not given"
            )
        if not missing:
            for name, path, what in (("cert", self.cert_path, "certificate"),
                                     ("key", self.key_path, "private key"),
                                     ("ca", self.ca_path, "CA certificate")):
                data = _read(path, what)
                if b"-----BEGIN " not in data:
                    raise SecurityError(f"{what} {path!r} is not a PEM file")
                object.__setattr__(self, name, data)
        if self.secret_path:
            secret = _read(self.secret_path, "job secret").strip()
            if len(secret) < MIN_SECRET_BYTES:
                raise SecurityError(
                    f"job secret {self.secret_path!r} holds {len(secret)} bytes; use at least "
                    f"{MIN_SECRET_BYTES} (pstrain certs writes one of 64)"
                )
            object.__setattr__(self, "secret", secret)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Security:
        """From PSTRAIN_TLS_CERT, PSTRAIN_TLS_KEY, PSTRAIN_TLS_CA and PSTRAIN_SECRET_FILE;
        for entry points only."""
        return cls(env.get(ENV_CERT, ""), env.get(ENV_KEY, ""), env.get(ENV_CA, ""),
                   env.get(ENV_SECRET_FILE, ""))

    def env(self) -> dict[str, str]:
        """The environment entries that hand these credentials to a child process."""
        return {ENV_CERT: self.cert_path, ENV_KEY: self.key_path, ENV_CA: self.ca_path,
                ENV_SECRET_FILE: self.secret_path}

    @property
    def tls(self) -> bool:
        return bool(self.cert)

    @property
    def enabled(self) -> bool:
        return self.tls or bool(self.secret)

    def token(self) -> str:
        """The job token every call carries; "" without a secret."""
        if not self.secret:
            return ""
        return hmac.new(self.secret, _TOKEN_CONTEXT, hashlib.sha256).hexdigest()

    def call_metadata(self) -> tuple[tuple[str, str], ...]:
        """What a client sends with every call."""
        token = self.token()
        return ((TOKEN_KEY, token),) if token else ()

    def channel(self, address: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A channel to `address`: TLS with this process's certificate when TLS is on."""
        if not self.tls:
            return grpc.insecure_channel(address, options=list(options))
        credentials = grpc.ssl_channel_credentials(
            root_certificates=self.ca, private_key=self.key, certificate_chain=self.cert)
        return grpc.secure_channel(address, credentials, options=list(options))

    def add_port(self, server: grpc.Server, bind: str) -> int:
        """Makes `server` listen on `bind`; with TLS, for clients with a certificate of the
        job's CA only. Returns the port (0 when it could not bind)."""
        if not self.tls:
            return int(server.add_insecure_port(bind))
        credentials = grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.ca, require_client_auth=True)
        return int(server.add_secure_port(bind, credentials))


_ENV_OF = {"--tls-cert": ENV_CERT, "--tls-key": ENV_KEY, "--tls-ca": ENV_CA}


def add_flags(parser: argparse.ArgumentParser, env: Mapping[str, str], cert_help: str) -> None:
    """The --tls-cert, --tls-key, --tls-ca and --secret-file flags of an entry point, with
    their environment variables as defaults."""
    parser.add_argument("--tls-cert", default=env.get(ENV_CERT, ""),
                        help=f"PEM file of {cert_help}; with --tls-key and --tls-ca turns on "
                             f"mutual TLS (env {ENV_CERT}; pstrain certs makes them)")
    parser.add_argument("--tls-key", default=env.get(ENV_KEY, ""),
                        help=f"PEM file of that certificate's private key (env {ENV_KEY})")
    parser.add_argument("--tls-ca", default=env.get(ENV_CA, ""),
                        help=f"PEM file of the job's CA certificate (env {ENV_CA})")
    parser.add_argument("--secret-file", default=env.get(ENV_SECRET_FILE, ""),
                        help="file holding the job's secret; every call then carries a token "
                             f"derived from it (env {ENV_SECRET_FILE})")


def from_flags(args: argparse.Namespace) -> Security:
    """The Security that `add_flags`' flags describe; SecurityError names a bad file."""
    return Security(args.tls_cert, args.tls_key, args.tls_ca, args.secret_file)


def peer_role(auth_context: Mapping[str, Sequence[bytes]]) -> Role | None:
    """The role named by a TLS peer's certificate (its common name); None when the peer
    presented none, or one that names no role. Pure."""
    names = auth_context.get("x509_common_name") or ()
    if len(names) != 1:
        return None
    try:
        return Role(names[0].decode("utf-8", "replace"))
    except ValueError:
        return None


def peer_rank(auth_context: Mapping[str, Sequence[bytes]]) -> int | None:
    """The rank a TLS peer's certificate binds it to (a subject alternative name
    pstrain://JOB/worker/RANK, as `pstrain certs --workers` makes); None when it names none,
    as the generic worker certificate and the admin's do. Pure."""
    for name in auth_context.get("x509_subject_alternative_name") or ():
        scheme, _, rest = name.decode("utf-8", "replace").partition("://")
        parts = rest.split("/")
        if scheme == "pstrain" and len(parts) == 3 and parts[1] == "worker":
            ok = parts[2].isascii() and parts[2].isdigit()
            return int(parts[2]) if ok else -1  # -1: a rank no worker holds
    return None


def token_matches(presented: str, expected: str) -> bool:
    """Whether a call's token is the job's, compared in constant time. Pure."""
    return hmac.compare_digest(presented.encode("utf-8", "replace"),
                               expected.encode("utf-8"))
