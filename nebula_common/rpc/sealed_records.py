"""Sealed records: AES-256-GCM records of at most 1 MiB on the bare TCP connection after mutual TLS 1.3.

Why: a Python ``ssl`` endpoint moves at most one 16 KiB TLS record per call (two ``recv`` system calls
and one interpreter round per record, then a copy out of OpenSSL's record buffer), which makes the
switch that reads the link the busiest process of the relay (``docs/bench/relay.md``). A sealed
connection keeps the mutual TLS 1.3 handshake and every identity check after it, then carries each
message as records of up to ``MAX_RECORD_BYTES`` that are decrypted straight into the buffer the
message is handed on in.

This module is the record protection alone, TLS 1.3's (RFC 8446 section 5) with larger records; the
keys come from the TLS exporter of the authenticated session (``sealed_negotiation.py``), the
receiving state machine lives in ``sealed_receive.py``. Design review: ``docs/data-plane.md``,
"Sealed link records".

* **Keys and IVs.** Each direction has a traffic secret exported from TLS; from it HKDF-Expand derives
  that direction's AES-256-GCM key and a secret 12-byte IV. A record's nonce is the IV XOR its 64-bit
  record number (left-padded to 12 bytes), as in RFC 8446 section 5.3: never sent, never reused under
  one key, so a record replayed, dropped, reordered or reflected to its sender fails authentication.
* **Records.** Header ``kind (1 byte) + record length (4) + message length (4)``, the AEAD's associated
  data, then ciphertext and tag. A message is one ``LAST`` record or ``PART`` records followed by a
  ``LAST``, each record at most 1 MiB and authenticated on its own before any of its plaintext is used;
  ``CLOSE`` (empty) ends a connection cleanly, so a TCP end without it is a cut.
* **Key lifetime.** Like TLS 1.3's KeyUpdate, a direction moves to the next secret (HKDF-Expand, label
  ``traffic upd``) and restarts its record number after ``KEY_LIMIT_BYTES`` of plaintext or
  ``KEY_LIMIT_RECORDS`` records, whichever comes first; both ends decide alike from the records both see.
"""

from __future__ import annotations

import struct

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand

from nebula_common.rpc.raw_record_bounds import MAX_MESSAGE_BYTES

HEADER = struct.Struct(">BII")
"""A record's header: kind, record plaintext length, whole message length; the AEAD's associated data."""
TAG_BYTES = 16
IV_BYTES = 12
KEY_BYTES = 32
SECRET_BYTES = 32
PART = 1
"""Kind of a record that carries a message's bytes and is followed by more of them."""
LAST = 2
"""Kind of the record that completes a message (a message of at most 1 MiB is this one record)."""
CLOSE = 3
"""Kind of the empty record that ends a connection cleanly."""
MAX_RECORD_BYTES = 1 << 20
"""Largest plaintext of one record: what a receiver holds before it is authenticated."""
KEY_LIMIT_BYTES = 1 << 36
"""Plaintext bytes one key seals before its direction moves to the next key (64 GiB)."""
KEY_LIMIT_RECORDS = 1 << 24
"""Records one key seals before the next (RFC 8446 section 5.5 allows 2^24.5 full records per AES-GCM key)."""
READ_TIMEOUT_S = 60.0
"""How long a record may stay incomplete with no byte of it arriving: the longest the link's liveness
waits for any sign of life (``services/switch/liveness.py``, dead-peer timeout ceiling)."""
_LABEL = b"nebula sealed v2 "


class SealedRecordError(ConnectionError):
    """A sealed record or negotiation failed: tampered with, replayed, reordered, truncated, malformed."""


def expand(secret: bytes, label: str, length: int) -> bytes:
    """HKDF-Expand (RFC 5869) of ``secret`` under this protocol's ``label`` (as TLS 1.3 expands secrets)."""
    return HKDFExpand(hashes.SHA256(), length, info=_LABEL + label.encode()).derive(secret)


class _Direction:
    """One direction's secret, key, IV, record number and key budget (sender and receiver keep a copy)."""

    def __init__(self, secret: bytes, limit_bytes: int, limit_records: int) -> None:
        if len(secret) != SECRET_BYTES:
            raise ValueError(f"a traffic secret is {SECRET_BYTES} bytes, got {len(secret)}")
        self._limit_bytes = limit_bytes
        self._limit_records = limit_records
        self._use(secret)

    def _use(self, secret: bytes) -> None:
        self._secret = secret
        self._aead = AESGCM(expand(secret, "key", KEY_BYTES))
        self._iv = int.from_bytes(expand(secret, "iv", IV_BYTES), "big")
        self._counter = 0
        self._used = 0

    def next_nonce(self, length: int) -> tuple[AESGCM, bytes]:
        """The key and nonce for the next record of ``length`` plaintext bytes (moving to the next key
        first when this record would pass the budget: both ends decide alike from the same records)."""
        if self._counter and (
            self._used + length > self._limit_bytes or self._counter >= self._limit_records
        ):
            self._use(expand(self._secret, "traffic upd", SECRET_BYTES))
        nonce = (self._iv ^ self._counter).to_bytes(IV_BYTES, "big")
        self._counter += 1
        self._used += length
        return self._aead, nonce

    def state(self) -> tuple[bytes, int, int]:
        """(current secret, records sealed or opened under it, plaintext bytes under it)."""
        return self._secret, self._counter, self._used

    def restore(self, counter: int, used: int) -> None:
        """Continue under the current secret after ``counter`` records of ``used`` bytes."""
        if not (0 <= counter < self._limit_records and 0 <= used <= self._limit_bytes):
            raise ValueError(f"a sealing state of {counter} records and {used} bytes is out of bounds")
        self._counter, self._used = counter, used


def parse_header(header: bytes | memoryview, offset: int, total: int) -> tuple[int, int, int]:
    """(kind, record length, message length) of a record header read ``offset`` bytes into a message of
    ``total`` bytes (0, 0 between messages). SealedRecordError for anything a sender of this module never
    writes, checked before any buffer is sized from the header."""
    if len(header) != HEADER.size:
        raise SealedRecordError(f"a sealed record header is {HEADER.size} bytes, got {len(header)}")
    kind, length, message = HEADER.unpack(header)
    if kind not in (PART, LAST, CLOSE):
        raise SealedRecordError(f"a sealed record of unknown kind {kind}")
    if kind == CLOSE:
        if length or message:
            raise SealedRecordError("a sealed close record announced bytes (a close carries none)")
        if offset:
            raise SealedRecordError("a sealed close record inside a message")
        return kind, 0, 0
    if length > MAX_RECORD_BYTES:
        raise SealedRecordError(f"a sealed record announced {length} bytes (limit {MAX_RECORD_BYTES})")
    if message > MAX_MESSAGE_BYTES:
        raise SealedRecordError(f"a sealed message announced {message} bytes (limit {MAX_MESSAGE_BYTES})")
    if offset and message != total:
        raise SealedRecordError(f"a sealed record says its message is {message} bytes, not {total}")
    end = offset + length
    if kind == PART and (length == 0 or end >= message):
        raise SealedRecordError("a sealed part record that carries nothing or ends its message")
    if kind == LAST and end != message:
        raise SealedRecordError(f"a sealed last record ends its message at {end} of {message} bytes")
    return kind, length, message


def sealed_size(length: int, record_bytes: int = MAX_RECORD_BYTES) -> int:
    """Bytes on the wire of a message of ``length`` bytes in records of ``record_bytes`` (each with its
    header and tag)."""
    records = max(1, -(-length // record_bytes))
    return length + records * (HEADER.size + TAG_BYTES)


class RecordSealing:
    """The two directions of one sealed connection: ``seal_into`` for sending, ``open_into`` for receiving.

    Not thread-safe: one I/O thread owns it (as it owns the socket). ``record_bytes`` (at most
    ``MAX_RECORD_BYTES``, which every receiver accepts) is the size of the records this end sends.
    """

    def __init__(
        self,
        send_secret: bytes,
        receive_secret: bytes,
        limit_bytes: int = KEY_LIMIT_BYTES,
        limit_records: int = KEY_LIMIT_RECORDS,
        record_bytes: int = MAX_RECORD_BYTES,
    ) -> None:
        if not 0 < record_bytes <= MAX_RECORD_BYTES:
            raise ValueError(f"records of 1 to {MAX_RECORD_BYTES} bytes, not {record_bytes}")
        self.record_bytes = record_bytes
        self._send = _Direction(send_secret, limit_bytes, limit_records)
        self._receive = _Direction(receive_secret, limit_bytes, limit_records)

    sealed_size = staticmethod(sealed_size)
    parse_header = staticmethod(parse_header)

    def handover(self) -> dict[str, str | int]:
        """Both directions' state, for the process that takes the connection over (``resumed``).

        Why: a trainer makes a stage's edge connection (its handshake, its ticket) and passes the socket
        to the stage process, which holds no key of the trainer's; this state keys that one connection.
        """
        send, sent, sent_bytes = self._send.state()
        receive, opened, opened_bytes = self._receive.state()
        return {
            "send": send.hex(),
            "sent": sent,
            "sent_bytes": sent_bytes,
            "receive": receive.hex(),
            "opened": opened,
            "opened_bytes": opened_bytes,
            "record_bytes": self.record_bytes,
        }

    @classmethod
    def resumed(cls, state: dict[str, object]) -> RecordSealing:
        """The sealing ``handover`` described; ValueError naming what is wrong with ``state``."""
        try:
            sealing = cls(
                bytes.fromhex(str(state["send"])),
                bytes.fromhex(str(state["receive"])),
                record_bytes=int(str(state["record_bytes"])),
            )
            sealing._send.restore(int(str(state["sent"])), int(str(state["sent_bytes"])))
            sealing._receive.restore(int(str(state["opened"])), int(str(state["opened_bytes"])))
        except (KeyError, TypeError) as exc:
            raise ValueError(f"a sealing handover without a valid {exc}") from None
        return sealing

    def seal_into(self, message: bytes | memoryview, out: memoryview) -> int:
        """Write the records of ``message`` into ``out`` (``sealed_size(len(message), record_bytes)``
        bytes at least); their length."""
        view = memoryview(message).cast("B")
        total = len(view)
        at = offset = 0
        while True:
            length = min(self.record_bytes, total - offset)
            kind = LAST if offset + length == total else PART
            at = self._seal_record(kind, view[offset : offset + length], total, out, at)
            offset += length
            if kind == LAST:
                return at

    def seal_close_into(self, out: memoryview) -> int:
        """Write the ``CLOSE`` record into ``out`` (``sealed_size(0)`` bytes); its length."""
        return self._seal_record(CLOSE, b"", 0, out, 0)

    def _seal_record(self, kind: int, plain: bytes | memoryview, total: int, out: memoryview, at: int) -> int:
        header = HEADER.pack(kind, len(plain), total)
        aead, nonce = self._send.next_nonce(len(plain))
        body = at + HEADER.size
        end = body + len(plain) + TAG_BYTES
        out[at:body] = header
        aead.encrypt_into(nonce, plain, header, out[body:end])
        return end

    def open_into(self, header: bytes | memoryview, sealed: memoryview, target: memoryview) -> None:
        """Authenticate and decrypt ``sealed`` (ciphertext + tag) into ``target`` (its plaintext length).

        On SealedRecordError ``target`` holds nothing usable: the caller ends the connection and drops it.
        """
        aead, nonce = self._receive.next_nonce(len(target))
        try:
            aead.decrypt_into(nonce, sealed, bytes(header), target)
        except (InvalidTag, ValueError):
            raise SealedRecordError(
                "a sealed record failed authentication (changed, replayed, reordered or cut on the way)"
            ) from None


__all__ = [
    "CLOSE",
    "HEADER",
    "KEY_LIMIT_BYTES",
    "KEY_LIMIT_RECORDS",
    "LAST",
    "MAX_RECORD_BYTES",
    "PART",
    "READ_TIMEOUT_S",
    "TAG_BYTES",
    "RecordSealing",
    "SealedRecordError",
    "expand",
    "parse_header",
    "sealed_size",
]
