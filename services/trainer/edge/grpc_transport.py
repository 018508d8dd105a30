"""The production edge transport: a sync gRPC Relay.OpenEdge stream to this cluster's switch.

Training code is synchronous torch, so this is a sync gRPC stream: outgoing messages
go through an unbounded queue (the session's credit bounds it) that gRPC drains on its
own thread, and a receiver thread hands incoming messages to the session.

When the stream fails (the switch was killed or restarted: UNAVAILABLE, a reset
stream), the transport tells the session (``on_down``: it stops sending and its
outage clock runs) and re-opens with capped exponential backoff, with
``EdgeOpen(reconnect=True)``; the switch's ready resumes the session. Refusals that a
retry cannot fix (authentication, permission, a bad request) fail the edge at once.
Every open carries the transport's epoch (``EdgeOpen.epoch``); a reconnect stays in it,
and the switch's ``EdgeRestart`` goes to the session like any other message (the session
then shuts the transport down).

Link framing (``nebula_common/rpc/framing.py``): the stream is called with raw-bytes serializers. The
open announces ``link_framing`` and the session hands framed chunks (bytes) to ``send``, which go out
untouched; framed chunks from the peer reach the session as ``FramedChunk`` views (no protobuf parse of
the payload). A ready announcing another ``link_framing`` fails the edge at once: that switch could not
read the chunks. So does a message from the switch that does not parse (bytes that are not an
``EdgeMessage``, a framed chunk whose header is corrupt): a protocol violation by the switch, which a
reconnect would only receive again; the failure names what was wrong.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc
from google.protobuf.message import DecodeError

from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.rpc import bearer_metadata
from nebula_common.rpc.framing import (
    LINK_FRAMING_VERSION,
    FramedChunk,
    FramingError,
    framing_refusal,
    is_framed,
    parse_chunk,
)
from nebula_common.rpc.internal_tls import internal_channel
from services.trainer.edge.transport import TransportHandler

log = logging.getLogger(__name__)
_END = object()
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
"""Stream errors a reconnect cannot fix: the edge fails with the switch's message."""
OPEN_EDGE = "/nebula.v1.Relay/OpenEdge"


def _serialize(item: relay_pb2.EdgeMessage | bytes) -> bytes:
    """Framed chunks are already wire bytes; everything else is a message serialized here."""
    return item if isinstance(item, bytes) else item.SerializeToString()


class _Unreadable(Exception):
    """A message from the switch that does not parse; the text says what it was instead."""


def _received(raw: bytes) -> relay_pb2.EdgeMessage | FramedChunk:
    if is_framed(raw):
        try:
            return parse_chunk(raw)
        except FramingError as exc:
            raise _Unreadable(f"a framed chunk that does not parse: {exc}") from None
    try:
        return relay_pb2.EdgeMessage.FromString(raw)
    except DecodeError as exc:
        raise _Unreadable(f"a message that is not an EdgeMessage: {exc}") from None


class GrpcEdgeTransport:
    frames_chunks = True
    """The session hands payload chunks over framed (bytes): every switch reads them."""

    def __init__(
        self,
        switch_address: str,
        token: str | Callable[[], str],
        job_id: str,
        edge: str,
        *,
        backoff_initial_s: float = 0.1,
        backoff_max_s: float = 5.0,
        epoch: int = 0,
        peer_cluster: str = "",
    ) -> None:
        self.epoch = epoch
        self.peer_cluster = peer_cluster
        """The cluster at the other end of the edge (EdgeOpen.peer_cluster; empty: the switch's only peer)."""
        self.switch_address = switch_address
        self.token = token
        self.job_id = job_id
        self.edge = edge
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.opens = 0
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._closing = False
        self._close_sent = threading.Event()
        self._call_ended = threading.Event()  # the live call ended after we closed
        self._outgoing: queue.Queue[object] | None = None  # the live stream's queue, once ready
        self._call: grpc.Call | None = None
        self._channel: grpc.Channel | None = None
        self._thread: threading.Thread | None = None

    def start(self, handler: TransportHandler) -> None:
        self._thread = threading.Thread(
            target=self._run, args=(handler,), name=f"edge-{self.edge}", daemon=True
        )
        self._thread.start()

    def _requests(self, outgoing: queue.Queue[object]) -> Iterator[relay_pb2.EdgeMessage | bytes]:
        while True:
            item = outgoing.get()
            if item is _END:
                if self._closing:
                    self._close_sent.set()  # gRPC asked for more after the close: it is written
                return
            assert isinstance(item, relay_pb2.EdgeMessage | bytes)
            yield item

    def _run(self, handler: TransportHandler) -> None:
        backoff = self.backoff_initial_s
        ever_ready = False
        peer_closed = False
        while not self._stopping.is_set() and not peer_closed:
            outgoing: queue.Queue[object] = queue.Queue()
            outgoing.put(
                relay_pb2.EdgeMessage(
                    open=relay_pb2.EdgeOpen(
                        job_id=self.job_id,
                        edge=self.edge,
                        reconnect=ever_ready,
                        epoch=self.epoch,
                        link_framing=LINK_FRAMING_VERSION,
                        peer_cluster=self.peer_cluster,
                    )
                )
            )
            channel = internal_channel(self.switch_address, service="switch")
            open_edge = channel.stream_stream(OPEN_EDGE, request_serializer=_serialize)  # raw replies
            token = self.token() if callable(self.token) else self.token  # a job token renewed under us
            call = open_edge(self._requests(outgoing), metadata=bearer_metadata(token))
            with self._lock:
                self._call, self._channel = call, channel
            if self._stopping.is_set():  # shut down while we were opening
                call.cancel()
            self.opens += 1
            reason = "the switch ended the edge stream"
            try:
                for raw in call:
                    try:
                        message = _received(raw)
                    except _Unreadable as exc:  # the switch breaks the protocol: a reconnect would not help
                        handler.on_failed(f"the switch sent edge {self.edge!r} {exc}")
                        self._stopping.set()
                        break
                    kind = message.WhichOneof("body")
                    if kind == "ready":
                        assert isinstance(message, relay_pb2.EdgeMessage)
                        refusal = framing_refusal("EdgeReady.link_framing", message.ready.link_framing)
                        if refusal is not None:  # no reconnect can fix that switch
                            handler.on_failed(f"refused the switch's ready for edge {self.edge!r}: {refusal}")
                            self._stopping.set()
                            break
                        ever_ready = True
                        backoff = self.backoff_initial_s
                        with self._lock:
                            if not self._closing:
                                self._outgoing = outgoing
                        handler.on_ready(message.ready)
                        continue
                    handler.on_message(message)
                    # After the peer's close keep the stream: our own close still goes out on it, and
                    # the switch ends the call once it has both (a clean close in its audit log).
                    peer_closed = peer_closed or kind == "close"
            except grpc.RpcError as exc:
                code = exc.code()
                if self._stopping.is_set() or peer_closed:
                    break
                if code in FATAL_CODES:
                    handler.on_failed(f"switch refused edge {self.edge!r}: {code.name}: {exc.details()}")
                    self._stopping.set()
                    break
                reason = f"switch stream failed: {code.name}: {exc.details()}"
            finally:
                with self._lock:
                    self._outgoing = None
                    if self._closing:
                        self._call_ended.set()
                outgoing.put(_END)
                call.cancel()
                channel.close()
            if self._stopping.is_set() or self._closing or peer_closed:
                break
            log.warning(
                "edge stream to the switch lost; reconnecting",
                extra={"fields": {"job_id": self.job_id, "edge": self.edge, "reason": reason}},
            )
            handler.on_down(reason)
            self._stopping.wait(backoff)
            backoff = min(backoff * 2, self.backoff_max_s)

    def send(self, message: relay_pb2.EdgeMessage | bytes) -> None:
        with self._lock:
            if self._outgoing is None:
                return
            self._outgoing.put(message)

    def close(self, reason: str, error: bool) -> None:
        """Send EdgeClose and half-close; the stream keeps delivering until the peer closes."""
        with self._lock:
            self._closing = True
            if self._outgoing is not None:
                self._outgoing.put(
                    relay_pb2.EdgeMessage(close=relay_pb2.EdgeClose(reason=reason, error=error))
                )
                self._outgoing.put(_END)
                self._outgoing = None
            else:  # no live stream: nothing to wait for
                self._close_sent.set()
                self._call_ended.set()

    def wait_close_sent(self, timeout: float) -> None:
        """Wait (bounded) until our EdgeClose is written and the switch has ended the call.

        Cancelling right after writing could reach the switch before it reads the close: the switch
        would then take the stream for a vanished trainer and keep its route orphaned (the peer learns
        nothing until the orphan timeout) instead of passing our close and its reason on at once.
        """
        deadline = time.monotonic() + timeout
        if self._close_sent.wait(timeout):
            self._call_ended.wait(max(0.0, deadline - time.monotonic()))

    def shutdown(self) -> None:
        self._stopping.set()
        with self._lock:
            self._closing = True
            call, channel = self._call, self._channel
        if call is not None:
            call.cancel()
        if channel is not None:
            channel.close()


__all__ = ["FATAL_CODES", "GrpcEdgeTransport"]
