"""TLS on the cluster-internal ports: server credentials that hot-reload, client credentials that pin.

Every service listens twice on one gRPC server (see ``nebula_common.service.resources``):

* the **client port** (``grpc_port``; the switch's ``internal_port``): TLS 1.2+, the server proves
  its identity, clients need no certificate. Users (CLI, SDK) call here with their bearer token;
  gRPC's Python API can only *require* a client certificate or *not ask* for one, so the user port
  does not ask, and the role check (``nebula_common.auth.peer_roles``) lets only user-facing methods
  through it.
* the **service port** (``service_port``): mutual TLS, a client certificate issued by the cluster
  CA is required by the handshake itself, and the role it names is checked against
  ``nebula_common.auth.roles`` on every call.

Clients verify the server against the cluster CA *and* pin the service they meant to reach
(``grpc.ssl_target_name_override`` = ``<service>.<cluster>.nebula.internal``), so a trainer
certificate cannot answer for the auth service.

Plaintext exists for development only: ``NEBULA_INTERNAL_PLAINTEXT=1`` lets a service start
without internal TLS files, and a client without a CA, each logging a warning. Without the flag a
missing TLS configuration is an error that names what to set.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization

from nebula_common.errors import NebulaError
from nebula_common.pki.identity import Identity, cluster_dns_domain, identity_from_certificate
from nebula_common.pki.service_identity import ServiceTlsFiles
from nebula_common.rpc.channels import internal_channel_options

log = logging.getLogger(__name__)

PLAINTEXT_ENV = "NEBULA_INTERNAL_PLAINTEXT"
"""The development flag that allows plaintext internal ports and channels (``1``/``true``/``yes``)."""


class InternalTlsError(NebulaError):
    """Internal TLS is required but not configured, or its files are unusable."""


def plaintext_allowed() -> bool:
    """True when the development flag allows plaintext on the internal ports."""
    return os.environ.get(PLAINTEXT_ENV, "").strip().lower() in {"1", "true", "yes", "on"}


def server_name(service: str, cluster_id: str) -> str:
    """The DNS SAN a client pins when it calls ``service`` of ``cluster_id``."""
    return f"{service}.{cluster_dns_domain(cluster_id)}"


def _read(path: Path, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise InternalTlsError(f"missing {what} {path}") from None
    except OSError as exc:
        raise InternalTlsError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    if not data.strip():
        raise InternalTlsError(f"{what} {path} is empty")
    return data


@dataclass(frozen=True)
class _Material:
    key_pem: bytes
    cert_pem: bytes
    ca_pem: bytes
    cert: x509.Certificate
    identity: Identity


def load_material(files: ServiceTlsFiles) -> _Material:
    """Read and check one service's files: the key matches, the leaf chains to the CA, it names a service."""
    key_pem = _read(files.key, "internal TLS private key")
    cert_pem = _read(files.cert, "internal TLS certificate")
    ca_pem = _read(files.ca, "cluster CA certificate")
    try:
        cert = x509.load_pem_x509_certificate(cert_pem)
        ca = x509.load_pem_x509_certificate(ca_pem)
        key = serialization.load_pem_private_key(key_pem, password=None)
    except (ValueError, TypeError) as exc:
        raise InternalTlsError(f"internal TLS files in {files.dir} are not PEM: {exc}") from None
    if key.public_key() != cert.public_key():
        raise InternalTlsError(f"{files.key} does not match {files.cert}")
    try:
        cert.verify_directly_issued_by(ca)
    except (InvalidSignature, ValueError, TypeError):
        raise InternalTlsError(f"{files.cert} was not issued by the CA in {files.ca}") from None
    try:
        identity = identity_from_certificate(cert)
    except ValueError as exc:
        raise InternalTlsError(f"{files.cert}: {exc}") from None
    return _Material(key_pem, cert_pem, ca_pem, cert, identity)


def _stamp(files: ServiceTlsFiles) -> tuple[tuple[int, int], ...]:
    stamps = []
    for path in (files.ca, files.cert, files.key):
        try:
            st = path.stat()
            stamps.append((st.st_mtime_ns, st.st_size))
        except OSError:
            stamps.append((0, -1))
    return tuple(stamps)


class ServerTls:
    """A service's internal TLS identity, re-read from disk whenever its files change.

    gRPC asks every credentials object built here for the newest certificate before each new
    handshake; established connections keep the session they negotiated, so replacing the files
    (a renewal) drops no call. A changed set of files that does not load (a key written before its
    certificate, a half-copied Secret) is ignored until it does; the last good one keeps serving.
    """

    def __init__(
        self, files: ServiceTlsFiles, *, on_reload: Callable[[x509.Certificate], None] | None = None
    ) -> None:
        self.files = files
        self._on_reload = on_reload
        self._lock = threading.Lock()
        self._stamp = _stamp(files)
        self._material = load_material(files)
        self._generation = 0

    @property
    def identity(self) -> Identity:
        return self._material.identity

    @property
    def not_after(self) -> datetime:
        return self._material.cert.not_valid_after_utc

    @property
    def serial(self) -> int:
        return self._material.cert.serial_number

    def refresh(self) -> bool:
        """Reload the files if they changed and now load cleanly; True when a new certificate is in use."""
        stamp = _stamp(self.files)
        with self._lock:
            if stamp == self._stamp:
                return False
            try:
                material = load_material(self.files)
            except InternalTlsError as exc:
                log.warning("internal TLS files changed but do not load yet: %s", exc)
                return False
            self._stamp = stamp
            changed = material.cert_pem != self._material.cert_pem or material.ca_pem != self._material.ca_pem
            self._material = material
            if changed:
                self._generation += 1
        if changed and self._on_reload is not None:
            self._on_reload(material.cert)
        return changed

    def pem(self) -> tuple[bytes, bytes, bytes]:
        """(certificate, key, cluster CA) in PEM, the newest that loads (for a non-gRPC mutual TLS port)."""
        self.refresh()
        material = self._material
        return material.cert_pem, material.key_pem, material.ca_pem

    def _config(self) -> grpc.ServerCertificateConfiguration:
        material = self._material
        return grpc.ssl_server_certificate_configuration(
            [(material.key_pem, material.cert_pem)], root_certificates=material.ca_pem
        )

    def credentials(self, *, require_client_auth: bool) -> grpc.ServerCredentials:
        """Credentials for one port: mutual TLS (service port) or server-only TLS (client port)."""
        served = {"generation": self._generation}

        def fetch() -> grpc.ServerCertificateConfiguration | None:
            self.refresh()
            if served["generation"] == self._generation:
                return None
            served["generation"] = self._generation
            return self._config()

        return grpc.dynamic_ssl_server_credentials(
            self._config(), fetch, require_client_authentication=require_client_auth
        )


@dataclass(frozen=True)
class ClientTls:
    """How a client reaches one cluster's internal ports: the cluster CA, and optionally its own leaf.

    Services present their leaf (the service port requires it); users may leave it out (the client
    port never asks for one). Files are read each time credentials are built, so a channel opened
    after a renewal presents the new certificate.
    """

    cluster_id: str
    ca: Path
    cert: Path | None = None
    key: Path | None = None

    @classmethod
    def for_service(cls, files: ServiceTlsFiles, cluster_id: str) -> ClientTls:
        return cls(cluster_id, files.ca, files.cert, files.key)

    def credentials(self) -> grpc.ChannelCredentials:
        ca = _read(self.ca, "cluster CA certificate")
        if self.cert is None or self.key is None:
            return grpc.ssl_channel_credentials(root_certificates=ca)
        return grpc.ssl_channel_credentials(
            root_certificates=ca,
            private_key=_read(self.key, "client private key"),
            certificate_chain=_read(self.cert, "client certificate"),
        )

    def pem(self) -> tuple[bytes, bytes, bytes]:
        """(certificate, key, cluster CA) in PEM, read now; InternalTlsError without a certificate."""
        if self.cert is None or self.key is None:
            raise InternalTlsError(f"no client certificate for cluster {self.cluster_id!r}")
        return (
            _read(self.cert, "client certificate"),
            _read(self.key, "client private key"),
            _read(self.ca, "cluster CA certificate"),
        )

    def options(self, service: str) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", server_name(service, self.cluster_id))]


CA_ENV = "NEBULA_CA_CERT"
"""For users' commands given bare addresses (``nebula data --address``): the cluster CA to verify."""


def cluster_of_ca(ca_pem: bytes, origin: str) -> str:
    """The cluster a Nebula CA belongs to, read from its name constraint (``<id>.nebula.internal``)."""
    try:
        ca = x509.load_pem_x509_certificate(ca_pem)
        constraints = ca.extensions.get_extension_for_class(x509.NameConstraints).value
    except (ValueError, x509.ExtensionNotFound):
        raise InternalTlsError(f"{origin} is not a Nebula cluster CA certificate") from None
    for name in constraints.permitted_subtrees or ():
        if isinstance(name, x509.DNSName) and name.value.endswith(".nebula.internal"):
            return name.value.removesuffix(".nebula.internal")
    raise InternalTlsError(
        f"{origin} is not a Nebula cluster CA certificate (no <id>.nebula.internal constraint)"
    )


def user_tls_from_env() -> ClientTls | None:
    """The user's client TLS from ``NEBULA_CA_CERT`` (no client certificate), or None when unset."""
    value = os.environ.get(CA_ENV, "").strip()
    if not value:
        return None
    path = Path(value)
    return ClientTls(cluster_of_ca(_read(path, f"{CA_ENV}"), f"{CA_ENV}={path}"), path)


_process_tls: ClientTls | None = None
_endpoints: dict[str, ClientTls] = {}
_warned_plaintext = False


def trust_endpoint(address: str, tls: ClientTls) -> None:
    """Remember how to reach ``address`` (a deployment's internal port, learnt from its description).

    A CLI or SDK process talks to two clusters, each with its own CA; the deployment file says which
    address belongs to which cluster, so clients given only an address still verify the right CA
    and pin the right cluster.
    """
    _endpoints[address] = tls


def forget_endpoint(address: str) -> None:
    """Stop trusting what ``trust_endpoint`` said about ``address`` (its deployment is gone; the port
    may next belong to anything)."""
    _endpoints.pop(address, None)


def endpoint_tls(address: str) -> ClientTls | None:
    return _endpoints.get(address)


def set_process_client_tls(tls: ClientTls | None) -> None:
    """The identity this process presents on internal calls that were not given one (a service's own)."""
    global _process_tls
    _process_tls = tls


def process_client_tls() -> ClientTls | None:
    return _process_tls


def warn_plaintext(what: str) -> None:
    """Log, once per process, that internal traffic of ``what`` is plaintext (the development flag)."""
    global _warned_plaintext
    if not _warned_plaintext:
        _warned_plaintext = True
        log.warning(
            "%s uses PLAINTEXT on cluster-internal ports (%s is set): tokens, passwords and data "
            "cross the network in clear. For development only.",
            what,
            PLAINTEXT_ENV,
        )


LOCAL_SOCKET_PREFIX = "unix:"
"""An address on a Unix socket (``unix:/path``): local to the host, never TLS (see ``internal_channel``)."""


def internal_channel(
    address: str,
    *,
    service: str,
    tls: ClientTls | None = None,
    aio: bool = False,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.Channel | grpc.aio.Channel:
    """A channel to ``service`` at ``address`` on the cluster network: TLS verifying the cluster CA.

    ``tls`` defaults to, in order: what a deployment description said about ``address``
    (``trust_endpoint``), the process's own identity (a service's, ``set_process_client_tls``), the
    user's ``NEBULA_CA_CERT``. Without any, the channel is plaintext only under the development flag.
    """
    merged = [*internal_channel_options(), *options]
    if address.startswith(LOCAL_SOCKET_PREFIX):
        # A stage process's way out: a Unix socket its trainer serves in a directory only that stage
        # can reach; no bytes leave the host, and the trainer checks the stage's secret on every call.
        if aio:
            return grpc.aio.insecure_channel(address, options=merged)
        return grpc.insecure_channel(address, options=merged)
    tls = tls or _endpoints.get(address) or _process_tls or user_tls_from_env()
    if tls is None:
        if not plaintext_allowed():
            raise InternalTlsError(
                f"no TLS configuration to reach the {service} service at {address}: give the cluster's CA "
                f"(a deployment file from `nebula local up`, or {CA_ENV}=<pki>/<cluster>/ca.crt), or set "
                f"{PLAINTEXT_ENV}=1 for a plaintext development deployment"
            )
        warn_plaintext(f"the client of {service} at {address}")
        if aio:
            return grpc.aio.insecure_channel(address, options=merged)
        return grpc.insecure_channel(address, options=merged)
    merged += tls.options(service)
    if aio:
        return grpc.aio.secure_channel(address, tls.credentials(), options=merged)
    return grpc.secure_channel(address, tls.credentials(), options=merged)
