"""Sealed records: AES-256-GCM records on the bare TCP connection, keyed through a verified mutual TLS.

Why: a Python ``ssl`` endpoint moves at most one 16 KiB TLS record per call (two ``recv`` system calls
and one interpreter round per record, then a copy out of OpenSSL's record buffer), which makes the
switch that reads the link the busiest process of the relay (``docs/bench/relay.md``). A sealed
connection keeps the mutual TLS 1.3 handshake -- certificates, names, revocation and every identity
check stay exactly as they are -- and then carries each whole message as ONE authenticated record
(up to ``MAX_MESSAGE_BYTES``), decrypted straight into the buffer the message is handed on in.

The design (reviewed in ``docs/data-plane.md``, "Sealed link records"):

* **Negotiation inside TLS.** Right after the handshake the dialer sends, through the verified TLS
  session, ``OFFER`` = magic ``NBSEAL1`` + its wish (1: sealed records, 0: TLS records) + a fresh 32-byte
  secret; the acceptor answers with the same magic, its decision (1 only if both want it) and its own
  fresh secret. Both messages are TLS application data, so an attacker on the path can neither read
  the secrets nor change a decision (a downgrade to TLS records is impossible too, not just harmless).
* **Keys.** HKDF-SHA256 over the whole transcript (offer + answer: both secrets and both wishes), one
  AES-256-GCM key per direction (``dialer -> acceptor`` and ``acceptor -> dialer``). Fresh secrets from
  both sides make every connection's keys new; TLS 1.3's ephemeral key exchange gives them forward
  secrecy. Then the TLS socket is detached (``pending()`` must be 0: no TLS byte is left unread) and
  the session's TCP connection carries sealed records only.
* **Records.** ``kind (1 byte) + plaintext length (4 bytes, big-endian)`` as the header, then the
  ciphertext and its 16-byte tag. The header is the associated data, so a changed length or kind
  fails authentication. The nonce is a per-direction counter (4 zero bytes + 8-byte record number),
  never sent: a record replayed, dropped, reordered or moved to the other direction fails
  authentication at the receiver, which ends the connection (the link's own sequence numbers and
  replay then recover, as after any lost connection).
* **Authenticated end.** A connection ends cleanly only with a sealed ``CLOSE`` record; a TCP end
  without it is truncation, reported as an error (TLS records, whose ragged ends Python suppresses,
  cannot tell these apart).
* **Key lifetime.** After ``KEY_LIMIT_BYTES`` of plaintext under one key (well inside AES-GCM's bounds:
  TLS 1.3 allows about 2^38 bytes of full records), both ends derive the next key from the current one
  (HKDF, the label ``next``) at the same record, with no message between them, and restart the counter.
"""

from __future__ import annotations

import os
import socket
import ssl
import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

MAGIC = b"NBSEAL1"
"""First bytes of both negotiation messages (inside TLS)."""
SECRET_BYTES = 32
NEGOTIATION = struct.Struct(f">{len(MAGIC)}sB{SECRET_BYTES}s")
"""The offer and the answer: magic, wish or decision (1 = sealed), a fresh secret."""
HEADER = struct.Struct(">BI")
"""A record's header: its kind and its plaintext length; the AEAD's associated data."""
TAG_BYTES = 16
MESSAGE = 1
"""Kind of a record that carries one message."""
CLOSE = 2
"""Kind of the empty record that ends a connection cleanly."""
KEY_LIMIT_BYTES = 1 << 36
"""Plaintext bytes one key seals before both ends move to the next (64 GiB)."""
_LABEL = b"nebula.v1 sealed link records"


class SealedRecordError(ConnectionError):
    """A sealed record failed: tampered with, replayed, reordered, truncated, or malformed."""


class _Direction:
    """One direction's key, record counter and key budget (the sender and the receiver keep a copy each)."""

    def __init__(self, key: bytes, limit: int) -> None:
        self._key = key
        self._aead = AESGCM(key)
        self._counter = 0
        self._used = 0
        self._limit = limit

    def next_nonce(self, length: int) -> tuple[AESGCM, bytes]:
        """The key and nonce for the next record of ``length`` plaintext bytes (moving to the next key
        first when this record would pass the budget: both ends decide alike from the same lengths)."""
        if self._used and self._used + length > self._limit:
            self._key = HKDF(hashes.SHA256(), 32, salt=None, info=_LABEL + b" next").derive(self._key)
            self._aead = AESGCM(self._key)
            self._counter = 0
            self._used = 0
        nonce = b"\0\0\0\0" + self._counter.to_bytes(8, "big")
        self._counter += 1
        self._used += length
        return self._aead, nonce


class RecordSealing:
    """The two directions of one sealed connection: ``seal_into`` for sending, ``open_into`` for receiving.

    Not thread-safe: one I/O thread owns it (as it owns the socket).
    """

    def __init__(self, send_key: bytes, receive_key: bytes, limit: int = KEY_LIMIT_BYTES) -> None:
        self._send = _Direction(send_key, limit)
        self._receive = _Direction(receive_key, limit)

    @staticmethod
    def sealed_size(length: int) -> int:
        """Bytes on the wire of a record carrying ``length`` plaintext bytes."""
        return HEADER.size + length + TAG_BYTES

    def seal_into(self, kind: int, message: bytes | memoryview, out: memoryview) -> int:
        """Write the record of ``message`` into ``out`` (at least ``sealed_size`` bytes); its length."""
        length = len(message)
        header = HEADER.pack(kind, length)
        aead, nonce = self._send.next_nonce(length)
        end = HEADER.size + length + TAG_BYTES
        out[: HEADER.size] = header
        aead.encrypt_into(nonce, message, header, out[HEADER.size : end])
        return end

    @staticmethod
    def parse_header(header: bytes | memoryview, limit: int) -> tuple[int, int]:
        """(kind, plaintext length) of a record header; SealedRecordError for an unknown kind or a
        length over ``limit`` (checked before any buffer is sized from it)."""
        if len(header) != HEADER.size:
            raise SealedRecordError(f"a sealed record header is {HEADER.size} bytes, got {len(header)}")
        kind, length = HEADER.unpack(header)
        if kind not in (MESSAGE, CLOSE):
            raise SealedRecordError(f"a sealed record of unknown kind {kind}")
        if kind == CLOSE and length:
            raise SealedRecordError(f"a sealed close record announced {length} bytes (a close carries none)")
        if length > limit:
            raise SealedRecordError(f"a sealed record announced {length} bytes (limit {limit})")
        return kind, length

    def open_into(self, header: bytes | memoryview, sealed: memoryview, target: memoryview) -> None:
        """Authenticate and decrypt ``sealed`` (ciphertext + tag) into ``target`` (its plaintext length)."""
        aead, nonce = self._receive.next_nonce(len(target))
        try:
            aead.decrypt_into(nonce, sealed, bytes(header), target)
        except InvalidTag:
            raise SealedRecordError(
                "a sealed record failed authentication (changed, replayed, reordered or cut on the way)"
            ) from None


def _recv_exact(sock: ssl.SSLSocket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        part = sock.recv(size - len(data))
        if not part:
            raise SealedRecordError("the peer closed the connection during the sealed-records negotiation")
        data += part
    return data


def _keys(offer: bytes, answer: bytes) -> tuple[bytes, bytes]:
    """(dialer -> acceptor key, acceptor -> dialer key) from the whole negotiation transcript."""
    keys = HKDF(hashes.SHA256(), 64, salt=_LABEL, info=b"dialer->acceptor|acceptor->dialer").derive(
        offer + answer
    )
    return keys[:32], keys[32:]


def _detach(tls: ssl.SSLSocket) -> socket.socket:
    if tls.pending():
        raise SealedRecordError("TLS holds bytes past the sealed-records negotiation: refusing to switch")
    timeout = tls.gettimeout()
    raw = socket.socket(fileno=tls.detach())
    raw.settimeout(timeout)
    return raw


def negotiate_dialer(
    tls: ssl.SSLSocket, want: bool
) -> tuple[ssl.SSLSocket | socket.socket, RecordSealing | None]:
    """The dialer's side, blocking, right after the TLS handshake: offer, read the decision.

    Returns the socket to carry the connection (the bare TCP socket when sealed, else ``tls``) and the
    sealing (None: TLS records). SealedRecordError / OSError if the peer breaks the negotiation.
    """
    offer = NEGOTIATION.pack(MAGIC, 1 if want else 0, os.urandom(SECRET_BYTES))
    tls.sendall(offer)
    answer = _recv_exact(tls, NEGOTIATION.size)
    magic, decision, _ = NEGOTIATION.unpack(answer)
    if magic != MAGIC or decision not in (0, 1) or (decision and not want):
        raise SealedRecordError("the peer answered the sealed-records offer with something else")
    if not decision:
        return tls, None
    to_acceptor, to_dialer = _keys(offer, answer)
    return _detach(tls), RecordSealing(send_key=to_acceptor, receive_key=to_dialer)


def negotiate_acceptor(
    tls: ssl.SSLSocket, allow: bool
) -> tuple[ssl.SSLSocket | socket.socket, RecordSealing | None]:
    """The acceptor's side, blocking, right after the TLS handshake: read the offer, decide, answer."""
    offer = _recv_exact(tls, NEGOTIATION.size)
    magic, wish, _ = NEGOTIATION.unpack(offer)
    if magic != MAGIC or wish not in (0, 1):
        raise SealedRecordError("the peer's first message is not a sealed-records offer")
    decision = 1 if (wish and allow) else 0
    answer = NEGOTIATION.pack(MAGIC, decision, os.urandom(SECRET_BYTES))
    tls.sendall(answer)
    if not decision:
        return tls, None
    to_acceptor, to_dialer = _keys(offer, answer)
    return _detach(tls), RecordSealing(send_key=to_dialer, receive_key=to_acceptor)
