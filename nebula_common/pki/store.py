"""The only code that writes the dev PKI (its layout and checks: ``layout.py``).

One organisation's root holds one cluster (:func:`init_cluster`, then :func:`add_trust` per peer
CA received out of band); the demo :func:`init_pki` runs the same steps for several clusters.

Every write goes through :func:`nebula_common.durable.atomic_write` (temporary file in the target
directory, fsynced, then ``os.replace``d into place), so a crash leaves either the old or the new
file, never a torn one. Key files are created with mode 0600 from their first byte, so they are
never readable by others, even briefly.
"""

from __future__ import annotations

import contextlib
import fcntl
import hmac
import os
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import NamedTuple

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from nebula_common.audit import open_service_audit
from nebula_common.durable import atomic_write
from nebula_common.pki.ca import DEFAULT_LEAF_VALIDITY, create_ca, issue_certificate
from nebula_common.pki.crl import build_crl
from nebula_common.pki.fingerprint import format_fingerprint
from nebula_common.pki.identity import (
    cluster_dns_domain,
    identity_from_certificate,
    validate_cluster_id,
)
from nebula_common.pki.layout import (
    ClusterPaths,
    FingerprintMismatch,
    PkiError,
    PkiLayout,
    ca_problem,
    cert_fingerprint,
    cert_pem,
    check_own,
    key_pem,
    load_layout,
    peers_of,
    read_cert,
    read_key,
    validate_clusters,
)
from nebula_common.pki.pins import permitted_domains, pinned_pem

__all__ = [
    "ClusterPaths",
    "FingerprintMismatch",
    "PkiError",
    "PkiLayout",
    "add_trust",
    "init_cluster",
    "init_pki",
    "load_layout",
    "remove_trust",
]

KEY_MODE = 0o600
_LOCK_NAME = ".pki.lock"
CERT_MODE = 0o644


class _ClusterMaterial(NamedTuple):
    ca_cert: x509.Certificate
    ca_key: ec.EllipticCurvePrivateKey
    switch_cert: x509.Certificate
    switch_key: ec.EllipticCurvePrivateKey


@contextlib.contextmanager
def exclusive(root: Path) -> Iterator[None]:
    """Serialise writers of one PKI root across processes.

    Two ``nebula demo`` runs starting at once would otherwise both generate CAs and interleave
    their files into a layout where, say, a's switch certificate was signed by the other run's CA.
    """
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / _LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _write_bundle(paths: ClusterPaths) -> None:
    """Rebuild trust-bundle.pem from trust/*.crt (sorted, so the output is deterministic), each CA
    pinned to the peer it was added for (nebula_common/pki/pins.py)."""
    pem = b"".join(pinned_pem(p.stem, read_cert(p)) for p in sorted(paths.trust_dir.glob("*.crt")))
    atomic_write(paths.trust_bundle, pem, mode=CERT_MODE)


def init_pki(
    root: Path,
    clusters: Sequence[str],
    *,
    leaf_validity: timedelta = DEFAULT_LEAF_VALIDITY,
    force: bool = False,
) -> PkiLayout:
    """Create (or reuse) a dev PKI: a CA per cluster, a switch leaf each, and pairwise trust.

    Without ``force`` a complete, consistent existing layout is returned untouched (so callers like
    ``nebula demo`` may call this on every start), while any partial or inconsistent layout is an
    error: silently replacing a CA would break every peer that already trusts it. An existing but
    expired switch certificate is also an error, because reusing it would only fail later in a TLS
    handshake with a far less helpful message. ``force=True`` regenerates everything for the listed
    clusters; CAs of other organisations already in ``trust/`` are kept.
    """
    ids = validate_clusters(clusters, minimum=2)
    require_positive_validity(leaf_validity)
    root = Path(root)
    with exclusive(root):
        return _init_locked(root, ids, leaf_validity=leaf_validity, force=force)


def _init_locked(root: Path, ids: tuple[str, ...], *, leaf_validity: timedelta, force: bool) -> PkiLayout:
    """Body of :func:`init_pki`; must run under :func:`exclusive` so the existence check holds."""
    layout = PkiLayout(root, ids)

    if not force:
        existing = [
            path
            for cid in ids
            for path in layout.cluster(cid).required_files(peers_of(cid, ids))
            if path.exists() or path.is_symlink()
        ]
        if existing:
            try:
                loaded = load_layout(root, ids)
            except PkiError as exc:
                raise PkiError(
                    f"{exc}. Refusing to overwrite the existing PKI at {root}; "
                    "rerun with force=True (nebula pki init --force) to regenerate all of it"
                ) from exc
            now = datetime.now(UTC)
            for cid in ids:
                cert = read_cert(loaded.cluster(cid).switch_cert)
                if cert.not_valid_after_utc <= now:
                    raise PkiError(
                        f"switch certificate {loaded.cluster(cid).switch_cert} expired at "
                        f"{cert.not_valid_after_utc.isoformat()}; rerun with force=True "
                        "(nebula pki init --force) to regenerate the PKI"
                    )
            for cid in ids:
                _ensure_crl(loaded, cid)
            return loaded

    # Built on the per-organisation steps: each cluster creates its own CA and switch (what one
    # organisation runs alone, `nebula pki init --cluster`), then each trusts the others' CA
    # certificates (the exchange two organisations do by hand, `nebula pki trust add`). No step
    # reads another cluster's private key.
    for cid in ids:
        _init_cluster_locked(root, cid, leaf_validity=leaf_validity, force=True)
    for cid in ids:
        for peer in peers_of(cid, ids):
            _add_trust_locked(root, cid, peer, read_cert(layout.cluster(peer).ca_cert))

    loaded = load_layout(root, ids)
    loaded.created = True
    for cid in ids:
        _ensure_crl(loaded, cid)
    return loaded


def init_cluster(
    root: Path,
    cluster_id: str,
    *,
    leaf_validity: timedelta = DEFAULT_LEAF_VALIDITY,
    force: bool = False,
) -> tuple[ClusterPaths, bool]:
    """Create (or reuse) ONE organisation's PKI: its CA, its switch certificate and an empty CRL.

    Returns the cluster's paths and whether anything was generated. Nothing about any peer is read
    or written: trust comes later, one CA certificate at a time (:func:`add_trust`). Without
    ``force`` a consistent existing CA and switch pair is reused and a partial or inconsistent one
    is an error (replacing a CA silently would break every peer that trusts it); ``force``
    regenerates the CA and switch and keeps the peers already trusted.
    """
    validate_cluster_id(cluster_id)
    require_positive_validity(leaf_validity)
    root = Path(root)
    with exclusive(root):
        created = _init_cluster_locked(root, cluster_id, leaf_validity=leaf_validity, force=force)
    return ClusterPaths.for_cluster(root, cluster_id), created


def _init_cluster_locked(root: Path, cluster_id: str, *, leaf_validity: timedelta, force: bool) -> bool:
    paths = ClusterPaths.for_cluster(root, cluster_id)
    own = (paths.ca_cert, paths.ca_key, paths.switch_cert, paths.switch_key)
    if not force and any(path.exists() or path.is_symlink() for path in own):
        try:
            check_own(paths)
        except PkiError as exc:
            raise PkiError(
                f"{exc}. Refusing to overwrite the existing PKI of cluster {cluster_id!r} at {root}; "
                "rerun with --force to regenerate its CA and switch certificate"
            ) from exc
        cert = read_cert(paths.switch_cert)
        if cert.not_valid_after_utc <= datetime.now(UTC):
            raise PkiError(
                f"switch certificate {paths.switch_cert} expired at {cert.not_valid_after_utc.isoformat()}; "
                "renew it (nebula pki renew) or rerun init with --force"
            )
        paths.trust_dir.mkdir(exist_ok=True)
        if not paths.crl.is_file():
            _write_empty_crl(paths)
        return False

    # Generate in memory first so a failure (e.g. bad input) writes nothing.
    ca_cert, ca_key = create_ca(cluster_id)
    leaf_cert, leaf_key = issue_certificate(ca_cert, ca_key, paths.switch_identity, validity=leaf_validity)
    paths.dir.mkdir(parents=True, exist_ok=True)
    paths.trust_dir.mkdir(exist_ok=True)
    # A file named after our own cluster in trust/ would put our own CA on the WAN trust list.
    paths.trust_cert(cluster_id).unlink(missing_ok=True)
    atomic_write(paths.ca_key, key_pem(ca_key), mode=KEY_MODE)
    atomic_write(paths.ca_cert, cert_pem(ca_cert), mode=CERT_MODE)
    atomic_write(paths.switch_key, key_pem(leaf_key), mode=KEY_MODE)
    atomic_write(paths.switch_cert, cert_pem(leaf_cert), mode=CERT_MODE)
    # A new CA starts with an empty revocation list (the old CA's list means nothing for it).
    _write_empty_crl(paths)
    _write_bundle(paths)
    audit_ca(paths, "cert.issue", leaf_cert, detail={"by": "pki init"})
    return True


def _write_empty_crl(paths: ClusterPaths) -> None:
    crl = build_crl(read_cert(paths.ca_cert), read_key(paths.ca_key), {}, number=1)
    atomic_write(paths.crl, crl.public_bytes(serialization.Encoding.PEM), mode=CERT_MODE)


def require_positive_validity(validity: timedelta) -> None:
    if validity <= timedelta(0):
        raise ValueError(f"leaf validity must be positive, got {validity}")


def add_trust(
    root: Path,
    cluster_id: str,
    peer_cluster_id: str,
    peer_ca_pem: bytes,
    *,
    expected_fingerprint: bytes | None = None,
) -> Path:
    """Make ``cluster_id`` trust ``peer_cluster_id``'s CA on the WAN; returns the file written.

    This is the manual trust exchange between organisations that do not share a PKI root: each
    side hands the other its ``ca.crt`` out of band. The PEM must hold exactly one self-signed,
    unexpired CA certificate: a leaf here would not work as an anchor, and a bundle could smuggle in
    extra anchors. A CA name-constrained to another cluster's domain is refused (it could never
    certify this peer); any other CA is pinned to ``peer_cluster_id`` in the bundle, so the switch
    accepts it for that peer's identities and CRLs only, never another's. Replacing an existing
    ``trust/<peer>.crt`` is allowed (that is CA rotation).

    ``expected_fingerprint`` (SHA-256 of the certificate, compared out of band) is checked before
    anything is written: a mismatch raises :class:`FingerprintMismatch` and leaves the disk as it was.
    """
    validate_cluster_id(cluster_id)
    validate_cluster_id(peer_cluster_id)
    if cluster_id == peer_cluster_id:
        raise PkiError(f"cluster {cluster_id!r} must not trust its own CA on the WAN")
    paths = ClusterPaths.for_cluster(Path(root), cluster_id)
    if not paths.ca_cert.is_file():
        raise PkiError(f"no PKI for cluster {cluster_id!r}: missing {paths.ca_cert} (run init first)")
    try:
        certs = x509.load_pem_x509_certificates(peer_ca_pem)
    except ValueError as exc:
        raise PkiError(f"CA for peer {peer_cluster_id!r} is not PEM certificate data: {exc}") from exc
    if len(certs) != 1:
        raise PkiError(f"expected exactly one CA certificate for peer {peer_cluster_id!r}, got {len(certs)}")
    peer_ca = certs[0]
    if expected_fingerprint is not None and not hmac.compare_digest(
        cert_fingerprint(peer_ca), expected_fingerprint
    ):
        raise FingerprintMismatch(
            f"fingerprint mismatch for peer {peer_cluster_id!r}: the certificate given has "
            f"{format_fingerprint(peer_ca)}, but the fingerprint you were told is "
            f"SHA256:{expected_fingerprint.hex(':').upper()}. Nothing was written; do not trust this file "
            "and compare fingerprints with the peer organisation again over a second channel"
        )
    if (problem := ca_problem(peer_ca)) is not None:
        raise PkiError(f"refusing to trust the certificate given for peer {peer_cluster_id!r}: {problem}")
    if cert_fingerprint(peer_ca) == cert_fingerprint(read_cert(paths.ca_cert)):
        raise PkiError(
            f"the certificate given for peer {peer_cluster_id!r} is cluster {cluster_id!r}'s own CA"
        )
    if (domains := permitted_domains(peer_ca)) is not None and domains != [
        cluster_dns_domain(peer_cluster_id)
    ]:
        raise PkiError(
            f"the CA given for peer {peer_cluster_id!r} may only certify {', '.join(domains) or 'nothing'}, "
            f"not {cluster_dns_domain(peer_cluster_id)}: it is another cluster's CA"
        )
    with exclusive(Path(root)):
        return _add_trust_locked(Path(root), cluster_id, peer_cluster_id, peer_ca)


def _add_trust_locked(root: Path, cluster_id: str, peer_cluster_id: str, peer_ca: x509.Certificate) -> Path:
    paths = ClusterPaths.for_cluster(root, cluster_id)
    target = paths.trust_cert(peer_cluster_id)
    replaced = target.is_file()
    atomic_write(target, cert_pem(peer_ca), mode=CERT_MODE)
    _write_bundle(paths)
    _audit_trust(paths, "trust.add", peer_cluster_id, peer_ca, replaced=replaced)
    return target


def remove_trust(root: Path, cluster_id: str, peer_cluster_id: str) -> list[Path]:
    """Stop trusting ``peer_cluster_id``'s CA (offboarding); returns the files removed.

    The CA and its CRL copy leave ``trust/`` and the bundle is rebuilt without it. A running switch
    watches its bundle and closes a link whose peer no longer chains to a trusted CA within seconds
    (services/switch/peer_trust.py).
    """
    validate_cluster_id(cluster_id)
    validate_cluster_id(peer_cluster_id)
    root = Path(root)
    paths = ClusterPaths.for_cluster(root, cluster_id)
    target = paths.trust_cert(peer_cluster_id)
    with exclusive(root):
        if not target.is_file():
            raise PkiError(f"cluster {cluster_id!r} does not trust peer {peer_cluster_id!r}: no {target}")
        cert = read_cert(target)
        removed = [target]
        target.unlink()
        crl_copy = paths.trust_crl(peer_cluster_id)
        if crl_copy.is_file():
            crl_copy.unlink()
            removed.append(crl_copy)
        _write_bundle(paths)
        _audit_trust(paths, "trust.remove", peer_cluster_id, cert)
    return removed


def _audit_trust(paths: ClusterPaths, event: str, peer: str, ca: x509.Certificate, **detail: object) -> None:
    """Record a trust change in the cluster's PKI audit log, with the fingerprint that was trusted."""
    with open_service_audit(paths.audit_dir, service="pki", cluster=paths.cluster_id, seal_every=1) as audit:
        audit.append(
            event,
            details={
                "peer": peer,
                "fingerprint": format_fingerprint(ca),
                "subject": ca.subject.rfc4514_string(),
                **detail,
            },
        )


# --------------------------------------------------------------------------------------------------
# Audit and CRLs


def audit_ca(paths: ClusterPaths, event: str, cert: x509.Certificate, *, detail: dict[str, object]) -> None:
    """Record a CA operation in ``<cluster>/audit/audit.log`` (sealed at once: CA operations are rare)."""
    try:
        identity = identity_from_certificate(cert).uri
    except ValueError:
        identity = ""
    with open_service_audit(paths.audit_dir, service="pki", cluster=paths.cluster_id, seal_every=1) as audit:
        audit.append(
            event,
            details={
                "serial": f"{cert.serial_number:x}",
                "identity": identity,
                "not_after": cert.not_valid_after_utc.isoformat(),
                **detail,
            },
        )


def _ensure_crl(layout: PkiLayout, cluster_id: str) -> None:
    """Give a cluster an (empty) CRL if it has none yet, and make sure its peers hold a copy."""
    paths = layout.cluster(cluster_id)
    if not paths.crl.is_file():
        crl = build_crl(read_cert(paths.ca_cert), read_key(paths.ca_key), {}, number=1)
        atomic_write(paths.crl, crl.public_bytes(serialization.Encoding.PEM), mode=CERT_MODE)
    pem = paths.crl.read_bytes()
    for peer in layout.cluster_ids:
        if peer == cluster_id:
            continue
        copy = layout.cluster(peer).trust_crl(cluster_id)
        if not copy.is_file() or copy.read_bytes() != pem:
            atomic_write(copy, pem, mode=CERT_MODE)
