"""Who a certificate speaks for.

Every Nebula certificate names exactly one cluster and one role. The URI SAN
(``spiffe://nebula/cluster/<cluster_id>/<role>``) is the identity that authorization code reads;
the DNS SAN (``<role>.<cluster_id>.nebula.internal``) exists because gRPC's hostname verification
only looks at DNS names, and because a CA's DNS name constraint is what stops one cluster's CA from
minting certificates for another cluster (see :mod:`nebula_common.pki.ca`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cryptography import x509

__all__ = [
    "DNS_SUFFIX",
    "KNOWN_ROLES",
    "TRUST_DOMAIN",
    "Identity",
    "cluster_dns_domain",
    "identity_from_certificate",
    "identity_from_pem",
    "validate_cluster_id",
]

#: SPIFFE trust domain shared by every Nebula deployment.
TRUST_DOMAIN = "nebula"
#: Parent DNS domain of every certificate's DNS SAN; it never has to resolve, it is only matched.
DNS_SUFFIX = "nebula.internal"
#: Roles a certificate may carry. Kept closed so a typo cannot create an identity nobody authorizes.
#: ``auth``, ``codec``, ``data`` and ``trainer`` are the per-service identities of the internal
#: ports (:mod:`nebula_common.pki.service_identity`); what each may call is
#: :mod:`nebula_common.auth.roles`. ``worker`` is a cluster rank process: it calls no RPC, it only joins
#: its trainer's rank store (``services/trainer/runtime/rank_gate.py``). ``monitoring`` is the cluster's
#: Prometheus: it calls no RPC, it only reads the services' ``/metrics`` (``nebula_common.metrics``).
KNOWN_ROLES: frozenset[str] = frozenset(
    {"switch", "service", "operator", "auth", "codec", "data", "trainer", "worker", "monitoring"}
)

CLUSTER_ID_PATTERN = r"^[a-z][a-z0-9-]{0,30}$"
"""The one cluster-id rule: a lowercase DNS label, so it fits SPIFFE URIs, DNS names and token issuers."""
_CLUSTER_ID_RE = re.compile(CLUSTER_ID_PATTERN)
_URI_RE = re.compile(rf"spiffe://{TRUST_DOMAIN}/cluster/(?P<cluster>[^/]+)/(?P<role>[^/]+)")


def validate_cluster_id(cluster_id: str) -> str:
    """Return ``cluster_id`` unchanged if it is well formed, else raise ``ValueError``.

    The id is embedded in URIs, DNS labels and file names, so it is restricted to a lowercase
    DNS-label-safe alphabet; anything else could escape the PKI directory or break name matching.
    """
    if not isinstance(cluster_id, str) or not _CLUSTER_ID_RE.fullmatch(cluster_id):
        raise ValueError(
            f"invalid cluster id {cluster_id!r}: must match ^[a-z][a-z0-9-]{{0,30}}$ "
            "(lowercase letter first, then up to 30 lowercase letters, digits or '-')"
        )
    return cluster_id


def cluster_dns_domain(cluster_id: str) -> str:
    """DNS domain under which all of ``cluster_id``'s certificate DNS names live.

    Shared by identities (their DNS SAN) and CAs (their name constraint) so both always agree.
    """
    return f"{validate_cluster_id(cluster_id)}.{DNS_SUFFIX}"


@dataclass(frozen=True)
class Identity:
    """A (cluster, role) pair: the unit of authentication on the WAN link."""

    cluster_id: str
    role: str

    def __post_init__(self) -> None:
        validate_cluster_id(self.cluster_id)
        if self.role not in KNOWN_ROLES:
            raise ValueError(f"unknown role {self.role!r}; known roles: {', '.join(sorted(KNOWN_ROLES))}")

    @property
    def uri(self) -> str:
        """SPIFFE-style URI placed in the certificate's URI SAN."""
        return f"spiffe://{TRUST_DOMAIN}/cluster/{self.cluster_id}/{self.role}"

    @property
    def dns_name(self) -> str:
        """DNS name placed in the certificate's DNS SAN and used for hostname verification."""
        return f"{self.role}.{cluster_dns_domain(self.cluster_id)}"

    @classmethod
    def from_uri(cls, uri: str) -> Identity:
        """Parse a ``spiffe://nebula/cluster/<cluster_id>/<role>`` URI.

        Parsing is exact (no normalisation, no trailing slash, no query) because the URI comes from
        a peer's certificate and any leniency here would widen what a certificate can claim.
        """
        match = _URI_RE.fullmatch(uri) if isinstance(uri, str) else None
        if match is None:
            raise ValueError(
                f"invalid Nebula identity URI {uri!r}: expected spiffe://{TRUST_DOMAIN}/cluster/<cluster_id>/<role>"
            )
        try:
            return cls(cluster_id=match["cluster"], role=match["role"])
        except ValueError as exc:
            raise ValueError(f"invalid Nebula identity URI {uri!r}: {exc}") from exc

    def __str__(self) -> str:
        return self.uri


def identity_from_certificate(cert: x509.Certificate) -> Identity:
    """Extract the single Nebula identity a certificate carries.

    Exactly one URI SAN is required: a certificate that could be read as two identities is
    rejected rather than resolved by picking one. The DNS SAN must name the same identity, since
    that is what hostname verification and the issuing CA's name constraint check; a mismatch would
    let the URI claim a cluster the CA was never allowed to vouch for.
    """
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise ValueError(
            f"certificate {cert.subject.rfc4514_string()!r} has no subjectAltName, so it names no identity"
        ) from None
    uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    if not uris:
        raise ValueError(f"certificate {cert.subject.rfc4514_string()!r} has no URI SAN naming an identity")
    if len(uris) > 1:
        raise ValueError(
            f"certificate {cert.subject.rfc4514_string()!r} is ambiguous: it has {len(uris)} URI SANs {uris}"
        )
    identity = Identity.from_uri(uris[0])
    dns_names = san.get_values_for_type(x509.DNSName)
    if identity.dns_name not in dns_names:
        raise ValueError(
            f"certificate for {identity.uri} lacks the matching DNS SAN {identity.dns_name!r} "
            f"(has {dns_names})"
        )
    return identity


def identity_from_pem(pem: bytes) -> Identity:
    """Like :func:`identity_from_certificate`, for a single PEM-encoded certificate."""
    try:
        cert = x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise ValueError(f"not a PEM X.509 certificate: {exc}") from exc
    return identity_from_certificate(cert)
