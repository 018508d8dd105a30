"""The dialer's side of a records link connection: TCP, the preamble in clear, mutual TLS 1.3, sealing.

The handshake runs through pyOpenSSL (``nebula_common/rpc/exporter_tls.py``: the certificate, key and
trust bundle of the switch's ``ssl`` contexts, plus the TLS exporter the records' keys come from), then
the negotiation inside TLS (``sealed_negotiation.py``).

``PeerLink`` dials raw (``link_dialer.py``) once the acceptor said yes inside the gRPC handshake; this
is the blocking set-up it runs on a thread of its own, then the connection the session runs on. A
preamble that comes back changed or not at all is a ``PreambleError`` (refused with layer
``transport``), never a reason to fall back to gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

from OpenSSL import SSL

from nebula_common.rpc.blocking_steps import in_thread
from nebula_common.rpc.exporter_tls import handshake
from nebula_common.rpc.sealed_negotiation import negotiate_dialer
from services.switch.link_handshake import HANDSHAKE_TIMEOUT_S, PreambleError
from services.switch.rawlink_connection import PREAMBLE, RawConnection, Secured


def _connect(address: str, context: SSL.Context, server_name: str, timeout: float) -> Secured:
    """Blocking: TCP connect, exchange the preamble, mutual TLS 1.3 and the sealed-records negotiation
    inside it (on a thread of its own)."""
    host, _, port = address.rpartition(":")
    preamble = PREAMBLE
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
        conn, cert = handshake(sock, context, server_name=server_name, deadline=deadline)
        carrier, sealing = negotiate_dialer(conn, sock, deadline)
        return carrier, sealing, cert
    except BaseException:
        sock.close()
        raise


async def dial_raw(
    address: str,
    context: SSL.Context,
    server_name: str,
    timeout: float = HANDSHAKE_TIMEOUT_S,
    send_buffer: int = 0,
) -> RawConnection:
    """Connect to the peer's WAN address, exchange the preamble, complete mutual TLS 1.3 with the
    pyOpenSSL ``context`` and agree on sealed records inside it.

    TLS verifies the server's chain against the trust bundle and its DNS name against ``server_name``
    (the expected peer switch); identity, revocation and handshake checks follow in ``PeerLink``.
    """
    sock, sealing, cert = await in_thread(
        lambda: _connect(address, context, server_name, timeout), "raw-link-dial"
    )
    with contextlib.suppress(OSError):
        sock.settimeout(None)
    return RawConnection(sock, address, asyncio.get_running_loop(), send_buffer, sealing, cert, PREAMBLE)


__all__ = ["dial_raw"]
