"""The dialer's side of a raw link connection: TCP, the preamble in clear, mutual TLS 1.3, sealing.

With TLS records the handshake is Python ``ssl``'s; a dialer that offers sealed records runs it through
pyOpenSSL instead (``nebula_common/rpc/exporter_tls.py``: the same material and checks, plus the TLS
exporter their keys come from), then the negotiation inside TLS (``sealed_negotiation.py``).

``PeerLink`` dials raw (``link_dialer.py``) once the acceptor said yes inside the gRPC handshake; this
is the blocking set-up it runs on a thread of its own, then the connection the session runs on. A
preamble that comes back changed or not at all is a ``PreambleError`` (refused with layer
``transport``), never a reason to fall back to gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time

from OpenSSL import SSL

from nebula_common.rpc.blocking_steps import in_thread
from nebula_common.rpc.exporter_tls import handshake
from nebula_common.rpc.raw_records import peer_certificate
from nebula_common.rpc.sealed_negotiation import negotiate_dialer
from services.switch.link_handshake import HANDSHAKE_TIMEOUT_S, PreambleError
from services.switch.rawlink_connection import PREAMBLE, PREAMBLE_SEALED, RawConnection, Secured


def _connect(
    address: str,
    context: ssl.SSLContext,
    server_name: str,
    timeout: float,
    sealed: SSL.Context | None = None,
) -> Secured:
    """Blocking: TCP connect, exchange the preamble, mutual TLS 1.3, with ``sealed`` (the pyOpenSSL
    context) the offer of sealed records inside it (on a thread of its own)."""
    host, _, port = address.rpartition(":")
    preamble = PREAMBLE_SEALED if sealed is not None else PREAMBLE
    deadline = time.monotonic() + timeout
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(preamble)
        answer = b""
        while len(answer) < len(preamble):
            part = sock.recv(len(preamble) - len(answer))
            if not part:
                raise PreambleError(
                    f"peer at {address} closed the raw link connection during the preamble {preamble!r} "
                    f"(after {answer!r}): a path that rewrites or drops it, or no raw link there"
                )
            answer += part
        if answer != preamble:
            raise PreambleError(
                f"peer at {address} answered the raw link preamble {preamble!r} with {answer!r}"
            )
        if sealed is None:
            tls = context.wrap_socket(sock, server_hostname=server_name)
            return tls, None, peer_certificate(tls)
        conn, cert = handshake(sock, sealed, server_name=server_name, deadline=deadline)
        carrier, sealing = negotiate_dialer(conn, sock, True, deadline)
        return carrier, sealing, cert
    except BaseException:
        sock.close()
        raise


async def dial_raw(
    address: str,
    context: ssl.SSLContext,
    server_name: str,
    timeout: float = HANDSHAKE_TIMEOUT_S,
    send_buffer: int = 0,
    sealed: SSL.Context | None = None,
) -> RawConnection:
    """Connect to the peer's WAN address, exchange the preamble and complete mutual TLS 1.3 (then,
    with ``sealed``, the pyOpenSSL twin of ``context``, switch to sealed records if the peer agrees
    inside TLS).

    TLS verifies the server's chain against the trust bundle and its DNS name against ``server_name``
    (the expected peer switch); identity, revocation and handshake checks follow in ``PeerLink``.
    """
    sock, sealing, cert = await in_thread(
        lambda: _connect(address, context, server_name, timeout, sealed), "raw-link-dial"
    )
    with contextlib.suppress(OSError):
        sock.settimeout(None)
    preamble = PREAMBLE_SEALED if sealed is not None else PREAMBLE
    return RawConnection(sock, address, asyncio.get_running_loop(), send_buffer, sealing, cert, preamble)


__all__ = ["dial_raw"]
