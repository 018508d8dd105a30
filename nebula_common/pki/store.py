"""On-disk layout of the dev PKI, and the only code that writes it.

Layout under a PKI root::

    <root>/<cluster>/ca.crt              PEM CA certificate
    <root>/<cluster>/ca.key              PEM PKCS#8 CA key (0600)
    <root>/<cluster>/switch.crt          PEM leaf of the cluster's switch
    <root>/<cluster>/switch.key          PEM PKCS#8 leaf key (0600)
    <root>/<cluster>/trust/<peer>.crt    a peer cluster's CA, trusted on the WAN
    <root>/<cluster>/trust-bundle.pem    all trust/*.crt concatenated (gRPC root_certificates), each
                                         pinned to its peer (``Nebula-Peer: <id>``, pki/pins.py)
    <root>/<cluster>/crl.pem             CRL signed by this cluster's CA (``nebula pki revoke``)
    <root>/<cluster>/trust/<peer>.crl.pem    the peer CA's CRL (demo layout with every cluster in one
                                         root; between organisations the switch receives it over
                                         the WAN port instead, services/switch/crl_exchange.py)
    <root>/<cluster>/audit/              audit log of CA operations (issue, renew, revoke) and trust
                                         changes (trust.add, trust.remove, with fingerprints)

One organisation's root holds one cluster (:func:`init_cluster`, then :func:`add_trust` per peer
CA received out of band); the demo :func:`init_pki` runs the same steps for several clusters.

A cluster never trusts its own CA on the WAN: only the peer's switch should be able to connect,
and a cluster-local certificate has no business on the inter-cluster link.

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
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import NamedTuple

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from nebula_common.audit import open_service_audit
from nebula_common.durable import atomic_write
from nebula_common.pki.ca import DEFAULT_LEAF_VALIDITY, create_ca, issue_certificate
from nebula_common.pki.crl import build_crl, crl_entries, crl_number
from nebula_common.pki.fingerprint import format_fingerprint
from nebula_common.pki.identity import (
    Identity,
    cluster_dns_domain,
    identity_from_certificate,
    validate_cluster_id,
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
    "issue_leaf",
    "load_layout",
    "remove_trust",
    "renew_switch_certificate",
    "revoke_certificate",
]

_KEY_MODE = 0o600
_LOCK_NAME = ".pki.lock"
_CERT_MODE = 0o644


class PkiError(Exception):
    """The PKI on disk is missing, incomplete, inconsistent, or would be overwritten."""


class FingerprintMismatch(PkiError):
    """A CA certificate offered for trust is not the one whose fingerprint was compared out of band."""


@dataclass(frozen=True)
class ClusterPaths:
    """Where one cluster's PKI material lives. Pure path arithmetic: nothing is read or checked."""

    cluster_id: str
    dir: Path
    ca_cert: Path
    ca_key: Path
    switch_cert: Path
    switch_key: Path
    trust_dir: Path
    trust_bundle: Path
    crl: Path
    audit_dir: Path

    @classmethod
    def for_cluster(cls, root: Path, cluster_id: str) -> ClusterPaths:
        """Paths for ``cluster_id`` under ``root`` (the id is validated so it cannot escape root)."""
        validate_cluster_id(cluster_id)
        base = Path(root) / cluster_id
        return cls(
            cluster_id=cluster_id,
            dir=base,
            ca_cert=base / "ca.crt",
            ca_key=base / "ca.key",
            switch_cert=base / "switch.crt",
            switch_key=base / "switch.key",
            trust_dir=base / "trust",
            trust_bundle=base / "trust-bundle.pem",
            crl=base / "crl.pem",
            audit_dir=base / "audit",
        )

    @property
    def switch_identity(self) -> Identity:
        """The identity this cluster's switch certificate must carry."""
        return Identity(self.cluster_id, "switch")

    def trust_cert(self, peer_cluster_id: str) -> Path:
        """Where the CA of ``peer_cluster_id`` is stored when this cluster trusts it."""
        return self.trust_dir / f"{validate_cluster_id(peer_cluster_id)}.crt"

    def trust_crl(self, peer_cluster_id: str) -> Path:
        """Where the CRL of ``peer_cluster_id``'s CA is kept for this cluster's switch to load."""
        return self.trust_dir / f"{validate_cluster_id(peer_cluster_id)}.crl.pem"

    def required_files(self, peers: Iterable[str]) -> list[Path]:
        """Every file that must exist for this cluster's PKI to be complete, given its peers."""
        return [
            self.ca_cert,
            self.ca_key,
            self.switch_cert,
            self.switch_key,
            *(self.trust_cert(peer) for peer in peers),
            self.trust_bundle,
        ]


class PkiLayout:
    """A loaded PKI root: the set of clusters it was loaded for and their paths."""

    def __init__(self, root: Path, cluster_ids: Sequence[str], *, created: bool = False) -> None:
        self.root = Path(root)
        self.cluster_ids: tuple[str, ...] = tuple(cluster_ids)
        #: True when this layout was just generated, False when an existing one was reused.
        self.created = created
        self._paths = {cid: ClusterPaths.for_cluster(self.root, cid) for cid in self.cluster_ids}

    def cluster(self, cluster_id: str) -> ClusterPaths:
        """Paths of one cluster of this layout; unknown clusters are an error, not a guess."""
        try:
            return self._paths[cluster_id]
        except KeyError:
            raise PkiError(
                f"cluster {cluster_id!r} is not part of the PKI layout at {self.root} "
                f"(clusters: {', '.join(self.cluster_ids)})"
            ) from None

    def __repr__(self) -> str:
        return f"PkiLayout(root={str(self.root)!r}, clusters={self.cluster_ids!r}, created={self.created})"


# --------------------------------------------------------------------------------------------------
# Encoding


def _cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _fingerprint(cert: x509.Certificate) -> bytes:
    return cert.fingerprint(hashes.SHA256())


# --------------------------------------------------------------------------------------------------
# Reading and checking


def _read_cert(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except FileNotFoundError:
        raise PkiError(f"missing certificate {path}") from None
    except ValueError as exc:
        raise PkiError(f"{path} is not a PEM certificate: {exc}") from exc


def _read_key(path: Path) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except FileNotFoundError:
        raise PkiError(f"missing private key {path}") from None
    except (ValueError, TypeError) as exc:
        raise PkiError(f"{path} is not an unencrypted PEM private key: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PkiError(f"{path} is not an ECDSA private key")
    return key


def _ca_problem(cert: x509.Certificate) -> str | None:
    """Why ``cert`` cannot serve as a trust anchor, or None if it can."""
    try:
        constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        return "it has no basicConstraints extension, so it is not a CA certificate"
    if not constraints.ca:
        return "it is not a CA certificate (basicConstraints CA=false)"
    try:
        usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        usage = None
    if usage is not None and not usage.key_cert_sign:
        return "its keyUsage does not allow signing certificates"
    try:
        cert.verify_directly_issued_by(cert)
    except (InvalidSignature, ValueError, TypeError) as exc:
        return f"it is not a self-signed root CA ({exc.__class__.__name__})"
    if cert.not_valid_after_utc <= datetime.now(UTC):
        return f"it expired at {cert.not_valid_after_utc.isoformat()}"
    return None


def _check_own(paths: ClusterPaths) -> None:
    """Raise ``PkiError`` unless ``paths`` holds a consistent CA and switch pair (trust not checked).

    This is all one organisation needs before it has exchanged CAs with anybody.
    """
    for required in (paths.ca_cert, paths.ca_key, paths.switch_cert, paths.switch_key):
        if not required.is_file():
            raise PkiError(f"PKI for cluster {paths.cluster_id!r} is incomplete: missing {required}")
    ca_cert = _read_cert(paths.ca_cert)
    if (problem := _ca_problem(ca_cert)) is not None:
        raise PkiError(f"{paths.ca_cert} cannot be used as the cluster CA: {problem}")
    if _read_key(paths.ca_key).public_key() != ca_cert.public_key():
        raise PkiError(f"{paths.ca_key} does not match {paths.ca_cert}")

    switch_cert = _read_cert(paths.switch_cert)
    try:
        switch_cert.verify_directly_issued_by(ca_cert)
    except (InvalidSignature, ValueError, TypeError) as exc:
        raise PkiError(f"{paths.switch_cert} was not issued by {paths.ca_cert} ({exc})") from exc
    try:
        identity = identity_from_certificate(switch_cert)
    except ValueError as exc:
        raise PkiError(f"{paths.switch_cert}: {exc}") from exc
    if identity != paths.switch_identity:
        raise PkiError(f"{paths.switch_cert} names {identity.uri}, expected {paths.switch_identity.uri}")
    if _read_key(paths.switch_key).public_key() != switch_cert.public_key():
        raise PkiError(f"{paths.switch_key} does not match {paths.switch_cert}")


def _check_cluster(paths: ClusterPaths, peers: Sequence[str]) -> None:
    """Raise ``PkiError`` unless ``paths`` holds a complete, self-consistent PKI for its cluster.

    Catching a mismatched key, a foreign leaf, or a stale bundle here turns what would be an
    opaque TLS handshake failure at run time into an error naming the offending file.
    """
    for required in paths.required_files(peers):
        if not required.is_file():
            raise PkiError(f"PKI for cluster {paths.cluster_id!r} is incomplete: missing {required}")
    _check_own(paths)
    ca_cert = _read_cert(paths.ca_cert)

    trusted: set[bytes] = set()
    for trust_file in sorted(paths.trust_dir.glob("*.crt")):
        cert = _read_cert(trust_file)
        if (problem := _ca_problem(cert)) is not None:
            raise PkiError(f"trusted certificate {trust_file} is unusable: {problem}")
        trusted.add(_fingerprint(cert))
    if not trusted:
        raise PkiError(f"cluster {paths.cluster_id!r} trusts no peer CA: {paths.trust_dir} has no *.crt")
    if _fingerprint(ca_cert) in trusted:
        raise PkiError(
            f"{paths.trust_dir} contains cluster {paths.cluster_id!r}'s own CA; it must not be trusted"
        )
    try:
        bundle = {_fingerprint(c) for c in x509.load_pem_x509_certificates(paths.trust_bundle.read_bytes())}
    except ValueError as exc:
        raise PkiError(f"{paths.trust_bundle} is not a PEM certificate bundle: {exc}") from exc
    if bundle != trusted:
        raise PkiError(
            f"{paths.trust_bundle} does not match the certificates in {paths.trust_dir}; it is stale"
        )


def _validate_clusters(clusters: Sequence[str], *, minimum: int) -> tuple[str, ...]:
    if isinstance(clusters, str):
        raise TypeError("clusters must be a sequence of cluster ids, not a single string")
    ids = tuple(clusters)
    for cid in ids:
        validate_cluster_id(cid)
    duplicates = sorted({cid for cid in ids if ids.count(cid) > 1})
    if duplicates:
        raise ValueError(f"duplicate cluster ids: {', '.join(duplicates)}")
    if len(ids) < minimum:
        raise ValueError(f"need at least {minimum} distinct cluster(s), got {len(ids)}: {list(ids)}")
    return ids


def _peers(cluster_id: str, clusters: Sequence[str]) -> list[str]:
    return [peer for peer in clusters if peer != cluster_id]


def load_layout(root: Path, clusters: Sequence[str]) -> PkiLayout:
    """Load and verify an existing PKI for ``clusters`` under ``root``.

    Each cluster must trust every other listed cluster; a single cluster may be loaded on its own
    (a switch only needs its own directory). Expiry of the switch leaf is not checked here so that
    tooling can still load and display an expired layout.
    """
    ids = _validate_clusters(clusters, minimum=1)
    layout = PkiLayout(root, ids)
    for cid in ids:
        _check_cluster(layout.cluster(cid), _peers(cid, ids))
    return layout


class _ClusterMaterial(NamedTuple):
    ca_cert: x509.Certificate
    ca_key: ec.EllipticCurvePrivateKey
    switch_cert: x509.Certificate
    switch_key: ec.EllipticCurvePrivateKey


@contextlib.contextmanager
def _exclusive(root: Path) -> Iterator[None]:
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
    pem = b"".join(pinned_pem(p.stem, _read_cert(p)) for p in sorted(paths.trust_dir.glob("*.crt")))
    atomic_write(paths.trust_bundle, pem, mode=_CERT_MODE)


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
    ids = _validate_clusters(clusters, minimum=2)
    _require_positive_validity(leaf_validity)
    root = Path(root)
    with _exclusive(root):
        return _init_locked(root, ids, leaf_validity=leaf_validity, force=force)


def _init_locked(root: Path, ids: tuple[str, ...], *, leaf_validity: timedelta, force: bool) -> PkiLayout:
    """Body of :func:`init_pki`; must run under :func:`_exclusive` so the existence check holds."""
    layout = PkiLayout(root, ids)

    if not force:
        existing = [
            path
            for cid in ids
            for path in layout.cluster(cid).required_files(_peers(cid, ids))
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
                cert = _read_cert(loaded.cluster(cid).switch_cert)
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
        for peer in _peers(cid, ids):
            _add_trust_locked(root, cid, peer, _read_cert(layout.cluster(peer).ca_cert))

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
    _require_positive_validity(leaf_validity)
    root = Path(root)
    with _exclusive(root):
        created = _init_cluster_locked(root, cluster_id, leaf_validity=leaf_validity, force=force)
    return ClusterPaths.for_cluster(root, cluster_id), created


def _init_cluster_locked(root: Path, cluster_id: str, *, leaf_validity: timedelta, force: bool) -> bool:
    paths = ClusterPaths.for_cluster(root, cluster_id)
    own = (paths.ca_cert, paths.ca_key, paths.switch_cert, paths.switch_key)
    if not force and any(path.exists() or path.is_symlink() for path in own):
        try:
            _check_own(paths)
        except PkiError as exc:
            raise PkiError(
                f"{exc}. Refusing to overwrite the existing PKI of cluster {cluster_id!r} at {root}; "
                "rerun with --force to regenerate its CA and switch certificate"
            ) from exc
        cert = _read_cert(paths.switch_cert)
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
    atomic_write(paths.ca_key, _key_pem(ca_key), mode=_KEY_MODE)
    atomic_write(paths.ca_cert, _cert_pem(ca_cert), mode=_CERT_MODE)
    atomic_write(paths.switch_key, _key_pem(leaf_key), mode=_KEY_MODE)
    atomic_write(paths.switch_cert, _cert_pem(leaf_cert), mode=_CERT_MODE)
    # A new CA starts with an empty revocation list (the old CA's list means nothing for it).
    _write_empty_crl(paths)
    _write_bundle(paths)
    _audit_ca(paths, "cert.issue", leaf_cert, detail={"by": "pki init"})
    return True


def _write_empty_crl(paths: ClusterPaths) -> None:
    crl = build_crl(_read_cert(paths.ca_cert), _read_key(paths.ca_key), {}, number=1)
    atomic_write(paths.crl, crl.public_bytes(serialization.Encoding.PEM), mode=_CERT_MODE)


def _require_positive_validity(validity: timedelta) -> None:
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
        _fingerprint(peer_ca), expected_fingerprint
    ):
        raise FingerprintMismatch(
            f"fingerprint mismatch for peer {peer_cluster_id!r}: the certificate given has "
            f"{format_fingerprint(peer_ca)}, but the fingerprint you were told is "
            f"SHA256:{expected_fingerprint.hex(':').upper()}. Nothing was written; do not trust this file "
            "and compare fingerprints with the peer organisation again over a second channel"
        )
    if (problem := _ca_problem(peer_ca)) is not None:
        raise PkiError(f"refusing to trust the certificate given for peer {peer_cluster_id!r}: {problem}")
    if _fingerprint(peer_ca) == _fingerprint(_read_cert(paths.ca_cert)):
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
    with _exclusive(Path(root)):
        return _add_trust_locked(Path(root), cluster_id, peer_cluster_id, peer_ca)


def _add_trust_locked(root: Path, cluster_id: str, peer_cluster_id: str, peer_ca: x509.Certificate) -> Path:
    paths = ClusterPaths.for_cluster(root, cluster_id)
    target = paths.trust_cert(peer_cluster_id)
    replaced = target.is_file()
    atomic_write(target, _cert_pem(peer_ca), mode=_CERT_MODE)
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
    with _exclusive(root):
        if not target.is_file():
            raise PkiError(f"cluster {cluster_id!r} does not trust peer {peer_cluster_id!r}: no {target}")
        cert = _read_cert(target)
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
# Revocation, renewal and further leaves


def _audit_ca(paths: ClusterPaths, event: str, cert: x509.Certificate, *, detail: dict[str, object]) -> None:
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


def _publish_crl(root: Path, cluster_id: str, pem: bytes) -> list[Path]:
    """Copy ``cluster_id``'s CRL next to its CA in every other cluster of ``root`` that trusts it."""
    own_ca = _fingerprint(_read_cert(ClusterPaths.for_cluster(root, cluster_id).ca_cert))
    written = []
    for other in sorted(p for p in root.iterdir() if p.is_dir() and p.name != cluster_id):
        try:
            peer_paths = ClusterPaths.for_cluster(root, other.name)
        except ValueError:
            continue
        trusted = peer_paths.trust_cert(cluster_id)
        if trusted.is_file() and _fingerprint(_read_cert(trusted)) == own_ca:
            atomic_write(peer_paths.trust_crl(cluster_id), pem, mode=_CERT_MODE)
            written.append(peer_paths.trust_crl(cluster_id))
    return written


def _ensure_crl(layout: PkiLayout, cluster_id: str) -> None:
    """Give a cluster an (empty) CRL if it has none yet, and make sure its peers hold a copy."""
    paths = layout.cluster(cluster_id)
    if not paths.crl.is_file():
        crl = build_crl(_read_cert(paths.ca_cert), _read_key(paths.ca_key), {}, number=1)
        atomic_write(paths.crl, crl.public_bytes(serialization.Encoding.PEM), mode=_CERT_MODE)
    pem = paths.crl.read_bytes()
    for peer in layout.cluster_ids:
        if peer == cluster_id:
            continue
        copy = layout.cluster(peer).trust_crl(cluster_id)
        if not copy.is_file() or copy.read_bytes() != pem:
            atomic_write(copy, pem, mode=_CERT_MODE)


def revoke_certificate(root: Path, cluster_id: str, serial: int, *, reason: str = "") -> list[Path]:
    """Add ``serial`` (a certificate issued by ``cluster_id``'s CA) to that CA's CRL and publish it.

    Returns the files written: the cluster's own ``crl.pem`` and each peer's ``trust/<id>.crl.pem``
    (the copy the peer's switch loads within about a second). Revoking twice is harmless.
    """
    if serial <= 0:
        raise PkiError(f"certificate serial must be a positive integer, got {serial}")
    root = Path(root)
    paths = ClusterPaths.for_cluster(root, cluster_id)
    with _exclusive(root):
        ca_cert, ca_key = _read_cert(paths.ca_cert), _read_key(paths.ca_key)
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
        atomic_write(paths.crl, pem, mode=_CERT_MODE)
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
    _require_positive_validity(validity)
    root = Path(root)
    paths = ClusterPaths.for_cluster(root, cluster_id)
    with _exclusive(root):
        ca_cert, ca_key = _read_cert(paths.ca_cert), _read_key(paths.ca_key)
        cert, key = issue_certificate(ca_cert, ca_key, paths.switch_identity, validity=validity)
        atomic_write(paths.switch_key, _key_pem(key), mode=_KEY_MODE)
        atomic_write(paths.switch_cert, _cert_pem(cert), mode=_CERT_MODE)
        _audit_ca(paths, "cert.renew", cert, detail={"by": "nebula pki renew"})
    return cert


def issue_leaf(
    root: Path, cluster_id: str, role: str, out_dir: Path, *, validity: timedelta = DEFAULT_LEAF_VALIDITY
) -> tuple[Path, Path]:
    """Issue a service or operator certificate of ``cluster_id`` into ``out_dir``; (cert, key) paths."""
    _require_positive_validity(validity)
    identity = Identity(cluster_id, role)
    paths = ClusterPaths.for_cluster(Path(root), cluster_id)
    ca_cert, ca_key = _read_cert(paths.ca_cert), _read_key(paths.ca_key)
    cert, key = issue_certificate(ca_cert, ca_key, identity, validity=validity)
    out_dir = Path(out_dir)
    cert_path, key_path = out_dir / f"{role}.crt", out_dir / f"{role}.key"
    atomic_write(key_path, _key_pem(key), mode=_KEY_MODE)
    atomic_write(cert_path, _cert_pem(cert), mode=_CERT_MODE)
    _audit_ca(paths, "cert.issue", cert, detail={"by": "nebula pki issue", "role": role})
    return cert_path, key_path
