"""The switch's edge socket: a stage's edge as records on a Unix socket or a TCP port, no gRPC.

Why. A stage process's edge through gRPC costs two gRPC hops (stage to its trainer's proxy, proxy to
the switch) with a copy into and out of Python at each end of each. Here the trainer obtains a
one-time ticket on the internal port (``Relay/IssueEdgeTicket``, authenticated and checked as an
OpenEdge: ``relay_tickets.py``), connects to this socket, presents the ticket as the first record and
hands the connected socket to its stage process (``services/trainer/stage_edge_fds.py``); the stage
then speaks the edge itself on it (``services/trainer/edge/records_transport.py``). On a Unix socket
(the trainer on this host) the records are plain ``4-byte length + bytes``; on a TCP port (Kubernetes)
each connection first passes mutual TLS 1.3 as a trainer of this cluster (``edge_tls_accept.py``) and
its records are sealed, keyed from the TLS exporter (``nebula_common/rpc/edge_tls.py``).

Each connection: the first record must be a ticket, within ``TICKET_WAIT_S``; a missing, unknown,
reused or expired ticket (or a record that is not one) is refused with a status record naming why,
audited as a refused ``edge.open`` (``transport: records``; through the switch's refusal aggregator, so
repeats are counted, not each written), and the connection closed. A redeemed
ticket runs the edge's common body (``RelayServicer.serve_edge``) on a ``RecordsEdgeStream``: the same
checks, bounds, throttle, credits and audit records as an OpenEdge stream. Records are bounded
(``MAX_EDGE_RECORD_BYTES``, checked from the header before any buffer), a record that stays
incomplete with no byte arriving for ``STALL_S`` ends the connection, and at most
``MAX_UNTICKETED`` connections may wait for their ticket at once: a new one beyond that ends the one
that has waited longest (``RESOURCE_EXHAUSTED``, which a stage retries). A trainer writes its ticket
as it connects, so its connection is read at once; a local peer that opens connections and sends
nothing (a stage in a container, where the socket's directory is visible to it) only pushes out its
own older ones and cannot keep a genuine edge from opening. The socket's file mode is defence in
depth; the ticket is the boundary.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from asyncio import FIRST_COMPLETED
from pathlib import Path
from typing import NoReturn, Protocol

import grpc

from nebula_common.cancellation import raise_if_cancelling
from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.rpc.edge_records import MAX_EDGE_RECORD_BYTES, status_record
from nebula_common.rpc.edge_tls import UNIX, edge_address
from nebula_common.rpc.raw_record_bounds import RecordViolation
from nebula_common.rpc.raw_records import RawConnection, RawConnectionError
from services.switch.edge_listeners import bind_socket, bind_tcp, host_port
from services.switch.edge_stream import EdgeStream, TrainerVanished
from services.switch.edge_tickets import EdgeTickets, TicketError
from services.switch.edge_tls_accept import EdgeTlsAcceptor, EdgeTlsRefused
from services.switch.link import PeerLink

log = logging.getLogger(__name__)

TRANSPORT = "records"
"""What the edge's audit records name as its carrier."""
TICKET_WAIT_S = 10.0
"""How long a new connection may take to present its ticket."""
STALL_S = 60.0
"""How long a record may stay incomplete with no byte arriving (the link's dead-peer ceiling)."""
MAX_UNTICKETED = 64
"""Connections waiting for their ticket at once; a new one beyond that ends the longest waiting."""
SOCKET_BUFFER_BYTES = 4 << 20
"""Send and receive buffer of an edge connection (the kernel's ~208 KiB default blocks a chunk)."""


class EdgeServer(Protocol):
    """What the edge socket needs of ``RelayServicer``."""

    tickets: EdgeTickets | None
    link: PeerLink

    async def serve_edge(
        self,
        stream: EdgeStream,
        account: str,
        open_: relay_pb2.EdgeOpen,
        *,
        credential: str = "",
        issued_at: float = 0.0,
        serial: int = 0,
        expires_at: float = 0.0,
    ) -> None: ...

    async def _refuse_open(
        self, stream: EdgeStream, code: grpc.StatusCode, reason: str, *, audit: bool = True, **fields: object
    ) -> NoReturn: ...


class EdgeAborted(Exception):
    """The edge was refused or aborted (its status record is sent); ends the connection's handler."""


class RecordsEdgeStream:
    """An ``EdgeStream`` over one edge socket connection.

    The stage never half-closes: its EdgeClose is the last item it sends and it keeps the connection
    until the switch ends it, so an end of the records before a close is a vanished stage (a killed
    process), like a cancelled gRPC call.
    """

    transport = TRANSPORT

    def __init__(self, connection: RawConnection) -> None:
        self.connection = connection
        self._ended = False
        #: Why the records ended, when the peer broke their bounds (an oversized or stalled record).
        self.violation = ""

    async def read(self) -> object:
        try:
            raw = await self.connection.read()
        except RawConnectionError as exc:
            if isinstance(exc.__cause__, RecordViolation):
                self.violation = str(exc.__cause__)
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
            await self.connection.write(status_record(code, message))
        raise EdgeAborted(f"{code.name}: {message}")

    def cancelled(self) -> bool:
        return self._ended


class EdgeSocket:
    """Serves the edge socket in the internal server's event loop (see the module doc)."""

    def __init__(
        self,
        relay: EdgeServer,
        tickets: EdgeTickets,
        *,
        ticket_wait_s: float = TICKET_WAIT_S,
        stall_s: float = STALL_S,
        max_record_bytes: int = MAX_EDGE_RECORD_BYTES,
        tls: EdgeTlsAcceptor | None = None,
    ) -> None:
        self.relay = relay
        #: Mutual TLS for a TCP edge socket (None: only a Unix socket path can be served).
        self.tls = tls
        self.tickets = tickets
        self.ticket_wait_s = ticket_wait_s
        self.stall_s = stall_s
        self.max_record_bytes = max_record_bytes
        self.path = ""
        self._listener: socket.socket | None = None
        self._acceptor: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: Connections waiting for their ticket, oldest first, each with the future that pushes it out.
        self._waiting: dict[socket.socket, asyncio.Future[None]] = {}

    async def start(self, address: str) -> str:
        """Listen at ``address`` (a Unix socket path, or host:port with ``tls``); the relay then issues
        tickets for it. The address listened at (a TCP port of 0 resolved)."""
        kind, where = edge_address(address, "NEBULA_SWITCH_EDGE_SOCKET")
        if kind == UNIX:
            self._listener = bind_socket(Path(where))
            self.path = where
        else:
            if self.tls is None:
                raise ValueError(
                    f"NEBULA_SWITCH_EDGE_SOCKET={address!r} is a TCP port, which needs internal TLS "
                    "(its edges are sealed records after mutual TLS 1.3); give a socket path instead"
                )
            self._listener = bind_tcp(where)
            host, port = self._listener.getsockname()[:2]
            self.path = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.relay.tickets = self.tickets
        self._acceptor = asyncio.create_task(self._accept_forever(), name="edge-socket")
        return self.path

    async def stop(self) -> None:
        """Stop accepting and end every connection (their edges record their end first)."""
        self.relay.tickets = None
        if self._acceptor is not None:
            self._acceptor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._acceptor
        if self._listener is not None:
            unix = self._listener.family == socket.AF_UNIX
            self._listener.close()
            if unix:
                with contextlib.suppress(OSError):
                    os.unlink(self.path)
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.tls is not None:
            self.tls.close()

    async def _accept_forever(self) -> None:
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, address = await loop.sock_accept(self._listener)
            except OSError as exc:  # out of descriptors: the connection waits in the backlog
                log.warning("edge socket accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._accepted(conn, address), name="edge-socket-connection")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _accepted(self, conn: socket.socket, address: object) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.ticket_wait_s
        peer = f"unix:{self.path}" if conn.family == socket.AF_UNIX else f"tls:{host_port(address)}"
        if len(self._waiting) >= MAX_UNTICKETED:
            oldest, pushed = next(iter(self._waiting.items()))
            del self._waiting[oldest]
            pushed.set_result(None)
        pushed_out = loop.create_future()
        self._waiting[conn] = pushed_out
        try:
            await self._secured(conn, peer, pushed_out, deadline)
        finally:
            self._waiting.pop(conn, None)

    async def _secured(
        self, conn: socket.socket, peer: str, pushed_out: asyncio.Future[None], deadline: float
    ) -> None:
        """The connection, after mutual TLS on a TCP port: its ticket, then its edge."""
        sealing = None
        refusal: str | None = None
        if conn.family == socket.AF_UNIX:
            for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
                with contextlib.suppress(OSError):
                    conn.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        else:
            assert self.tls is not None
            try:
                conn, sealing, refusal = await self.tls.secure(conn, pushed_out, deadline)
            except EdgeTlsRefused as exc:
                conn.close()
                self._refused_unheard(str(exc), peer)
                return
        connection = RawConnection(
            conn,
            peer,
            asyncio.get_running_loop(),
            views=True,
            read_timeout_s=self.stall_s,
            max_message_bytes=self.max_record_bytes,
            plain_read_timeout=True,
            violation_record=lambda why: status_record(grpc.StatusCode.INVALID_ARGUMENT, why),
            sealing=sealing,
        )
        stream = RecordsEdgeStream(connection)
        try:
            if refusal is not None:
                await self._refuse(stream, refusal, grpc.StatusCode.PERMISSION_DENIED, peer)
            await self._serve(stream, peer, pushed_out, deadline)
            if stream.violation:  # the edge ended as a vanished stage's would; say why
                self._audit_violation(stream.violation)
        except EdgeAborted as exc:
            log.info("edge socket connection refused or aborted: %s", exc)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # one connection's failure never takes the socket down
            log.warning("edge socket connection ended: %s", exc)
        finally:
            await connection.close()

    async def _serve(
        self, stream: RecordsEdgeStream, peer: str, pushed_out: asyncio.Future[None], deadline: float
    ) -> None:
        """The ticket, then the edge's common body."""
        reading = asyncio.ensure_future(stream.read())
        left = max(0.0, deadline - asyncio.get_running_loop().time())
        try:
            await asyncio.wait({reading, pushed_out}, timeout=left, return_when=FIRST_COMPLETED)
        finally:
            if not reading.done():
                reading.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reading
        raise_if_cancelling()  # a stop that reached the ticket's read as it finished
        if not reading.done() or reading.cancelled():
            if pushed_out.done():
                reason = f"{MAX_UNTICKETED} newer edge socket connections waited for a ticket"
                await self._refuse(stream, reason, grpc.StatusCode.RESOURCE_EXHAUSTED, peer)
            await self._refuse(stream, f"no edge ticket within {self.ticket_wait_s:g} s", peer=peer)
        key = reading.result()
        if key is grpc.aio.EOF or not isinstance(key, bytes | memoryview):
            await self._refuse(
                stream, stream.violation or "the connection ended before its edge ticket", peer=peer
            )
        try:
            ticket = self.tickets.redeem(key)
        except TicketError as exc:
            await self._refuse(stream, str(exc), peer=peer)
        await self.relay.serve_edge(
            stream,
            ticket.account,
            ticket.open,
            credential=ticket.credential,
            issued_at=ticket.issued_at,
            serial=ticket.serial,
            expires_at=ticket.expires_at,
        )

    def _audit_violation(self, reason: str) -> None:
        log.warning("edge socket connection broke the record bounds: %s", reason)
        self.relay.link.record("edge.refused", outcome="refused", reason=reason, transport=TRANSPORT)

    async def _refuse(
        self,
        stream: RecordsEdgeStream,
        reason: str,
        code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED,
        peer: str = "",
    ) -> NoReturn:
        """A connection without a valid ticket or identity: audited (``edge.open`` refused) and told why.

        Anyone who can reach the socket can be refused here, so the records go through the switch's
        refusal aggregator (the WAN port's: the first of each reason at once, repeats counted per
        interval) and a local flood cannot fill the audit disk.
        """
        refusals = self.relay.link.refusals
        if refusals is None:
            await self.relay._refuse_open(stream, code, reason, transport=TRANSPORT)
        refusals.refused(
            "edge.open", "ticket", reason, {"transport": TRANSPORT, "address": peer or self.path}
        )
        await stream.abort(code, reason)

    def _refused_unheard(self, reason: str, peer: str) -> None:
        """A TCP connection that failed its mutual TLS: audited as ``_refuse`` does, with nothing to tell."""
        log.info("edge socket connection refused: %s", reason)
        refusals = self.relay.link.refusals
        details = {"transport": TRANSPORT, "address": peer}
        if refusals is None:
            self.relay.link.record("edge.refused", outcome="refused", reason=reason, **details)
            return
        refusals.refused("edge.open", "tls", reason, details)


__all__ = ["MAX_UNTICKETED", "STALL_S", "TICKET_WAIT_S", "TRANSPORT", "EdgeSocket", "RecordsEdgeStream"]
