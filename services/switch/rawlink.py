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
import socket
import ssl
from collections.abc import Callable

import grpc
from cryptography import x509

from nebula_common.pki import Identity, identity_from_certificate
from services.switch.link import (
    HANDSHAKE_TIMEOUT_S,
    RAW_LINK_VERSION,
    HandshakeError,
    PeerLink,
    parse_link_message,
)

log = logging.getLogger(__name__)

PREAMBLE = b"NBLINK1\n"
"""First bytes of a raw connection (plaintext, both ways); a TLS record starts with 0x16 instead."""
MAX_MESSAGE_BYTES = 64 << 20
"""Largest record accepted (the gRPC link's message limit)."""
STREAM_LIMIT = 8 << 20
"""StreamReader buffer limit: fewer pause/resume cycles for 1-4 MiB chunks."""
WRITE_HIGH_WATER = 1 << 20
"""Bytes the TLS transport may hold unsent before a writer waits (like the gRPC link's 1 MiB window)."""
PASSTHROUGH_READ = 256 << 10


def _peer_certificate(writer: asyncio.StreamWriter) -> x509.Certificate | None:
    ssl_object = writer.get_extra_info("ssl_object")
    der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    return x509.load_der_x509_certificate(der) if der else None


class RawConnection:
    """One raw link connection after TLS: ``read`` / ``write`` of whole messages, as the gRPC call's."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer: str,
        cert: x509.Certificate | None,
        send_buffer: int = 0,
    ) -> None:
        self.reader = reader
        self.writer = writer
        self.peer = peer
        self.peer_cert = cert
        with contextlib.suppress(AttributeError, NotImplementedError):
            writer.transport.set_write_buffer_limits(high=WRITE_HIGH_WATER)
        sock = writer.get_extra_info("socket")
        if send_buffer and sock is not None:
            # A fixed send buffer bounds what waits first-in first-out below the switch's fair scheduler,
            # as the gRPC link's fixed HTTP/2 window does (link_window_bytes; 0 keeps kernel autotuning).
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)

    async def read(self) -> object:
        """The next message's bytes, or ``grpc.aio.EOF`` when the peer closed cleanly between messages."""
        try:
            head = await self.reader.readexactly(4)
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                return grpc.aio.EOF
            raise HandshakeError("the raw link connection ended inside a record header") from None
        size = int.from_bytes(head, "big")
        if size > MAX_MESSAGE_BYTES:
            raise HandshakeError(f"peer sent a {size}-byte record (limit {MAX_MESSAGE_BYTES})")
        try:
            return await self.reader.readexactly(size)
        except asyncio.IncompleteReadError:
            raise HandshakeError(f"the raw link connection ended inside a {size}-byte record") from None

    async def write(self, data: bytes) -> None:
        if len(data) > MAX_MESSAGE_BYTES:
            raise HandshakeError(f"a {len(data)}-byte message exceeds the raw link's record limit")
        self.writer.write(len(data).to_bytes(4, "big"))
        self.writer.write(data)
        await self.writer.drain()
        # drain() returns without yielding while the transport is below its high-water mark: yield once
        # per message so the other lanes' writers and the readers get their turn, as after a gRPC write.
        await asyncio.sleep(0)

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.writer.wait_closed(), 2.0)


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
    host, _, port = address.rpartition(":")

    async def connect() -> RawConnection:
        reader, writer = await asyncio.open_connection(host.strip("[]"), int(port), limit=STREAM_LIMIT)
        try:
            writer.write(PREAMBLE)
            await writer.drain()
            answer = await reader.readexactly(len(PREAMBLE))
            if answer != PREAMBLE:
                raise HandshakeError(f"peer at {address} does not serve the raw link transport")
            await writer.start_tls(context, server_hostname=server_name)
        except BaseException:
            writer.close()
            raise
        return RawConnection(reader, writer, address, _peer_certificate(writer), send_buffer)

    try:
        return await asyncio.wait_for(connect(), timeout)
    except asyncio.IncompleteReadError:
        raise HandshakeError(
            f"peer at {address} closed the raw link connection during the preamble"
        ) from None


class WanFrontend:
    """The WAN port of a switch serving the raw transport: raw connections here, gRPC ones passed through.

    ``backend`` is the loopback address of the gRPC WAN server; ``context`` returns the current server
    TLS context (hot reload); ``handshake_timeout_s`` bounds preamble + TLS + the link handshake, as
    ``grpc.server_handshake_timeout_ms`` does on the gRPC port.
    """

    def __init__(
        self,
        link: PeerLink,
        backend: str,
        context: Callable[[], ssl.SSLContext],
        *,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        send_buffer: int = 0,
    ) -> None:
        self.link = link
        self.send_buffer = send_buffer
        self.backend = backend
        self.context = context
        self.handshake_timeout_s = handshake_timeout_s
        self.server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, listen: str) -> int:
        host, _, port = listen.rpartition(":")
        self.server = await asyncio.start_server(
            self._accepted, host.strip("[]"), int(port), limit=STREAM_LIMIT, reuse_address=True
        )
        return int(self.server.sockets[0].getsockname()[1])

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 2.0)

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        peer = str(writer.get_extra_info("peername") or "")
        try:
            try:
                first = await asyncio.wait_for(reader.readexactly(1), self.handshake_timeout_s)
            except (asyncio.IncompleteReadError, TimeoutError, OSError):
                return
            if first == PREAMBLE[:1]:
                await self._raw(first, reader, writer, peer)
            else:
                await self._pass_through(first, reader, writer)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one connection's failure never takes the port down
            log.warning("raw link connection from %s ended: %s", peer, exc)
        finally:
            self._tasks.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), 2.0)

    async def _pass_through(
        self, first: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """A gRPC (TLS) peer: relay its encrypted bytes to the gRPC WAN server and back, untouched."""
        host, _, port = self.backend.rpartition(":")
        back_reader, back_writer = await asyncio.open_connection(host, int(port))

        async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter, head: bytes = b"") -> None:
            try:
                if head:
                    sink.write(head)
                while data := await source.read(PASSTHROUGH_READ):
                    sink.write(data)
                    await sink.drain()
            finally:
                with contextlib.suppress(Exception):
                    sink.write_eof()

        tasks = [
            asyncio.create_task(pump(reader, back_writer, first)),
            asyncio.create_task(pump(back_reader, writer)),
        ]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for task in tasks:
                task.cancel()
            back_writer.close()

    async def _raw(
        self, first: bytes, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str
    ) -> None:
        link = self.link
        try:
            rest = await asyncio.wait_for(reader.readexactly(len(PREAMBLE) - 1), self.handshake_timeout_s)
        except (asyncio.IncompleteReadError, TimeoutError):
            return
        if first + rest != PREAMBLE:
            link.refuse("handshake", "connection sent neither TLS nor the raw link preamble", address=peer)
            return
        writer.write(PREAMBLE)
        try:
            await writer.drain()
            await asyncio.wait_for(
                writer.start_tls(self.context(), ssl_handshake_timeout=self.handshake_timeout_s),
                self.handshake_timeout_s,
            )
        except (ssl.SSLError, TimeoutError, ConnectionError) as exc:
            reason = str(exc) or "no TLS handshake in time"
            link.refuse("tls", f"raw link TLS handshake refused: {reason}", address=peer)
            log.warning("refused raw WAN link from %s: %s", peer, reason)
            return
        connection = RawConnection(reader, writer, peer, _peer_certificate(writer), self.send_buffer)
        await serve_raw(link, connection, self.handshake_timeout_s)


async def serve_raw(link: PeerLink, connection: RawConnection, handshake_timeout_s: float) -> None:
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
        link.check_identity(certified)
    except PermissionError as exc:
        link.refuse("identity", str(exc), address=peer, serial=serial)
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
