"""Mutual TLS 1.3 contexts from a test PKI's service certificates, for tests and benchmarks.

pyOpenSSL's (with the TLS exporter) are the link's construction, for sealed records; the switch builds
its own from its certificate manager (``services/switch/certs.py``). ``ssl``'s are the reference they
are held to (``tests/unit/test_sealed_identity.py``) and the one-hop TLS baseline of the relay
benchmark (``bench/wan/tls_endpoint.py``).
"""

from __future__ import annotations

import ssl
from pathlib import Path

from OpenSSL import SSL

from nebula_common.rpc.exporter_tls import openssl_context


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


def openssl_server_context(cert: str, key: str, ca: str) -> SSL.Context:
    """The pyOpenSSL twin of ``server_context`` (``nebula_common/rpc/exporter_tls.py``): sealed records."""
    return openssl_context(*_read(cert, key, ca), server_side=True)


def openssl_client_context(cert: str, key: str, ca: str) -> SSL.Context:
    """The pyOpenSSL twin of ``client_context`` (the server's name is checked at the handshake)."""
    return openssl_context(*_read(cert, key, ca), server_side=False)


def _read(*paths: str) -> tuple[bytes, ...]:
    return tuple(Path(path).read_bytes() for path in paths)
