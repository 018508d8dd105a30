"""A raw link connection: the shared raw-record connection as the switch's link uses it.

The link session treats every transport alike (``link_transport.py``), so a raw connection fails with
the link's ``HandshakeError`` as a gRPC call would, keeps the preamble that crossed in clear for the
session's check inside TLS (``Handshake.raw_preamble``) and says which carrier it is for the
``link.up`` audit. The dialer (``rawlink_dialer.py``) and the acceptor (``wan_frontend.py``) both
build it from what their TLS set-up hands over (``Secured``): the bare TCP socket and the sealing
keyed from that session's TLS exporter.
"""

from __future__ import annotations

import asyncio
import socket

from cryptography import x509

from nebula_common.rpc.raw_records import RawConnection as _RawConnection
from nebula_common.rpc.sealed_records import RecordSealing
from services.switch.link_handshake import HandshakeError

PREAMBLE = b"NBLINK3\n"
"""First bytes of a records connection (plaintext, both ways; a TLS record starts with 0x16 instead):
mutual TLS 1.3 follows, then the sealed-records negotiation inside it (``sealed_negotiation.py``)."""
OLD_PREAMBLES = {
    b"NBLINK1\n": "TLS records on the raw link",
    b"NBLINK2\n": "sealed records keyed by secrets of its own",
}
"""What older switches offered, each refused with a reason that names it."""


class RawConnection(_RawConnection):
    """A raw link connection (``nebula_common.rpc.raw_records``) whose failures are ``HandshakeError``."""

    def __init__(
        self,
        sock: socket.socket,
        peer: str,
        loop: asyncio.AbstractEventLoop,
        send_buffer: int,
        sealing: RecordSealing,
        peer_cert: x509.Certificate | None,
        preamble: bytes = PREAMBLE,
    ) -> None:
        super().__init__(
            sock, peer, loop, send_buffer, HandshakeError, views=True, sealing=sealing, peer_cert=peer_cert
        )
        #: The preamble exchanged in clear; each side confirms it inside TLS (``Handshake.raw_preamble``).
        self.preamble = preamble

    @property
    def transport(self) -> str:
        """The carrier, as audited with ``link.up`` (the ``link_carrier`` setting's name for it)."""
        return "records"


Secured = tuple[socket.socket, RecordSealing, x509.Certificate | None]
"""A records connection after TLS: the bare TCP socket, its sealing, the peer's certificate."""


__all__ = ["OLD_PREAMBLES", "PREAMBLE", "RawConnection", "Secured"]
