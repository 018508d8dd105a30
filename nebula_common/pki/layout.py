"""Where a cluster's PKI lives on disk, and the checks that say a loaded layout is usable.

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

A cluster never trusts its own CA on the WAN: only the peer's switch should be able to connect,
and a cluster-local certificate has no business on the inter-cluster link. Reading and checking
only: every write is in ``store.py`` (init, trust) and ``lifecycle.py`` (revoke, renew, issue).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from nebula_common.pki.identity import Identity, identity_from_certificate, validate_cluster_id


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


def cert_pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def cert_fingerprint(cert: x509.Certificate) -> bytes:
    return cert.fingerprint(hashes.SHA256())


# --------------------------------------------------------------------------------------------------
# Reading and checking


def read_cert(path: Path) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(path.read_bytes())
    except FileNotFoundError:
        raise PkiError(f"missing certificate {path}") from None
    except ValueError as exc:
        raise PkiError(f"{path} is not a PEM certificate: {exc}") from exc


def read_key(path: Path) -> ec.EllipticCurvePrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except FileNotFoundError:
        raise PkiError(f"missing private key {path}") from None
    except (ValueError, TypeError) as exc:
        raise PkiError(f"{path} is not an unencrypted PEM private key: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PkiError(f"{path} is not an ECDSA private key")
    return key


def ca_problem(cert: x509.Certificate) -> str | None:
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


def check_own(paths: ClusterPaths) -> None:
    """Raise ``PkiError`` unless ``paths`` holds a consistent CA and switch pair (trust not checked).

    This is all one organisation needs before it has exchanged CAs with anybody.
    """
    for required in (paths.ca_cert, paths.ca_key, paths.switch_cert, paths.switch_key):
        if not required.is_file():
            raise PkiError(f"PKI for cluster {paths.cluster_id!r} is incomplete: missing {required}")
    ca_cert = read_cert(paths.ca_cert)
    if (problem := ca_problem(ca_cert)) is not None:
        raise PkiError(f"{paths.ca_cert} cannot be used as the cluster CA: {problem}")
    if read_key(paths.ca_key).public_key() != ca_cert.public_key():
        raise PkiError(f"{paths.ca_key} does not match {paths.ca_cert}")

    switch_cert = read_cert(paths.switch_cert)
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
    if read_key(paths.switch_key).public_key() != switch_cert.public_key():
        raise PkiError(f"{paths.switch_key} does not match {paths.switch_cert}")


def check_cluster(paths: ClusterPaths, peers: Sequence[str]) -> None:
    """Raise ``PkiError`` unless ``paths`` holds a complete, self-consistent PKI for its cluster.

    Catching a mismatched key, a foreign leaf, or a stale bundle here turns what would be an
    opaque TLS handshake failure at run time into an error naming the offending file.
    """
    for required in paths.required_files(peers):
        if not required.is_file():
            raise PkiError(f"PKI for cluster {paths.cluster_id!r} is incomplete: missing {required}")
    check_own(paths)
    ca_cert = read_cert(paths.ca_cert)

    trusted: set[bytes] = set()
    for trust_file in sorted(paths.trust_dir.glob("*.crt")):
        cert = read_cert(trust_file)
        if (problem := ca_problem(cert)) is not None:
            raise PkiError(f"trusted certificate {trust_file} is unusable: {problem}")
        trusted.add(cert_fingerprint(cert))
    if not trusted:
        raise PkiError(f"cluster {paths.cluster_id!r} trusts no peer CA: {paths.trust_dir} has no *.crt")
    if cert_fingerprint(ca_cert) in trusted:
        raise PkiError(
            f"{paths.trust_dir} contains cluster {paths.cluster_id!r}'s own CA; it must not be trusted"
        )
    try:
        bundle = {
            cert_fingerprint(c) for c in x509.load_pem_x509_certificates(paths.trust_bundle.read_bytes())
        }
    except ValueError as exc:
        raise PkiError(f"{paths.trust_bundle} is not a PEM certificate bundle: {exc}") from exc
    if bundle != trusted:
        raise PkiError(
            f"{paths.trust_bundle} does not match the certificates in {paths.trust_dir}; it is stale"
        )


def validate_clusters(clusters: Sequence[str], *, minimum: int) -> tuple[str, ...]:
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


def peers_of(cluster_id: str, clusters: Sequence[str]) -> list[str]:
    return [peer for peer in clusters if peer != cluster_id]


def load_layout(root: Path, clusters: Sequence[str]) -> PkiLayout:
    """Load and verify an existing PKI for ``clusters`` under ``root``.

    Each cluster must trust every other listed cluster; a single cluster may be loaded on its own
    (a switch only needs its own directory). Expiry of the switch leaf is not checked here so that
    tooling can still load and display an expired layout.
    """
    ids = validate_clusters(clusters, minimum=1)
    layout = PkiLayout(root, ids)
    for cid in ids:
        check_cluster(layout.cluster(cid), peers_of(cid, ids))
    return layout
