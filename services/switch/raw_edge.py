"""The raw edge transport: a trainer's job edge as length-prefixed records on its own mutual-TLS socket.

Why. On the gRPC edge every payload byte passes gRPC's C core, HTTP/2 framing and a Python message
object at both the trainer and its switch. The raw edge carries the SAME bytes (serialized
``EdgeMessage`` items and framed chunks) as ``4-byte length + bytes`` records
(``nebula_common/rpc/raw_records.py``), and the switch runs the SAME edge code on them
(``RelayServicer.serve_edge`` over an ``EdgeStream``): credits, acks, replay, resume, epochs, the
per-account throttle, the limits and the audit records do not depend on the carrier.

Negotiation (relay.proto, ``EdgeOpen.raw_edge`` / ``EdgeReady.raw_edge_port``). The trainer always
opens on gRPC (``Relay/OpenEdge`` on the service port), which runs every check of that port: mutual
TLS with the cluster CA, the certificate's role (``PeerRoleInterceptor``), the bearer token and its
account (``TokenAuthInterceptor``), the peer the edge names and the account's penalty backoff. If the
trainer offers ``raw_edge`` and this switch serves it, the switch answers with the raw listener's port
and a one-time ticket bound to the caller's certificate (identity and serial), account, job and edge,
valid for ``TICKET_TTL_S``, and ends the call. The trainer then connects to that port with the same
certificate and presents the ticket as its first record; the edge continues there as if the gRPC call
had gone on. A switch without the raw edge (or a trainer without it) keeps the edge on the call.

Checks on the raw port, each refused and audited: the TLS handshake (a certificate of the cluster CA
is required), the certificate's cluster, revocation and role (``auth.refused``, as the role
interceptor writes them), then the ticket (unknown, expired, used, or presented by another
certificate: ``edge.open`` refused). A refused connection gets one error record (``ERROR_MARK``
followed by JSON ``{"code", "details"}``, never a valid item: protobuf has no field 0) and is closed.

The Unix socket edge (``raw_edge_unix``, opt-in): a trainer on the switch's own host may carry the same
records over a Unix domain socket instead of TLS on TCP, which saves both ends' encryption. It opens on
gRPC exactly as above (mutual TLS, role, token, account: that is where the ticket comes from); only
the connection that redeems the ticket differs. The socket is 0600 in a 0700 directory of the switch's
user, and the switch reads the peer's credentials from the kernel (``SO_PEERCRED``): a process of any
other uid is refused (``auth.refused``, counted as ``peer-uid``) before it may present anything. There is
no certificate on that connection, so the ticket is checked for being known, unused and unexpired, but
not bound to a certificate: it is a 32-byte one-time secret the holder received over the verified
mutual-TLS call, and only processes of the switch's own uid can reach the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import ssl
import stat
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn, Protocol

import grpc
from cryptography import x509

from nebula_common.audit.aggregate import RefusalAggregator
from nebula_common.auth.interceptor import REFUSALS, AuditSink
from nebula_common.auth.roles import refusal
from nebula_common.pki import Identity, identity_from_certificate
from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.rpc.raw_edge import ERROR_MARK, RAW_EDGE_VERSION, error_record, parse_error_record
from nebula_common.rpc.raw_records import RawConnection, RawConnectionError, in_thread
from services.switch.edge_stream import TrainerVanished

log = logging.getLogger(__name__)

OPEN_EDGE = "/nebula.v1.Relay/OpenEdge"
TICKET_TTL_S = 10.0
"""How long a raw edge ticket may wait for its connection."""
HANDSHAKE_TIMEOUT_S = 10.0
"""TLS handshake plus the ticket record, at most."""
MAX_HANDSHAKES = 32
UNIX_BUFFER_BYTES = 4 << 20
"""Send and receive buffer of a Unix socket edge (the kernel's ~208 KiB default blocks a 1 MiB chunk)."""


class EdgeServer(Protocol):
    """What the raw edge port hands a ticketed connection to (``RelayServicer``)."""

    link: Any

    async def serve_edge(
        self,
        stream: Any,
        account: str,
        open_: relay_pb2.EdgeOpen,
        *,
        issued_at: float = 0.0,
        serial: int = 0,
        expires_at: float = 0.0,
    ) -> None: ...


class TicketError(Exception):
    """A ticket that may not open an edge (the reason is what the audit record and the trainer get)."""


@dataclass(frozen=True)
class Ticket:
    identity: str
    """The URI of the certificate identity that obtained it."""
    serial: int
    account: str
    open: relay_pb2.EdgeOpen
    expires: float
    issued_at: float = 0.0
    """``iat`` of the token the ticket was obtained with (the route ends if it is revoked)."""
    token_expires_at: float = 0.0
    """``exp`` of that token (the route ends when it passes unrenewed)."""


class EdgeTickets:
    """One-time tickets of the raw edge: issued on a checked gRPC OpenEdge, redeemed once on the raw port."""

    def __init__(self, ttl_s: float = TICKET_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._tickets: dict[bytes, Ticket] = {}

    def issue(
        self,
        identity: Identity,
        serial: int,
        account: str,
        open_: relay_pb2.EdgeOpen,
        issued_at: float = 0.0,
        token_expires_at: float = 0.0,
    ) -> bytes:
        now = self._clock()
        for key in [key for key, each in self._tickets.items() if each.expires <= now]:
            del self._tickets[key]
        key = secrets.token_bytes(32)
        self._tickets[key] = Ticket(
            identity.uri, serial, account, open_, now + self.ttl_s, issued_at, token_expires_at
        )
        return key

    def redeem(self, key: bytes, identity: Identity | None, serial: int | None) -> Ticket:
        """The ticket's grant; TicketError if unknown, used, expired or obtained by another certificate.

        A ticket is gone after its first presentation, whoever presents it. ``identity`` None: the
        connection has no certificate (the Unix socket edge, whose peer uid was checked instead).
        """
        ticket = self._tickets.pop(bytes(key), None)
        if ticket is None:
            raise TicketError("unknown or already used raw edge ticket")
        if ticket.expires <= self._clock():
            raise TicketError(f"raw edge ticket expired (valid {self.ttl_s:g} s)")
        if identity is not None and (ticket.identity, ticket.serial) != (identity.uri, serial):
            raise TicketError(
                f"raw edge ticket of {ticket.identity} (certificate {ticket.serial:x}) presented by "
                f"{identity.uri} (certificate {serial:x})"
            )
        return ticket


class EdgeAborted(Exception):
    """The raw edge was refused (its error record is sent); ends the connection's handler."""


class RawEdgeStream:
    """An ``EdgeStream`` (relay_servicer.py) over a raw edge connection.

    A trainer never half-closes a raw edge: its EdgeClose is the last item it sends, and it keeps the
    connection until the switch ends it. So an end of the records (a clean EOF, a reset, a killed
    process) before a close is a vanished trainer, like a cancelled gRPC call.
    """

    transport = "raw"

    def __init__(self, connection: RawConnection, transport: str = "raw") -> None:
        self.connection = connection
        #: ``raw`` (TLS on TCP) or ``unix`` (the Unix socket edge): named in the edge's audit records.
        self.transport = transport
        self._ended = False

    async def read(self) -> object:
        try:
            raw = await self.connection.read()
        except RawConnectionError:
            raw = grpc.aio.EOF
        if raw is grpc.aio.EOF:
            self._ended = True
        return raw

    async def write(self, data: bytes) -> None:
        try:
            await self.connection.write(data)
        except RawConnectionError as exc:
            self._ended = True
            raise TrainerVanished(str(exc)) from exc

    async def abort(self, code: grpc.StatusCode, message: str) -> NoReturn:
        with contextlib.suppress(RawConnectionError):
            await self.connection.write(error_record(code, message))
        raise EdgeAborted(f"{code.name}: {message}")

    def cancelled(self) -> bool:
        return self._ended


class RawEdgeListener:
    """The switch's raw edge port: mutual TLS, the role check, the ticket, then the edge's common body."""

    def __init__(
        self,
        servicer: EdgeServer,
        cluster_id: str,
        context: Callable[[], ssl.SSLContext],
        *,
        audit: AuditSink | None,
        revoked: Callable[[], frozenset[int]] = frozenset,
        tickets: EdgeTickets | None = None,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
        refusals: RefusalAggregator | None = None,
    ) -> None:
        self.servicer = servicer
        #: Refusals written once per source, reason per interval, repeats counted (None: each one).
        self.refusals = refusals
        self.cluster_id = cluster_id
        self.context = context
        self.audit = audit
        self.revoked = revoked
        self.tickets = tickets or EdgeTickets()
        self.handshake_timeout_s = handshake_timeout_s
        self.port = 0
        #: Path of the Unix socket edge, when served (``start_unix``).
        self.unix_path = ""
        self._unix: socket.socket | None = None
        self._unix_acceptor: asyncio.Task[None] | None = None
        self._listener: socket.socket | None = None
        self._acceptor: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._handshakes = asyncio.Semaphore(MAX_HANDSHAKES)

    async def start(self, listen: str) -> int:
        host, _, port = listen.rpartition(":")
        family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
        listener = socket.create_server((host.strip("[]"), int(port)), family=family, backlog=128)
        listener.setblocking(False)
        self._listener = listener
        self.port = int(listener.getsockname()[1])
        self._acceptor = asyncio.create_task(self._accept_forever(), name="raw-edge-listener")
        return self.port

    async def start_unix(self, path: str) -> str:
        """Also serve the edge on a Unix socket at ``path`` (0600, in a 0700 directory of this user).

        ValueError naming the path if its directory belongs to another user or is open to others
        (it is created 0700 if missing), or if something other than a socket is in the way.
        """
        where = Path(path)
        directory = where.parent
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = directory.stat()
        if info.st_uid != os.getuid():
            raise ValueError(f"raw_edge_unix {path}: directory {directory} belongs to uid {info.st_uid}")
        if stat.S_IMODE(info.st_mode) & 0o077:
            raise ValueError(
                f"raw_edge_unix {path}: directory {directory} is open to others "
                f"(mode {stat.S_IMODE(info.st_mode):o}; it must be 0700)"
            )
        if where.exists() or where.is_symlink():
            if not stat.S_ISSOCK(where.lstat().st_mode):
                raise ValueError(f"raw_edge_unix {path}: exists and is not a socket")
            where.unlink()  # a previous run's socket
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(str(where))
            os.chmod(where, 0o600)  # the 0700 directory already keeps others out between bind and this
            listener.listen(128)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._unix = listener
        self.unix_path = str(where)
        self._unix_acceptor = asyncio.create_task(self._accept_unix_forever(), name="raw-edge-unix-listener")
        return self.unix_path

    async def stop(self) -> None:
        if self._acceptor is not None:
            self._acceptor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._acceptor
        if self._listener is not None:
            self._listener.close()
        if self._unix_acceptor is not None:
            self._unix_acceptor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._unix_acceptor
        if self._unix is not None:
            self._unix.close()
            with contextlib.suppress(OSError):
                os.unlink(self.unix_path)
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
            except OSError as exc:
                log.warning("raw edge accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._accepted(conn, f"{address[0]}:{address[1]}"))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _accept_unix_forever(self) -> None:
        assert self._unix is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(self._unix)
            except OSError as exc:
                log.warning("Unix socket edge accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._accepted_unix(conn))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _accepted_unix(self, conn: socket.socket) -> None:
        """The peer's uid from the kernel, then the ticket and the edge's common body, no TLS."""
        connection: RawConnection | None = None
        try:
            pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
            peer = f"unix:{self.unix_path} pid {pid} uid {uid}"
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                with contextlib.suppress(OSError):
                    conn.setsockopt(socket.SOL_SOCKET, option, UNIX_BUFFER_BYTES)
            connection = RawConnection(conn, peer, asyncio.get_running_loop(), views=True)
            if uid != os.getuid():
                reason = f"Unix socket edge peer runs as uid {uid}, this switch as uid {os.getuid()}"
                self._refused(reason, "peer-uid", peer, transport="unix")
                await RawEdgeStream(connection, "unix").abort(grpc.StatusCode.PERMISSION_DENIED, reason)
            await self._serve(connection, None, None, peer, "unix")
        except EdgeAborted as exc:
            log.info("Unix socket edge refused: %s", exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one connection's failure never takes the listener down
            log.warning("Unix socket edge ended: %s", exc)
        finally:
            if connection is not None:
                await connection.close()
            else:
                conn.close()

    def _refused(
        self, reason: str, label: str, peer: str, identity: str = "", transport: str = "raw"
    ) -> None:
        """Count and audit a refusal on the transport identity, as the role interceptor does."""
        REFUSALS.labels("switch", "OpenEdge", label).inc()
        log.warning("refused raw edge from %s: %s", peer, reason)
        details = {"method": OPEN_EDGE, "peer": peer, "peer_identity": identity, "transport": transport}
        if self.refusals is not None:
            self.refusals.refused("auth.refused", label, reason, {**details, "address": peer})
        elif self.audit is not None:
            self.audit.append(
                "auth.refused",
                outcome="refused",
                details={
                    "method": OPEN_EDGE,
                    "reason": reason,
                    "peer": peer,
                    "peer_identity": identity,
                    "transport": transport,
                },
            )

    async def _accepted(self, conn: socket.socket, peer: str) -> None:
        connection: RawConnection | None = None
        try:
            async with self._handshakes:
                context = self.context()

                def handshake() -> ssl.SSLSocket:
                    conn.settimeout(self.handshake_timeout_s)
                    tls = context.wrap_socket(conn, server_side=True)
                    tls.settimeout(None)
                    return tls

                try:
                    tls = await in_thread(handshake, f"raw-edge-accept {peer}")
                except (ssl.SSLError, OSError) as exc:
                    self._refused(f"raw edge TLS handshake refused: {exc or 'timeout'}", "peer-cert", peer)
                    conn.close()
                    return
            with contextlib.suppress(OSError):
                tls.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection = RawConnection(tls, peer, asyncio.get_running_loop(), views=True)
            identity, serial = await self._check_certificate(connection, peer)
            await self._serve(connection, identity, serial, peer)
        except EdgeAborted as exc:
            log.info("raw edge from %s refused: %s", peer, exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one connection's failure never takes the port down
            log.warning("raw edge from %s ended: %s", peer, exc)
        finally:
            if connection is not None:
                await connection.close()

    async def _check_certificate(self, connection: RawConnection, peer: str) -> tuple[Identity, int]:
        cert: x509.Certificate | None = connection.peer_cert
        stream = RawEdgeStream(connection)
        if cert is None:  # CERT_REQUIRED makes this unreachable; kept as a guard
            reason = f"{OPEN_EDGE} is service-only: it needs a client certificate"
            self._refused(reason, "peer-role", peer)
            await stream.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        try:
            identity = identity_from_certificate(cert)
        except ValueError as exc:
            reason = f"client certificate: {exc}"
            self._refused(reason, "peer-cert", peer)
            await stream.abort(grpc.StatusCode.PERMISSION_DENIED, reason)
        serial = cert.serial_number
        if serial in self.revoked():
            reason = f"client certificate {serial:x} of {identity.uri} is revoked"
        elif identity.cluster_id != self.cluster_id:
            reason = f"client certificate of cluster {identity.cluster_id!r}, this is {self.cluster_id!r}"
        else:
            why = refusal(OPEN_EDGE, identity.role)
            if why is None:
                return identity, serial
            self._refused(why, "peer-role", peer, identity.uri)
            await stream.abort(grpc.StatusCode.PERMISSION_DENIED, why)
        self._refused(reason, "peer-cert", peer, identity.uri)
        await stream.abort(grpc.StatusCode.PERMISSION_DENIED, reason)

    async def _serve(
        self,
        connection: RawConnection,
        identity: Identity | None,
        serial: int | None,
        peer: str,
        transport: str = "raw",
    ) -> None:
        stream = RawEdgeStream(connection, transport)
        who = identity.uri if identity is not None else ""
        extra = {"peer": peer} if transport == "unix" else {}
        try:
            key = await asyncio.wait_for(stream.read(), self.handshake_timeout_s)
        except TimeoutError:
            key = grpc.aio.EOF
        if key is grpc.aio.EOF or not isinstance(key, bytes):
            reason = "no raw edge ticket in time"
            self.servicer.link.record(
                "edge.open", outcome="refused", reason=reason, peer_identity=who, transport=transport, **extra
            )
            await stream.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        try:
            ticket = self.tickets.redeem(key, identity, serial)
            if identity is None and ticket.serial in self.revoked():
                # No certificate on this connection: the one that obtained the ticket must still be good.
                raise TicketError(f"the certificate {ticket.serial:x} that obtained the ticket is revoked")
        except TicketError as exc:
            self.servicer.link.record(
                "edge.open",
                outcome="refused",
                reason=str(exc),
                peer_identity=who,
                transport=transport,
                **extra,
            )
            await stream.abort(grpc.StatusCode.UNAUTHENTICATED, str(exc))
        await self.servicer.serve_edge(
            stream,
            ticket.account,
            ticket.open,
            issued_at=ticket.issued_at,
            serial=ticket.serial,
            expires_at=ticket.token_expires_at,
        )


def server_context(cert: str, key: str, ca: str) -> ssl.SSLContext:
    """TLS 1.3 context of the raw edge port: the service certificate; client certificates required."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_cert_chain(cert, key)
    context.load_verify_locations(cafile=ca)
    context.verify_mode = ssl.CERT_REQUIRED
    return context


__all__ = [
    "ERROR_MARK",
    "RAW_EDGE_VERSION",
    "EdgeTickets",
    "RawEdgeListener",
    "RawEdgeStream",
    "TicketError",
    "error_record",
    "parse_error_record",
    "server_context",
]
