"""The raw edge transport: the edge on its own mutual-TLS socket to the switch (switch side: raw_edge.py).

Every open starts as ``GrpcEdgeTransport``'s does, on ``Relay/OpenEdge`` with the bearer token and
the service certificate, offering ``EdgeOpen.raw_edge``. A switch that serves the raw edge answers
with its raw port and a one-time ticket and ends the call; this transport then connects there (TLS
1.3, the same client certificate, the switch's name pinned as on gRPC), presents the ticket and runs
the edge on ``4-byte length + bytes`` records: the same serialized items and framed chunks as the
gRPC stream, without gRPC's C core, HTTP/2 framing or a Python message object per item. The I/O is
``nebula_common.rpc.raw_records.RawConnection`` (one thread owning the socket, GIL released while it
encrypts and copies), driven by an event loop on this transport's own thread.

A switch that does not offer it keeps the edge on the gRPC call. A raw connection that cannot be
made (the port unreachable, TLS refused) falls back to gRPC for ``RAW_RETRY_S``; a dropped raw
connection is an outage like a failed stream: ``on_down``, then a reconnecting open (a fresh ticket).
A refusal on the raw port (the switch's error record) that a retry cannot fix fails the edge.

With ``NEBULA_TRAINER_RAW_EDGE_UNIX`` (a trainer on its switch's host, the switch's ``raw_edge_unix``)
the ticketed connection is that Unix socket instead: the same records without TLS on this hop (each end
checks the other's uid from the kernel; the open on gRPC keeps mutual TLS and the token).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import stat
import struct
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.rpc.framing import LINK_FRAMING_VERSION, ChunkHead, FramedChunk, parse_chunk_head
from nebula_common.rpc.internal_tls import ClientTls, endpoint_tls, process_client_tls, server_name
from nebula_common.rpc.raw_edge import RAW_EDGE_VERSION, parse_error_record
from nebula_common.rpc.raw_records import (
    PlacedMessage,
    Placement,
    Placer,
    RawConnection,
    RawConnectionError,
    in_thread,
)
from services.trainer.edge.grpc_transport import _END, FATAL_CODES, GrpcEdgeTransport, _received, _serialize
from services.trainer.edge.session import TransportHandler

log = logging.getLogger(__name__)
RAW_RETRY_S = 60.0
"""After a raw connection could not be made, opens stay on gRPC this long."""
CONNECT_TIMEOUT_S = 10.0
RAW_EDGE_UNIX_ENV = "NEBULA_TRAINER_RAW_EDGE_UNIX"
"""Path of the switch's Unix socket edge (``raw_edge_unix``): the raw edge's records go there, not TLS.
``{cluster}`` in it is this trainer's cluster id."""
UNIX_BUFFER_BYTES = 4 << 20
_FATAL = frozenset(code.name for code in FATAL_CODES)


class RawEdgeUnavailable(Exception):
    """The raw edge cannot be used from here (no client certificate, the port unreachable, TLS refused)."""


class _Fatal(Exception):
    pass


def chunk_placer(place: Callable[[ChunkHead], Placement | None]) -> Placer:
    """A ``RawConnection`` placer for an edge session: a framed chunk's payload goes where the session
    says (``EdgeSession.place_chunk``: the frame's own buffer), read from the chunk's first bytes."""

    def placer(prefix: memoryview, size: int) -> Placement | None:
        head = parse_chunk_head(prefix, size)
        return place(head) if head is not None else None

    return placer


def placed_chunk(message: PlacedMessage) -> FramedChunk:
    """The framed chunk a placed message carries (its payload already in the session's buffer)."""
    head = message.placement.info
    assert isinstance(head, tuple) and isinstance(head[0], ChunkHead)
    chunk, owner = head
    return FramedChunk(
        raw=message.head,
        job_id=chunk.job_id,
        edge=chunk.edge,
        epoch=chunk.epoch,
        frame_id=chunk.frame_id,
        offset=chunk.offset,
        last=chunk.last,
        data=message.placement.dest,
        frame_size=chunk.frame_size,
        item=chunk.item,
        placed=owner,
    )


def client_context(tls: ClientTls) -> ssl.SSLContext:
    """TLS 1.3 client context: the cluster CA, this service's certificate."""
    if tls.cert is None or tls.key is None:
        raise RawEdgeUnavailable("the raw edge needs this process's service certificate (none configured)")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_verify_locations(cafile=str(tls.ca))
    context.load_cert_chain(str(tls.cert), str(tls.key))
    return context


def _connect(address: str, context: ssl.SSLContext, name: str) -> ssl.SSLSocket:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tls = context.wrap_socket(sock, server_hostname=name)
        tls.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return tls


def _check_unix_path(path: str) -> None:
    """The socket and its directory must be this user's and closed to others, as the switch makes them."""
    where = Path(path)
    directory, me = where.parent.stat(), os.getuid()
    if directory.st_uid != me or stat.S_IMODE(directory.st_mode) & 0o022:
        raise PermissionError(
            f"Unix socket edge {path}: its directory belongs to uid {directory.st_uid} with mode "
            f"{stat.S_IMODE(directory.st_mode):o}; a switch's is this trainer's (uid {me}), closed to others"
        )
    info = where.lstat()
    if not stat.S_ISSOCK(info.st_mode) or info.st_uid != me:
        raise PermissionError(f"Unix socket edge {path}: not a socket of this trainer's uid {me}")


def _connect_unix(path: str) -> socket.socket:
    """A Unix socket edge connection: no TLS on this hop, so both ends check the other's uid.

    The switch reads this process's credentials from the kernel; this side checks the path before
    connecting and the listening process's credentials (``SO_PEERCRED``) after, so a socket that
    another user put in the way never receives the edge's one-time ticket.
    """
    _check_unix_path(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, option, UNIX_BUFFER_BYTES)
        sock.settimeout(CONNECT_TIMEOUT_S)
        sock.connect(path)
        sock.settimeout(None)
        pid, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        if uid != os.getuid():
            raise PermissionError(
                f"Unix socket edge {path} is served by pid {pid} of uid {uid}, not by a switch of this "
                f"trainer's uid {os.getuid()}: the edge's ticket is not sent there"
            )
    except BaseException:
        sock.close()
        raise
    return sock


class _LoopQueue:
    """Stands where the gRPC stream's ``queue.Queue`` does: ``put`` queues the item on the raw connection.

    Items go straight into the connection's outbox from the session's thread (``send_nowait``: the
    session's credit window bounds them), with no hop through the raw loop; only the end (``_END``)
    goes to the loop's writer, after everything put before it.
    """

    def __init__(
        self, loop: asyncio.AbstractEventLoop, items: asyncio.Queue[object], connection: RawConnection
    ) -> None:
        self._loop = loop
        self._items = items
        self._connection = connection

    def put(self, item: object) -> None:
        if item is _END:
            with contextlib.suppress(RuntimeError):  # the session's loop is gone: the stream is dead
                self._loop.call_soon_threadsafe(self._items.put_nowait, item)
            return
        assert isinstance(item, relay_pb2.EdgeMessage | bytes)
        with contextlib.suppress(RawConnectionError):  # the connection is over: the reader reports it
            self._connection.send_nowait(_serialize(item))


class RawEdgeTransport(GrpcEdgeTransport):
    """``GrpcEdgeTransport`` that moves its edge to the switch's raw edge port when offered."""

    def __init__(
        self, *args: object, tls: ClientTls | None = None, unix_path: str | None = None, **kwargs: object
    ) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.tls = tls
        #: The switch's Unix socket edge (None: ``NEBULA_TRAINER_RAW_EDGE_UNIX``; empty: TLS on TCP).
        self.unix_path = os.environ.get(RAW_EDGE_UNIX_ENV, "") if unix_path is None else unix_path
        #: Raw connections made (each carried the edge after a ticket).
        self.raw_opens = 0
        self._raw_until = 0.0  # no raw offer before this (monotonic), after a failed raw connection
        self._raw_stop: Callable[[], None] | None = None

    def _raw_offer(self) -> int:
        return RAW_EDGE_VERSION if time.monotonic() >= self._raw_until else 0

    def _carry_raw(
        self, handler: TransportHandler, offer: relay_pb2.EdgeReady
    ) -> tuple[bool, bool, str] | None:
        try:
            return asyncio.run(self._raw_session(handler, offer))
        except _Fatal as exc:
            handler.on_failed(str(exc))
            return None
        except (RawEdgeUnavailable, ssl.SSLError, OSError) as exc:
            self._raw_until = time.monotonic() + RAW_RETRY_S
            log.warning(
                "raw edge connection failed; the edge stays on gRPC for a while",
                extra={"fields": {"job_id": self.job_id, "edge": self.edge, "reason": str(exc)}},
            )
            return False, False, f"raw edge connection failed: {exc}"

    async def _raw_session(
        self, handler: TransportHandler, offer: relay_pb2.EdgeReady
    ) -> tuple[bool, bool, str]:
        loop = asyncio.get_running_loop()
        if self.unix_path:
            path = self.unix_path
            if "{cluster}" in path:  # one setting for every cluster of a local deployment
                tls = self.tls or endpoint_tls(self.switch_address) or process_client_tls()
                if tls is None:
                    raise RawEdgeUnavailable(f"{RAW_EDGE_UNIX_ENV}={path!r} names {{cluster}}: none is known")
                path = path.replace("{cluster}", tls.cluster_id)
            address = f"unix:{path}"
            sock: socket.socket = await in_thread(lambda: _connect_unix(path), "raw-edge-dial")
        else:
            tls = self.tls or endpoint_tls(self.switch_address) or process_client_tls()
            if tls is None:
                raise RawEdgeUnavailable("no internal TLS configuration for the raw edge")
            context = client_context(tls)
            address = f"{self.switch_address.rpartition(':')[0]}:{offer.raw_edge_port}"
            name = server_name("switch", tls.cluster_id)
            sock = await in_thread(lambda: _connect(address, context, name), "raw-edge-dial")
        place = getattr(handler, "place_chunk", None)
        connection = RawConnection(
            sock, address, loop, views=True, placer=chunk_placer(place) if place is not None else None
        )
        self.raw_opens += 1
        stop: asyncio.Future[None] = loop.create_future()

        def request_stop() -> None:
            if not stop.done():
                stop.set_result(None)

        with self._lock:
            self._raw_stop = lambda: loop.call_soon_threadsafe(request_stop)
        if self._stopping.is_set():
            request_stop()
        items: asyncio.Queue[object] = asyncio.Queue()
        state = {"attached": False, "peer_closed": False}
        reason = "the switch ended the raw edge"
        writer = asyncio.create_task(self._raw_writer(connection, items))
        outgoing = _LoopQueue(loop, items, connection)
        reader = asyncio.create_task(self._raw_reader(connection, handler, outgoing, state))
        try:
            await connection.write(bytes(offer.raw_edge_ticket))
            done, _ = await asyncio.wait({reader, stop}, return_when=asyncio.FIRST_COMPLETED)
            reason = reader.result() if reader in done else "the edge was shut down"
        except RawConnectionError as exc:
            reason = f"raw edge connection failed: {exc}"
        finally:
            with self._lock:
                self._outgoing = None
                self._raw_stop = None
                if self._closing:
                    self._call_ended.set()
            for task in (reader, writer):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, RawConnectionError):
                    await task
            await connection.close()
        return state["attached"], state["peer_closed"], reason

    async def _raw_reader(
        self,
        connection: RawConnection,
        handler: TransportHandler,
        outgoing: _LoopQueue,
        state: dict[str, bool],
    ) -> str:
        while True:
            try:
                raw = await connection.read()
            except RawConnectionError as exc:
                return f"raw edge connection failed: {exc}"
            if raw is grpc.aio.EOF:
                return "the switch ended the raw edge"
            if isinstance(raw, PlacedMessage):  # a chunk whose payload is in the session's buffer already
                handler.on_message(placed_chunk(raw))
                continue
            assert isinstance(raw, bytes | memoryview)
            refused = parse_error_record(raw)
            if refused is not None:
                code, details = refused
                if code in _FATAL and not state["attached"]:
                    raise _Fatal(f"switch refused edge {self.edge!r}: {code}: {details}")
                if code in _FATAL:
                    raise _Fatal(f"switch ended edge {self.edge!r}: {code}: {details}")
                return f"switch ended the raw edge: {code}: {details}"
            message = _received(raw)
            kind = message.WhichOneof("body")
            if kind == "ready":
                assert isinstance(message, relay_pb2.EdgeMessage)
                state["attached"] = True
                with self._lock:
                    self.link_framing = message.ready.link_framing >= LINK_FRAMING_VERSION
                    if not self._closing:
                        self._outgoing = outgoing  # type: ignore[assignment]
                handler.on_ready(message.ready)
                continue
            handler.on_message(message)
            state["peer_closed"] = state["peer_closed"] or kind == "close"

    async def _raw_writer(self, connection: RawConnection, items: asyncio.Queue[object]) -> None:
        while True:
            item = await items.get()
            if item is _END:
                if self._closing:
                    self._close_sent.set()  # written: the I/O thread sends in order, the switch reads it
                return
            assert isinstance(item, relay_pb2.EdgeMessage | bytes)
            await connection.write(_serialize(item))

    def shutdown(self) -> None:
        super().shutdown()
        with self._lock:
            stop = self._raw_stop
        if stop is not None:
            with contextlib.suppress(RuntimeError):
                stop()


__all__ = ["RAW_EDGE_UNIX_ENV", "RAW_RETRY_S", "RawEdgeTransport", "RawEdgeUnavailable", "client_context"]
