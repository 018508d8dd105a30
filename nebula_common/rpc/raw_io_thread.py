"""The I/O thread of a ``RawConnection``: the one thread that touches its socket, and its hand-offs.

The socket belongs to this thread alone: it receives records straight into a reused buffer
(``recv_into``), hands each complete message to the event loop, and sends queued messages without
copying them. With sealed records (``sealed_records.py``, the link between switches) it seals each
message's records itself and opens them through its ``SealedReceiver`` (``sealed_receive.py``), and
ends the connection when a sealed record stays incomplete with no byte of it arriving for
``read_timeout_s`` (a peer that stops mid-record cannot hold a reader); plain records (a local Unix
socket: the switch's edge socket) carry the same framing unsealed. Encryption, decryption and the
socket calls run with the GIL released, so the event loop keeps routing while bytes move.

Hand-offs to the loop cost a system call and a wake-up each, so they happen only when the loop waits
(``docs/bench/relay.md``): a received message goes into a deque and the loop is woken only if a reader
waits; sent messages are counted and a writer is woken only when it waits for them.

:class:`RawIoThread` is part of :class:`~nebula_common.rpc.raw_records.RawConnection`, whose
``__init__`` sets the state it declares and starts ``_run`` on a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import threading
import time
from collections import deque
from collections.abc import Callable

from nebula_common.rpc.raw_record_bounds import END, SMALL_MESSAGE, RecordViolation
from nebula_common.rpc.sealed_receive import SealedReceiver
from nebula_common.rpc.sealed_records import (
    MAX_RECORD_BYTES,
    TAG_BYTES,
    RecordSealing,
    SealedRecordError,
    sealed_size,
)


def fresh_buffer(size: int) -> memoryview:
    """A writable ``size``-byte buffer that is not zeroed first (numpy's ``empty``: malloc, reused memory)."""
    import numpy

    return memoryview(numpy.empty(size, dtype=numpy.uint8)).cast("B")


class RawIoThread:
    """The I/O thread's loop and its hand-offs to the event loop (see the module doc)."""

    sock: socket.socket
    sealing: RecordSealing | None
    read_timeout_s: float
    max_message_bytes: int
    plain_read_timeout: bool
    violation_record: Callable[[str], bytes] | None
    views: bool
    peer: str
    _error: type[Exception]
    _loop: asyncio.AbstractEventLoop
    _wake_r: socket.socket
    _wake_w: socket.socket
    # Shared with the loop, under ``_lock``.
    _lock: threading.Lock
    _outbox: deque[tuple[bytes | memoryview, bool]]
    _sent: int
    _send_waiters: list[tuple[int, asyncio.Future[None]]]
    _arrived: deque[object]
    _read_waiter: asyncio.Future[None] | None
    _room: int
    _parked: bool
    _closing: bool
    _failure: BaseException | None
    _stopped: asyncio.Future[None]

    # ----- hand-offs from the I/O thread (each only when the loop waits for it) ----------
    def _call(self, callback: Callable[..., object], *args: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self._loop.call_soon_threadsafe(callback, *args)

    def _post(self, item: object) -> None:
        """A received message (or the end) for the loop; the loop is woken only if a reader waits."""
        with self._lock:
            self._arrived.append(item)
            waiter = self._read_waiter
            self._read_waiter = None
        if waiter is not None:
            self._call(_release, waiter)

    def _count_sent(self) -> None:
        """One more message sent; writers waiting for it are released (one wake-up for all)."""
        with self._lock:
            self._sent += 1
            if not self._send_waiters or self._send_waiters[0][0] > self._sent:
                return
            ready = [waiter for count, waiter in self._send_waiters if count <= self._sent]
            self._send_waiters = [(c, w) for c, w in self._send_waiters if c > self._sent]
        self._call(_release_all, ready, None)

    # ----- the I/O thread ----------------------------------------------------------------
    def _run(self) -> None:
        error: BaseException | None = None
        try:
            self._pump()
            if self._closing:  # closed here (a lane dropped, the session over): a reader must not wait
                error = ConnectionError("the connection was closed by this switch")
                self._post(error)
        except BaseException as exc:  # handed to the session as a read error
            error = exc
            self._post(exc)
            if isinstance(exc, RecordViolation):
                self._say_why(exc)
        finally:
            with self._lock:
                self._failure = error or ConnectionError("connection closed")
                self._outbox.clear()
                waiting = [waiter for _, waiter in self._send_waiters]
                self._send_waiters = []
            failure = self._error(f"raw write to {self.peer} failed: {self._failure}")
            if waiting:
                self._call(_release_all, waiting, failure)
            with contextlib.suppress(OSError):
                self.sock.close()
            self._wake_r.close()
            self._wake_w.close()

            def stopped() -> None:
                if not self._stopped.done():
                    self._stopped.set_result(None)

            self._call(stopped)

    def _say_why(self, violation: RecordViolation) -> None:
        """A last record telling a peer that broke the bounds why it is cut (``violation_record``)."""
        if self.violation_record is None or self.sealing is not None:
            return
        record = self.violation_record(str(violation))
        with contextlib.suppress(OSError, ValueError):
            self.sock.settimeout(2.0)
            self.sock.sendall(len(record).to_bytes(4, "big") + record)

    def _pump(self) -> None:
        sock = self.sock
        sealing = self.sealing
        receiver = SealedReceiver(sealing, self.views, fresh_buffer) if sealing is not None else None
        head_size = receiver.header_size if receiver is not None else 4
        head = bytearray(head_size)
        head_view = memoryview(head)
        # Small messages (and, sealed, every record's ciphertext: at most one record's worth).
        buffer = bytearray(MAX_RECORD_BYTES + TAG_BYTES if receiver is not None else 1 << 20)
        seal_buffer = bytearray(0)  # sealed: the records of the message being sent (reused)
        target, need, got, reading_head = head_view, head_size, 0, True
        fresh = False
        size = 0
        last_byte = time.monotonic()  # sealed: when a byte last arrived (read timeout inside a record)
        current: memoryview | None = None
        whole = False  # ``current`` is the last part of a message (its send completes the message)
        while True:
            with self._lock:
                if self._closing:
                    break
                room = self._room
            # Receive: as much as the socket has ready, while the session has room for messages.
            while room > 0:
                try:
                    n = sock.recv_into(target[got:need])
                except BlockingIOError:  # nothing ready
                    break
                if n == 0:
                    if receiver is not None:
                        raise SealedRecordError("the connection ended without its sealed close: cut")
                    if reading_head and got == 0:
                        self._post(END)
                        return
                    raise ConnectionError("the raw connection ended inside a record")
                last_byte = time.monotonic()
                got += n
                if got < need:
                    continue
                if receiver is not None:
                    if reading_head:
                        need = receiver.header(head)
                        target, got, reading_head = memoryview(buffer), 0, False
                        continue
                    message = receiver.body(target[:need])
                    target, need, got, reading_head = head_view, head_size, 0, True
                    if message is None:
                        continue  # a part: its message continues in the next record
                    if message is END:
                        self._post(END)
                        return
                elif reading_head:
                    size = int.from_bytes(head, "big")
                    if size > self.max_message_bytes:
                        raise RecordViolation(
                            f"peer sent a {size}-byte record (limit {self.max_message_bytes})"
                        )
                    if size == 0:
                        message = b""
                    else:
                        fresh = self.views and size > SMALL_MESSAGE
                        if fresh:
                            target = fresh_buffer(size)  # handed on as is: received once, never copied
                        else:
                            if size > len(buffer):
                                buffer = bytearray(size)
                            target = memoryview(buffer)
                        need, got, reading_head = size, 0, False
                        continue
                else:
                    message = target if fresh else bytes(target[:need])
                with self._lock:
                    self._room -= 1
                    room = self._room
                self._post(message)
                target, need, got, reading_head = head_view, head_size, 0, True
            # Send: queued parts (the rest of a part retried when the socket takes it).
            blocked = False
            while True:
                if current is None:
                    with self._lock:
                        if not self._outbox:
                            break
                        data, whole = self._outbox.popleft()
                    if sealing is not None:  # the message's records, sealed here (GIL released)
                        if sealed_size(len(data), sealing.record_bytes) > len(seal_buffer):
                            seal_buffer = bytearray(sealed_size(len(data), sealing.record_bytes))
                        end = sealing.seal_into(data, memoryview(seal_buffer))
                        current = memoryview(seal_buffer)[:end]
                    else:
                        current = memoryview(data).cast("B")
                try:
                    sent = sock.send(current)
                except BlockingIOError:
                    blocked = True
                    break
                current = current[sent:] if sent < len(current) else None
                if current is None and whole:
                    self._count_sent()
            # Sleep until there is something to do: the wake pipe, the socket readable (when the
            # session has room), the socket writable (when a send would block).
            with self._lock:
                if self._closing:
                    break
                room = self._room
                if not blocked and (current is not None or self._outbox):
                    continue  # written meanwhile
                self._parked = True
            wait = 1.0
            inside = got or not reading_head
            if receiver is not None and room > 0 and (inside or receiver.inside_message):
                left = last_byte + self.read_timeout_s - time.monotonic()
                if left <= 0:
                    raise SealedRecordError(
                        f"no byte of an unfinished sealed record for {self.read_timeout_s:g} s: peer stalled"
                    )
                wait = min(wait, left)
            elif self.plain_read_timeout and room > 0 and inside:
                left = last_byte + self.read_timeout_s - time.monotonic()
                if left <= 0:
                    raise RecordViolation(
                        f"no byte of an unfinished record for {self.read_timeout_s:g} s: peer stalled"
                    )
                wait = min(wait, left)
            else:
                last_byte = time.monotonic()
            # poll, not select: a busy switch has descriptors above select's 1024.
            poller = select.poll()
            poller.register(self._wake_r, select.POLLIN)
            events = (select.POLLIN if room > 0 else 0) | (select.POLLOUT if blocked else 0)
            if events:
                poller.register(sock, events)
            woken = any(fd == self._wake_r.fileno() for fd, _ in poller.poll(wait * 1000))
            with self._lock:
                self._parked = False
            if woken:
                with contextlib.suppress(OSError):
                    while self._wake_r.recv(4096):
                        pass
        if sealing is not None and current is None:
            self._send_close(sealing)

    def _send_close(self, sealing: RecordSealing) -> None:
        """Closed here between records: end with the sealed close, so the peer can tell an end from a cut."""
        record = bytearray(sealed_size(0))
        sealing.seal_close_into(memoryview(record))
        with contextlib.suppress(OSError):
            self.sock.settimeout(2.0)
            self.sock.sendall(record)


def _release(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _release_all(waiters: list[asyncio.Future[None]], error: BaseException | None) -> None:
    for waiter in waiters:
        if waiter.done():
            continue
        if error is None:
            waiter.set_result(None)
        else:
            waiter.set_exception(error)


__all__ = ["RawIoThread", "fresh_buffer"]
