"""Whole messages as records on a socket, for asyncio: sealed (the link) or plain (the edge socket).

The carrier of the switch-to-switch link (``services/switch/rawlink.py``: sealed records on the bare TCP
connection after a mutual TLS 1.3 handshake) and of the switch's edge socket (``edge_socket.py``: plain
``4-byte big-endian length + bytes`` records on a local Unix socket). ``RawConnection`` gives
it the ``read`` / ``write`` pair a gRPC call gives (``read`` returns ``grpc.aio.EOF`` at a clean end),
so the link's session code runs unchanged on either carrier.

This module is the connection's event-loop side (``read``, ``write``, ``close``); its parts live apart:
the I/O thread that alone touches the socket and frames or seals the records (``raw_io_thread.py``),
the record limit and the read/write bounds both sides share (``raw_record_bounds.py``), and
``in_thread`` for the blocking TLS set-up before a connection exists (``blocking_steps.py``). Their
names stay importable from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
from collections import deque
from collections.abc import Callable

import grpc
from cryptography import x509

from nebula_common.rpc.blocking_steps import in_thread
from nebula_common.rpc.raw_io_thread import RawIoThread, fresh_buffer
from nebula_common.rpc.raw_record_bounds import (
    END,
    MAX_MESSAGE_BYTES,
    READ_AHEAD,
    SMALL_MESSAGE,
    WRITE_AHEAD,
)
from nebula_common.rpc.sealed_records import READ_TIMEOUT_S, RecordSealing


class RawConnectionError(ConnectionError):
    """A raw connection failed or was closed (the default error of ``RawConnection``)."""


class RawConnection(RawIoThread):
    """One raw connection after TLS: ``read`` / ``write`` of whole messages, as the gRPC call's.

    ``sock`` is the bare TCP socket under sealed records (``sealing``, after the TLS handshake whose
    peer certificate is ``peer_cert``), or a local socket carrying plain records.

    The socket belongs to one I/O thread: it receives records straight into a reused buffer
    (``recv_into``), hands each complete message to the event loop, and sends queued messages without
    copying them. Sealing, opening and the socket calls run with the GIL released, so the event loop
    keeps routing while bytes move.

    Hand-offs between the two threads cost a system call and a wake-up each, so they happen only when
    the other side waits (``docs/bench/relay.md``): received messages go into a deque
    the loop's reader takes from, and the loop is woken only when a reader waits on it; written
    messages go into the thread's outbox, and the thread is woken only when it sleeps in ``select``;
    a writer counts sent messages and is woken only when it waits for the thread to catch up
    (``WRITE_AHEAD``). A busy path so moves several messages per wake-up instead of one.
    """

    def __init__(
        self,
        sock: socket.socket,
        peer: str,
        loop: asyncio.AbstractEventLoop,
        send_buffer: int = 0,
        error: type[Exception] = RawConnectionError,
        views: bool = False,
        sealing: RecordSealing | None = None,
        peer_cert: x509.Certificate | None = None,
        read_timeout_s: float = READ_TIMEOUT_S,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        plain_read_timeout: bool = False,
        violation_record: Callable[[str], bytes] | None = None,
    ) -> None:
        self.sock = sock
        #: Largest message received (a bigger record's header ends the connection before any buffer).
        self.max_message_bytes = max_message_bytes
        #: Plain records too end after ``read_timeout_s`` without a byte inside a record (an untrusted peer
        #: on a local socket); sealed records always do.
        self.plain_read_timeout = plain_read_timeout
        #: Plain records: the record sent to a peer that broke the bounds, built from why, before the cut.
        self.violation_record = violation_record
        #: Sealed records (``nebula_common/rpc/sealed_records.py``) on the bare socket ``sock`` after a
        #: TLS handshake whose peer certificate is ``peer_cert``; None: the records of ``sock`` itself.
        self.sealing = sealing
        #: Sealed: how long a record may stay incomplete with no byte of it arriving (then an error).
        self.read_timeout_s = read_timeout_s
        self._error = error
        #: Messages over SMALL_MESSAGE are received into a fresh buffer each and handed on as a
        #: ``memoryview`` of it (no copy); otherwise as ``bytes`` copied out of one reused buffer.
        self.views = views
        self.peer = peer
        self.peer_cert = peer_cert
        self._loop = loop
        if send_buffer:
            # A fixed send buffer bounds what waits first-in first-out below the switch's fair scheduler,
            # as the gRPC link's fixed HTTP/2 window does (LINK_WINDOW_BYTES; 0 keeps kernel autotuning).
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        sock.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        # Everything below is shared by the loop and the I/O thread, under ``_lock``.
        self._lock = threading.Lock()
        #: Parts to send, each with whether it completes a message (a big message: its header, then it).
        self._outbox: deque[tuple[bytes | memoryview, bool]] = deque()
        self._queued = 0  # messages written (``write``/``send_nowait``)
        self._sent = 0  # of them, messages the I/O thread sent completely
        self._send_waiters: list[tuple[int, asyncio.Future[None]]] = []  # (sent count awaited, future)
        self._arrived: deque[object] = deque()  # received messages, then END or an exception
        self._read_waiter: asyncio.Future[None] | None = None
        self._room = READ_AHEAD
        self._parked = False  # the I/O thread sleeps (or is about to) in select: writers must wake it
        self._closing = False
        self._failure: BaseException | None = None
        self._stopped: asyncio.Future[None] = loop.create_future()
        self._thread = threading.Thread(target=self._run, name=f"raw {peer}", daemon=True)
        self._thread.start()

    # ----- the event loop's side -------------------------------------------------------
    async def read(self) -> object:
        """The next message (``bytes``, or a ``memoryview`` with ``views``), or ``grpc.aio.EOF`` when the
        peer closed cleanly between messages."""
        wake = False
        while True:
            with self._lock:
                if self._arrived:
                    item = self._arrived[0]
                    if item is END or isinstance(item, BaseException):
                        break  # stays: every later read sees the end too
                    self._arrived.popleft()
                    self._room += 1
                    wake = self._room == 1 and self._parked
                    if wake:
                        self._parked = False
                    break
                waiter = self._read_waiter
                if waiter is None or waiter.done():
                    waiter = self._read_waiter = self._loop.create_future()
            await waiter
        if item is END:
            return grpc.aio.EOF
        if isinstance(item, BaseException):
            raise self._error(f"raw connection to {self.peer} failed: {item}") from item
        if wake:
            self._wake()
        return item

    def pending_reads(self) -> int:
        """Messages received and not read yet (at most ``READ_AHEAD``)."""
        with self._lock:
            return sum(1 for item in self._arrived if item is not END and not isinstance(item, BaseException))

    def send_nowait(self, data: bytes | memoryview) -> None:
        """Queue ``data`` as one message from any thread, without waiting for the I/O thread.

        For a caller that bounds what it queues itself (the trainer's edge session: its credit window).
        RawConnectionError if the message is too big or the connection is over.
        """
        if len(data) > MAX_MESSAGE_BYTES:
            raise self._error(f"a {len(data)}-byte message exceeds the raw record limit")
        self._queue(data)

    def _queue(self, data: bytes | memoryview) -> int:
        head = len(data).to_bytes(4, "big")
        with self._lock:
            if self._failure is not None or self._closing:
                raise self._error(f"raw connection to {self.peer} is closed")
            if self.sealing is not None:
                self._outbox.append((data, True))  # sealed whole by the I/O thread (header and all)
            elif len(data) <= SMALL_MESSAGE:
                self._outbox.append((head + data, True))
            else:
                self._outbox.append((head, False))
                self._outbox.append((data, True))
            self._queued += 1
            queued = self._queued
            wake = self._parked
            if wake:
                self._parked = False
        if wake:
            self._wake()
        return queued

    async def write(self, data: bytes | memoryview) -> None:
        if len(data) > MAX_MESSAGE_BYTES:
            raise self._error(f"a {len(data)}-byte message exceeds the raw record limit")
        if self._stopped.done():
            raise self._error(f"raw connection to {self.peer} is closed")
        queued = self._queue(data)
        await self._sent_up_to(queued - WRITE_AHEAD)
        # Yield once per message so the other lanes' writers and the readers get their turn.
        await asyncio.sleep(0)

    async def _sent_up_to(self, count: int) -> None:
        """Wait until the I/O thread has sent ``count`` messages; the connection's error if it failed."""
        with self._lock:
            if self._sent >= count:
                return
            if self._failure is not None:
                failure = self._failure
            else:
                failure = None
                waiter: asyncio.Future[None] = self._loop.create_future()
                self._send_waiters.append((count, waiter))
        if failure is not None:
            raise self._error(f"raw write to {self.peer} failed: {failure}") from failure
        await waiter

    async def close(self) -> None:
        """Send what was written (a lane's last mark must reach the peer), then close; 2 s at most."""
        with self._lock:
            queued = self._queued
        if not self._stopped.done():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._sent_up_to(queued), 2.0)
        with self._lock:
            self._closing = True
        self._wake()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._stopped), 5.0)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # a full wake pipe already wakes the thread
            self._wake_w.send(b"\0")


__all__ = [
    "MAX_MESSAGE_BYTES",
    "READ_AHEAD",
    "SMALL_MESSAGE",
    "WRITE_AHEAD",
    "RawConnection",
    "RawConnectionError",
    "fresh_buffer",
    "in_thread",
]
