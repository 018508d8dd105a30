"""A raw link connection: the shared raw-record connection as the switch's link uses it.

The link session treats every transport alike (``link_transport.py``), so a raw connection fails with
the link's ``HandshakeError`` as a gRPC call would, keeps the preamble that crossed in clear for the
session's check inside TLS (``Handshake.raw_preamble``) and says which transport it is for the
``link.up`` audit. The dialer (``rawlink_dialer.py``) and the acceptor (``wan_frontend.py``) both
build it from what their TLS set-up hands over (``Secured``).
"""

from __future__ import annotations

import asyncio
import ssl

from cryptography import x509

from nebula_common.pki import Identity, identity_from_certificate
from nebula_common.rpc.raw_records import RawConnection as _RawConnection
from nebula_common.rpc.sealed_negotiation import Carrier
from nebula_common.rpc.sealed_records import RecordSealing
from services.switch.link_handshake import HandshakeError

PREAMBLE = b"NBLINK1\n"
"""First bytes of a raw connection (plaintext, both ways); a TLS record starts with 0x16 instead."""
PREAMBLE_SEALED = b"NBLINK3\n"
"""First bytes of a raw connection whose dialer offers sealed records after TLS (``link_records=sealed``);
an acceptor that knows it answers the same, and the two negotiate inside TLS (``sealed_negotiation.py``)."""
OLD_PREAMBLE_SEALED = b"NBLINK2\n"
"""What a switch from before exporter-keyed sealed records offers: refused, with a reason that says so."""


class RawConnection(_RawConnection):
    """A raw link connection (``nebula_common.rpc.raw_records``) whose failures are ``HandshakeError``."""

    def __init__(
        self,
        sock: ssl.SSLSocket | Carrier,
        peer: str,
        loop: asyncio.AbstractEventLoop,
        send_buffer: int = 0,
        sealing: RecordSealing | None = None,
        peer_cert: x509.Certificate | None = None,
        preamble: bytes = PREAMBLE,
    ) -> None:
        super().__init__(
            sock, peer, loop, send_buffer, HandshakeError, views=True, sealing=sealing, peer_cert=peer_cert
        )
        #: The preamble exchanged in clear; each side confirms it inside TLS (``Handshake.raw_preamble``).
        self.preamble = preamble

    @property
    def transport(self) -> str:
        """How this connection carries the link, as audited with ``link.up``: ``raw`` or ``raw+sealed``."""
        return "raw+sealed" if self.sealing is not None else "raw"


Secured = tuple[ssl.SSLSocket | Carrier, RecordSealing | None, x509.Certificate | None]
"""A raw connection after TLS: its socket (bare when sealed), the sealing, the peer's certificate."""


def identity_of(connection: RawConnection) -> Identity:
    """The identity the peer's verified certificate names (PermissionError if none)."""
    if connection.peer_cert is None:
        raise PermissionError("peer presented no certificate on the raw link")
    try:
        return identity_from_certificate(connection.peer_cert)
    except ValueError as exc:
        raise PermissionError(f"peer's certificate carries no valid Nebula identity: {exc}") from exc


__all__ = ["OLD_PREAMBLE_SEALED", "PREAMBLE", "PREAMBLE_SEALED", "RawConnection", "Secured", "identity_of"]
