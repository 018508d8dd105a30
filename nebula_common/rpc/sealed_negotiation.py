"""Choosing sealed records inside TLS and keying them from the TLS exporter of the session.

Why: whether a connection moves to sealed records must be decided where nobody on the path can change
it, and their keys must come from the authenticated TLS 1.3 session itself (RFC 8446 section 7.5), so
no secret of ours ever crosses the wire. Right after the handshake (``exporter_tls.py``) the dialer sends,
as TLS application data, ``OFFER`` = magic ``NBSEAL2`` + its wish (1: sealed records); the acceptor
answers the magic + its decision (1). Nebula carries the link only in sealed records, so a wish or a
decision of 0 (TLS records, which older switches could keep) ends the connection with a reason. Then
each end exports 64 bytes from TLS under ``EXPORTER_LABEL`` with the offer and the answer as the
exporter's context: the first 32 are the dialer -> acceptor traffic secret, the last 32 the acceptor ->
dialer one (``sealed_records.py`` derives each direction's key and IV from them). The TLS connection
must hold no unread byte (``pending() == 0``: the dialer sends nothing after its offer, the acceptor
nothing after its answer) and is then left for the bare TCP socket.

A peer that speaks the old negotiation (``NBSEAL1``, which sent secrets of its own) is refused with a
reason that says so.
"""

from __future__ import annotations

import socket
import struct

from OpenSSL import SSL

from nebula_common.rpc.exporter_tls import TlsHandshakeError, recv_exact, send_all
from nebula_common.rpc.sealed_records import SECRET_BYTES, RecordSealing, SealedRecordError

MAGIC = b"NBSEAL2"
"""First bytes of both negotiation messages (inside TLS); ``NBSEAL1`` was the version before exporters."""
OLD_MAGIC = b"NBSEAL1"
NEGOTIATION = struct.Struct(f">{len(MAGIC)}sB")
"""The offer and the answer: magic, then the wish or the decision (1 = sealed records)."""
EXPORTER_LABEL = b"EXPORTER-nebula-sealed-link-records-v2"
"""The link's exporter label; a stage's edge over TCP uses its own (``edge_tls.py``), so keys of one
protocol can never be those of the other."""
DECLINED = "TLS records instead of sealed ones, which this switch does not carry: update the older switch"


def parse_offer(offer: bytes) -> bool:
    """The dialer's wish in ``offer``; SealedRecordError for anything but an offer of this version."""
    return _parse(offer, "the peer's first message is not a sealed-records offer")


def parse_answer(answer: bytes, want: bool) -> bool:
    """The acceptor's decision in ``answer`` to an offer with ``want``; SealedRecordError for anything
    but a valid answer (sealed records although not wished for included)."""
    decision = _parse(answer, "the peer answered the sealed-records offer with something else")
    if decision and not want:
        raise SealedRecordError("the peer answered the sealed-records offer with sealed records, not offered")
    return decision


def _parse(message: bytes, what: str) -> bool:
    if len(message) != NEGOTIATION.size:
        raise SealedRecordError(f"{what}: {len(message)} bytes, not {NEGOTIATION.size}")
    magic, flag = NEGOTIATION.unpack(message)
    if magic == OLD_MAGIC:
        raise SealedRecordError(
            f"{what}: the peer speaks {OLD_MAGIC.decode()} (sealed records keyed by secrets of its own), "
            f"this switch {MAGIC.decode()} (keyed by the TLS exporter): update the older switch"
        )
    if magic != MAGIC or flag not in (0, 1):
        raise SealedRecordError(f"{what}: {message[: NEGOTIATION.size]!r}")
    return bool(flag)


def exported_sealing(
    conn: SSL.Connection, offer: bytes, answer: bytes, *, dialer: bool, label: bytes = EXPORTER_LABEL
) -> RecordSealing:
    """The record sealing of one end from the TLS exporter of ``conn``'s session (both ends alike)."""
    secrets = conn.export_keying_material(label, 2 * SECRET_BYTES, offer + answer)
    to_acceptor, to_dialer = secrets[:SECRET_BYTES], secrets[SECRET_BYTES:]
    if dialer:
        return RecordSealing(send_secret=to_acceptor, receive_secret=to_dialer)
    return RecordSealing(send_secret=to_dialer, receive_secret=to_acceptor)


def _receive(conn: SSL.Connection, sock: socket.socket, deadline: float) -> bytes:
    """The peer's offer or answer; SealedRecordError if it ends the connection first."""
    try:
        return recv_exact(conn, sock, NEGOTIATION.size, deadline)
    except TlsHandshakeError:
        raise
    except ConnectionError as exc:
        raise SealedRecordError(str(exc)) from None


def _bare(conn: SSL.Connection, sock: socket.socket) -> socket.socket:
    """The TCP socket under ``conn`` for sealed records, once TLS holds no byte past the negotiation."""
    if conn.pending():
        raise SealedRecordError("TLS holds bytes past the sealed-records negotiation: refusing to switch")
    return sock


def negotiate_dialer(
    conn: SSL.Connection, sock: socket.socket, deadline: float, label: bytes = EXPORTER_LABEL
) -> tuple[socket.socket, RecordSealing]:
    """The dialer's side, blocking, right after the handshake: offer, read the decision, key.

    Returns the bare TCP socket and the sealing. SealedRecordError / TlsHandshakeError / OSError if the
    peer breaks the negotiation or declines sealed records.
    """
    offer = NEGOTIATION.pack(MAGIC, 1)
    send_all(conn, sock, offer, deadline)
    answer = _receive(conn, sock, deadline)
    if not parse_answer(answer, True):
        raise SealedRecordError(f"the peer answered with {DECLINED}")
    return _bare(conn, sock), exported_sealing(conn, offer, answer, dialer=True, label=label)


def negotiate_acceptor(
    conn: SSL.Connection, sock: socket.socket, deadline: float, label: bytes = EXPORTER_LABEL
) -> tuple[socket.socket, RecordSealing]:
    """The acceptor's side, blocking, right after the handshake: read the offer, answer, key.

    An offer that wishes TLS records is answered with a decline (so the dialer reads why) and refused.
    """
    offer = _receive(conn, sock, deadline)
    wanted = parse_offer(offer)
    answer = NEGOTIATION.pack(MAGIC, 1 if wanted else 0)
    send_all(conn, sock, answer, deadline)
    if not wanted:
        raise SealedRecordError(f"the dialer wishes {DECLINED}")
    return _bare(conn, sock), exported_sealing(conn, offer, answer, dialer=False, label=label)


__all__ = [
    "DECLINED",
    "EXPORTER_LABEL",
    "MAGIC",
    "NEGOTIATION",
    "OLD_MAGIC",
    "TlsHandshakeError",
    "exported_sealing",
    "negotiate_acceptor",
    "negotiate_dialer",
    "parse_answer",
    "parse_offer",
]
