"""What one organisation hands another, and what it holds of others: CA export and the trust list.

Two organisations never share a disk or a key. Organisation *a* runs ``nebula pki export-ca``,
sends the certificate file any way it likes and reads its fingerprint to *b* over a second channel;
*b* runs ``nebula pki trust add`` with both, which refuses the file unless the fingerprint matches
(:func:`nebula_common.pki.store.add_trust`). Only public certificates ever cross: nothing here reads a
private key.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from cryptography import x509

from nebula_common.durable import atomic_write
from nebula_common.pki.crl import CrlError, load_crl_for
from nebula_common.pki.fingerprint import format_fingerprint
from nebula_common.pki.pins import PinnedCa
from nebula_common.pki.store import ClusterPaths, PkiError

__all__ = ["TrustedPeer", "export_ca", "list_trust"]


@dataclass(frozen=True)
class TrustedPeer:
    """One peer CA in a cluster's ``trust/`` directory, as ``nebula pki trust list`` shows it."""

    peer: str
    path: Path
    fingerprint: str
    subject: str
    not_after: datetime
    #: Number and next update of the peer's CRL copy on disk, if any (switches also get it over the link).
    crl_number: int | None
    crl_next_update: datetime | None
    #: Why the CRL file next to the CA could not be used (unreadable, not signed by the CA...), else None.
    crl_error: str | None = None
    #: What this CA may certify here: the peer it is pinned to, and its own name constraint if any.
    scope: str = ""

    def as_dict(self) -> dict[str, object]:
        return {
            "peer": self.peer,
            "path": str(self.path),
            "fingerprint": self.fingerprint,
            "subject": self.subject,
            "not_after": self.not_after.isoformat(),
            "crl_number": self.crl_number,
            "crl_next_update": self.crl_next_update.isoformat() if self.crl_next_update else None,
            "crl_error": self.crl_error,
            "scope": self.scope,
        }


def _own_ca(paths: ClusterPaths) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(paths.ca_cert.read_bytes())
    except FileNotFoundError:
        raise PkiError(
            f"no PKI for cluster {paths.cluster_id!r}: missing {paths.ca_cert} "
            f"(run `nebula pki init --cluster {paths.cluster_id}` first)"
        ) from None
    except ValueError as exc:
        raise PkiError(f"{paths.ca_cert} is not a PEM certificate: {exc}") from exc


def export_ca(root: Path, cluster_id: str, out: Path) -> tuple[Path, str]:
    """Write ``cluster_id``'s CA certificate to ``out``; returns the path and its SHA-256 fingerprint.

    ``out`` may be a directory (the file is then ``<cluster>-ca.crt`` inside it).
    """
    paths = ClusterPaths.for_cluster(Path(root), cluster_id)
    ca = _own_ca(paths)
    out = Path(out)
    if out.is_dir():
        out = out / f"{cluster_id}-ca.crt"
    if not out.parent.is_dir():
        raise PkiError(f"cannot write {out}: directory {out.parent} does not exist")
    atomic_write(out, paths.ca_cert.read_bytes(), mode=0o644)
    return out, format_fingerprint(ca)


def list_trust(root: Path, cluster_id: str) -> list[TrustedPeer]:
    """Every peer CA ``cluster_id`` trusts, sorted by peer id."""
    paths = ClusterPaths.for_cluster(Path(root), cluster_id)
    _own_ca(paths)
    peers = []
    for path in sorted(paths.trust_dir.glob("*.crt")):
        try:
            cert = x509.load_pem_x509_certificate(path.read_bytes())
        except ValueError as exc:
            raise PkiError(f"trusted certificate {path} is not a PEM certificate: {exc}") from exc
        number = next_update = crl_error = None
        crl_path = paths.trust_crl(path.stem)
        if crl_path.is_file():
            # A CRL file the switch would refuse is shown with the reason, never as "no CRL": the
            # operator must see that the copy on disk is broken.
            try:
                loaded = load_crl_for(crl_path.read_bytes(), [cert], source=str(crl_path))
                number, next_update = loaded.number, loaded.next_update
            except (CrlError, OSError) as exc:
                crl_error = str(exc)
        peers.append(
            TrustedPeer(
                peer=path.stem,
                path=path,
                fingerprint=format_fingerprint(cert),
                subject=cert.subject.rfc4514_string(),
                not_after=cert.not_valid_after_utc,
                crl_number=number,
                crl_next_update=next_update,
                crl_error=crl_error,
                scope=PinnedCa(cert, path.stem).scope(),
            )
        )
    return peers
