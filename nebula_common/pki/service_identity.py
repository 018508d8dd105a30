"""Per-service certificates for the cluster-internal ports: one short-lived identity per service.

The cluster CA that signs the switch's WAN certificate also signs one leaf per service instance,
``spiffe://nebula/cluster/<id>/<service>`` (DNS SAN ``<service>.<id>.nebula.internal``), so every
internal call is mutual TLS and every server knows *which* service is calling (what each role may
call is :mod:`nebula_common.auth.roles`). Each service gets a directory of its own holding exactly
what it needs, the shape a Kubernetes Secret or a compose volume mounts::

    <dir>/ca.crt        the cluster CA (trust anchor for servers *and* clients of this cluster)
    <dir>/service.crt   this service's leaf
    <dir>/service.key   its private key (0600)

In a local PKI layout the directories are ``<pki>/<cluster>/services/<service>/``.

Leaves live ``DEFAULT_SERVICE_VALIDITY`` (24 h) and are renewed once less than a third of their
lifetime is left (:func:`renewal_due`): by the launcher when it reuses a run directory, and by a
running service that holds the CA key (local development only) — servers reload the files before
every new handshake, so a renewal never drops a call (``nebula_common.rpc.internal_tls``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric import ec

from nebula_common.audit import open_service_audit
from nebula_common.durable import atomic_write
from nebula_common.pki.ca import issue_certificate
from nebula_common.pki.identity import Identity, identity_from_certificate
from nebula_common.pki.layout import ClusterPaths, PkiError, cert_pem, key_pem, read_cert, read_key
from nebula_common.pki.store import exclusive

__all__ = [
    "DEFAULT_SERVICE_VALIDITY",
    "IDENTITY_ROLES",
    "LAUNCHED_IDENTITIES",
    "MONITORING_ROLE",
    "SERVICE_ROLES",
    "WORKER_ROLE",
    "ServiceTlsFiles",
    "ensure_service_certificates",
    "issue_service_certificate",
    "mirror_crl",
    "renewal_due",
    "service_tls_dir",
]

#: The services that get an internal identity (every process of a cluster).
SERVICE_ROLES: tuple[str, ...] = ("auth", "codec", "data", "switch", "trainer")
WORKER_ROLE = "worker"
"""A cluster rank process (``services.trainer.worker``): it serves no port, it joins its trainer's rank
store through mutual TLS (``services/trainer/runtime/rank_gate.py``); issued only where ranks run."""
MONITORING_ROLE = "monitoring"
"""The cluster's Prometheus: it serves no port, it reads the services' ``/metrics`` over mutual TLS
(``nebula_common.metrics``), which refuse every other reader but an operator."""
IDENTITY_ROLES: tuple[str, ...] = (*SERVICE_ROLES, WORKER_ROLE, MONITORING_ROLE)
LAUNCHED_IDENTITIES: tuple[str, ...] = (*SERVICE_ROLES, MONITORING_ROLE)
"""What ``nebula local up`` keeps issued per cluster: every service's identity and the scraper's."""
DEFAULT_SERVICE_VALIDITY = timedelta(hours=24)
#: Renew once less than this fraction of a leaf's lifetime is left.
RENEW_FRACTION = 1 / 3

CA_FILE = "ca.crt"
CERT_FILE = "service.crt"
KEY_FILE = "service.key"
CRL_FILE = "crl.pem"


@dataclass(frozen=True)
class ServiceTlsFiles:
    """The three files of one service's internal TLS directory (pure paths: nothing is read)."""

    dir: Path
    ca: Path
    cert: Path
    key: Path

    @classmethod
    def in_dir(cls, directory: Path) -> ServiceTlsFiles:
        directory = Path(directory)
        return cls(directory, directory / CA_FILE, directory / CERT_FILE, directory / KEY_FILE)


def service_tls_dir(pki_root: Path, cluster_id: str, service: str) -> Path:
    """Where ``service`` of ``cluster_id`` keeps its internal TLS files in a local PKI layout."""
    _check_service(service)
    return ClusterPaths.for_cluster(Path(pki_root), cluster_id).dir / "services" / service


def _check_service(service: str) -> None:
    if service not in IDENTITY_ROLES:
        raise PkiError(f"unknown service {service!r}; services with an identity: {', '.join(IDENTITY_ROLES)}")


def renewal_due(cert: x509.Certificate, *, now: datetime | None = None) -> bool:
    """True once less than :data:`RENEW_FRACTION` of ``cert``'s lifetime is left (or it expired)."""
    now = now or datetime.now(UTC)
    lifetime = cert.not_valid_after_utc - cert.not_valid_before_utc
    return cert.not_valid_after_utc - now < lifetime * RENEW_FRACTION


def _revoked_serials(crl_path: Path, ca_cert: x509.Certificate) -> frozenset[int]:
    """Serials the cluster CA's CRL lists (empty if there is none, or it is not the CA's own)."""
    try:
        crl = x509.load_pem_x509_crl(crl_path.read_bytes())
        public = ca_cert.public_key()
        if not isinstance(public, ec.EllipticCurvePublicKey) or not crl.is_signature_valid(public):
            return frozenset()
    except (OSError, ValueError):
        return frozenset()
    return frozenset(entry.serial_number for entry in crl)


def _usable(
    files: ServiceTlsFiles,
    ca_cert: x509.Certificate,
    identity: Identity,
    revoked: frozenset[int] = frozenset(),
) -> bool:
    """Whether ``files`` hold a matching, CA-issued, not-yet-due, not revoked leaf for ``identity``."""
    try:
        cert, key = read_cert(files.cert), read_key(files.key)
        cert.verify_directly_issued_by(ca_cert)
        if identity_from_certificate(cert) != identity or key.public_key() != cert.public_key():
            return False
        if cert.serial_number in revoked:  # `nebula pki revoke`: the next start/pki-init issues a new one
            return False
        return files.ca.read_bytes() == cert_pem(ca_cert) and not renewal_due(cert)
    except (PkiError, OSError, ValueError, TypeError, InvalidSignature):
        return False


def _write(
    files: ServiceTlsFiles, ca_cert: x509.Certificate, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> None:
    """CA first, then key, then certificate: a reader between the last two sees a mismatched pair,
    which the server-side loader refuses until the certificate follows (never a torn pair)."""
    files.dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    atomic_write(files.ca, cert_pem(ca_cert), mode=0o644)
    atomic_write(files.key, key_pem(key), mode=0o600)
    atomic_write(files.cert, cert_pem(cert), mode=0o644)


def _audit(paths: ClusterPaths, event: str, cert: x509.Certificate, by: str) -> None:
    with (
        contextlib.suppress(OSError),
        open_service_audit(paths.audit_dir, service="pki", cluster=paths.cluster_id, seal_every=1) as audit,
    ):
        audit.append(
            event,
            details={
                "serial": f"{cert.serial_number:x}",
                "identity": identity_from_certificate(cert).uri,
                "not_after": cert.not_valid_after_utc.isoformat(),
                "by": by,
            },
        )


def issue_from_ca(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    files: ServiceTlsFiles,
    identity: Identity,
    *,
    validity: timedelta = DEFAULT_SERVICE_VALIDITY,
) -> x509.Certificate:
    """Issue ``identity`` a fresh key and leaf into ``files`` (no lock, no audit: callers do both)."""
    cert, key = issue_certificate(ca_cert, ca_key, identity, validity=validity)
    _write(files, ca_cert, cert, key)
    return cert


def issue_service_certificate(
    pki_root: Path,
    cluster_id: str,
    service: str,
    *,
    validity: timedelta = DEFAULT_SERVICE_VALIDITY,
    by: str = "nebula pki",
) -> ServiceTlsFiles:
    """Issue (or re-issue) ``service`` of ``cluster_id`` a new leaf in its local directory; audited."""
    _check_service(service)
    paths = ClusterPaths.for_cluster(Path(pki_root), cluster_id)
    files = ServiceTlsFiles.in_dir(service_tls_dir(pki_root, cluster_id, service))
    with exclusive(Path(pki_root)):
        ca_cert, ca_key = read_cert(paths.ca_cert), read_key(paths.ca_key)
        cert = issue_from_ca(ca_cert, ca_key, files, Identity(cluster_id, service), validity=validity)
    _audit(paths, "cert.issue", cert, by)
    return files


def ensure_service_certificates(
    pki_root: Path,
    cluster_id: str,
    services: tuple[str, ...] = LAUNCHED_IDENTITIES,
    *,
    validity: timedelta = DEFAULT_SERVICE_VALIDITY,
) -> dict[str, ServiceTlsFiles]:
    """Every service of ``cluster_id`` with a usable leaf: kept when still good, else (re)issued.

    A leaf the cluster CA's CRL lists (``nebula pki revoke``) is not good: it is replaced.

    ``nebula local up`` calls this on every start, so a reused run directory keeps its leaves
    until a third of their life is left, and a regenerated CA gets new leaves at once.
    """
    for service in services:
        _check_service(service)
    paths = ClusterPaths.for_cluster(Path(pki_root), cluster_id)
    result: dict[str, ServiceTlsFiles] = {}
    issued: list[x509.Certificate] = []
    with exclusive(Path(pki_root)):
        ca_cert, ca_key = read_cert(paths.ca_cert), read_key(paths.ca_key)
        revoked = _revoked_serials(paths.crl, ca_cert)
        for service in services:
            files = ServiceTlsFiles.in_dir(service_tls_dir(pki_root, cluster_id, service))
            identity = Identity(cluster_id, service)
            if not _usable(files, ca_cert, identity, revoked):
                issued.append(issue_from_ca(ca_cert, ca_key, files, identity, validity=validity))
            result[service] = files
    for cert in issued:
        _audit(paths, "cert.issue", cert, "nebula local up")
    return result


def mirror_crl(
    pki_root: Path, cluster_id: str, services: tuple[str, ...] = LAUNCHED_IDENTITIES
) -> list[Path]:
    """Copy the cluster CA's CRL into each service's own directory where it differs; the copies written.

    A service boxed by the launcher (``launcher/service_box.py``) sees its own directory and not the
    cluster's, which holds keys that are not its own; the launcher keeps this copy current so that
    ``nebula pki revoke`` still reaches its internal ports.
    """
    source = ClusterPaths.for_cluster(Path(pki_root), cluster_id).crl
    try:
        content = source.read_bytes()
    except FileNotFoundError:
        return []
    written = []
    for service in services:
        target = service_tls_dir(pki_root, cluster_id, service) / CRL_FILE
        if target.parent.is_dir() and (not target.exists() or target.read_bytes() != content):
            atomic_write(target, content, mode=0o644)
            written.append(target)
    return written
