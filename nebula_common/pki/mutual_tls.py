"""Mutual TLS on a plain socket between identities of one cluster: contexts and the peer check.

gRPC ports do this through ``nebula_common.rpc.internal_tls``; the few listeners that are not gRPC
(the trainer's rank gate, the services' ``/metrics``) use Python's ``ssl`` with the same files
(``ServiceTlsFiles``: the cluster CA, one leaf, its key) and the same rule: the handshake checks the
chain, then the peer's SPIFFE identity must name an allowed role of *this* cluster and its serial
must not be on the cluster CA's CRL.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from cryptography import x509

from nebula_common.pki.identity import Identity, identity_from_certificate
from nebula_common.pki.service_identity import ServiceTlsFiles

__all__ = ["MutualTls", "PeerAuthError", "ReloadingContext"]


class PeerAuthError(Exception):
    """A peer that is not an allowed identity of this cluster (the message says which and why)."""


@dataclass(frozen=True)
class MutualTls:
    """One side's TLS material: its own identity's files, the cluster, and the CA's revoked serials."""

    files: ServiceTlsFiles
    cluster_id: str
    revoked: Callable[[], frozenset[int]] = field(default=lambda: frozenset())
    minimum_version: ssl.TLSVersion = ssl.TLSVersion.TLSv1_3

    def context(self, *, server_side: bool) -> ssl.SSLContext:
        """Read from disk at every use: a renewed certificate is taken at the next connection."""
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = self.minimum_version
        context.load_verify_locations(cafile=str(self.files.ca))
        context.load_cert_chain(str(self.files.cert), str(self.files.key))
        if server_side:
            context.verify_mode = ssl.CERT_REQUIRED
        return context

    def check_peer(
        self, ssl_object: ssl.SSLObject | ssl.SSLSocket | None, roles: str | Iterable[str]
    ) -> Identity:
        """The verified peer's identity, if it is one of ``roles`` of this cluster and not revoked."""
        allowed = {roles} if isinstance(roles, str) else set(roles)
        der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
        if not der:
            raise PeerAuthError("no certificate presented")
        cert = x509.load_der_x509_certificate(der)
        try:
            identity = identity_from_certificate(cert)
        except ValueError as exc:
            raise PeerAuthError(str(exc)) from None
        if identity.cluster_id != self.cluster_id or identity.role not in allowed:
            wanted = " or ".join(sorted(Identity(self.cluster_id, role).uri for role in allowed))
            raise PeerAuthError(f"{identity.uri} is not {wanted}")
        if cert.serial_number in self.revoked():
            raise PeerAuthError(f"certificate {cert.serial_number:x} of {identity.uri} is revoked")
        return identity


class ReloadingContext:
    """A server context rebuilt when the files change (a renewal is used at the next connection).

    A set of files that does not load yet (a key written before its certificate) keeps the last good
    context in use; with none yet, the error propagates.
    """

    def __init__(self, tls: MutualTls) -> None:
        self._tls = tls
        self._stamp: tuple[tuple[int, int], ...] = ()
        self._context: ssl.SSLContext | None = None

    def current(self) -> ssl.SSLContext:
        files = self._tls.files
        try:
            stats = [path.stat() for path in (files.ca, files.cert, files.key)]
        except OSError:
            if self._context is None:
                raise
            return self._context
        stamp = tuple((st.st_mtime_ns, st.st_size) for st in stats)
        if self._context is None or stamp != self._stamp:
            try:
                self._context = self._tls.context(server_side=True)
            except (ssl.SSLError, OSError):
                if self._context is None:
                    raise
            self._stamp = stamp
        return self._context
