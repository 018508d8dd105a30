"""Receiving sealed records: whole messages from records of at most 1 MiB, each authenticated first.

Why apart: the I/O thread (``raw_io_thread.py``) owns the socket and its reads; this is the state
machine between them and the record protection (``sealed_records.py``), with nothing of a socket in it,
so every path through it can be driven (and fuzzed) with bytes alone.

The reader asks ``header_size``, hands the header to ``header`` (which says how many sealed bytes come
next, after checking the header against the message in progress), then those bytes to ``body``, which
authenticates the record and returns a completed message, ``END`` for the sealed close, or None while a
message continues. A message's first record is opened into a reused 1 MiB buffer, so nothing is sized
from a header before a record of that message has authenticated; then the message gets its own buffer
(``fresh``, handed on as a view with ``views``) and later records are opened straight into it. A failed
record raises SealedRecordError and the caller drops the connection with that buffer: no byte of a
message is handed on before all of its records have authenticated.
"""

from __future__ import annotations

from collections.abc import Callable

from nebula_common.rpc.raw_record_bounds import END, SMALL_MESSAGE
from nebula_common.rpc.sealed_records import (
    CLOSE,
    HEADER,
    MAX_RECORD_BYTES,
    TAG_BYTES,
    RecordSealing,
    SealedRecordError,
    parse_header,
)


class SealedReceiver:
    """One connection's receiving side of sealed records (owned by its I/O thread, as the socket is)."""

    header_size = HEADER.size

    def __init__(
        self,
        sealing: RecordSealing,
        views: bool,
        fresh: Callable[[int], memoryview] = lambda size: memoryview(bytearray(size)),
    ) -> None:
        self._sealing = sealing
        self._views = views
        self._fresh = fresh
        self._scratch = bytearray(MAX_RECORD_BYTES)
        self._header = b""
        self._kind = 0
        self._length = 0
        self._offset = 0  # bytes of the message in progress opened so far (0: between messages)
        self._total = 0
        self._message: memoryview | None = None

    @property
    def inside_message(self) -> bool:
        """A message has begun and not ended: its next record is due (the read timeout applies)."""
        return self._offset > 0

    def header(self, head: bytes | memoryview) -> int:
        """Check the next record's header; the number of sealed bytes (ciphertext + tag) to read next."""
        self._kind, self._length, total = parse_header(head, self._offset, self._total)
        self._header = bytes(head)
        if not self._offset:
            self._total = total
        return self._length + TAG_BYTES

    def body(self, sealed: memoryview) -> object | None:
        """Open the record whose header came last: a whole message (bytes, or a view with ``views``),
        ``END`` after the sealed close, None while its message continues. SealedRecordError if it fails."""
        if len(sealed) != self._length + TAG_BYTES:
            raise SealedRecordError(f"a sealed record body of {len(sealed)} bytes, expected {self._length}")
        length, total = self._length, self._total
        if self._kind == CLOSE:
            self._sealing.open_into(self._header, sealed, memoryview(self._scratch)[:0])
            return END
        if self._offset == 0 and length == total:  # a whole message in one record
            if self._views and total > SMALL_MESSAGE:
                opened = self._fresh(total)
                self._sealing.open_into(self._header, sealed, opened)
                return opened
            scratch = memoryview(self._scratch)[:total]
            self._sealing.open_into(self._header, sealed, scratch)
            return bytes(scratch)
        if self._offset == 0:  # the first part: authenticated before the message's buffer exists
            scratch = memoryview(self._scratch)[:length]
            self._sealing.open_into(self._header, sealed, scratch)
            self._message = self._fresh(total) if self._views else memoryview(bytearray(total))
            self._message[:length] = scratch
            self._offset = length
            return None
        assert self._message is not None
        end = self._offset + length
        self._sealing.open_into(self._header, sealed, self._message[self._offset : end])
        self._offset = end
        if end < total:
            return None
        message, self._message, self._offset, self._total = self._message, None, 0, 0
        return message if self._views else bytes(message)


__all__ = ["SealedReceiver"]
