"""Mutual TLS 1.3 through pyOpenSSL, for the connections that key sealed records from its exporter.

Why: Python's ``ssl`` offers no TLS exporter (RFC 8446 section 7.5), and sealed records must be keyed
from the authenticated session, not from secrets of our own. pyOpenSSL (PyCA, on ``cryptography``'s
OpenSSL) offers ``export_keying_material``. The link's handshake therefore runs here, with the checks
an ``ssl`` mutual-TLS context makes (``tests/unit/test_sealed_identity.py`` holds the two to the same
answers): TLS 1.3 only, this switch's certificate chain and key, the peer's chain verified against the
trust bundle, a client certificate demanded by the server, the server's name checked by the client by
RFC 6125 through PyCA's ``service-identity`` (subject alternative names; ``ssl``'s ``check_hostname``
decides alike for every certificate our PKI issues). Revocation and the peer's identity are checked
after the handshake on the peer certificate, as for every link connection.
"""

from __future__ import annotations

import ipaddress
import select
import socket
import time
from collections.abc import Callable
from typing import TypeVar

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from OpenSSL import SSL, crypto
from service_identity import CertificateError, VerificationError
from service_identity.cryptography import verify_certificate_hostname, verify_certificate_ip_address

T = TypeVar("T")


_VERIFY_ERRORS = {
    9: "certificate is not yet valid",
    10: "certificate has expired",
    18: "self-signed certificate",
    19: "self-signed certificate in certificate chain",
    20: "unable to get local issuer certificate",
    21: "unable to verify the first certificate",
    26: "unsupported certificate purpose",
    47: "permitted subtree violation",
}
"""OpenSSL's X509_V_ERR reasons an audit names (as ``ssl``'s CERTIFICATE_VERIFY_FAILED message does)."""


class TlsHandshakeError(ConnectionError):
    """The TLS handshake of a sealed-records connection failed or was refused (the ``tls`` layer)."""


def openssl_context(cert_pem: bytes, key_pem: bytes, bundle_pem: bytes, *, server_side: bool) -> SSL.Context:
    """A TLS 1.3-only context with this certificate chain and key, verifying the peer against the bundle."""
    context = SSL.Context(SSL.TLS_METHOD)
    context.set_min_proto_version(SSL.TLS1_3_VERSION)
    chain = x509.load_pem_x509_certificates(cert_pem)
    context.use_certificate(chain[0])
    for extra in chain[1:]:
        context.add_extra_chain_cert(extra)
    key = serialization.load_pem_private_key(key_pem, password=None)
    context.use_privatekey(key)  # type: ignore[arg-type]
    context.check_privatekey()
    store = context.get_cert_store()
    assert store is not None
    for trusted in x509.load_pem_x509_certificates(bundle_pem):
        store.add_cert(crypto.X509.from_cryptography(trusted))
    mode = SSL.VERIFY_PEER | (SSL.VERIFY_FAIL_IF_NO_PEER_CERT if server_side else 0)
    context.set_verify(mode, _note_verify_error)
    return context


def _note_verify_error(conn: SSL.Connection, cert: object, errno: int, depth: int, ok: int) -> bool:
    """OpenSSL's own verdict, unchanged; the first failure's reason kept for the refusal's message."""
    if not ok and conn.get_app_data() is None:
        conn.set_app_data(
            _VERIFY_ERRORS.get(errno, f"certificate verify error {errno}") + f" (depth {depth})"
        )
    return bool(ok)


def name_matches(cert: x509.Certificate, server_name: str) -> bool:
    """Whether ``cert`` is for ``server_name`` (a DNS name or an IP address), by RFC 6125 as PyCA's
    ``service-identity`` decides it: subject alternative names only, a wildcard only as a whole leftmost
    label. Our PKI puts every name a switch is dialled by there."""
    try:
        if _is_address(server_name):
            verify_certificate_ip_address(cert, server_name.strip("[]"))
        else:
            verify_certificate_hostname(cert, server_name.rstrip("."))
    except (VerificationError, CertificateError, ValueError):
        return False
    return True


def _until(conn: SSL.Connection, sock: socket.socket, deadline: float, call: Callable[[], T]) -> T:
    """Run a pyOpenSSL call on the non-blocking ``sock`` to completion, waiting on the socket until
    ``deadline`` (TimeoutError after it)."""
    while True:
        try:
            return call()
        except SSL.WantReadError:
            events = select.POLLIN
        except SSL.WantWriteError:
            events = select.POLLOUT
        left = deadline - time.monotonic()
        poller = select.poll()  # not select(): a busy switch has descriptors above its 1024
        poller.register(sock, events)
        if left <= 0 or not poller.poll(left * 1000):
            raise TimeoutError("no TLS progress before the handshake deadline")


def handshake(
    sock: socket.socket, context: SSL.Context, *, server_name: str | None, deadline: float
) -> tuple[SSL.Connection, x509.Certificate]:
    """Mutual TLS 1.3 on ``sock`` (client side with ``server_name``, else server side) by ``deadline``:
    the connection and the peer's verified certificate. TlsHandshakeError if refused, TimeoutError."""
    sock.setblocking(False)
    conn = SSL.Connection(context, sock)
    if server_name is None:
        conn.set_accept_state()
    else:
        if not _is_address(server_name):
            conn.set_tlsext_host_name(server_name.encode("idna"))
        conn.set_connect_state()
    try:
        _until(conn, sock, deadline, conn.do_handshake)
    except SSL.Error as exc:
        noted = conn.get_app_data()
        detail = f": {noted}" if noted else ""
        raise TlsHandshakeError(f"TLS handshake failed: {_reason(exc)}{detail}") from None
    cert = conn.get_peer_certificate(as_cryptography=True)
    if cert is None or conn.get_protocol_version_name() != "TLSv1.3":
        raise TlsHandshakeError("TLS handshake without a verified TLS 1.3 peer certificate")
    if server_name is not None and not name_matches(cert, server_name):
        raise TlsHandshakeError(f"certificate verify failed: the certificate is not for {server_name!r}")
    return conn, cert


def send_all(conn: SSL.Connection, sock: socket.socket, data: bytes, deadline: float) -> None:
    """Send ``data`` as TLS application data by ``deadline``."""
    sent = 0
    while sent < len(data):
        rest = memoryview(data)[sent:]
        try:
            sent += _until(conn, sock, deadline, lambda: conn.send(rest))  # noqa: B023 (called here)
        except SSL.Error as exc:
            raise TlsHandshakeError(f"TLS send failed: {_reason(exc)}") from None


def recv_exact(conn: SSL.Connection, sock: socket.socket, size: int, deadline: float) -> bytes:
    """Exactly ``size`` bytes of TLS application data by ``deadline``; ConnectionError at an end."""
    data = b""
    while len(data) < size:
        want = size - len(data)
        try:
            part = _until(conn, sock, deadline, lambda: conn.recv(want))  # noqa: B023 (called here)
        except (SSL.ZeroReturnError, SSL.SysCallError):
            part = b""
        except SSL.Error as exc:
            raise TlsHandshakeError(f"TLS receive failed: {_reason(exc)}") from None
        if not part:
            raise ConnectionError("the peer closed the connection during the sealed-records negotiation")
        data += part
    return data


def _is_address(name: str) -> bool:
    try:
        ipaddress.ip_address(name.strip("[]"))
    except ValueError:
        return False
    return True


def _reason(exc: SSL.Error) -> str:
    """OpenSSL's reason strings of ``exc`` (e.g. ``certificate verify failed``)."""
    details = exc.args[0] if exc.args else None
    if isinstance(details, list):
        return "; ".join(str(entry[-1]) for entry in details if entry) or repr(exc)
    return str(exc) or repr(exc)


__all__ = [
    "TlsHandshakeError",
    "handshake",
    "name_matches",
    "openssl_context",
    "recv_exact",
    "send_all",
]
