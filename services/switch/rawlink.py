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
on that gRPC call as before. The choice is thus made inside TLS; a raw connection that does not start is
retried raw, never replaced by the gRPC link (nothing sent in clear can choose the transport).

One port for both. Every switch owns its WAN port in Python (:class:`WanFrontend`, which also gives
each source address a few slots before its handshake completes: ``source_limits.py``) and keeps gRPC's
WAN server on a loopback port behind it. Each accepted
connection starts either with the raw preamble (``NBLINK1\\n``, plaintext; the frontend answers with the
same 8 bytes, then TLS starts) or with a TLS record (a gRPC peer): the latter is passed through byte for
byte to the gRPC server, whose TLS still authenticates the peer end to end. So one address (and one
shaped path through a WAN emulator) serves both transports.

Authentication is the gRPC link's: mutual TLS with this switch's certificate (hot-reloaded,
``CertificateManager.ssl_context``) against the same trust bundle; the dialer verifies the server
certificate's DNS name (the peer switch's), the acceptor requires a client certificate; then the
certificate must name exactly the configured peer switch (``PeerLink.check_identity``), not be revoked
(``PeerLink.is_revoked``), and the handshake must agree with it (``PeerLink.check_hello``). Every refusal
is counted and audited (``link.refused`` with the layer: tls, identity, revoked, handshake, transport).
The preamble crosses in clear, so each side confirms it inside TLS (``Handshake.raw_preamble``): a
preamble rewritten on path fails the connection (layer ``transport``) whatever it was rewritten to.
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
from nebula_common.rpc.raw_records import MAX_MESSAGE_BYTES, in_thread, peer_certificate
from nebula_common.rpc.raw_records import RawConnection as _RawConnection
from nebula_common.rpc.sealed_records import RecordSealing, negotiate_acceptor, negotiate_dialer
from services.switch import passthrough
from services.switch.link_handshake import (
    HANDSHAKE_TIMEOUT_S,
    RAW_LINK_VERSION,
    HandshakeError,
    PreambleError,
    parse_link_message,
)
from services.switch.peers import PeerLinks
from services.switch.source_limits import UNTRUSTED_ROOM, SourceLimits

log = logging.getLogger(__name__)

PREAMBLE = b"NBLINK1\n"
"""First bytes of a raw connection (plaintext, both ways); a TLS record starts with 0x16 instead."""
PREAMBLE_SEALED = b"NBLINK2\n"
"""First bytes of a raw connection whose dialer offers sealed records after TLS (``link_records=sealed``);
an acceptor that knows it answers the same, and the two negotiate inside TLS (``sealed_records.py``)."""
MAX_RAW_HANDSHAKES = 16
"""Raw TLS handshakes the frontend runs at once (each on a thread of its own, bounded by the timeout)."""


class RawConnection(_RawConnection):
    """A raw link connection (``nebula_common.rpc.raw_records``) whose failures are ``HandshakeError``."""

    def __init__(
        self,
        sock: ssl.SSLSocket | socket.socket,
        peer: str,
        loop: asyncio.AbstractEventLoop,
        send_buffer: int = 0,
        sealing: RecordSealing | None = None,
        peer_cert: x509.Certificate | None = None,
        preamble: bytes = PREAMBLE,
    ) -> None:
        super().__init__(
            sock, peer, loop, send_buffer, HandshakeError, views=True, sealing=sealing, peer_cert=peer_cert
        )
        #: The preamble exchanged in clear; each side confirms it inside TLS (``Handshake.raw_preamble``).
        self.preamble = preamble

    @property
    def transport(self) -> str:
        """How this connection carries the link, as audited with ``link.up``: ``raw`` or ``raw+sealed``."""
        return "raw+sealed" if self.sealing is not None else "raw"


Secured = tuple[ssl.SSLSocket | socket.socket, RecordSealing | None, x509.Certificate | None]
"""A raw connection after TLS: its socket (bare when sealed), the sealing, the peer's certificate."""


def _connect(
    address: str, context: ssl.SSLContext, server_name: str, timeout: float, sealed: bool = False
) -> Secured:
    """Blocking: TCP connect, exchange the preamble, mutual TLS 1.3, with ``sealed`` the offer of
    sealed records inside it (on a thread of its own)."""
    host, _, port = address.rpartition(":")
    preamble = PREAMBLE_SEALED if sealed else PREAMBLE
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(preamble)
        answer = b""
        while len(answer) < len(preamble):
            part = sock.recv(len(preamble) - len(answer))
            if not part:
                raise PreambleError(
                    f"peer at {address} closed the raw link connection during the preamble {preamble!r} "
                    f"(after {answer!r}): a path that rewrites or drops it, or no raw link there"
                )
            answer += part
        if answer != preamble:
            raise PreambleError(
                f"peer at {address} answered the raw link preamble {preamble!r} with {answer!r}"
            )
        tls = context.wrap_socket(sock, server_hostname=server_name)
    except BaseException:
        sock.close()
        raise
    cert = peer_certificate(tls)
    if not sealed:
        return tls, None, cert
    try:
        carrier, sealing = negotiate_dialer(tls, want=True)
    except BaseException:
        tls.close()
        raise
    return carrier, sealing, cert


async def dial_raw(
    address: str,
    context: ssl.SSLContext,
    server_name: str,
    timeout: float = HANDSHAKE_TIMEOUT_S,
    send_buffer: int = 0,
    sealed: bool = False,
) -> RawConnection:
    """Connect to the peer's WAN address, exchange the preamble and complete mutual TLS 1.3 (then,
    with ``sealed``, switch to sealed records if the peer agrees inside TLS).

    TLS verifies the server's chain against the trust bundle and its DNS name against ``server_name``
    (the expected peer switch); identity, revocation and handshake checks follow in ``PeerLink``.
    """
    sock, sealing, cert = await in_thread(
        lambda: _connect(address, context, server_name, timeout, sealed), "raw-link-dial"
    )
    with contextlib.suppress(OSError):
        sock.settimeout(None)
    preamble = PREAMBLE_SEALED if sealed else PREAMBLE
    return RawConnection(sock, address, asyncio.get_running_loop(), send_buffer, sealing, cert, preamble)


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
    """The WAN port of a switch: per-source slots for every connection (source_limits.py), raw
    connections served here (``serves_raw``), gRPC ones passed through to the gRPC WAN server.

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
        sealed_records: bool = False,
        serves_raw: bool = True,
        grpc_max_connections: int | None = None,
    ) -> None:
        self.links = links
        #: Raw link connections are served here (link_transport=raw); else only gRPC ones, passed through.
        self.serves_raw = serves_raw
        self.send_buffer = send_buffer
        #: A dialer's offer of sealed records is taken (``link_records=sealed``); else it keeps TLS records.
        self.sealed_records = sealed_records
        self.backend = backend
        self.context = context
        self.handshake_timeout_s = handshake_timeout_s
        self._listener: socket.socket | None = None
        self._acceptor: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._handshakes = asyncio.Semaphore(MAX_RAW_HANDSHAKES)
        #: Slots per source address until mutual TLS completes (source_limits.py); relayed connections of
        #: unknown addresses leave room under the gRPC WAN server's cap for the known peer's.
        untrusted = None if grpc_max_connections is None else grpc_max_connections - UNTRUSTED_ROOM
        self.limits = SourceLimits(relayed_untrusted=untrusted)

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
            host, peer = str(address[0]), f"{address[0]}:{address[1]}"
            if (refused := self.limits.admit(host)) is not None:
                conn.close()
                self.links.refuse("limit", refused, address=peer)
                continue
            task = asyncio.create_task(self._accepted(conn, peer, host))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _accepted(self, conn: socket.socket, peer: str, host: str) -> None:
        handed_off = False
        slot: list[str] = ["pending"]  # the kind of slot this connection holds ([] once released)

        def authenticated() -> None:
            if slot:
                self.limits.release(host, slot.pop())

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
                if not self.serves_raw:
                    self.links.refuse("transport", "this switch does not serve the raw link", address=peer)
                    return
                handed_off = await self._raw(conn, peer, authenticated)
            else:
                slot.clear()
                if (refused := self.limits.move(host, "relayed")) is not None:
                    self.links.refuse("limit", refused, address=peer)
                    return
                slot.append("relayed")
                handed_off = True
                # gRPC drops a connection that has not finished mutual TLS within the handshake timeout:
                # one still relayed after it comes from an authenticated peer.
                known = asyncio.get_running_loop().call_later(
                    self.handshake_timeout_s + 1.0, self.limits.trust, host
                )
                try:
                    await self._pass_through(conn)
                finally:
                    known.cancel()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one connection's failure never takes the port down
            log.warning("WAN connection from %s ended: %s", peer, exc)
        finally:
            authenticated()
            if not handed_off:
                conn.close()

    async def _pass_through(self, conn: socket.socket) -> None:
        """A gRPC (TLS) peer: relay its encrypted bytes to the gRPC WAN server and back, untouched."""
        await passthrough.relay(conn, self.backend)

    async def _raw(self, conn: socket.socket, peer: str, authenticated: Callable[[], None]) -> bool:
        """Preamble, mutual TLS (on a thread), then the link handshake and session; True once handed off.

        ``authenticated`` is called once mutual TLS has completed: the source's slot is free from then.
        """
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
        if preamble not in (PREAMBLE, PREAMBLE_SEALED):
            links.refuse("transport", "connection sent neither TLS nor a raw link preamble", address=peer)
            return False
        offered = preamble == PREAMBLE_SEALED
        if self._handshakes.locked():
            links.refuse(
                "handshake", f"more than {MAX_RAW_HANDSHAKES} raw TLS handshakes at once", address=peer
            )
            return False
        async with self._handshakes:
            await loop.sock_sendall(conn, preamble)
            context = self.context()
            timeout = max(0.1, deadline - loop.time())
            allow = self.sealed_records

            def handshake() -> Secured:
                conn.setblocking(True)
                conn.settimeout(timeout)
                tls = context.wrap_socket(conn, server_side=True)
                cert = peer_certificate(tls)
                carrier, sealing = negotiate_acceptor(tls, allow) if offered else (tls, None)
                carrier.settimeout(None)
                return carrier, sealing, cert

            try:
                carrier, sealing, cert = await in_thread(handshake, f"raw-link-accept {peer}")
            except (ssl.SSLError, OSError) as exc:  # TimeoutError and SealedRecordError are OSErrors
                reason = str(exc) or "no TLS handshake in time"
                links.refuse("tls", f"raw link TLS handshake refused: {reason}", address=peer)
                log.warning("refused raw WAN link from %s: %s", peer, reason)
                return False
        authenticated()
        self.limits.trust(peer.rpartition(":")[0].strip("[]"))
        with contextlib.suppress(OSError):
            carrier.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connection = RawConnection(carrier, peer, loop, self.send_buffer, sealing, cert, preamble)
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
    if (refused := link.refusal(cert)) is not None:
        layer, reason = refused
        link.refuse(layer, reason, address=peer, serial=serial, identity=certified.uri)
        log.warning("refused raw WAN link: %s", reason, extra={"fields": {"peer": peer}})
        return
    try:
        raw = await asyncio.wait_for(connection.read(), handshake_timeout_s)
        if raw is grpc.aio.EOF:
            raise HandshakeError("peer closed the link during the handshake")
        hello = parse_link_message(raw)
        link.check_hello(hello, certified)
        lane, session_id = hello.hello.lane, hello.hello.session_id
        if hello.hello.raw_preamble != connection.preamble:
            reason = (
                f"the raw link preamble was rewritten on path: received {connection.preamble!r}, the peer "
                f"says inside TLS it sent {hello.hello.raw_preamble!r}"
            )
            link.refuse("transport", reason, address=peer, serial=serial, identity=certified.uri)
            log.warning("refused raw WAN link from %s: %s", certified.uri, reason)
            return
        if lane and not link.joins_current_session(session_id):
            raise HandshakeError(f"connection {lane} names no running session of this link")
    except (HandshakeError, TimeoutError) as exc:
        link.refuse("handshake", str(exc) or "no handshake in time", address=peer, serial=serial)
        log.warning("refused raw WAN link from %s: %s", certified.uri, exc)
        return
    await connection.write(
        link.hello(
            session_id=session_id, lane=lane, raw_link=RAW_LINK_VERSION, raw_preamble=connection.preamble
        ).SerializeToString()
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
        session_id=session_id,
        marking=hello.hello.lanes and bool(session_id),
        transport=connection.transport,
        peer_witness=hello.hello.audit_witness,
        peer_paced=hello.hello.paced,
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
    "PREAMBLE_SEALED",
    "RAW_LINK_VERSION",
    "RawConnection",
    "WanFrontend",
    "dial_raw",
    "identity_of",
    "serve_raw",
]
