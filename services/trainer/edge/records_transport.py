"""The edge as records on a connection to the switch's edge socket, from a stage process.

Why: a stage's edge through gRPC crosses two gRPC hops (stage to its trainer's proxy, proxy to the
switch), each copying every byte into and out of Python at both ends. Here the stage's trainer hands
it a socket already connected to the switch's edge socket and ticketed (``socket_request.py``), and
the edge's items travel on it as ``4-byte big-endian length + bytes`` records: the same serialized
``EdgeMessage`` items and framed chunks an OpenEdge stream carries (``nebula_common/rpc/edge_records.py``).

Like ``GrpcEdgeTransport``: every open carries the transport's epoch, a reopen after a drop says
``reconnect``, the switch's ready resumes the session, refusals a retry cannot fix (``FATAL_CODES``,
from the switch's final status record or the trainer's answer) fail the edge at once, and anything
else is an outage: ``on_down``, then a new connection asked for with capped exponential backoff.
There is no other carrier to fall back to: a missing or refusing edge socket is retried, naming why.

Threads: this transport's own thread asks for connections and reads records (into a buffer of the
record's size, handed on as a view: framed chunks are not copied here); a writer thread drains the
session's queue with ``sendmsg`` of each record's header and bytes (no join, no copy).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import socket
import threading
import time
from collections.abc import Callable

from nebula_common.bulk_memory import uninitialized_bytearray
from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.rpc.edge_records import MAX_EDGE_RECORD_BYTES, parse_status_record
from nebula_common.rpc.framing import LINK_FRAMING_VERSION, framing_refusal, is_framed
from services.trainer.edge.grpc_transport import FATAL_CODES, _received, _serialize, _Unreadable
from services.trainer.edge.socket_request import EdgeSocketRefused
from services.trainer.edge.transport import TransportHandler

log = logging.getLogger(__name__)
_END = object()
SMALL_RECORD = 64 << 10
"""Records up to this size are read into a reused buffer and copied out; bigger ones get their own."""

Connector = Callable[[relay_pb2.EdgeOpen], socket.socket]
"""(the open) -> a socket connected to the switch's edge socket, its ticket presented (EdgeSocketRefused)."""


class _Ended(Exception):
    """The connection ended; the text says how."""


class _Fatal(Exception):
    """The edge fails for good (a refusal or a protocol break a reconnect would meet again)."""


def _send_record(sock: socket.socket, data: bytes | memoryview) -> None:
    """One record, header and bytes in one ``sendmsg`` where the kernel takes them, never joined."""
    parts = [memoryview(len(data).to_bytes(4, "big")), memoryview(data).cast("B")]
    while parts:
        sent = sock.sendmsg(parts)
        while parts and sent >= len(parts[0]):
            sent -= len(parts[0])
            parts.pop(0)
        if parts and sent:
            parts[0] = parts[0][sent:]


class _Reader:
    """Whole records from a blocking socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._small = bytearray(SMALL_RECORD)
        self._head = bytearray(4)

    def _fill(self, view: memoryview, first: bool) -> bool:
        got = 0
        while got < len(view):
            n = self.sock.recv_into(view[got:])
            if n == 0:
                if first and got == 0:
                    return False
                raise _Ended("the switch's edge socket ended inside a record")
            got += n
        return True

    def read(self) -> bytes | memoryview | None:
        """The next record, or None at a clean end between records."""
        if not self._fill(memoryview(self._head), True):
            return None
        size = int.from_bytes(self._head, "big")
        if size > MAX_EDGE_RECORD_BYTES:
            raise _Fatal(f"the switch sent a {size}-byte record (limit {MAX_EDGE_RECORD_BYTES})")
        if size <= SMALL_RECORD:
            view = memoryview(self._small)[:size]
            self._fill(view, False)
            return bytes(view)
        body = memoryview(uninitialized_bytearray(size))
        self._fill(body, False)
        return body if is_framed(body) else bytes(body)  # a view only where the parser takes one


class RecordsEdgeTransport:
    """An edge ``Transport`` on connections to the switch's edge socket (see the module doc)."""

    frames_chunks = True
    """The session hands payload chunks over framed (bytes), sent as they are."""

    def __init__(
        self,
        connect: Connector,
        job_id: str,
        edge: str,
        *,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 5.0,
        epoch: int = 0,
        peer_cluster: str = "",
    ) -> None:
        self.connect = connect
        self.job_id = job_id
        self.edge = edge
        self.epoch = epoch
        self.peer_cluster = peer_cluster
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.opens = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._closing = False
        self._close_sent = threading.Event()
        self._call_ended = threading.Event()
        self._outgoing: queue.Queue[object] | None = None  # the live connection's queue, once ready
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self, handler: TransportHandler) -> None:
        self._thread = threading.Thread(
            target=self._run, args=(handler,), name=f"edge-{self.edge}", daemon=True
        )
        self._thread.start()

    def _open(self, reconnect: bool) -> relay_pb2.EdgeOpen:
        return relay_pb2.EdgeOpen(
            job_id=self.job_id,
            edge=self.edge,
            reconnect=reconnect,
            epoch=self.epoch,
            link_framing=LINK_FRAMING_VERSION,
            peer_cluster=self.peer_cluster,
        )

    def _run(self, handler: TransportHandler) -> None:
        backoff = self.backoff_initial_s
        ever_ready = False
        peer_closed = False
        while not self._stopping.is_set() and not peer_closed:
            try:
                sock = self.connect(self._open(ever_ready))
            except EdgeSocketRefused as exc:
                if exc.code in FATAL_CODES:
                    handler.on_failed(f"switch refused edge {self.edge!r}: {exc.code.name}: {exc.message}")
                    self._stopping.set()
                    break
                reason = f"no edge connection: {exc.code.name}: {exc.message}"
            else:
                self.opens += 1
                try:
                    ready, peer_closed, reason = self._carry(sock, handler)
                except _Fatal as exc:
                    handler.on_failed(str(exc))
                    self._stopping.set()
                    break
                if ready:
                    ever_ready = True
                    backoff = self.backoff_initial_s
            if self._stopping.is_set() or self._closing or peer_closed:
                break
            log.warning(
                "edge connection to the switch lost; reconnecting",
                extra={"fields": {"job_id": self.job_id, "edge": self.edge, "reason": reason}},
            )
            handler.on_down(reason)
            self._stopping.wait(backoff)
            backoff = min(backoff * 2, self.backoff_max_s)

    def _carry(self, sock: socket.socket, handler: TransportHandler) -> tuple[bool, bool, str]:
        """Run one connection until it ends: (it was ready, the peer closed, how it ended)."""
        sock.settimeout(None)
        outgoing: queue.Queue[object] = queue.Queue()
        with self._lock:
            self._sock = sock
        if self._stopping.is_set():
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        writer = threading.Thread(
            target=self._write, args=(sock, outgoing), name=f"edge-{self.edge}-writer", daemon=True
        )
        writer.start()
        reader = _Reader(sock)
        ready = peer_closed = False
        reason = "the switch ended the edge"
        try:
            while True:
                try:
                    raw = reader.read()
                except OSError as exc:
                    reason = f"edge connection failed: {exc}"
                    break
                except _Ended as exc:
                    reason = str(exc)
                    break
                if raw is None:
                    break
                status = parse_status_record(raw)
                if status is not None:
                    code, message = status
                    if code in FATAL_CODES and not peer_closed and not self._stopping.is_set():
                        raise _Fatal(f"switch refused edge {self.edge!r}: {code.name}: {message}")
                    reason = f"switch ended the edge: {code.name}: {message}"
                    break
                try:
                    message = _received(raw)  # type: ignore[arg-type]
                except _Unreadable as exc:
                    raise _Fatal(f"the switch sent edge {self.edge!r} {exc}") from None
                kind = message.WhichOneof("body")
                if kind == "ready":
                    assert isinstance(message, relay_pb2.EdgeMessage)
                    refusal = framing_refusal("EdgeReady.link_framing", message.ready.link_framing)
                    if refusal is not None:
                        raise _Fatal(f"refused the switch's ready for edge {self.edge!r}: {refusal}")
                    ready = True
                    with self._lock:
                        if not self._closing:
                            self._outgoing = outgoing
                    handler.on_ready(message.ready)
                    continue
                handler.on_message(message)
                # After the peer's close keep the connection: our own close still goes out on it, and
                # the switch ends it once it has both.
                peer_closed = peer_closed or kind == "close"
        finally:
            with self._lock:
                self._outgoing = None
                self._sock = None
                if self._closing:
                    self._call_ended.set()
            outgoing.put(_END)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            writer.join(5)
            sock.close()
        return ready, peer_closed, reason

    def _write(self, sock: socket.socket, outgoing: queue.Queue[object]) -> None:
        while True:
            item = outgoing.get()
            if item is _END:
                return
            assert isinstance(item, relay_pb2.EdgeMessage | bytes)
            try:
                _send_record(sock, _serialize(item))
            except OSError:
                return  # the reader sees the connection's end and reports it
            if self._closing and isinstance(item, relay_pb2.EdgeMessage) and item.HasField("close"):
                self._close_sent.set()

    def send(self, message: relay_pb2.EdgeMessage | bytes) -> None:
        with self._lock:
            if self._outgoing is None:
                return
            self._outgoing.put(message)

    def close(self, reason: str, error: bool) -> None:
        """Queue EdgeClose and reconnect no more; the connection keeps delivering until the switch ends it."""
        with self._lock:
            self._closing = True
            if self._outgoing is not None:
                self._outgoing.put(
                    relay_pb2.EdgeMessage(close=relay_pb2.EdgeClose(reason=reason, error=error))
                )
                self._outgoing = None
            else:  # no live connection: nothing to wait for
                self._close_sent.set()
                self._call_ended.set()

    def wait_close_sent(self, timeout: float) -> None:
        """Wait (bounded) until our EdgeClose is written and the switch has ended the connection."""
        deadline = time.monotonic() + timeout
        if self._close_sent.wait(timeout):
            self._call_ended.wait(max(0.0, deadline - time.monotonic()))

    def shutdown(self) -> None:
        self._stopping.set()
        with self._lock:
            self._closing = True
            sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


__all__ = ["Connector", "RecordsEdgeTransport"]
