"""The switch's own certificate: hot reload, automatic renewal, expiry metric and warnings.

New TLS handshakes pick up a new certificate without a restart: the WAN server is built with
``grpc.dynamic_ssl_server_credentials``, whose fetcher gRPC calls before *every* new handshake, and
the dialer rebuilds its channel credentials on each (re)connect. Live HTTP/2 connections keep the
TLS session they negotiated, so a rotation never drops a training stream. The records link carrier
(``rawlink.py``) takes a pyOpenSSL context per handshake from :meth:`CertificateManager.openssl_context`,
rebuilt from the same material whenever its generation changes.

Renewal has two sources, and the switch handles both the same way (reload from disk):

* external: something else (``nebula pki renew``, cert-manager updating a mounted Secret) replaces
  the files; the switch notices the change within ``CERT_CHECK_INTERVAL_S`` (5 s);
* internal: when ``ca_cert``/``ca_key`` are configured the switch issues itself a fresh key and
  certificate, with the same lifetime as the current one, once less than a third
  of that lifetime remains. That puts the CA key inside the switch: fine for the local dev PKI,
  production should use the external path.

A certificate/key pair read from disk is only used if the key matches the certificate, it chains to
the cluster's CA (when known) and it names this cluster's switch; otherwise the previous pair stays
in use and the problem is logged, so a half-written rotation can never take the WAN port down.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from OpenSSL import SSL
from prometheus_client import Gauge

from nebula_common.audit import AuditLog
from nebula_common.durable import atomic_write
from nebula_common.pki import Identity, identity_from_certificate, issue_certificate
from nebula_common.rpc.exporter_tls import openssl_context

log = logging.getLogger(__name__)

RENEW_BEFORE_FRACTION = 1 / 3
"""Self-renewal (development PKI) when less than this fraction of the lifetime is left."""
WARN_BEFORE_S = 3600.0
"""A warning is logged while the certificate expires within this (alerts: a day before)."""

CERT_EXPIRY = Gauge(
    "nebula_switch_certificate_expiry_seconds", "Seconds until this switch's TLS certificate expires."
)
CERT_RENEWALS = Gauge("nebula_switch_certificate_generation", "How many certificates this switch has loaded.")


class CertificateError(Exception):
    """The switch's certificate material on disk is unusable; the message names the file."""


@dataclass(frozen=True)
class Material:
    """One consistent set of TLS material, as PEM bytes plus the parsed leaf."""

    key_pem: bytes
    cert_pem: bytes
    bundle_pem: bytes
    cert: x509.Certificate
    generation: int

    @property
    def serial(self) -> int:
        return self.cert.serial_number

    def seconds_left(self, now: datetime | None = None) -> float:
        return (self.cert.not_valid_after_utc - (now or datetime.now(UTC))).total_seconds()

    def lifetime(self) -> timedelta:
        return self.cert.not_valid_after_utc - self.cert.not_valid_before_utc


def _read(path: Path, what: str) -> bytes:
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise CertificateError(f"missing {what} {path}") from None
    if not data.strip():
        raise CertificateError(f"{what} {path} is empty")
    return data


class CertificateManager:
    """Owns the switch's current certificate; thread-safe (gRPC calls the fetcher on its own threads)."""

    def __init__(
        self,
        cert_path: Path,
        key_path: Path,
        bundle_path: Path,
        identity: Identity,
        *,
        audit: AuditLog,
        ca_cert_path: Path | None = None,
        ca_key_path: Path | None = None,
        renew_before_fraction: float = RENEW_BEFORE_FRACTION,
        warn_before: timedelta = timedelta(seconds=WARN_BEFORE_S),
    ) -> None:
        if not 0 < renew_before_fraction < 1:
            raise ValueError(f"renew_before_fraction must be between 0 and 1, got {renew_before_fraction}")
        self.cert_path, self.key_path, self.bundle_path = Path(cert_path), Path(key_path), Path(bundle_path)
        self.identity = identity
        self._audit = audit
        self._ca_cert_path = ca_cert_path
        self._ca_key_path = ca_key_path
        self._renew_before_fraction = renew_before_fraction
        self._warn_before = warn_before
        self._lock = threading.Lock()
        self._fetched_generation = 0
        self._listeners: list[Callable[[Material], None]] = []
        self._openssl_contexts: dict[tuple[bool, int], SSL.Context] = {}
        self._current = self._load(generation=1)
        self._stamp = self._file_stamp()
        CERT_RENEWALS.set(1)
        CERT_EXPIRY.set(self._current.seconds_left())

    # ------------------------------------------------------------------ reading
    def _file_stamp(self) -> tuple[tuple[int, int, int], ...]:
        stamps = []
        for path in (self.cert_path, self.key_path, self.bundle_path):
            try:
                st = path.stat()
                stamps.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except FileNotFoundError:
                stamps.append((0, 0, 0))
        return tuple(stamps)

    def _ca_cert(self) -> x509.Certificate | None:
        if self._ca_cert_path is None:
            return None
        return x509.load_pem_x509_certificate(_read(self._ca_cert_path, "CA certificate"))

    def _load(self, generation: int) -> Material:
        key_pem = _read(self.key_path, "switch private key")
        cert_pem = _read(self.cert_path, "switch certificate")
        bundle_pem = _read(self.bundle_path, "trust bundle")
        try:
            cert = x509.load_pem_x509_certificate(cert_pem)
            key = serialization.load_pem_private_key(key_pem, password=None)
            x509.load_pem_x509_certificates(bundle_pem)
        except (ValueError, TypeError) as exc:
            raise CertificateError(
                f"unreadable switch TLS material ({self.cert_path}, {self.key_path}): {exc}"
            ) from exc
        if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
            raise CertificateError(f"{self.key_path} does not match {self.cert_path}")
        try:
            named = identity_from_certificate(cert)
        except ValueError as exc:
            raise CertificateError(f"{self.cert_path}: {exc}") from exc
        if named != self.identity:
            raise CertificateError(f"{self.cert_path} names {named.uri}, expected {self.identity.uri}")
        ca = self._ca_cert()
        if ca is not None:
            try:
                cert.verify_directly_issued_by(ca)
            except Exception as exc:
                raise CertificateError(f"{self.cert_path} was not issued by {self._ca_cert_path}") from exc
        return Material(key_pem, cert_pem, bundle_pem, cert, generation)

    # ------------------------------------------------------------------ using
    @property
    def current(self) -> Material:
        with self._lock:
            return self._current

    def on_change(self, listener: Callable[[Material], None]) -> None:
        """Call ``listener`` (from the checking thread) after every successful reload."""
        self._listeners.append(listener)

    def server_credentials(self) -> grpc.ServerCredentials:
        """Dynamic server credentials: every new handshake gets the newest certificate and trust bundle."""
        material = self.current
        with self._lock:
            self._fetched_generation = material.generation
        return grpc.dynamic_ssl_server_credentials(
            self._configuration(material), self._fetch, require_client_authentication=True
        )

    @staticmethod
    def _configuration(material: Material) -> grpc.ServerCertificateConfiguration:
        return grpc.ssl_server_certificate_configuration(
            [(material.key_pem, material.cert_pem)], root_certificates=material.bundle_pem
        )

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        # Called by gRPC before every new server handshake: cheap unless a new generation exists.
        with self._lock:
            if self._current.generation == self._fetched_generation:
                return None
            self._fetched_generation = self._current.generation
            material = self._current
        return self._configuration(material)

    def openssl_context(self, *, server_side: bool) -> SSL.Context:
        """A TLS 1.3 context for the records link carrier from the current material (cached per
        generation): both sides present this switch's leaf and verify the peer against the trust bundle
        only; the server side demands a client certificate, the client side checks the server's DNS name
        (``exporter_tls.handshake``), as the gRPC channel's target-name override does. pyOpenSSL, because
        the records' keys come from the session's TLS exporter, which Python's ``ssl`` does not offer."""
        material = self.current
        key = (server_side, material.generation)
        with self._lock:
            cached = self._openssl_contexts.get(key)
        if cached is not None:
            return cached
        context = openssl_context(
            material.cert_pem, material.key_pem, material.bundle_pem, server_side=server_side
        )
        with self._lock:
            self._openssl_contexts = {
                k: v for k, v in self._openssl_contexts.items() if k[1] == material.generation
            }
            self._openssl_contexts[key] = context
        return context

    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client credentials from the current material; the dialer calls this on every reconnect."""
        material = self.current
        return grpc.ssl_channel_credentials(
            root_certificates=material.bundle_pem,
            private_key=material.key_pem,
            certificate_chain=material.cert_pem,
        )

    # ------------------------------------------------------------------ checking and renewing
    def check(self, now: datetime | None = None) -> Material | None:
        """Reload changed files, renew when due, update the metric; returns new material if any."""
        now = now or datetime.now(UTC)
        changed: Material | None = None
        stamp = self._file_stamp()
        if stamp != self._stamp:
            changed = self._try_reload(stamp, reason="files changed on disk")
        current = self.current
        left = current.seconds_left(now)
        due = left <= current.lifetime().total_seconds() * self._renew_before_fraction
        if due and self._ca_key_path is not None and self._ca_cert_path is not None:
            changed = self._renew(now) or changed
            current = self.current
            left = current.seconds_left(now)
        CERT_EXPIRY.set(left)
        if left <= self._warn_before.total_seconds():
            log.warning(
                "switch certificate expires soon",
                extra={"fields": {"serial": f"{current.serial:x}", "seconds_left": int(left)}},
            )
        return changed

    def _try_reload(self, stamp: tuple[tuple[int, int, int], ...], *, reason: str) -> Material | None:
        previous = self.current
        try:
            material = self._load(previous.generation + 1)
        except (CertificateError, OSError) as exc:
            log.warning("not reloading the switch certificate yet: %s", exc)
            return None  # keep the stamp old: retry on the next check
        self._stamp = stamp
        if material.cert_pem == previous.cert_pem and material.bundle_pem == previous.bundle_pem:
            return None
        with self._lock:
            self._current = material
        CERT_RENEWALS.set(material.generation)
        self._audit.append(
            "cert.reload",
            details={
                "reason": reason,
                "old_serial": f"{previous.serial:x}",
                "serial": f"{material.serial:x}",
                "not_after": material.cert.not_valid_after_utc.isoformat(),
            },
        )
        log.info(
            "switch certificate reloaded",
            extra={"fields": {"serial": f"{material.serial:x}", "reason": reason}},
        )
        for listener in self._listeners:
            listener(material)
        return material

    def _renew(self, now: datetime) -> Material | None:
        assert self._ca_cert_path is not None and self._ca_key_path is not None
        current = self.current
        try:
            ca_cert = x509.load_pem_x509_certificate(_read(self._ca_cert_path, "CA certificate"))
            ca_key = serialization.load_pem_private_key(_read(self._ca_key_path, "CA key"), password=None)
            if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
                raise CertificateError(f"{self._ca_key_path} is not an ECDSA key")
            validity = current.lifetime() - timedelta(minutes=5)  # issue_certificate backdates by 5 min
            cert, key = issue_certificate(
                ca_cert, ca_key, self.identity, validity=max(validity, timedelta(seconds=1))
            )
        except (CertificateError, ValueError, OSError) as exc:
            self._audit.append("cert.renew", outcome="failure", details={"error": str(exc)})
            log.error("automatic certificate renewal failed: %s", exc)
            return None
        key_pem = key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
        atomic_write(self.key_path, key_pem, mode=0o600)
        atomic_write(self.cert_path, cert.public_bytes(serialization.Encoding.PEM), mode=0o644)
        self._audit.append(
            "cert.renew",
            details={
                "old_serial": f"{current.serial:x}",
                "serial": f"{cert.serial_number:x}",
                "not_after": cert.not_valid_after_utc.isoformat(),
                "seconds_left_before": int(current.seconds_left(now)),
            },
        )
        return self._try_reload(self._file_stamp(), reason="renewed before expiry")
