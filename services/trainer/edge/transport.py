"""The interface between an edge session and how its messages travel.

Two implementations: ``grpc_transport`` (the Relay.OpenEdge stream to this cluster's switch) and
``memory`` (an in-memory pair with fault controls, for tests). The session holds no transport
state of its own, so either can carry the same delivery contract.
"""

from __future__ import annotations

from typing import Protocol

from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.rpc.framing import FramedChunk


class Transport(Protocol):
    """How an edge session's messages travel (gRPC to the local switch, or an in-memory pair).

    A transport whose ``frames_chunks`` attribute is true takes payload chunks framed (``bytes``);
    without it, the session sends them as ``TensorFrame`` messages.
    """

    def start(self, handler: TransportHandler) -> None: ...

    def send(self, message: relay_pb2.EdgeMessage | bytes) -> None:
        """Best effort and non-blocking: a message sent while the link is down may be lost.

        ``bytes`` are a framed chunk, handed over only when ``frames_chunks`` is true."""

    def close(self, reason: str, error: bool) -> None:
        """Send EdgeClose and stop reconnecting; keep delivering until the peer closes."""

    def wait_close_sent(self, timeout: float) -> None:
        """Wait (bounded) until the EdgeClose is handed to the wire (or cannot be)."""

    def shutdown(self) -> None:
        """Tear down now (idempotent)."""


class TransportHandler(Protocol):
    """What a transport calls, from its own thread, as messages and link events arrive."""

    def on_ready(self, ready: relay_pb2.EdgeReady) -> None: ...

    def on_message(self, message: relay_pb2.EdgeMessage | FramedChunk) -> None: ...

    def on_down(self, reason: str) -> None: ...

    def on_failed(self, reason: str) -> None: ...


__all__ = ["Transport", "TransportHandler"]
