"""The gRPC carrier of an edge: a sync Relay.OpenEdge stream to this cluster's switch.

Where it runs: stages whose trainer has no switch edge socket (Kubernetes, cluster ranks) reach the
switch through their trainer's stage proxy on this stream. Training code is synchronous torch, so this
is a sync gRPC stream: outgoing messages go through an unbounded queue (the session's credit bounds it)
that gRPC drains on its own thread, and the transport's thread hands incoming messages to the session.
Reconnects, epochs, refusals and the close are the base's (``reconnecting.py``).

Link framing (``nebula_common/rpc/framing.py``): the stream is called with raw-bytes serializers. The
open announces ``link_framing`` and the session hands framed chunks (bytes) to ``send``, which go out
untouched; framed chunks from the peer reach the session as ``FramedChunk`` views (no protobuf parse of
the payload).
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from typing import Unpack

import grpc

from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.rpc import bearer_metadata
from nebula_common.rpc.internal_tls import internal_channel
from services.trainer.edge.reconnecting import (
    END,
    FATAL_CODES,
    EdgeFailed,
    EdgeOptions,
    ReconnectingEdgeTransport,
    received,
    serialize,
)
from services.trainer.edge.transport import TransportHandler

OPEN_EDGE = "/nebula.v1.Relay/OpenEdge"


class GrpcEdgeTransport(ReconnectingEdgeTransport):
    """An edge ``Transport`` on Relay.OpenEdge streams (see the module doc)."""

    END_AFTER_CLOSE = True  # our EdgeClose ends the request stream: a half-close

    def __init__(
        self,
        switch_address: str,
        token: str | Callable[[], str],
        job_id: str,
        edge: str,
        **options: Unpack[EdgeOptions],
    ) -> None:
        super().__init__(job_id, edge, **options)
        self.switch_address = switch_address
        self.token = token
        self._call: grpc.Call | None = None
        self._channel: grpc.Channel | None = None

    def _requests(self, outgoing: queue.Queue[object]) -> Iterator[relay_pb2.EdgeMessage | bytes]:
        while True:
            item = outgoing.get()
            if item is END:
                if self._closing:
                    self._close_sent.set()  # gRPC asked for more after the close: it is written
                return
            assert isinstance(item, relay_pb2.EdgeMessage | bytes)
            yield item

    def _carry(self, opened: relay_pb2.EdgeOpen, handler: TransportHandler) -> tuple[bool, bool, str]:
        outgoing: queue.Queue[object] = queue.Queue()
        outgoing.put(relay_pb2.EdgeMessage(open=opened))
        channel = internal_channel(self.switch_address, service="switch")
        open_edge = channel.stream_stream(OPEN_EDGE, request_serializer=serialize)  # raw replies
        token = self.token() if callable(self.token) else self.token  # a job token renewed under us
        call = open_edge(self._requests(outgoing), metadata=bearer_metadata(token))
        with self._lock:
            self._call, self._channel = call, channel
        if self._stopping.is_set():  # shut down while we were opening
            call.cancel()
        self.opens += 1
        ready = peer_closed = False
        reason = "the switch ended the edge stream"
        try:
            for raw in call:
                now_ready, closed = self._deliver(received(raw, self.edge), outgoing, handler)
                ready, peer_closed = ready or now_ready, peer_closed or closed
        except grpc.RpcError as exc:
            code = exc.code()
            if not self._stopping.is_set() and not peer_closed:
                if code in FATAL_CODES:
                    raise EdgeFailed(
                        f"switch refused edge {self.edge!r}: {code.name}: {exc.details()}"
                    ) from None
                reason = f"switch stream failed: {code.name}: {exc.details()}"
        finally:
            self._ended()
            outgoing.put(END)
            call.cancel()
            channel.close()
        return ready, peer_closed, reason

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
