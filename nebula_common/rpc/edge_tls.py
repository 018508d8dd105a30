"""A stage's edge across hosts: sealed records on TCP after mutual TLS 1.3 with the cluster's CA.

Why: where a trainer and its switch share no host (Kubernetes: separate pods), there is no Unix socket
for the edge socket to be. The same records then travel on TCP, protected as the link's are: mutual
TLS 1.3 (``exporter_tls.py``: the trainer's internal certificate, the switch's pinned by name, both
verified against the cluster CA), then sealed records keyed from the session's TLS exporter
(``sealed_negotiation.py``) under a label of their own. The trainer makes the connection, presents the
one-time ticket as its first sealed message and hands the socket with this connection's record state
(``RecordSealing.handover``) to its stage process: the stage can carry that one connection and holds no
key of the trainer's.

One setting names where edges go, on both ends: a path (``/``-anywhere) is the Unix edge socket, a
``host:port`` this TCP port (``edge_address``).
"""

from __future__ import annotations

import contextlib
import socket
import time

from cryptography import x509

from nebula_common.rpc.exporter_tls import handshake, openssl_context
from nebula_common.rpc.internal_tls import ClientTls, server_name
from nebula_common.rpc.sealed_negotiation import negotiate_acceptor, negotiate_dialer
from nebula_common.rpc.sealed_records import RecordSealing, sealed_size

EDGE_EXPORTER_LABEL = b"EXPORTER-nebula-sealed-edge-records-v1"
"""The exporter label of edge connections (the link's is another: neither's keys are the other's)."""
SOCKET_BUFFER_BYTES = 4 << 20
"""Send and receive buffer of an edge connection (the kernel's default blocks a chunk)."""
UNIX = "unix"
TLS = "tls"


def edge_address(value: str, setting: str) -> tuple[str, str]:
    """(``UNIX``, path) or (``TLS``, host:port) for a value of ``setting``; ValueError if neither."""
    if "/" in value:
        return UNIX, value
    host, sep, port = value.rpartition(":")
    if not sep or not host.strip("[]") or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(
            f"{setting}={value!r} is neither a socket path (with a '/') nor host:port (mutual TLS records)"
        )
    return TLS, value


def _tuned(sock: socket.socket) -> socket.socket:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
    return sock


def dial_edge(address: str, tls: ClientTls, ticket: bytes, timeout: float) -> tuple[socket.socket, dict]:
    """The trainer's side, blocking: connect to the switch's edge port, mutual TLS 1.3 as this trainer
    (the switch pinned as ``switch.<cluster>.nebula.internal``), key sealed records from the exporter and
    present ``ticket`` as the first message. The bare socket (blocking) and its ``handover`` state;
    OSError (``TlsHandshakeError``, ``SealedRecordError``, ``TimeoutError`` included) if any step fails."""
    cert_pem, key_pem, ca_pem = tls.pem()
    context = openssl_context(cert_pem, key_pem, ca_pem, server_side=False)
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    sock = _tuned(socket.create_connection((host.strip("[]"), int(port)), timeout=timeout))
    try:
        conn, _ = handshake(
            sock, context, server_name=server_name("switch", tls.cluster_id), deadline=deadline
        )
        bare, sealing = negotiate_dialer(conn, sock, deadline, label=EDGE_EXPORTER_LABEL)
        record = bytearray(sealed_size(len(ticket), sealing.record_bytes))
        end = sealing.seal_into(ticket, memoryview(record))
        bare.settimeout(max(0.1, deadline - time.monotonic()))
        bare.sendall(memoryview(record)[:end])
        bare.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return bare, sealing.handover()


def accept_edge(
    sock: socket.socket, pem: tuple[bytes, bytes, bytes], deadline: float
) -> tuple[socket.socket, RecordSealing, x509.Certificate]:
    """The switch's side, blocking: mutual TLS 1.3 with its internal certificate ``pem`` (certificate,
    key, cluster CA), a client certificate of the cluster CA demanded, then the sealed-records
    negotiation. The bare socket, the sealing and the client's verified certificate (whose identity the
    caller checks); OSError (``TlsHandshakeError``, ``SealedRecordError``, ``TimeoutError``) if not."""
    cert_pem, key_pem, ca_pem = pem
    context = openssl_context(cert_pem, key_pem, ca_pem, server_side=True)
    _tuned(sock)
    conn, peer = handshake(sock, context, server_name=None, deadline=deadline)
    bare, sealing = negotiate_acceptor(conn, sock, deadline, label=EDGE_EXPORTER_LABEL)
    return bare, sealing, peer


__all__ = ["EDGE_EXPORTER_LABEL", "TLS", "UNIX", "accept_edge", "dial_edge", "edge_address"]
