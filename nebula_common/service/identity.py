"""A service's internal identity at run time: load it, enforce it, keep it fresh.

``service_identity(stack, settings, service)`` is what every service's ``start`` calls first:

* with ``NEBULA_<SVC>_INTERNAL_TLS_DIR`` it loads the service's leaf (it must name exactly this
  service of this cluster), makes it the identity the process presents on its own internal calls,
  and starts a background task that re-reads the files every ``CERT_CHECK_INTERVAL_S``. A service
  never holds a CA key: its leaf is renewed by whoever issued it (the launcher under
  ``local up``/``cluster up``, pki-init in compose,
  the operator or cert-manager in Kubernetes), who replaces the files. Servers pick the new files up
  before their next handshake; live connections keep theirs, so no call is dropped. Expiry is
  ``nebula_internal_certificate_expiry_seconds``, renewals ``nebula_internal_certificate_renewals_total``,
  each reload is audited as ``cert.reload``.
* without it, only the development flag ``NEBULA_INTERNAL_PLAINTEXT=1`` lets the service start
  (plaintext ports, a warning in the log); otherwise start-up fails naming the setting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from prometheus_client import Counter, Gauge

from nebula_common.auth.interceptor import AuditSink
from nebula_common.auth.peer_roles import PeerRoleInterceptor
from nebula_common.pki.identity import Identity
from nebula_common.pki.mutual_tls import MutualTls
from nebula_common.pki.service_identity import ServiceTlsFiles
from nebula_common.rpc.internal_tls import (
    PLAINTEXT_ENV,
    ClientTls,
    InternalTlsError,
    ServerTls,
    plaintext_allowed,
    set_process_client_tls,
    warn_plaintext,
)
from nebula_common.service.settings import ServiceSettings

log = logging.getLogger(__name__)

CERT_CHECK_INTERVAL_S = 5.0
"""How often a service re-reads its certificate files (a renewal by their issuer) and the cluster CRL:
a revoked client is refused within this, a renewed certificate served within this."""

CERT_EXPIRY = Gauge(
    "nebula_internal_certificate_expiry_seconds",
    "Seconds until this service's internal (cluster mTLS) certificate expires.",
    ["service"],
)
CERT_RENEWALS = Counter(
    "nebula_internal_certificate_renewals",
    "Internal certificates taken into use after start (renewed here or replaced on disk).",
    ["service"],
)


@dataclass
class ServiceIdentity:
    """What ``service_identity`` hands a service: its server TLS (None: plaintext) and client TLS."""

    service: str
    cluster_id: str
    server: ServerTls | None
    client: ClientTls | None
    audit: AuditSink | None = None
    crl: Path | None = None
    revoked: frozenset[int] = frozenset()
    _crl_stamp: tuple[int, int] | None = None
    _pending: list[tuple[str, dict[str, Any]]] = field(default_factory=list)

    def interceptors(self, audit: AuditSink | None = None) -> list[grpc.aio.ServerInterceptor]:
        """The role check to put first on the service's server (none in plaintext mode: no identities).

        ``audit`` also receives the certificate events (records from before it was given are kept
        and written then).
        """
        if self.server is None:
            return []
        if audit is not None:
            self.audit = audit
            pending, self._pending = self._pending, []
            for event, details in pending:
                audit.append(event, details=details)
        return [PeerRoleInterceptor(self.service, self.cluster_id, audit=audit, revoked=lambda: self.revoked)]

    def refresh_crl(self) -> bool:
        """Re-read the cluster CRL if it changed; True when a new list is in force.

        A CRL that does not parse or that the cluster CA did not sign is ignored (logged): the last
        good list stays in force, so a bad file cannot un-revoke anything.
        """
        if self.crl is None or self.server is None:
            return False
        try:
            st = self.crl.stat()
        except OSError as exc:
            log.warning("internal CRL %s unreadable: %s", self.crl, exc)
            return False
        stamp = (st.st_mtime_ns, st.st_size)
        if stamp == self._crl_stamp:
            return False
        try:
            crl = x509.load_pem_x509_crl(self.crl.read_bytes())
            ca = x509.load_pem_x509_certificate(self.server.files.ca.read_bytes())
            public = ca.public_key()
            if not isinstance(public, ec.EllipticCurvePublicKey) or not crl.is_signature_valid(public):
                raise ValueError("not signed by the cluster CA")
        except (OSError, ValueError) as exc:
            log.warning("internal CRL %s ignored: %s", self.crl, exc)
            return False
        self._crl_stamp = stamp
        revoked = frozenset(entry.serial_number for entry in crl)
        changed = revoked != self.revoked
        self.revoked = revoked
        if changed:
            self.record("crl.reload", {"kind": "internal", "revoked": len(revoked)})
        return changed

    def record(self, event: str, details: dict[str, Any]) -> None:
        """Audit a certificate event in the service's log (held until the log is attached)."""
        if self.audit is None:
            # A service without an audit log (codec) keeps only the latest few; its log has them all.
            self._pending = [*self._pending[-15:], (event, details)]
        else:
            self.audit.append(event, details=details)

    def credentials(self, *, require_client_auth: bool) -> grpc.ServerCredentials | None:
        if self.server is None:
            return None
        return self.server.credentials(require_client_auth=require_client_auth)

    def metrics_tls(self) -> MutualTls | None:
        """Who may read this service's ``/metrics``: its cluster's monitoring or operator identities
        (None in plaintext development mode: plain HTTP)."""
        if self.server is None:
            return None
        return MutualTls(self.server.files, self.cluster_id, lambda: self.revoked)

    def describe(self) -> dict[str, Any]:
        if self.server is None:
            return {"internal_tls": False}
        return {
            "internal_tls": True,
            "identity": self.server.identity.uri,
            "serial": f"{self.server.serial:x}",
            "not_after": self.server.not_after.isoformat(),
        }


async def service_identity(
    stack: contextlib.AsyncExitStack, settings: ServiceSettings, service: str
) -> ServiceIdentity:
    """Load (or, under the development flag, do without) ``service``'s internal identity."""
    directory = settings.internal_tls_dir
    prefix = str(type(settings).model_config.get("env_prefix", ""))
    if directory is None:
        if not plaintext_allowed():
            raise InternalTlsError(
                f"{prefix}INTERNAL_TLS_DIR: required (this service's ca.crt, service.crt and service.key); "
                f"set {PLAINTEXT_ENV}=1 only for a plaintext development deployment"
            )
        warn_plaintext(f"the {service} service")
        set_process_client_tls(None)
        return ServiceIdentity(service, settings.cluster_id, None, None)
    files = ServiceTlsFiles.in_dir(directory)
    expected = Identity(settings.cluster_id, service)
    holder: dict[str, ServiceIdentity] = {}

    def reloaded(cert: x509.Certificate) -> None:
        CERT_RENEWALS.labels(service).inc()
        _observe_expiry(service, cert.not_valid_after_utc)
        log.info(
            "internal certificate reloaded",
            extra={
                "fields": {
                    "serial": f"{cert.serial_number:x}",
                    "not_after": cert.not_valid_after_utc.isoformat(),
                }
            },
        )
        ident = holder.get("identity")
        if ident is not None:
            ident.record(
                "cert.reload",
                {
                    "kind": "internal",
                    "serial": f"{cert.serial_number:x}",
                    "not_after": cert.not_valid_after_utc.isoformat(),
                },
            )

    try:
        server = ServerTls(files, on_reload=reloaded)
    except InternalTlsError as exc:
        raise InternalTlsError(f"{prefix}INTERNAL_TLS_DIR: {exc}") from None
    if server.identity != expected:
        raise InternalTlsError(
            f"{prefix}INTERNAL_TLS_DIR: {files.cert} names {server.identity.uri}, "
            f"this service is {expected.uri}"
        )
    _observe_expiry(service, server.not_after)
    client = ClientTls.for_service(files, settings.cluster_id)
    set_process_client_tls(client)
    identity = ServiceIdentity(service, settings.cluster_id, server, client, crl=settings.internal_crl)
    identity.refresh_crl()  # in force before the first call
    holder["identity"] = identity
    task = asyncio.create_task(
        _maintain(identity),
        name=f"{service}-internal-cert",
    )

    async def cancel() -> None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    stack.push_async_callback(cancel)
    log.info("internal TLS on", extra={"fields": identity.describe()})
    return identity


def _observe_expiry(service: str, not_after: datetime) -> None:
    CERT_EXPIRY.labels(service).set((not_after - datetime.now(UTC)).total_seconds())


async def _maintain(identity: ServiceIdentity) -> None:
    """Re-read the files (a renewal by their issuer) and the CRL; keep the expiry metric current."""
    server = identity.server
    assert server is not None  # only started with internal TLS on
    while True:
        await asyncio.sleep(CERT_CHECK_INTERVAL_S)
        try:
            await asyncio.to_thread(server.refresh)
            await asyncio.to_thread(identity.refresh_crl)
        except Exception as exc:  # keep serving the current certificate; say why the reload failed
            log.warning("internal certificate maintenance failed: %s", exc)
        _observe_expiry(identity.service, server.not_after)
