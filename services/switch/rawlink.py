"""The raw link transport: the switch-to-switch session over length-prefixed frames on TLS 1.3.

The gRPC link (``wan_servicer.py``, ``link.py``) carries each message as an HTTP/2 DATA frame of a
gRPC stream; every byte then passes gRPC's C core at both ends (a copy into and out of Python, HTTP/2
framing, its own TLS). The raw transport carries the SAME messages -- serialized ``LinkMessage`` and
framed chunks, byte for byte -- as ``4-byte big-endian length + bytes`` records on a Python ``ssl``
TLS 1.3 connection, so the session code (``PeerLink.run_session`` / ``run_lane``: credits, acks, lanes,
liveness, replay) is unchanged; only the byte carrier differs.

Negotiation (``Handshake.raw_link``). The dialer always starts on gRPC and offers ``raw_link = 1`` in
its handshake. An acceptor that serves the raw transport answers with ``raw_link = 1`` and ends the
call without starting a session; the dialer then reconnects raw to the SAME WAN address. An older
acceptor (or one with ``NEBULA_SWITCH_LINK_TRANSPORT=grpc``) answers without it and the session runs
on that gRPC call as before. A dialer whose raw connection fails falls back to gRPC for a while.

One port for both. An acceptor with the raw transport owns its WAN port in Python
(:class:`WanFrontend`) and keeps gRPC's WAN server on a loopback port behind it. Each accepted
connection starts either with the raw preamble (``NBLINK1\\n``, plaintext; the frontend answers with the
same 8 bytes, then TLS starts) or with a TLS record (a gRPC peer): the latter is passed through byte for
byte to the gRPC server, whose TLS still authenticates the peer end to end. So one address (and one
shaped path through a WAN emulator) serves both transports.

Authentication is the gRPC link's: mutual TLS with this switch's certificate (hot-reloaded,
``CertificateManager.ssl_context``) against the same trust bundle; the dialer verifies the server
certificate's DNS name (the peer switch's), the acceptor requires a client certificate; then the
certificate must name exactly the configured peer switch (``PeerLink.check_identity``), not be revoked
(``PeerLink.is_revoked``), and the handshake must agree with it (``PeerLink.check_hello``). Every refusal
is counted and audited (``link.refused`` with the layer: tls, identity, revoked, handshake).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import select
import socket
import ssl
import threading
from collections import deque
from collections.abc import Callable
from typing import TypeVar

import grpc
from cryptography import x509

from nebula_common.pki import Identity, identity_from_certificate
from services.switch.link import (
    HANDSHAKE_TIMEOUT_S,
    RAW_LINK_VERSION,
    HandshakeError,
    parse_link_message,
)
from services.switch.peers import PeerLinks

log = logging.getLogger(__name__)
T = TypeVar("T")

PREAMBLE = b"NBLINK1\n"
"""First bytes of a raw connection (plaintext, both ways); a TLS record starts with 0x16 instead."""
MAX_MESSAGE_BYTES = 64 << 20
"""Largest record accepted (the gRPC link's message limit)."""
READ_AHEAD = 8
"""Messages the I/O thread may receive ahead of the session (then it stops reading: TCP pushes back)."""
WRITE_AHEAD = 2
"""Messages a writer may queue for the I/O thread before it waits for the oldest to be sent."""
SMALL_MESSAGE = 64 << 10
"""Messages up to this size are joined with their header (one TLS record); bigger ones are not copied."""
PASSTHROUGH_READ = 256 << 10
MAX_RAW_HANDSHAKES = 16
"""Raw TLS handshakes the frontend runs at once (each on a thread of its own, bounded by the timeout)."""
_EOF = object()


def _peer_certificate(sock: ssl.SSLSocket) -> x509.Certificate | None:
    der = sock.getpeercert(binary_form=True)
    return x509.load_der_x509_certificate(der) if der else None


class RawConnection:
    """One raw link connection after TLS: ``read`` / ``write`` of whole messages, as the gRPC call's.

    The TLS socket belongs to one I/O thread (OpenSSL objects are not shared between threads): it
    receives records straight into a reused buffer (``recv_into``), hands each complete message to the
    event loop, and sends queued messages without copying them (``SSLSocket.send`` of the message
    itself). Encryption, decryption and the socket calls run with the GIL released, so the event loop
    keeps routing while bytes move; per message the loop does one queue step.
    """

    def __init__(
        self,
        sock: ssl.SSLSocket,
        peer: str,
        loop: asyncio.AbstractEventLoop,
        send_buffer: int = 0,
    ) -> None:
        self.sock = sock
        self.peer = peer
        self.peer_cert = _peer_certificate(sock)
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
        self._thread = threading.Thread(target=self._run, name=f"raw-link {peer}", daemon=True)
        self._thread.start()

    # ----- the event loop's side -------------------------------------------------------
    async def read(self) -> object:
        """The next message's bytes, or ``grpc.aio.EOF`` when the peer closed cleanly between messages."""
        item = await self._inbox.get()
        if item is _EOF:
            self._inbox.put_nowait(_EOF)  # every later read sees the end too
            return grpc.aio.EOF
        if isinstance(item, BaseException):
            self._inbox.put_nowait(item)
            raise HandshakeError(f"raw link connection to {self.peer} failed: {item}") from item
        with self._lock:
            self._room += 1
            wake = self._room == 1
        if wake:
            self._wake()
        return item

    async def write(self, data: bytes) -> None:
        if len(data) > MAX_MESSAGE_BYTES:
            raise HandshakeError(f"a {len(data)}-byte message exceeds the raw link's record limit")
        if self._stopped.done():
            raise HandshakeError(f"raw link connection to {self.peer} is closed")
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
                    future.set_exception(HandshakeError(f"raw link write to {self.peer} failed: {error}"))

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
        head = bytearray(4)
        head_view = memoryview(head)
        buffer = bytearray(1 << 20)
        target, need, got, reading_head = head_view, 4, 0, True
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
                except ssl.SSLWantReadError:
                    break
                except ssl.SSLWantWriteError:
                    wants_write_to_read = True
                    break
                if n == 0:
                    if reading_head and got == 0:
                        self._post(_EOF)
                        return
                    raise ConnectionError("the raw link connection ended inside a record")
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
                        if size > len(buffer):
                            buffer = bytearray(size)
                        target, need, got, reading_head = memoryview(buffer), size, 0, False
                        continue
                else:
                    message = bytes(target[:need])
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
                except ssl.SSLWantWriteError:
                    blocked = True
                    break
                except ssl.SSLWantReadError:
                    break
                current = current[sent:] if sent < len(current) else None
                if current is None:
                    self._settle(current_future, None)
                    current_future = None
            if room > 0 and sock.pending():
                continue  # decrypted bytes already waiting in TLS
            readers = [self._wake_r] + ([sock] if room > 0 else [])
            writers = [sock] if blocked or wants_write_to_read else []
            ready, _, _ = select.select(readers, writers, [], 1.0)
            if self._wake_r in ready:
                with contextlib.suppress(OSError):
                    while self._wake_r.recv(4096):
                        pass


def _connect(address: str, context: ssl.SSLContext, server_name: str, timeout: float) -> ssl.SSLSocket:
    """Blocking: TCP connect, exchange the preamble, mutual TLS 1.3 (on a thread of its own)."""
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(PREAMBLE)
        answer = b""
        while len(answer) < len(PREAMBLE):
            part = sock.recv(len(PREAMBLE) - len(answer))
            if not part:
                raise HandshakeError(f"peer at {address} closed the raw link connection during the preamble")
            answer += part
        if answer != PREAMBLE:
            raise HandshakeError(f"peer at {address} does not serve the raw link transport")
        tls = context.wrap_socket(sock, server_hostname=server_name)
    except BaseException:
        sock.close()
        raise
    return tls


async def _in_thread(function: Callable[[], T], name: str) -> T:
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


async def dial_raw(
    address: str,
    context: ssl.SSLContext,
    server_name: str,
    timeout: float = HANDSHAKE_TIMEOUT_S,
    send_buffer: int = 0,
) -> RawConnection:
    """Connect to the peer's WAN address, exchange the preamble and complete mutual TLS 1.3.

    TLS verifies the server's chain against the trust bundle and its DNS name against ``server_name``
    (the expected peer switch); identity, revocation and handshake checks follow in ``PeerLink``.
    """
    sock = await _in_thread(lambda: _connect(address, context, server_name, timeout), "raw-link-dial")
    return RawConnection(sock, address, asyncio.get_running_loop(), send_buffer)


async def _readable(sock: socket.socket, timeout: float) -> bool:
    """Wait until ``sock`` has bytes (or EOF) to read; False on timeout."""
    loop = asyncio.get_running_loop()
    ready = loop.create_future()
    loop.add_reader(sock.fileno(), lambda: ready.done() or ready.set_result(None))
    try:
        await asyncio.wait_for(ready, timeout)
        return True
    except TimeoutError:
        return False
    finally:
        loop.remove_reader(sock.fileno())


class WanFrontend:
    """The WAN port of a switch serving the raw transport: raw connections here, gRPC ones passed through.

    ``backend`` is the loopback address of the gRPC WAN server; ``context`` returns the current server
    TLS context (hot reload); ``handshake_timeout_s`` bounds preamble + TLS + the link handshake, as
    ``grpc.server_handshake_timeout_ms`` does on the gRPC port.
    """

    def __init__(
        self,
        links: PeerLinks,
        backend: str,
        context: Callable[[], ssl.SSLContext],
        *,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        send_buffer: int = 0,
    ) -> None:
        self.links = links
        self.send_buffer = send_buffer
        self.backend = backend
        self.context = context
        self.handshake_timeout_s = handshake_timeout_s
        self._listener: socket.socket | None = None
        self._acceptor: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._handshakes = asyncio.Semaphore(MAX_RAW_HANDSHAKES)

    async def start(self, listen: str) -> int:
        host, _, port = listen.rpartition(":")
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        listener = socket.create_server((host.strip("[]"), int(port)), family=family, backlog=128)
        listener.setblocking(False)
        self._listener = listener
        self._acceptor = asyncio.create_task(self._accept_forever(), name="wan-frontend")
        return int(listener.getsockname()[1])

    async def stop(self) -> None:
        if self._acceptor is not None:
            self._acceptor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._acceptor
        if self._listener is not None:
            self._listener.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    async def _accept_forever(self) -> None:
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, address = await loop.sock_accept(self._listener)
            except OSError as exc:  # e.g. out of file descriptors: keep the port, try again shortly
                log.warning("WAN frontend accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._accepted(conn, f"{address[0]}:{address[1]}"))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _accepted(self, conn: socket.socket, peer: str) -> None:
        handed_off = False
        try:
            conn.setblocking(False)
            if not await _readable(conn, self.handshake_timeout_s):
                return
            try:
                first = conn.recv(1, socket.MSG_PEEK)
            except (BlockingIOError, OSError):
                return
            if not first:
                return
            if first == PREAMBLE[:1]:
                handed_off = await self._raw(conn, peer)
            else:
                handed_off = True
                await self._pass_through(conn)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one connection's failure never takes the port down
            log.warning("WAN connection from %s ended: %s", peer, exc)
        finally:
            if not handed_off:
                conn.close()

    async def _pass_through(self, conn: socket.socket) -> None:
        """A gRPC (TLS) peer: relay its encrypted bytes to the gRPC WAN server and back, untouched."""
        reader, writer = await asyncio.open_connection(sock=conn)
        host, _, port = self.backend.rpartition(":")
        back_reader, back_writer = await asyncio.open_connection(host, int(port))

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(PASSTHROUGH_READ):
                    sink.write(data)
                    await sink.drain()
            finally:
                with contextlib.suppress(Exception):
                    sink.write_eof()

        tasks = [
            asyncio.create_task(pump(reader, back_writer)),
            asyncio.create_task(pump(back_reader, writer)),
        ]
        try:
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for task in tasks:
                task.cancel()
            back_writer.close()
            writer.close()

    async def _raw(self, conn: socket.socket, peer: str) -> bool:
        """Preamble, mutual TLS (on a thread), then the link handshake and session; True once handed off."""
        links = self.links
        loop = asyncio.get_running_loop()
        preamble = b""
        deadline = loop.time() + self.handshake_timeout_s
        while len(preamble) < len(PREAMBLE):
            left = deadline - loop.time()
            if left <= 0 or not await _readable(conn, left):
                return False
            part = conn.recv(len(PREAMBLE) - len(preamble))
            if not part:
                return False
            preamble += part
        if preamble != PREAMBLE:
            links.refuse("handshake", "connection sent neither TLS nor the raw link preamble", address=peer)
            return False
        if self._handshakes.locked():
            links.refuse(
                "handshake", f"more than {MAX_RAW_HANDSHAKES} raw TLS handshakes at once", address=peer
            )
            return False
        async with self._handshakes:
            await loop.sock_sendall(conn, PREAMBLE)
            context = self.context()
            timeout = max(0.1, deadline - loop.time())

            def handshake() -> ssl.SSLSocket:
                conn.setblocking(True)
                conn.settimeout(timeout)
                tls = context.wrap_socket(conn, server_side=True)
                tls.settimeout(None)
                return tls

            try:
                tls = await _in_thread(handshake, f"raw-link-accept {peer}")
            except (ssl.SSLError, OSError) as exc:  # TimeoutError is an OSError
                reason = str(exc) or "no TLS handshake in time"
                links.refuse("tls", f"raw link TLS handshake refused: {reason}", address=peer)
                log.warning("refused raw WAN link from %s: %s", peer, reason)
                return False
        with contextlib.suppress(OSError):
            tls.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection = RawConnection(tls, peer, loop, self.send_buffer)
        try:
            await serve_raw(links, connection, self.handshake_timeout_s)
        finally:
            await connection.close()
        return True


async def serve_raw(links: PeerLinks, connection: RawConnection, handshake_timeout_s: float) -> None:
    """The acceptor's side of a raw connection after TLS: the checks of ``SwitchLinkServicer.Link``."""
    cert = connection.peer_cert
    serial = f"{cert.serial_number:x}" if cert is not None else ""
    peer = connection.peer
    try:
        if cert is None:
            raise PermissionError("caller presented no verified client certificate on the raw link")
        try:
            certified = identity_from_certificate(cert)
        except ValueError as exc:
            raise PermissionError(
                f"caller's verified certificate carries no valid Nebula identity: {exc}"
            ) from exc
        link = links.select(certified)
    except PermissionError as exc:
        links.refuse("identity", str(exc), address=peer, serial=serial)
        log.warning("refused raw WAN link: %s", exc, extra={"fields": {"peer": peer}})
        return
    if link.is_revoked(cert):
        reason = f"peer certificate {serial} is revoked"
        link.refuse("revoked", reason, address=peer, serial=serial, identity=certified.uri)
        log.warning("refused raw WAN link: %s", reason, extra={"fields": {"peer": peer}})
        return
    try:
        raw = await asyncio.wait_for(connection.read(), handshake_timeout_s)
        if raw is grpc.aio.EOF:
            raise HandshakeError("peer closed the link during the handshake")
        hello = parse_link_message(raw)
        link.check_hello(hello, certified)
        lane, session_id = hello.hello.lane, hello.hello.session_id
        if lane and not link.joins_current_session(session_id):
            raise HandshakeError(f"connection {lane} names no running session of this link")
    except (HandshakeError, TimeoutError) as exc:
        link.refuse("handshake", str(exc) or "no handshake in time", address=peer, serial=serial)
        log.warning("refused raw WAN link from %s: %s", certified.uri, exc)
        return
    await connection.write(
        link.hello(session_id=session_id, lane=lane, raw_link=RAW_LINK_VERSION).SerializeToString()
    )
    if lane:
        await link.run_lane(lane, connection.read, connection.write)
        return
    await link.run_session(
        connection.read,
        connection.write,
        certified,
        "acceptor",
        cert,
        peer_framing=hello.hello.link_framing >= 1,
        session_id=session_id,
        marking=hello.hello.lanes and bool(session_id),
        transport="raw",
    )


def identity_of(connection: RawConnection) -> Identity:
    """The identity the peer's verified certificate names (PermissionError if none)."""
    if connection.peer_cert is None:
        raise PermissionError("peer presented no certificate on the raw link")
    try:
        return identity_from_certificate(connection.peer_cert)
    except ValueError as exc:
        raise PermissionError(f"peer's certificate carries no valid Nebula identity: {exc}") from exc


__all__ = [
    "MAX_MESSAGE_BYTES",
    "PREAMBLE",
    "RAW_LINK_VERSION",
    "RawConnection",
    "WanFrontend",
    "dial_raw",
    "identity_of",
    "serve_raw",
]
