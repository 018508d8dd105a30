"""The trainer's side of an edge as the switch sees it, whatever carries it.

``RelayServicer.serve_edge`` runs on an ``EdgeStream``, today the gRPC ``OpenEdge`` call
(``GrpcEdgeStream``): every check, the throttle, credits and the audit records are written against
this protocol, not against gRPC, so another carrier of the same items needs only its own stream.
"""

from __future__ import annotations

from typing import NoReturn, Protocol

import grpc


class TrainerVanished(Exception):
    """The trainer's call was cancelled (a crash, a kill): not an orderly end of its side."""


class EdgeStream(Protocol):
    """What the body of OpenEdge needs from a trainer's stream, whatever carries it.

    ``read`` returns the next item's bytes or ``grpc.aio.EOF``; ``write`` sends one item's bytes;
    ``abort`` ends the stream with a status and never returns; ``cancelled`` is True once the
    trainer's side vanished (a cancelled call, a dropped connection) rather than closed.
    """

    transport: str
    """What carries it (``grpc``), named in the edge's audit records."""

    async def read(self) -> object: ...

    async def write(self, data: bytes) -> None: ...

    async def abort(self, code: grpc.StatusCode, message: str) -> NoReturn: ...

    def cancelled(self) -> bool: ...


class GrpcEdgeStream:
    """An ``EdgeStream`` over the gRPC OpenEdge call."""

    transport = "grpc"

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self.context = context

    async def read(self) -> object:
        return await self.context.read()

    async def write(self, data: bytes) -> None:
        # A chunk that came over a raw transport is a view of its receive buffer: gRPC wants bytes.
        await self.context.write(data if isinstance(data, bytes) else bytes(data))

    async def abort(self, code: grpc.StatusCode, message: str) -> NoReturn:
        await self.context.abort(code, message)
        raise AssertionError("unreachable: the call was aborted")

    def cancelled(self) -> bool:
        return self.context.cancelled() or self.context.done()


__all__ = ["EdgeStream", "GrpcEdgeStream", "TrainerVanished"]
