"""TLS as a stranger sees a port: the certificate it presents now, and handshakes without one of ours."""

from __future__ import annotations

import contextlib
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


def strangers_context() -> ssl.SSLContext:
    """A client that verifies nothing and has no certificate: anyone on the internet."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def handshakes_without_certificate(address: tuple[str, int], count: int) -> None:
    """``count`` TLS handshakes without a client certificate (the server asks for one), each sending an
    HTTP/2 preface and reading whatever comes back: a refusal, a reset or nothing."""
    context = strangers_context()
    for _ in range(count):
        with (
            contextlib.suppress(ssl.SSLError, OSError),
            socket.create_connection(address, timeout=10) as raw,
            context.wrap_socket(raw) as tls,
        ):
            tls.sendall(b"PRI * HTTP/2.0\r\n\r\n")
            tls.recv(1)
