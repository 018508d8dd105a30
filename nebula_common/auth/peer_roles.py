"""The role check of every internal port: which service identity is calling, and may it?

``PeerRoleInterceptor`` is installed on every service's server when internal TLS is on, *outside*
the bearer-token interceptor, so a call is refused on the transport identity before any token is
looked at. The identity is read from the TLS session (``x509_pem_cert`` exists only once gRPC has
verified the client certificate against the cluster CA), then judged by ``roles.refusal``:

* a certificate of another cluster, or one naming no Nebula identity -> PERMISSION_DENIED;
* a certificate the cluster CA has revoked (its CRL, when the service is given one) -> PERMISSION_DENIED;
* a certificate whose role the matrix does not list for the method -> PERMISSION_DENIED;
* no certificate (the client port) on a service-only method -> UNAUTHENTICATED.

Each refusal is counted (``nebula_rpc_refusals_total{reason="peer-role"|"peer-cert"}``, the same
counter as token refusals) and audited as ``auth.refused`` with the method, the reason, the
caller's identity and its address.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable

import grpc
from cryptography import x509

from nebula_common.auth.interceptor import REFUSALS, AuditSink, _wrap
from nebula_common.auth.roles import refusal
from nebula_common.pki.identity import Identity, identity_from_pem

_PEM_CERT_KEY = "x509_pem_cert"


@functools.lru_cache(maxsize=64)
def _identity(pem: bytes) -> tuple[Identity, int]:
    try:
        serial = x509.load_pem_x509_certificate(pem).serial_number
    except ValueError as exc:
        raise ValueError(f"not a PEM X.509 certificate: {exc}") from exc
    return identity_from_pem(pem), serial


def peer_certificate(context: grpc.aio.ServicerContext) -> tuple[Identity, int] | None:
    """The verified client certificate's (identity, serial), None without one; ValueError if it names none."""
    pems = (context.auth_context() or {}).get(_PEM_CERT_KEY) or []
    if not pems:
        return None
    return _identity(pems[0])


class PeerRoleInterceptor(grpc.aio.ServerInterceptor):
    """Refuse calls whose TLS identity the role matrix does not allow (see the module docstring)."""

    def __init__(
        self,
        service: str,
        cluster_id: str,
        *,
        audit: AuditSink | None = None,
        revoked: Callable[[], frozenset[int]] = frozenset,
    ) -> None:
        self._service = service
        self._cluster_id = cluster_id
        self._audit = audit
        self._revoked = revoked

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method
        return _wrap(handler, lambda context: self._check(method, context))

    async def _check(self, method: str, context: grpc.aio.ServicerContext) -> None:
        identity: Identity | None = None
        try:
            peer = peer_certificate(context)
        except ValueError as exc:
            code, label, reason = grpc.StatusCode.PERMISSION_DENIED, "peer-cert", f"client certificate: {exc}"
        else:
            identity, serial = peer if peer is not None else (None, 0)
            if identity is not None and serial in self._revoked():
                code, label = grpc.StatusCode.PERMISSION_DENIED, "peer-cert"
                reason = f"client certificate {serial:x} of {identity.uri} is revoked"
            elif identity is not None and identity.cluster_id != self._cluster_id:
                code, label = grpc.StatusCode.PERMISSION_DENIED, "peer-cert"
                reason = (
                    f"client certificate of cluster {identity.cluster_id!r}, this is {self._cluster_id!r}"
                )
            elif (why := refusal(method, identity.role if identity else None)) is None:
                return
            else:
                reason = why
                label = "peer-role"
                code = grpc.StatusCode.PERMISSION_DENIED if identity else grpc.StatusCode.UNAUTHENTICATED
        REFUSALS.labels(self._service, method.rsplit("/", 1)[-1], label).inc()
        if self._audit is not None:
            await asyncio.to_thread(
                self._audit.append,
                "auth.refused",
                outcome="refused",
                details={
                    "method": method,
                    "reason": reason,
                    "peer": context.peer(),
                    "peer_identity": identity.uri if identity else "",
                },
            )
        await context.abort(code, reason)
