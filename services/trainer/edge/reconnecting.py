"""What both carriers of a stage's edge share: the reconnect loop, the switch's messages, the close.

Why one base: the edge's delivery contract (``session.py``) must not depend on how its bytes travel, so
the gRPC stream (``grpc_transport.py``) and the records on the switch's edge socket
(``records_transport.py``) differ only in how one connection is opened and carried
(``ReconnectingEdgeTransport._carry``). Everything around a connection is here, once:

- every open carries the transport's epoch (``EdgeOpen.epoch``), a reopen after a drop says
  ``reconnect``, and the switch's ``EdgeRestart`` goes to the session like any other message (the
  session then shuts the transport down);
- the switch's ready resumes the session unless it announces another ``link_framing``, which fails the
  edge at once (that switch could not read the chunks), as does a message that does not parse (a
  protocol violation a reconnect would only receive again; the failure names what was wrong);
- refusals a retry cannot fix (``FATAL_CODES``: authentication, permission, a bad request) fail the
  edge at once; anything else is an outage: ``on_down`` (the session stops sending and its outage clock
  runs), then a new connection with capped exponential backoff, ``EdgeOpen(reconnect=True)``;
- after the peer's close the connection is kept: our own close still goes out on it, and the switch
  ends it once it has both (a clean close in its audit log).
"""

from __future__ import annotations

import abc
import logging
import queue
import threading
import time
from typing import ClassVar, TypedDict

import grpc
from google.protobuf.message import DecodeError

from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.rpc.framing import (
    LINK_FRAMING_VERSION,
    FramedChunk,
    FramingError,
    framing_refusal,
    is_framed,
    parse_chunk,
)
from services.trainer.edge.transport import TransportHandler

log = logging.getLogger(__name__)
END = object()
"""Queued after the last item a connection's writer sends."""
FATAL_CODES = frozenset(
    {
        grpc.StatusCode.UNAUTHENTICATED,
        grpc.StatusCode.PERMISSION_DENIED,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.FAILED_PRECONDITION,
        grpc.StatusCode.NOT_FOUND,
        grpc.StatusCode.UNIMPLEMENTED,
    }
)
"""Refusals a reconnect cannot fix: the edge fails with the switch's message."""


class EdgeOptions(TypedDict, total=False):
    """How a transport reconnects and what its opens say, the same for every carrier."""

    backoff_initial_s: float
    backoff_max_s: float
    epoch: int
    peer_cluster: str


class EdgeFailed(Exception):
    """The edge fails for good (a refusal or a protocol break a reconnect would meet again)."""


def serialize(item: relay_pb2.EdgeMessage | bytes) -> bytes:
    """Framed chunks are already wire bytes; everything else is a message serialized here."""
    return item if isinstance(item, bytes) else item.SerializeToString()


def received(raw: bytes | memoryview | FramedChunk, edge: str) -> relay_pb2.EdgeMessage | FramedChunk:
    """What the switch sent on ``edge``; EdgeFailed naming what it was if it does not parse (a chunk
    its reader placed is parsed already)."""
    if isinstance(raw, FramedChunk):
        return raw
    if is_framed(raw):
        try:
            return parse_chunk(raw)
        except FramingError as exc:
            raise EdgeFailed(
                f"the switch sent edge {edge!r} a framed chunk that does not parse: {exc}"
            ) from None
    try:
        return relay_pb2.EdgeMessage.FromString(raw)
    except DecodeError as exc:
        raise EdgeFailed(
            f"the switch sent edge {edge!r} a message that is not an EdgeMessage: {exc}"
        ) from None


class ReconnectingEdgeTransport(abc.ABC):
    """An edge ``Transport`` that reconnects (see the module doc); subclasses carry one connection."""

    frames_chunks = True
    """The session hands payload chunks over framed (bytes), sent as they are."""
    END_AFTER_CLOSE: ClassVar[bool] = False
    """Whether the writer ends after our EdgeClose (a gRPC half-close) or runs until the switch ends."""

    def __init__(
        self,
        job_id: str,
        edge: str,
        *,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 5.0,
        epoch: int = 0,
        peer_cluster: str = "",
    ) -> None:
        self.job_id = job_id
        self.edge = edge
        self.epoch = epoch
        self.peer_cluster = peer_cluster
        """The cluster at the other end of the edge (EdgeOpen.peer_cluster; empty: the switch's only peer)."""
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.opens = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._closing = False
        self._close_sent = threading.Event()
        self._call_ended = threading.Event()  # the live connection ended after we closed
        self._outgoing: queue.Queue[object] | None = None  # the live connection's queue, once ready
        self._thread: threading.Thread | None = None

    # ----- what a carrier implements ------------------------------------------------------
    @abc.abstractmethod
    def _carry(self, opened: relay_pb2.EdgeOpen, handler: TransportHandler) -> tuple[bool, bool, str]:
        """Open one connection with ``opened`` and run it until it ends: (it was ready, the peer closed,
        how it ended). Messages go through ``_deliver``; ``_ended`` when it is over; EdgeFailed for good."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Tear down now (idempotent)."""

    # ----- shared -------------------------------------------------------------------------
    def start(self, handler: TransportHandler) -> None:
        self._thread = threading.Thread(
            target=self._run, args=(handler,), name=f"edge-{self.edge}", daemon=True
        )
        self._thread.start()

    def edge_open(self, reconnect: bool) -> relay_pb2.EdgeOpen:
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
                ready, peer_closed, reason = self._carry(self.edge_open(ever_ready), handler)
            except EdgeFailed as exc:
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

    def _deliver(
        self,
        message: relay_pb2.EdgeMessage | FramedChunk,
        outgoing: queue.Queue[object],
        handler: TransportHandler,
    ) -> tuple[bool, bool]:
        """Hand one message of the switch to the session: (it was the ready, it was the peer's close)."""
        kind = message.WhichOneof("body")
        if kind == "ready":
            assert isinstance(message, relay_pb2.EdgeMessage)
            refusal = framing_refusal("EdgeReady.link_framing", message.ready.link_framing)
            if refusal is not None:  # no reconnect can fix that switch
                raise EdgeFailed(f"refused the switch's ready for edge {self.edge!r}: {refusal}")
            with self._lock:
                if not self._closing:
                    self._outgoing = outgoing
            handler.on_ready(message.ready)
            return True, False
        handler.on_message(message)
        return False, kind == "close"

    def _ended(self) -> None:
        """The live connection is over: nothing more is sent on it."""
        with self._lock:
            self._outgoing = None
            if self._closing:
                self._call_ended.set()

    def send(self, message: relay_pb2.EdgeMessage | bytes) -> None:
        with self._lock:
            if self._outgoing is None:
                return
            self._outgoing.put(message)

    def close(self, reason: str, error: bool) -> None:
        """Send EdgeClose and reconnect no more; the connection keeps delivering until the peer closes."""
        with self._lock:
            self._closing = True
            if self._outgoing is not None:
                self._outgoing.put(
                    relay_pb2.EdgeMessage(close=relay_pb2.EdgeClose(reason=reason, error=error))
                )
                if self.END_AFTER_CLOSE:
                    self._outgoing.put(END)
                self._outgoing = None
            else:  # no live connection: nothing to wait for
                self._close_sent.set()
                self._call_ended.set()

    def wait_close_sent(self, timeout: float) -> None:
        """Wait (bounded) until our EdgeClose is written and the switch has ended the connection.

        Cutting right after writing could reach the switch before it reads the close: the switch would
        then take the connection for a vanished trainer and keep its route orphaned (the peer learns
        nothing until the orphan timeout) instead of passing our close and its reason on at once.
        """
        deadline = time.monotonic() + timeout
        if self._close_sent.wait(timeout):
            self._call_ended.wait(max(0.0, deadline - time.monotonic()))


__all__ = [
    "END",
    "FATAL_CODES",
    "EdgeFailed",
    "EdgeOptions",
    "ReconnectingEdgeTransport",
    "received",
    "serialize",
]
