"""Pumping one open edge both ways: the trainer's stream into its route, the route back to the trainer.

The trainer's stream is read eagerly into the route's bounded buffer toward the peer
(``Router.accept_local``), paced only by the account's item rate, and the route's buffer from the peer
is written to the trainer by a task of its own, so no stream ever waits on the link or on another.

A framed payload chunk (link framing, ``nebula_common/rpc/framing.py``) is kept as the bytes it came
in, checked only in its header (job, edge and epoch must be this stream's, else INVALID_ARGUMENT and an
``edge.refused`` audit record) and forwarded to the link as is; the chunks from the peer go out to the
trainer unchanged too. A protocol error tells the peer at once (an error close), unlike a vanished
trainer, whose route is left orphaned for the router's orphan timeout.

The servicer runs one :class:`EdgePump` per attached stream; the outcomes name how a stream ended,
for the servicer's ``edge.close`` record and for what the peer is told.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import NoReturn

import grpc

from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.rpc.framing import FramedChunk, FramingError, is_framed, parse_chunk
from services.switch.edge_stream import EdgeStream, TrainerVanished
from services.switch.link import PeerLink
from services.switch.relay_messages import parse_edge_message, serialize_edge_message
from services.switch.route_state import Attachment, Route
from services.switch.routing import Router
from services.switch.throttle import AccountThrottle

EOF_GRACE_S = 1.0
"""How long an edge whose trainer half-closed without a close waits to learn whether it was cancelled."""

# How a trainer stream ended, for the audit record and for what the peer is told.
FINISHED = "finished"  # the trainer closed its side and the peer's close was delivered
SUPERSEDED = "superseded"  # a reconnect of the same account took the route over
CLOSED_BY_SWITCH = "closed_by_switch"  # a bound was exceeded; both sides were told why
RESTARTED = "restarted"  # the route moved to a higher epoch: the trainer was sent EdgeRestart
FAILED = "failed"  # crash, cancel, or a broken stream: the route is orphaned (the peer waits)


class EdgePump:
    """One trainer stream attached to its route, pumped both ways until it ends (see the module doc).

    One object per edge holds what both directions work on, so the reader, the writer and the
    refusals share it instead of each being handed the stream, the router, the route and the
    attachment again. ``received`` is the servicer's: the close this stream was sent, if any, which
    its ``edge.close`` record and its penalties read even when the pump never ran.
    """

    def __init__(
        self,
        stream: EdgeStream,
        router: Router,
        route: Route,
        attachment: Attachment,
        account: str,
        received: list[relay_pb2.EdgeClose],
        *,
        throttle: AccountThrottle | None,
        link: PeerLink,
    ) -> None:
        self.stream = stream
        self.router = router
        self.route = route
        self.attachment = attachment
        self.account = account
        self.received = received
        self.throttle = throttle
        #: The audit records of the switch (every link writes the same audit log).
        self.link = link

    async def run(self) -> str:
        """Pump until the edge ends; returns how its stream ended (one of the outcomes above)."""
        route, attachment = self.route, self.attachment
        reader = asyncio.create_task(self._upstream())
        writer = asyncio.create_task(self._downstream())
        try:
            done, _ = await asyncio.wait({reader, writer}, return_when=asyncio.FIRST_COMPLETED)
            if reader in done:
                reader.result()  # an abort (invalid item) propagates
            if attachment.superseded:
                return SUPERSEDED
            if attachment.restart is not None and writer in done:
                return RESTARTED
            if route.closed_reason is not None and writer in done:
                return CLOSED_BY_SWITCH
            # The local side is done sending (or the peer closed): wait for the other half.
            await asyncio.wait({reader, writer}, return_when=asyncio.ALL_COMPLETED)
            reader.result()
            if attachment.superseded:
                return SUPERSEDED
            if attachment.restart is not None:
                return RESTARTED
            return CLOSED_BY_SWITCH if route.closed_reason is not None else FINISHED
        finally:
            for task in (reader, writer):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _upstream(self) -> None:
        """Read the trainer's items eagerly into the route's buffer toward the peer (never the link).

        Eagerly up to the account's item rate: an account above it is not read for a while.
        """
        stream, router, route, attachment = self.stream, self.router, self.route, self.attachment
        while not attachment.superseded and route.closed_reason is None:
            raw = await stream.read()
            if raw is grpc.aio.EOF:
                # A cancelled call (a crash, a kill) also reads as EOF here, before gRPC cancels this
                # handler; give the cancellation a moment to arrive so the peer hears of an error.
                await asyncio.sleep(EOF_GRACE_S)
                if stream.cancelled():
                    raise TrainerVanished("the trainer's stream was cancelled")
                attachment.local_closed = True
                router.accept_local(
                    route, attachment, relay_pb2.EdgeMessage(close=relay_pb2.EdgeClose(reason="closed"))
                )
                return
            if self.throttle is not None:
                await self.throttle.pace(self.account, route.key[0])
            if isinstance(raw, bytes | memoryview) and is_framed(raw):
                chunk = await self._framed(raw)
                router.accept_local(route, attachment, chunk)
                continue
            message = parse_edge_message(raw)
            if message is None:
                await self._refuse_item("bytes that are not an edge message")
                return
            kind = message.WhichOneof("body")
            if kind in ("frame", "signal", "ack"):
                router.accept_local(route, attachment, message)
            elif kind == "close":
                attachment.local_closed = True
                router.accept_local(route, attachment, message)
                return
            else:
                # A protocol error, not a vanished trainer: the peer is told at once.
                await self._fail(
                    f"the other cluster's stage sent an unexpected {kind!r} item",
                    f"unexpected {kind!r} on an open edge",
                )

    async def _framed(self, raw: bytes | memoryview) -> FramedChunk:
        """The framed chunk in ``raw``, if its header is valid and names this stream's job, edge and epoch.

        Anything else is refused like a protocol error (the peer is told, INVALID_ARGUMENT): a
        chunk tagged for another route would otherwise be forwarded into that route as if it
        were its own.
        """
        try:
            chunk = parse_chunk(raw)
        except FramingError as exc:
            await self._refuse_item(f"an invalid framed chunk ({exc})")
        job_id, edge = self.route.key
        if (chunk.job_id, chunk.edge, chunk.epoch) != (job_id, edge, self.attachment.epoch):
            await self._refuse_item(
                f"a framed chunk tagged job {chunk.job_id!r} edge {chunk.edge!r} epoch {chunk.epoch} on "
                f"the stream of job {job_id!r} edge {edge!r} epoch {self.attachment.epoch}",
            )
        return chunk

    async def _refuse_item(self, what: str) -> NoReturn:
        """Audit ``edge.refused``, send the peer an error close and abort the call (INVALID_ARGUMENT)."""
        job_id, edge = self.route.key
        self.link.record(
            "edge.refused",
            outcome="refused",
            account=self.account,
            job_id=job_id,
            edge=edge,
            reason=f"sent {what}",
        )
        await self._fail(
            f"the other cluster's stage sent {what}; its switch closed the edge",
            f"refused: the stream sent {what}",
        )

    async def _fail(self, peer_reason: str, detail: str) -> NoReturn:
        """End the edge for a protocol error of the trainer: the peer gets an error close (``peer_reason``)
        at once, and the trainer's call is aborted (INVALID_ARGUMENT, ``detail``)."""
        self.attachment.local_closed = True
        self.router.accept_local(
            self.route,
            self.attachment,
            relay_pb2.EdgeMessage(close=relay_pb2.EdgeClose(reason=peer_reason, error=True)),
        )
        await self.stream.abort(grpc.StatusCode.INVALID_ARGUMENT, detail)

    async def _downstream(self) -> None:
        """Write the route's items to the trainer until a close (kept in ``received``) or a restart
        went out, or the stream was superseded. Framed chunks go out as the bytes they came as."""
        stream, router, route, attachment = self.stream, self.router, self.route, self.attachment
        while not attachment.superseded:
            if attachment.restart is not None:
                await stream.write(serialize_edge_message(relay_pb2.EdgeMessage(restart=attachment.restart)))
                return
            message = router.pop_inbound(route, attachment)
            if message is None:
                attachment.wake.clear()
                message = router.pop_inbound(route, attachment)
                if message is None:
                    await attachment.wake.wait()
                    continue
            if isinstance(message, FramedChunk):
                await stream.write(message.raw)
                continue
            await stream.write(serialize_edge_message(message))
            if message.WhichOneof("body") == "close":
                self.received.append(message.close)
                return
