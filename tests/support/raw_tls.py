"""Mutual TLS 1.3 contexts from a test PKI's service certificates, for tests of ``RawConnection``.

The switch's raw link builds its own from its certificate manager (``services/switch/certs.py``); these
are the same construction for a socket pair made in a test or a benchmark.
"""

from __future__ import annotations

import ssl


def server_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """TLS 1.3 server: this certificate, client certificates of ``ca`` required."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_cert_chain(cert, key)
    context.load_verify_locations(cafile=ca)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """TLS 1.3 client: this certificate, the server's checked against ``ca`` (and its name)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_verify_locations(cafile=ca)
    context.load_cert_chain(cert, key)
    return context
