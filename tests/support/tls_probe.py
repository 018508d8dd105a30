"""What certificate a TLS port presents right now (a new handshake, as any client would see it)."""

from __future__ import annotations

import socket
import ssl
from pathlib import Path

from cryptography import x509


def served_certificate(address: str, ca: Path, server_name: str, timeout: float = 10.0) -> x509.Certificate:
    """The leaf ``address`` presents in a fresh handshake, verified against ``ca`` for ``server_name``."""
    host, _, port = address.rpartition(":")
    context = ssl.create_default_context(cafile=str(ca))
    context.set_alpn_protocols(["h2"])  # gRPC servers expect HTTP/2
    with (
        socket.create_connection((host, int(port)), timeout=timeout) as raw,
        context.wrap_socket(raw, server_hostname=server_name) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)
