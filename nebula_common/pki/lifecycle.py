"""A cluster's certificates after ``init``: revoke (and publish the CRL), renew the switch, issue leaves.

Each write is atomic and, where it touches what a running switch reads, under the PKI root's lock
(``store._exclusive``); every operation is sealed into the cluster's PKI audit log at once.
"""

from __future__ import annotations

import contextlib
from datetime import UTC, datetime, timedelta
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from nebula_common.audit import open_service_audit
from nebula_common.durable import atomic_write
from nebula_common.pki.ca import DEFAULT_LEAF_VALIDITY, issue_certificate
from nebula_common.pki.crl import build_crl, crl_entries, crl_number
from nebula_common.pki.identity import Identity
from nebula_common.pki.layout import (
    ClusterPaths,
    PkiError,
    cert_fingerprint,
    cert_pem,
    key_pem,
    read_cert,
    read_key,
)
from nebula_common.pki.store import CERT_MODE, KEY_MODE, audit_ca, exclusive, require_positive_validity

__all__ = ["issue_leaf", "renew_switch_certificate", "revoke_certificate"]


def _publish_crl(root: Path, cluster_id: str, pem: bytes) -> list[Path]:
    """Copy ``cluster_id``'s CRL next to its CA in every other cluster of ``root`` that trusts it."""
    own_ca = cert_fingerprint(read_cert(ClusterPaths.for_cluster(root, cluster_id).ca_cert))
    written = []
    for other in sorted(p for p in root.iterdir() if p.is_dir() and p.name != cluster_id):
        try:
            peer_paths = ClusterPaths.for_cluster(root, other.name)
        except ValueError:
            continue
        trusted = peer_paths.trust_cert(cluster_id)
        if trusted.is_file() and cert_fingerprint(read_cert(trusted)) == own_ca:
            atomic_write(peer_paths.trust_crl(cluster_id), pem, mode=CERT_MODE)
            written.append(peer_paths.trust_crl(cluster_id))
    return written


def revoke_certificate(root: Path, cluster_id: str, serial: int, *, reason: str = "") -> list[Path]:
    """Add ``serial`` (a certificate issued by ``cluster_id``'s CA) to that CA's CRL and publish it.

    Returns the files written: the cluster's own ``crl.pem`` and each peer's ``trust/<id>.crl.pem``
    (the copy the peer's switch loads within about a second). Revoking twice is harmless.
    """
    if serial <= 0:
        raise PkiError(f"certificate serial must be a positive integer, got {serial}")
    root = Path(root)
    paths = ClusterPaths.for_cluster(root, cluster_id)
    with exclusive(root):
        ca_cert, ca_key = read_cert(paths.ca_cert), read_key(paths.ca_key)
        entries: dict[int, datetime] = {}
        number = 1
        if paths.crl.is_file():
            try:
                existing = x509.load_pem_x509_crl(paths.crl.read_bytes())
            except ValueError as exc:
                raise PkiError(f"{paths.crl} is not a PEM CRL: {exc}") from exc
            entries, number = crl_entries(existing), crl_number(existing) + 1
        entries.setdefault(serial, datetime.now(UTC))
        pem = build_crl(ca_cert, ca_key, entries, number=number).public_bytes(serialization.Encoding.PEM)
        atomic_write(paths.crl, pem, mode=CERT_MODE)
        written = [paths.crl, *_publish_crl(root, cluster_id, pem)]
        with (
            contextlib.suppress(OSError),
            open_service_audit(paths.audit_dir, service="pki", cluster=cluster_id, seal_every=1) as audit,
        ):
            audit.append(
                "cert.revoke",
                details={"serial": f"{serial:x}", "reason": reason, "crl_number": number},
            )
    return written


def renew_switch_certificate(root: Path, cluster_id: str, *, validity: timedelta) -> x509.Certificate:
    """Issue ``cluster_id``'s switch a fresh key and certificate (a running switch hot-reloads them).

    The key is written before the certificate; a switch that reads between the two writes sees a
    key that does not match the certificate, rejects the pair and retries, so it never serves a
    mismatched pair.
    """
    require_positive_validity(validity)
    root = Path(root)
    paths = ClusterPaths.for_cluster(root, cluster_id)
    with exclusive(root):
        ca_cert, ca_key = read_cert(paths.ca_cert), read_key(paths.ca_key)
        cert, key = issue_certificate(ca_cert, ca_key, paths.switch_identity, validity=validity)
        atomic_write(paths.switch_key, key_pem(key), mode=KEY_MODE)
        atomic_write(paths.switch_cert, cert_pem(cert), mode=CERT_MODE)
        audit_ca(paths, "cert.renew", cert, detail={"by": "nebula pki renew"})
    return cert


def issue_leaf(
    root: Path, cluster_id: str, role: str, out_dir: Path, *, validity: timedelta = DEFAULT_LEAF_VALIDITY
) -> tuple[Path, Path]:
    """Issue a service or operator certificate of ``cluster_id`` into ``out_dir``; (cert, key) paths."""
    require_positive_validity(validity)
    identity = Identity(cluster_id, role)
    paths = ClusterPaths.for_cluster(Path(root), cluster_id)
    ca_cert, ca_key = read_cert(paths.ca_cert), read_key(paths.ca_key)
    cert, key = issue_certificate(ca_cert, ca_key, identity, validity=validity)
    out_dir = Path(out_dir)
    cert_path, key_path = out_dir / f"{role}.crt", out_dir / f"{role}.key"
    atomic_write(key_path, key_pem(key), mode=KEY_MODE)
    atomic_write(cert_path, cert_pem(cert), mode=CERT_MODE)
    audit_ca(paths, "cert.issue", cert, detail={"by": "nebula pki issue", "role": role})
    return cert_path, key_path
