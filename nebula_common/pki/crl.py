"""Certificate revocation lists: issued by a cluster's CA, loaded by the *peer* cluster's switch.

A CRL is the revocation format every TLS tool understands (``openssl crl``, ``openssl verify
-crl_check``), it is signed by the CA that issued the certificates it lists, so a switch can accept
a CRL from any channel (file copy, config map) and still know it is genuine: it checks the CRL's
signature against the peer CA it already trusts, never against the CRL's own claims.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtensionOID

__all__ = [
    "CRL_VALIDITY",
    "CrlError",
    "LoadedCrl",
    "build_crl",
    "key_id",
    "load_crl_for",
]

#: How long a CRL is current; ``nebula pki revoke`` (and ``init``) re-sign it. A switch whose CRL is
#: past ``next_update`` keeps enforcing it and warns loudly (failing closed would stop all training).
CRL_VALIDITY = timedelta(days=7)


class CrlError(Exception):
    """A CRL is unreadable, not signed by the expected CA, or otherwise unusable."""


@dataclass(frozen=True)
class LoadedCrl:
    """A verified CRL: which CA issued it, which serials it revokes, and until when it is current."""

    issuer: x509.Name
    #: Key identifier of the CA whose signature verified (``key_id``): which CA issued it, by key.
    issuer_key: bytes
    revoked: frozenset[int]
    number: int
    next_update: datetime
    pem: bytes

    def is_stale(self, now: datetime | None = None) -> bool:
        return (now or datetime.now(UTC)) >= self.next_update


def build_crl(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    revoked: dict[int, datetime],
    *,
    number: int,
    validity: timedelta = CRL_VALIDITY,
) -> x509.CertificateRevocationList:
    """Sign a CRL listing ``revoked`` (serial -> revocation time) with the cluster CA."""
    if ca_cert.public_key() != ca_key.public_key():
        raise CrlError("the CA key does not belong to the CA certificate")
    now = datetime.now(UTC)
    builder = (
        x509.CertificateRevocationListBuilder()
        .issuer_name(ca_cert.subject)
        .last_update(now - timedelta(minutes=5))
        .next_update(now + validity)
        .add_extension(x509.CRLNumber(number), critical=False)
    )
    try:
        ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski), critical=False
        )
    except x509.ExtensionNotFound:
        pass
    for serial, when in sorted(revoked.items()):
        builder = builder.add_revoked_certificate(
            x509.RevokedCertificateBuilder().serial_number(serial).revocation_date(when).build()
        )
    return builder.sign(ca_key, hashes.SHA256())


def _crl_number(crl: x509.CertificateRevocationList) -> int:
    try:
        return int(crl.extensions.get_extension_for_oid(ExtensionOID.CRL_NUMBER).value.crl_number)
    except x509.ExtensionNotFound:
        return 0


def key_id(cert: x509.Certificate) -> bytes:
    """The CA's key identifier: its subjectKeyIdentifier, else the SHA-1 of its public key (RFC 5280)."""
    try:
        return cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value.digest
    except x509.ExtensionNotFound:
        return x509.SubjectKeyIdentifier.from_public_key(cert.public_key()).digest


def _authority_key_id(crl: x509.CertificateRevocationList) -> bytes | None:
    try:
        return crl.extensions.get_extension_for_class(x509.AuthorityKeyIdentifier).value.key_identifier
    except x509.ExtensionNotFound:
        return None


def load_crl_for(pem: bytes, trusted_cas: list[x509.Certificate], *, source: str = "CRL") -> LoadedCrl:
    """Parse ``pem`` and accept it only if one of ``trusted_cas`` issued and signed it.

    The issuer is found by key, never by name alone: every trusted CA whose subject matches (and
    whose key identifier matches the CRL's authorityKeyIdentifier, when it has one) is tried, and
    the one whose key verifies the signature is the issuer. So a second CA with the same subject
    (a rotation, or another organisation's look-alike) can neither sign for this one nor make its
    genuine CRL fail.
    """
    try:
        crl = x509.load_pem_x509_crl(pem)
    except ValueError as exc:
        raise CrlError(f"{source} is not a PEM CRL: {exc}") from exc
    authority = _authority_key_id(crl)
    named = [ca for ca in trusted_cas if ca.subject == crl.issuer]
    if not named:
        raise CrlError(f"{source} was issued by {crl.issuer.rfc4514_string()!r}, which is not a trusted CA")
    candidates = [ca for ca in named if authority is None or key_id(ca) == authority]
    issuer = next((ca for ca in candidates if _signed_by(crl, ca)), None)
    if issuer is None:
        raise CrlError(f"{source} is not validly signed by {crl.issuer.rfc4514_string()!r}")
    next_update = crl.next_update_utc
    if next_update is None:
        raise CrlError(f"{source} has no nextUpdate")
    return LoadedCrl(
        issuer=crl.issuer,
        issuer_key=key_id(issuer),
        revoked=frozenset(entry.serial_number for entry in crl),
        number=_crl_number(crl),
        next_update=next_update,
        pem=crl.public_bytes(serialization.Encoding.PEM),
    )


def _signed_by(crl: x509.CertificateRevocationList, ca: x509.Certificate) -> bool:
    public_key = ca.public_key()
    return isinstance(public_key, ec.EllipticCurvePublicKey) and crl.is_signature_valid(public_key)


def crl_entries(crl: x509.CertificateRevocationList) -> dict[int, datetime]:
    """serial -> revocation time of an existing CRL, so a new one can extend it."""
    return {entry.serial_number: entry.revocation_date_utc for entry in crl}


def crl_number(crl: x509.CertificateRevocationList) -> int:
    return _crl_number(crl)
