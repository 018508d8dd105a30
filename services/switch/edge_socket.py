"""The switch's edge socket: a stage's edge as length-prefixed records on a Unix socket, no gRPC.

Why. A stage process's edge through gRPC costs two gRPC hops (stage to its trainer's proxy, proxy to
the switch) with a copy into and out of Python at each end of each. Here the trainer obtains a
one-time ticket on the internal port (``Relay/IssueEdgeTicket``, authenticated and checked as an
OpenEdge: ``relay_tickets.py``), connects to this socket, presents the ticket as the first record and
hands the connected socket to its stage process (``services/trainer/stage_edge_fds.py``); the stage
then speaks the edge itself on it (``services/trainer/edge/records_transport.py``).

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
import stat
from asyncio import FIRST_COMPLETED
from pathlib import Path
from typing import NoReturn, Protocol

import grpc

from nebula_common.cancellation import raise_if_cancelling
from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.rpc.edge_records import MAX_EDGE_RECORD_BYTES, status_record
from nebula_common.rpc.raw_record_bounds import RecordViolation
from nebula_common.rpc.raw_records import RawConnection, RawConnectionError
from nebula_common.rpc.unix_paths import bind_unix
from services.switch.edge_stream import EdgeStream, TrainerVanished
from services.switch.edge_tickets import EdgeTickets, TicketError
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


def bind_socket(path: Path) -> socket.socket:
    """A listening Unix socket at ``path``: a previous run's socket is replaced, anything else refused.

    Mode 0666: the trainer may run as another user (its own box's); the ticket, not the mode, decides
    who opens an edge, and the directory the deployment puts it in decides who reaches it.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ValueError(f"NEBULA_SWITCH_EDGE_SOCKET {path}: exists and is not a socket")
        path.unlink()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        bind_unix(listener, str(path))  # at any depth (``unix_paths.py``)
        os.chmod(path, 0o666)
        listener.listen(128)
        listener.setblocking(False)
    except BaseException:
        listener.close()
        raise
    return listener


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
    ) -> None:
        self.relay = relay
        self.tickets = tickets
        self.ticket_wait_s = ticket_wait_s
        self.stall_s = stall_s
        self.max_record_bytes = max_record_bytes
        self.path = ""
        self._listener: socket.socket | None = None
        self._acceptor: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        #: Connections waiting for their ticket, oldest first, each with the future that pushes it out.
        self._waiting: dict[RecordsEdgeStream, asyncio.Future[None]] = {}

    async def start(self, path: str) -> str:
        """Listen at ``path``; the relay then issues tickets for it."""
        self._listener = bind_socket(Path(path))
        self.path = path
        self.relay.tickets = self.tickets
        self._acceptor = asyncio.create_task(self._accept_forever(), name="edge-socket")
        return path

    async def stop(self) -> None:
        """Stop accepting and end every connection (their edges record their end first)."""
        self.relay.tickets = None
        if self._acceptor is not None:
            self._acceptor.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._acceptor
        if self._listener is not None:
            self._listener.close()
            with contextlib.suppress(OSError):
                os.unlink(self.path)
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
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as exc:  # out of descriptors: the connection waits in the backlog
                log.warning("edge socket accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._accepted(conn), name="edge-socket-connection")
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _accepted(self, conn: socket.socket) -> None:
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                conn.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)
        peer = f"unix:{self.path}"
        connection = RawConnection(
            conn,
            peer,
            asyncio.get_running_loop(),
            views=True,
            read_timeout_s=self.stall_s,
            max_message_bytes=self.max_record_bytes,
            plain_read_timeout=True,
            violation_record=lambda why: status_record(grpc.StatusCode.INVALID_ARGUMENT, why),
        )
        stream = RecordsEdgeStream(connection)
        try:
            await self._serve(stream)
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

    async def _serve(self, stream: RecordsEdgeStream) -> None:
        """The ticket, then the edge's common body."""
        if len(self._waiting) >= MAX_UNTICKETED:
            oldest, pushed_out = next(iter(self._waiting.items()))
            del self._waiting[oldest]
            pushed_out.set_result(None)
        pushed_out = asyncio.get_running_loop().create_future()
        self._waiting[stream] = pushed_out
        reading = asyncio.ensure_future(stream.read())
        try:
            await asyncio.wait({reading, pushed_out}, timeout=self.ticket_wait_s, return_when=FIRST_COMPLETED)
        finally:
            self._waiting.pop(stream, None)
            if not reading.done():
                reading.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reading
        raise_if_cancelling()  # a stop that reached the ticket's read as it finished
        if not reading.done() or reading.cancelled():
            if pushed_out.done():
                reason = f"{MAX_UNTICKETED} newer edge socket connections waited for a ticket"
                await self._refuse(stream, reason, grpc.StatusCode.RESOURCE_EXHAUSTED)
            await self._refuse(stream, f"no edge ticket within {self.ticket_wait_s:g} s")
        key = reading.result()
        if key is grpc.aio.EOF or not isinstance(key, bytes | memoryview):
            await self._refuse(stream, stream.violation or "the connection ended before its edge ticket")
        try:
            ticket = self.tickets.redeem(key)
        except TicketError as exc:
            await self._refuse(stream, str(exc))
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
        self, stream: RecordsEdgeStream, reason: str, code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED
    ) -> NoReturn:
        """A connection without a valid ticket: audited (``edge.open`` refused) and told why.

        Anyone who can reach the socket can be refused here, so the records go through the switch's
        refusal aggregator (the WAN port's: the first of each reason at once, repeats counted per
        interval) and a local flood cannot fill the audit disk.
        """
        refusals = self.relay.link.refusals
        if refusals is None:
            await self.relay._refuse_open(stream, code, reason, transport=TRANSPORT)
        refusals.refused("edge.open", "ticket", reason, {"transport": TRANSPORT, "address": self.path})
        await stream.abort(code, reason)


__all__ = ["MAX_UNTICKETED", "STALL_S", "TICKET_WAIT_S", "TRANSPORT", "EdgeSocket", "RecordsEdgeStream"]
