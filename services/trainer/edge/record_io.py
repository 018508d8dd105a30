"""A stage's records on its edge connection, blocking: plain (a Unix socket) or sealed (TCP after TLS).

Why apart from ``records_transport.py``: the transport runs one connection the same way whatever
protects its records; this is the one place that knows the two wire forms. Plain records are
``4-byte big-endian length + bytes`` (``nebula_common/rpc/edge_records.py``); sealed ones are the
link's (``nebula_common/rpc/sealed_records.py``, each record authenticated before its bytes are used),
keyed by the state the trainer handed over with the socket.

Each channel has one reader thread (``read``) and one writer thread (``send``): the two directions
share no state, sealed ones included (each direction has its own key and record number).

A record that stays incomplete with no byte arriving for ``STALL_S`` ends the connection (the switch
does the same to a stage's records); between records an edge may be silent as long as its stages
compute, so no timeout applies there.
"""

from __future__ import annotations

import dataclasses
import select
import socket
from collections.abc import Callable

from nebula_common.bulk_memory import uninitialized_bytearray
from nebula_common.rpc.edge_records import MAX_EDGE_RECORD_BYTES
from nebula_common.rpc.framing import FramedChunk, is_framed, peek_chunk
from nebula_common.rpc.raw_record_bounds import END
from nebula_common.rpc.sealed_receive import SealedReceiver
from nebula_common.rpc.sealed_records import MAX_RECORD_BYTES, TAG_BYTES, RecordSealing, sealed_size

SMALL_RECORD = 64 << 10
"""Plain records up to this size are read into a reused buffer and copied out; bigger ones get their own."""
STALL_S = 60.0
"""How long a record may stay incomplete with no byte arriving (the switch's own bound on a stage's)."""
PEEK_BYTES = 1024
"""How much of a large plain record is read first to find its chunk header (a chunk's header is
tens of bytes: job id, edge and a few numbers)."""

Placer = Callable[[FramedChunk, int], "tuple[object, memoryview] | None"]
"""Where a chunk's payload of the given size goes: (a token, a view of exactly that many bytes), or
None to receive the record whole (``EdgeReceiver.place_chunk``)."""


class Ended(Exception):
    """The connection ended; the text says how."""


class TooLarge(Exception):
    """The switch announced a record over the limit; the text says so."""


def _fill(sock: socket.socket, view: memoryview, first: bool, stall_s: float) -> bool:
    """Fill ``view`` from ``sock``; False at a clean end before its first byte (when ``first``).

    Inside a record (``first`` false, or a byte of ``view`` read) the socket is waited on for at most
    ``stall_s`` at a time; the ``recv`` itself never blocks there, so data already waiting costs no
    extra call."""
    got = 0
    poller: select.poll | None = None
    while got < len(view):
        if first and not got:
            n = sock.recv_into(view)
        else:
            try:
                n = sock.recv_into(view[got:], 0, socket.MSG_DONTWAIT)
            except BlockingIOError:
                if poller is None:
                    poller = select.poll()
                    poller.register(sock, select.POLLIN)
                if not poller.poll(stall_s * 1000):
                    why = f"no byte of an unfinished record for {stall_s:g} s: the switch's edge stalled"
                    raise Ended(why) from None
                continue
        if n == 0:
            if first and got == 0:
                return False
            raise Ended("the switch's edge socket ended inside a record")
        got += n
    return True


def _handed_on(body: memoryview) -> bytes | memoryview:
    return body if is_framed(body) else bytes(body)  # a view only where the parser takes one


class PlainRecords:
    """Length-prefixed records on a local socket."""

    def __init__(self, sock: socket.socket, stall_s: float = STALL_S, placer: Placer | None = None) -> None:
        self.sock = sock
        self.stall_s = stall_s
        self.placer = placer
        self._small = bytearray(SMALL_RECORD)
        self._head = bytearray(4)
        self._peek = bytearray(PEEK_BYTES)
        #: Payload bytes read straight into their destination (no copy on this side).
        self.placed_bytes = 0

    def read(self) -> bytes | memoryview | FramedChunk | None:
        """The next record, or None at a clean end between records. With a placer, a large chunk's
        payload is read straight into the buffer the placer names, and the chunk comes back parsed
        (``FramedChunk.placed`` set): the receiver's one copy of each payload byte is saved."""
        if not _fill(self.sock, memoryview(self._head), True, self.stall_s):
            return None
        size = int.from_bytes(self._head, "big")
        if size > MAX_EDGE_RECORD_BYTES:
            raise TooLarge(f"the switch sent a {size}-byte record (limit {MAX_EDGE_RECORD_BYTES})")
        if size <= SMALL_RECORD:
            view = memoryview(self._small)[:size]
            _fill(self.sock, view, False, self.stall_s)
            return bytes(view)
        if self.placer is None:
            body = memoryview(uninitialized_bytearray(size))
            _fill(self.sock, body, False, self.stall_s)
            return _handed_on(body)
        head = memoryview(self._peek)[:PEEK_BYTES]
        _fill(self.sock, head, False, self.stall_s)
        peeked = peek_chunk(head, size)
        placed = None if peeked is None else self.placer(peeked[0], size - peeked[1])
        if placed is None:
            body = memoryview(uninitialized_bytearray(size))
            body[:PEEK_BYTES] = head
            _fill(self.sock, body[PEEK_BYTES:], False, self.stall_s)
            return _handed_on(body)
        (chunk, start), (token, target) = peeked, placed  # type: ignore[misc]
        early = PEEK_BYTES - start
        target[:early] = head[start:]
        _fill(self.sock, target[early:], False, self.stall_s)
        self.placed_bytes += len(target)
        return dataclasses.replace(chunk, data=target, placed=token)

    def send(self, data: bytes | memoryview) -> None:
        """One record, header and bytes in one ``sendmsg`` where the kernel takes them, never joined."""
        parts = [memoryview(len(data).to_bytes(4, "big")), memoryview(data).cast("B")]
        while parts:
            sent = self.sock.sendmsg(parts)
            while parts and sent >= len(parts[0]):
                sent -= len(parts[0])
                parts.pop(0)
            if parts and sent:
                parts[0] = parts[0][sent:]


class SealedRecords:
    """Sealed records on a TCP connection (``RecordSealing.resumed`` from the trainer's handover)."""

    def __init__(self, sock: socket.socket, sealing: RecordSealing, stall_s: float = STALL_S) -> None:
        self.sock = sock
        self.stall_s = stall_s
        self._sealing = sealing
        fresh = lambda size: memoryview(uninitialized_bytearray(size))  # noqa: E731
        self._receiver = SealedReceiver(sealing, True, fresh)
        self._head = bytearray(self._receiver.header_size)
        self._body = bytearray(MAX_RECORD_BYTES + TAG_BYTES)
        self._out = bytearray(0)

    def read(self) -> bytes | memoryview | None:
        """The next message, or None after the switch's sealed close (SealedRecordError if a record
        fails; an end without the close is a cut)."""
        while True:
            between = not self._receiver.inside_message
            if not _fill(self.sock, memoryview(self._head), between, self.stall_s):
                raise Ended("the switch's edge connection ended without its sealed close: cut")
            need = self._receiver.header(self._head)
            body = memoryview(self._body)[:need]
            _fill(self.sock, body, False, self.stall_s)
            message = self._receiver.body(body)
            if message is END:
                return None
            if message is not None:
                assert isinstance(message, bytes | memoryview)
                return _handed_on(message) if isinstance(message, memoryview) else message

    def send(self, data: bytes | memoryview) -> None:
        """The records of one message, sealed into a reused buffer and sent."""
        size = sealed_size(len(data), self._sealing.record_bytes)
        if len(self._out) < size:
            self._out = bytearray(size)
        end = self._sealing.seal_into(data, memoryview(self._out))
        self.sock.sendall(memoryview(self._out)[:end])


def records(
    sock: socket.socket, sealing: RecordSealing | None, placer: Placer | None = None
) -> PlainRecords | SealedRecords:
    """The channel for a connection the trainer passed (sealed when it handed a sealing over; plain
    records place large chunks' payloads with ``placer``)."""
    return PlainRecords(sock, placer=placer) if sealing is None else SealedRecords(sock, sealing)


__all__ = ["SMALL_RECORD", "STALL_S", "Ended", "PlainRecords", "SealedRecords", "TooLarge", "records"]
