"""Certificate authority operations: one CA per cluster, short-lived leaves for its switches.

Each cluster has its own CA so that trust on the WAN is an explicit, per-peer decision (cluster
``a`` trusts ``b``'s CA, not a shared root). Each CA carries a critical DNS name constraint
limiting it to ``<cluster_id>.nebula.internal``; because identities must carry a matching DNS SAN
(:func:`~nebula_common.pki.identity.identity_from_certificate`), a peer CA we trust cannot issue a
certificate claiming to be a switch of some other cluster — TLS path validation rejects it.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from nebula_common.pki.identity import Identity, cluster_dns_domain, validate_cluster_id

__all__ = ["CLOCK_SKEW", "DEFAULT_CA_VALIDITY", "DEFAULT_LEAF_VALIDITY", "create_ca", "issue_certificate"]

DEFAULT_CA_VALIDITY = timedelta(days=3650)
DEFAULT_LEAF_VALIDITY = timedelta(days=7)
#: How far ``not_before`` is backdated so a peer whose clock runs slightly behind still accepts a
#: freshly issued certificate.
CLOCK_SKEW = timedelta(minutes=5)
_ORGANIZATION = "Nebula"


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _require_p256(key: ec.EllipticCurvePrivateKey, what: str) -> None:
    if not isinstance(key, ec.EllipticCurvePrivateKey) or not isinstance(key.curve, ec.SECP256R1):
        raise ValueError(f"{what} must be an ECDSA P-256 private key")


def _require_positive(validity: timedelta) -> None:
    if validity <= timedelta(0):
        raise ValueError(f"validity must be positive, got {validity}")


def create_ca(
    cluster_id: str, *, validity: timedelta = DEFAULT_CA_VALIDITY
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """Create a self-signed CA for one cluster.

    ``path_length=0`` forbids intermediate CAs: the CA only ever signs leaves, so a leaked leaf key
    can never be used to mint further certificates.
    """
    validate_cluster_id(cluster_id)
    _require_positive(validity)
    key = _new_key()
    name = x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, f"Nebula cluster {cluster_id} CA"),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, _ORGANIZATION),
        ]
    )
    now = datetime.now(UTC)
    public_key = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + validity)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .add_extension(
            x509.NameConstraints(
                permitted_subtrees=[x509.DNSName(cluster_dns_domain(cluster_id))], excluded_subtrees=None
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return cert, key


def issue_certificate(
    ca_cert: x509.Certificate,
    ca_key: ec.EllipticCurvePrivateKey,
    identity: Identity,
    *,
    validity: timedelta = DEFAULT_LEAF_VALIDITY,
    not_before: datetime | None = None,
    key: ec.EllipticCurvePrivateKey | None = None,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """Issue a leaf certificate for ``identity`` signed by ``ca_cert``/``ca_key``.

    The leaf carries both serverAuth and clientAuth because a switch accepts connections from its
    peer and dials its peer on the same link. When ``not_before`` is omitted it is backdated by
    :data:`CLOCK_SKEW` and the certificate stays valid for ``validity`` from now; when given (tests
    build expired or not-yet-valid certificates this way) validity counts from ``not_before``.

    The CA's name constraint is deliberately not checked here: tests rely on being able to build a
    certificate that validation must reject.
    """
    _require_positive(validity)
    _require_p256(ca_key, "ca_key")
    ca_public = ca_cert.public_key()
    if not isinstance(ca_public, ec.EllipticCurvePublicKey) or ca_public != ca_key.public_key():
        raise ValueError("ca_key does not belong to ca_cert")
    try:
        constraints = ca_cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except x509.ExtensionNotFound:
        constraints = None
    if constraints is None or not constraints.ca:
        raise ValueError(f"{ca_cert.subject.rfc4514_string()!r} is not a CA certificate")
    if key is None:
        key = _new_key()
    else:
        _require_p256(key, "key")

    if not_before is None:
        now = datetime.now(UTC)
        start, end = now - CLOCK_SKEW, now + validity
    else:
        if not_before.tzinfo is None:
            raise ValueError("not_before must be timezone-aware")
        start, end = not_before, not_before + validity

    if end > ca_cert.not_valid_after_utc:
        raise ValueError(
            f"leaf would outlive its CA: requested until {end.isoformat()}, "
            f"CA expires {ca_cert.not_valid_after_utc.isoformat()}"
        )

    public_key = key.public_key()
    try:
        ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        aki = x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski)
    except x509.ExtensionNotFound:
        aki = x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_public)
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.COMMON_NAME, identity.dns_name),
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, _ORGANIZATION),
                ]
            )
        )
        .issuer_name(ca_cert.subject)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.UniformResourceIdentifier(identity.uri), x509.DNSName(identity.dns_name)]
            ),
            critical=False,
        )
        .add_extension(aki, critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return cert, key
