"""Whole messages as ``4-byte big-endian length + bytes`` records on a TLS socket, for asyncio.

The carrier of the switch-to-switch raw link (``services/switch/rawlink.py``). ``RawConnection`` gives
it the ``read`` / ``write`` pair a gRPC call gives (``read`` returns ``grpc.aio.EOF`` at a clean end),
so the link's session code runs unchanged on either carrier.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import socket
import ssl
import threading
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import grpc
from cryptography import x509

from nebula_common.rpc.sealed_records import (
    CLOSE,
    HEADER,
    MESSAGE,
    TAG_BYTES,
    RecordSealing,
    SealedRecordError,
)

T = TypeVar("T")

MAX_MESSAGE_BYTES = 64 << 20
"""Largest record accepted (the gRPC link's message limit)."""
READ_AHEAD = 8
"""Messages the I/O thread may receive ahead of the session (then it stops reading: TCP pushes back)."""
WRITE_AHEAD = 2
"""Messages a writer may queue for the I/O thread before it waits for the oldest to be sent."""
SMALL_MESSAGE = 64 << 10
"""Messages up to this size are joined with their header (one TLS record); bigger ones are not copied."""
_EOF = object()


def fresh_buffer(size: int) -> memoryview:
    """A writable ``size``-byte buffer that is not zeroed first (numpy's ``empty``: malloc, reused memory)."""
    import numpy

    return memoryview(numpy.empty(size, dtype=numpy.uint8)).cast("B")


class RawConnectionError(ConnectionError):
    """A raw connection failed or was closed (the default error of ``RawConnection``)."""


def peer_certificate(sock: socket.socket) -> x509.Certificate | None:
    """The peer's certificate on a TLS socket (None on a plain socket, or sealed records' bare one)."""
    if not isinstance(sock, ssl.SSLSocket):
        return None
    der = sock.getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der) if der else None


class RawConnection:
    """One raw connection after TLS: ``read`` / ``write`` of whole messages, as the gRPC call's.

    ``sock`` is a TLS socket, or the bare TCP socket under sealed records.

    The TLS socket belongs to one I/O thread (OpenSSL objects are not shared between threads): it
    receives records straight into a reused buffer (``recv_into``), hands each complete message to the
    event loop, and sends queued messages without copying them (``SSLSocket.send`` of the message
    itself). Encryption, decryption and the socket calls run with the GIL released, so the event loop
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
        sock: ssl.SSLSocket | socket.socket,
        peer: str,
        loop: asyncio.AbstractEventLoop,
        send_buffer: int = 0,
        error: type[Exception] = RawConnectionError,
        views: bool = False,
        sealing: RecordSealing | None = None,
        peer_cert: x509.Certificate | None = None,
    ) -> None:
        self.sock = sock
        #: Sealed records (``nebula_common/rpc/sealed_records.py``) on the bare socket ``sock`` after a
        #: TLS handshake whose peer certificate is ``peer_cert``; None: the records of ``sock`` itself.
        self.sealing = sealing
        self._error = error
        #: Messages over SMALL_MESSAGE are received into a fresh buffer each and handed on as a
        #: ``memoryview`` of it (no copy); otherwise as ``bytes`` copied out of one reused buffer.
        self.views = views
        self.peer = peer
        self.peer_cert = peer_cert if peer_cert is not None else peer_certificate(sock)
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
        self._arrived: deque[object] = deque()  # received messages, then _EOF or an exception
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
                    if item is _EOF or isinstance(item, BaseException):
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
        if item is _EOF:
            return grpc.aio.EOF
        if isinstance(item, BaseException):
            raise self._error(f"raw connection to {self.peer} failed: {item}") from item
        if wake:
            self._wake()
        return item

    def pending_reads(self) -> int:
        """Messages received and not read yet (at most ``READ_AHEAD``)."""
        with self._lock:
            return sum(
                1 for item in self._arrived if item is not _EOF and not isinstance(item, BaseException)
            )

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

    def _pump(self) -> None:
        sock = self.sock
        tls = isinstance(sock, ssl.SSLSocket)
        sealing = self.sealing
        head_size = HEADER.size if sealing is not None else 4
        head = bytearray(head_size)
        head_view = memoryview(head)
        buffer = bytearray(1 << 20)  # small messages (and, sealed, every record's ciphertext)
        plain = bytearray(SMALL_MESSAGE) if sealing is not None else buffer
        seal_buffer = bytearray(0)  # sealed: the record being sent (one at a time, reused)
        target, need, got, reading_head = head_view, head_size, 0, True
        fresh = False
        size = 0
        current: memoryview | None = None
        whole = False  # ``current`` is the last part of a message (its send completes the message)
        while True:
            with self._lock:
                if self._closing:
                    break
                room = self._room
            # Receive: as much as TLS has ready, while the session has room for messages.
            wants_write_to_read = False
            while room > 0:
                try:
                    n = sock.recv_into(target[got:need])
                except (ssl.SSLWantReadError, BlockingIOError):  # TLS / a plain socket: nothing ready
                    break
                except ssl.SSLWantWriteError:
                    wants_write_to_read = True
                    break
                if n == 0:
                    if reading_head and got == 0:
                        if sealing is not None:
                            raise SealedRecordError("the connection ended without its sealed close: cut")
                        self._post(_EOF)
                        return
                    raise ConnectionError("the raw connection ended inside a record")
                got += n
                if got < need:
                    continue
                if reading_head:
                    if sealing is not None:
                        _, size = RecordSealing.parse_header(head, MAX_MESSAGE_BYTES)
                        sealed_size = size + TAG_BYTES
                        if sealed_size > len(buffer):
                            buffer = bytearray(sealed_size)
                        target = memoryview(buffer)
                        need, got, reading_head = sealed_size, 0, False
                        continue
                    size = int.from_bytes(head, "big")
                    if size > MAX_MESSAGE_BYTES:
                        raise ConnectionError(f"peer sent a {size}-byte record (limit {MAX_MESSAGE_BYTES})")
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
                elif sealing is not None:
                    fresh = self.views and size > SMALL_MESSAGE
                    if fresh:
                        opened = fresh_buffer(size)  # decrypted straight into the buffer handed on
                    else:
                        if size > len(plain):
                            plain = bytearray(size)
                        opened = memoryview(plain)[:size]
                    sealing.open_into(head_view, target[:need], opened)
                    if head[0] == CLOSE:
                        self._post(_EOF)
                        return
                    message = opened if fresh else bytes(opened)
                else:
                    message = target if fresh else bytes(target[:need])
                with self._lock:
                    self._room -= 1
                    room = self._room
                self._post(message)
                target, need, got, reading_head = head_view, head_size, 0, True
            # Send: queued parts, each as one SSL_write (retried with the same bytes if it would block).
            blocked = False
            while True:
                if current is None:
                    with self._lock:
                        if not self._outbox:
                            break
                        data, whole = self._outbox.popleft()
                    if sealing is not None:  # the whole message as one record, sealed here (GIL released)
                        if RecordSealing.sealed_size(len(data)) > len(seal_buffer):
                            seal_buffer = bytearray(RecordSealing.sealed_size(len(data)))
                        end = sealing.seal_into(MESSAGE, data, memoryview(seal_buffer))
                        current = memoryview(seal_buffer)[:end]
                    else:
                        current = memoryview(data).cast("B")
                try:
                    sent = sock.send(current)
                except (ssl.SSLWantWriteError, BlockingIOError):
                    blocked = True
                    break
                except ssl.SSLWantReadError:
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
                if not blocked and not wants_write_to_read and (current is not None or self._outbox):
                    continue  # written meanwhile
                if room > 0 and tls and sock.pending():
                    continue  # decrypted bytes already waiting in TLS
                self._parked = True
            readers = [self._wake_r] + ([sock] if room > 0 else [])
            writers = [sock] if blocked or wants_write_to_read else []
            ready, _, _ = select.select(readers, writers, [], 1.0)
            with self._lock:
                self._parked = False
            if self._wake_r in ready:
                with contextlib.suppress(OSError):
                    while self._wake_r.recv(4096):
                        pass
        if sealing is not None and current is None:
            self._send_close(sealing)

    def _send_close(self, sealing: RecordSealing) -> None:
        """Closed here between records: end with the sealed close, so the peer can tell an end from a cut."""
        record = bytearray(RecordSealing.sealed_size(0))
        sealing.seal_into(CLOSE, b"", memoryview(record))
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


async def in_thread(function: Callable[[], T], name: str) -> T:
    """Run a blocking step on a thread of its own (never the loop's default executor).

    If the caller is cancelled meanwhile, a result that can be closed (a socket) is closed.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def deliver(result: T | None, error: BaseException | None) -> None:
        if future.done():
            closer = getattr(result, "close", None)
            if closer is not None:
                with contextlib.suppress(Exception):
                    closer()
        elif error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)  # type: ignore[arg-type]

    def run() -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            result = function()
        except BaseException as exc:
            error = exc
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(deliver, result, error)

    threading.Thread(target=run, name=name, daemon=True).start()
    return await future


__all__ = [
    "MAX_MESSAGE_BYTES",
    "RawConnection",
    "RawConnectionError",
    "in_thread",
    "peer_certificate",
]
