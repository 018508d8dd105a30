"""Whole messages as ``4-byte big-endian length + bytes`` records on a TLS socket, for asyncio.

Shared by the two raw transports: the switch-to-switch raw link (``services/switch/rawlink.py``) and
the trainer-to-switch raw edge (``services/switch/raw_edge.py``, ``services/trainer/edge/raw_transport.py``).
``RawConnection`` gives them the ``read`` / ``write`` pair a gRPC call gives (``read`` returns
``grpc.aio.EOF`` at a clean end), so the session code above runs unchanged on either carrier.
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
    """The peer's certificate on a TLS socket (None on a plain socket: a Unix socket edge has none)."""
    if not isinstance(sock, ssl.SSLSocket):
        return None
    der = sock.getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der) if der else None


class RawConnection:
    """One raw connection after TLS: ``read`` / ``write`` of whole messages, as the gRPC call's.

    ``sock`` is a TLS socket, or a plain stream socket where the carrier itself is private (a Unix
    domain socket of the switch's own user: ``services/switch/raw_edge.py``).

    The TLS socket belongs to one I/O thread (OpenSSL objects are not shared between threads): it
    receives records straight into a reused buffer (``recv_into``), hands each complete message to the
    event loop, and sends queued messages without copying them (``SSLSocket.send`` of the message
    itself). Encryption, decryption and the socket calls run with the GIL released, so the event loop
    keeps routing while bytes move; per message the loop does one queue step.
    """

    def __init__(
        self,
        sock: ssl.SSLSocket | socket.socket,
        peer: str,
        loop: asyncio.AbstractEventLoop,
        send_buffer: int = 0,
        error: type[Exception] = RawConnectionError,
        views: bool = False,
    ) -> None:
        self.sock = sock
        self._error = error
        #: Messages over SMALL_MESSAGE are received into a fresh buffer each and handed on as a
        #: ``memoryview`` of it (no copy); otherwise as ``bytes`` copied out of one reused buffer.
        self.views = views
        self.peer = peer
        self.peer_cert = peer_certificate(sock)
        self._loop = loop
        if send_buffer:
            # A fixed send buffer bounds what waits first-in first-out below the switch's fair scheduler,
            # as the gRPC link's fixed HTTP/2 window does (link_window_bytes; 0 keeps kernel autotuning).
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)
        sock.setblocking(False)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._lock = threading.Lock()
        self._outbox: deque[tuple[bytes | memoryview, asyncio.Future[None] | None]] = deque()
        self._room = READ_AHEAD
        self._closing = False
        self._inbox: asyncio.Queue[object] = asyncio.Queue()
        self._pending: deque[asyncio.Future[None]] = deque()
        self._stopped: asyncio.Future[None] = loop.create_future()
        self._thread = threading.Thread(target=self._run, name=f"raw {peer}", daemon=True)
        self._thread.start()

    # ----- the event loop's side -------------------------------------------------------
    async def read(self) -> object:
        """The next message (``bytes``, or a ``memoryview`` with ``views``), or ``grpc.aio.EOF`` when the
        peer closed cleanly between messages."""
        item = await self._inbox.get()
        if item is _EOF:
            self._inbox.put_nowait(_EOF)  # every later read sees the end too
            return grpc.aio.EOF
        if isinstance(item, BaseException):
            self._inbox.put_nowait(item)
            raise self._error(f"raw connection to {self.peer} failed: {item}") from item
        with self._lock:
            self._room += 1
            wake = self._room == 1
        if wake:
            self._wake()
        return item

    async def write(self, data: bytes) -> None:
        if len(data) > MAX_MESSAGE_BYTES:
            raise self._error(f"a {len(data)}-byte message exceeds the raw record limit")
        if self._stopped.done():
            raise self._error(f"raw connection to {self.peer} is closed")
        head = len(data).to_bytes(4, "big")
        done: asyncio.Future[None] = self._loop.create_future()
        with self._lock:
            if len(data) <= SMALL_MESSAGE:
                self._outbox.append((head + data, done))
            else:
                self._outbox.append((head, None))
                self._outbox.append((data, done))
        self._pending.append(done)
        self._wake()
        while self._pending and (len(self._pending) > WRITE_AHEAD or self._pending[0].done()):
            await self._pending.popleft()
        # Yield once per message so the other lanes' writers and the readers get their turn.
        await asyncio.sleep(0)

    async def close(self) -> None:
        """Send what was written (a lane's last mark must reach the peer), then close; 2 s at most."""
        unsent = [future for future in self._pending if not future.done()]
        if unsent and not self._stopped.done():
            await asyncio.wait(unsent, timeout=2.0)
        with self._lock:
            self._closing = True
        self._wake()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._stopped), 5.0)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):  # a full wake pipe already wakes the thread
            self._wake_w.send(b"\0")

    def _post(self, item: object) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody reads any more
            self._loop.call_soon_threadsafe(self._inbox.put_nowait, item)

    def _settle(self, future: asyncio.Future[None] | None, error: BaseException | None) -> None:
        if future is None:
            return

        def settle() -> None:
            if not future.done():
                if error is None:
                    future.set_result(None)
                else:
                    future.set_exception(self._error(f"raw write to {self.peer} failed: {error}"))

        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(settle)

    # ----- the I/O thread ----------------------------------------------------------------
    def _run(self) -> None:
        error: BaseException | None = None
        try:
            self._pump()
            if self._closing:  # closed here (a lane dropped, the session over): a reader must not wait
                self._post(ConnectionError("the connection was closed by this switch"))
        except BaseException as exc:  # handed to the session as a read error
            error = exc
            self._post(exc)
        finally:
            with self._lock:
                left = list(self._outbox)
                self._outbox.clear()
            for _, future in left:
                self._settle(future, error or ConnectionError("connection closed"))
            with contextlib.suppress(OSError):
                self.sock.close()
            self._wake_r.close()
            self._wake_w.close()

            def stopped() -> None:
                if not self._stopped.done():
                    self._stopped.set_result(None)

            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(stopped)

    def _pump(self) -> None:
        sock = self.sock
        tls = isinstance(sock, ssl.SSLSocket)
        head = bytearray(4)
        head_view = memoryview(head)
        buffer = bytearray(1 << 20)
        target, need, got, reading_head = head_view, 4, 0, True
        fresh = False
        current: memoryview | None = None
        current_future: asyncio.Future[None] | None = None
        while True:
            with self._lock:
                if self._closing:
                    return
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
                        self._post(_EOF)
                        return
                    raise ConnectionError("the raw connection ended inside a record")
                got += n
                if got < need:
                    continue
                if reading_head:
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
                else:
                    message = target if fresh else bytes(target[:need])
                with self._lock:
                    self._room -= 1
                    room = self._room
                self._post(message)
                target, need, got, reading_head = head_view, 4, 0, True
            # Send: queued messages, each as one SSL_write (retried with the same bytes if it would block).
            blocked = False
            while True:
                if current is None:
                    with self._lock:
                        if not self._outbox:
                            break
                        data, current_future = self._outbox.popleft()
                    current = memoryview(data).cast("B")
                try:
                    sent = sock.send(current)
                except (ssl.SSLWantWriteError, BlockingIOError):
                    blocked = True
                    break
                except ssl.SSLWantReadError:
                    break
                current = current[sent:] if sent < len(current) else None
                if current is None:
                    self._settle(current_future, None)
                    current_future = None
            if room > 0 and tls and sock.pending():
                continue  # decrypted bytes already waiting in TLS
            readers = [self._wake_r] + ([sock] if room > 0 else [])
            writers = [sock] if blocked or wants_write_to_read else []
            ready, _, _ = select.select(readers, writers, [], 1.0)
            if self._wake_r in ready:
                with contextlib.suppress(OSError):
                    while self._wake_r.recv(4096):
                        pass


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
