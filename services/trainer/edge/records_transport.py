"""The edge as records on a connection to the switch's edge socket, from a stage process.

Why: a stage's edge through gRPC crosses two gRPC hops (stage to its trainer's proxy, proxy to the
switch), each copying every byte into and out of Python at both ends. Here the stage's trainer hands
it a socket already connected to the switch's edge socket and ticketed (``socket_request.py``), and
the edge's items travel on it as records: the same serialized ``EdgeMessage`` items and framed chunks
an OpenEdge stream carries (``nebula_common/rpc/edge_records.py``), plain on a Unix socket or sealed on
a TCP one (``record_io.py``).

Reconnects, epochs, refusals and the close are the base's (``reconnecting.py``), as for the gRPC
carrier; the switch's refusals arrive as its final status record, the trainer's as its answer to the
request for a connection. There is no other carrier to fall back to: a missing or refusing edge socket
is retried, naming why.

Threads: this transport's own thread asks for connections and reads records (into a buffer of the
message's size, handed on as a view: framed chunks are not copied here); a writer thread drains the
session's queue (plain: ``sendmsg`` of each record's header and bytes, no join, no copy).
"""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
from collections.abc import Callable
from typing import Unpack

from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.rpc.edge_records import parse_status_record
from nebula_common.rpc.framing import FramedChunk
from nebula_common.rpc.sealed_records import RecordSealing
from services.trainer.edge.reconnecting import (
    END,
    FATAL_CODES,
    EdgeFailed,
    EdgeOptions,
    ReconnectingEdgeTransport,
    received,
    serialize,
)
from services.trainer.edge.record_io import Ended, PlainRecords, SealedRecords, TooLarge, records
from services.trainer.edge.socket_request import EdgeSocketRefused
from services.trainer.edge.transport import TransportHandler

Connector = Callable[[relay_pb2.EdgeOpen], tuple[socket.socket, RecordSealing | None]]
"""(the open) -> a socket connected to the switch's edge socket, its ticket presented, and the sealed
records' state on a TCP one (EdgeSocketRefused if none)."""


class RecordsEdgeTransport(ReconnectingEdgeTransport):
    """An edge ``Transport`` on connections to the switch's edge socket (see the module doc)."""

    def __init__(
        self,
        connect: Connector,
        job_id: str,
        edge: str,
        **options: Unpack[EdgeOptions],
    ) -> None:
        super().__init__(job_id, edge, **options)
        self.connect = connect
        self._sock: socket.socket | None = None
        #: Payload bytes read straight into their frame's buffer (plain records: no copy in this process).
        self.placed_bytes = 0

    def _carry(self, opened: relay_pb2.EdgeOpen, handler: TransportHandler) -> tuple[bool, bool, str]:
        try:
            sock, sealing = self.connect(opened)
        except EdgeSocketRefused as exc:
            if exc.code in FATAL_CODES:
                raise EdgeFailed(
                    f"switch refused edge {self.edge!r}: {exc.code.name}: {exc.message}"
                ) from None
            return False, False, f"no edge connection: {exc.code.name}: {exc.message}"
        self.opens += 1
        return self._run_connection(sock, sealing, handler)

    def _run_connection(
        self, sock: socket.socket, sealing: RecordSealing | None, handler: TransportHandler
    ) -> tuple[bool, bool, str]:
        """Run one connection until it ends: (it was ready, the peer closed, how it ended)."""
        sock.settimeout(None)
        outgoing: queue.Queue[object] = queue.Queue()
        with self._lock:
            self._sock = sock
        if self._stopping.is_set():
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        channel = records(sock, sealing, getattr(handler, "place_chunk", None))
        writer = threading.Thread(
            target=self._write, args=(channel, outgoing), name=f"edge-{self.edge}-writer", daemon=True
        )
        writer.start()
        ready = peer_closed = False
        reason = "the switch ended the edge"
        try:
            while True:
                try:
                    raw = channel.read()
                except TooLarge as exc:
                    raise EdgeFailed(str(exc)) from None
                except OSError as exc:
                    reason = f"edge connection failed: {exc}"
                    break
                except Ended as exc:
                    reason = str(exc)
                    break
                if raw is None:
                    break
                status = None if isinstance(raw, FramedChunk) else parse_status_record(raw)
                if status is not None:
                    code, message = status
                    if code in FATAL_CODES and not peer_closed and not self._stopping.is_set():
                        raise EdgeFailed(f"switch refused edge {self.edge!r}: {code.name}: {message}")
                    reason = f"switch ended the edge: {code.name}: {message}"
                    break
                message = received(raw, self.edge)
                now_ready, closed = self._deliver(message, outgoing, handler)
                if isinstance(message, FramedChunk) and message.placed is not None:
                    self.placed_bytes += len(message.data)
                    message.data.release()  # the frame's buffer: no view of it outlives its delivery
                ready, peer_closed = ready or now_ready, peer_closed or closed
        finally:
            with self._lock:
                self._sock = None
            self._ended()
            outgoing.put(END)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            writer.join(5)
            sock.close()
        return ready, peer_closed, reason

    def _write(self, channel: PlainRecords | SealedRecords, outgoing: queue.Queue[object]) -> None:
        while True:
            item = outgoing.get()
            if item is END:
                return
            assert isinstance(item, relay_pb2.EdgeMessage | bytes)
            try:
                channel.send(serialize(item))
            except OSError:
                return  # the reader sees the connection's end and reports it
            if self._closing and isinstance(item, relay_pb2.EdgeMessage) and item.HasField("close"):
                self._close_sent.set()

    def shutdown(self) -> None:
        self._stopping.set()
        with self._lock:
            self._closing = True
            sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


__all__ = ["Connector", "RecordsEdgeTransport"]
