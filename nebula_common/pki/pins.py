"""Which peer each trusted CA may speak for: a peer CA vouches for its own cluster and nobody else.

A switch with several peers puts every peer CA in one bundle (the TLS layer needs one set of roots),
so the TLS handshake alone would accept a certificate for ``spiffe://nebula/cluster/a/switch`` from
organisation c's CA if c's CA carries no name constraint (an enterprise root, say). Nebula therefore
pins every CA it trusts to the one peer cluster it was added for (``nebula pki trust add --peer``),
and the switch uses a CA only for that peer's certificates and CRLs (services/switch/peer_trust.py).

The pin travels with the bundle, so every deployment (local, compose volumes, Kubernetes Secrets)
gets it without another file: each certificate in ``trust-bundle.pem`` is preceded by a line
``Nebula-Peer: <cluster id>``. That is RFC 7468 explanatory text, which TLS libraries skip when they
read the roots. A CA's own DNS name constraint, when present, must allow the pinned cluster's
domain as well; a CA in a bundle without a pin (written by hand) may certify a peer only if it is
name-constrained to exactly that peer's domain.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from nebula_common.pki.identity import cluster_dns_domain

__all__ = ["PEER_LABEL", "PinnedCa", "load_pinned", "permitted_domains", "pinned_pem"]

PEER_LABEL = "Nebula-Peer"
_BLOCK = re.compile(rb"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----", re.DOTALL)
_PIN = re.compile(rb"^" + PEER_LABEL.encode() + rb":[ \t]*(\S+)[ \t]*\r?$", re.MULTILINE)


def permitted_domains(cert: x509.Certificate) -> list[str] | None:
    """DNS names a CA's name constraint permits, or None when it is not name-constrained."""
    try:
        constraints = cert.extensions.get_extension_for_class(x509.NameConstraints).value
    except x509.ExtensionNotFound:
        return None
    return [name.value for name in constraints.permitted_subtrees or [] if isinstance(name, x509.DNSName)]


@dataclass(frozen=True)
class PinnedCa:
    """A trusted CA and the peer cluster it was pinned to (None: no pin in the bundle)."""

    cert: x509.Certificate
    peer: str | None

    def may_certify(self, peer_cluster_id: str) -> bool:
        """True if this CA may vouch for identities (and sign CRLs) of ``peer_cluster_id``."""
        domain = cluster_dns_domain(peer_cluster_id)
        domains = permitted_domains(self.cert)
        allowed = domains is None or any(domain == d or domain.endswith("." + d) for d in domains)
        if self.peer is not None:
            return self.peer == peer_cluster_id and allowed
        return domains == [domain]

    def scope(self) -> str:
        """What ``nebula pki trust list`` and the switch's log say this CA may certify."""
        domains = permitted_domains(self.cert)
        if self.peer is None:
            if domains is not None and len(domains) == 1:
                return f"names under {domains[0]} only (its name constraint; not pinned)"
            return "nothing (neither pinned to a peer nor name-constrained to one)"
        if domains is None:
            return f"cluster {self.peer} only (pinned by this cluster; the CA has no name constraint)"
        return f"cluster {self.peer} only (pinned, and name-constrained to {', '.join(domains)})"


def pinned_pem(peer_cluster_id: str, cert: x509.Certificate) -> bytes:
    """One bundle entry: the pin line, then the certificate."""
    return f"{PEER_LABEL}: {peer_cluster_id}\n".encode() + cert.public_bytes(serialization.Encoding.PEM)


def load_pinned(data: bytes) -> list[PinnedCa]:
    """Every certificate of a bundle with the pin written in the text since the previous one.

    Raises ``ValueError`` for a certificate block that does not parse.
    """
    entries: list[PinnedCa] = []
    start = 0
    for block in _BLOCK.finditer(data):
        pins = _PIN.findall(data[start : block.start()])
        start = block.end()
        cert = x509.load_pem_x509_certificate(block.group(0))
        entries.append(PinnedCa(cert, pins[-1].decode() if pins else None))
    return entries
