"""The WAN link to the peer switch: handshake, identity checks, and the frame pumps.

One bidirectional gRPC stream carries every job's frames. The cluster whose id
sorts first dials (through the WAN, via mTLS); the other accepts. Either way
the session is the same code: read LinkMessages, hand frames to the router;
take outgoing messages from one queue and write them. Identity comes from the
peer's verified certificate only: the handshake's claimed cluster id must
match it, or the link is refused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from nebula_common.pki import Identity
from nebula_common.proto.nebula.v1 import link_pb2, link_pb2_grpc, relay_pb2
from services.switch.metrics import LINK_UP, DirectionCounters
from services.switch.routing import Router

PROTOCOL_VERSION = 1
SOFTWARE_VERSION = "nebula/0.1.0"
HANDSHAKE_TIMEOUT_S = 10.0
log = logging.getLogger(__name__)

ReadFn = Callable[[], Awaitable[object]]
WriteFn = Callable[[link_pb2.LinkMessage], Awaitable[None]]


class HandshakeError(Exception):
    """The peer's handshake contradicts its certificate or our protocol."""


@dataclass
class LinkState:
    connected: bool = False
    peer_identity: str = ""
    role: str = ""


class PeerLink:
    """The switch's one link to its peer, surviving reconnects of the underlying stream."""

    def __init__(self, cluster_id: str, peer_cluster_id: str, router: Router) -> None:
        self.cluster_id = cluster_id
        self.expected_peer = Identity(cluster_id=peer_cluster_id, role="switch")
        self.router = router
        self.sent = DirectionCounters("sent")
        self.received = DirectionCounters("received")
        self.state = LinkState()
        self._outbound: asyncio.Queue[link_pb2.LinkMessage] = asyncio.Queue(maxsize=256)
        self._connected = asyncio.Event()
        self._session_lock = asyncio.Lock()
        self._current_session: asyncio.Task[None] | None = None
        self._stopping = False

    # ----- used by the relay servicer -------------------------------------------------
    async def wait_connected(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._connected.wait(), timeout)
        except TimeoutError:
            return False
        return True

    async def send(self, message: link_pb2.LinkMessage) -> None:
        """Queue a message for the peer; waits while the link is saturated (back-pressure)."""
        await self._outbound.put(message)

    def send_nowait(self, message: link_pb2.LinkMessage) -> bool:
        """Best-effort queueing for cleanup paths that must not block; False if the queue is full."""
        try:
            self._outbound.put_nowait(message)
        except asyncio.QueueFull:
            return False
        return True

    # ----- the session, shared by both roles -------------------------------------------
    def hello(self) -> link_pb2.LinkMessage:
        return link_pb2.LinkMessage(
            hello=link_pb2.Handshake(
                protocol_version=PROTOCOL_VERSION,
                cluster_id=self.cluster_id,
                software_version=SOFTWARE_VERSION,
            )
        )

    def check_hello(self, message: object, certified: Identity) -> None:
        """Refuse a peer whose handshake disagrees with its certificate or protocol."""
        if not isinstance(message, link_pb2.LinkMessage) or message.WhichOneof("body") != "hello":
            raise HandshakeError("peer did not start with a handshake")
        hello = message.hello
        if hello.protocol_version != PROTOCOL_VERSION:
            raise HandshakeError(
                f"peer speaks link protocol {hello.protocol_version}, this switch speaks {PROTOCOL_VERSION}"
            )
        if hello.cluster_id != certified.cluster_id:
            raise HandshakeError(
                f"peer claims cluster {hello.cluster_id!r} but its certificate says {certified.cluster_id!r}"
            )

    def check_identity(self, certified: Identity) -> None:
        if certified != self.expected_peer:
            raise PermissionError(
                f"peer certificate names {certified.uri}, but only {self.expected_peer.uri} may connect"
            )

    async def run_session(self, read: ReadFn, write: WriteFn, certified: Identity, role: str) -> None:
        """Pump frames both ways until either side ends; only one session runs at a time.

        A new session supersedes the current one: when a peer reconnects, the old stream is
        usually a dead TCP flow that keepalive has not noticed yet, and waiting for it would
        stall every job for tens of seconds.
        """
        me = asyncio.current_task()
        stale = self._current_session
        if stale is not None and stale is not me and not stale.done():
            stale.cancel()
        self._current_session = me
        async with self._session_lock:
            self.state = LinkState(connected=True, peer_identity=certified.uri, role=role)
            self._connected.set()
            LINK_UP.set(1)
            log.info("WAN link up", extra={"fields": {"peer": certified.uri, "role": role}})
            writer = asyncio.create_task(self._pump_out(write), name="link-writer")
            reader = asyncio.create_task(self._pump_in(read), name="link-reader")
            try:
                done, _ = await asyncio.wait({writer, reader}, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task.exception() is not None:
                        log.warning("WAN link session ended: %r", task.exception())
            finally:
                for task in (writer, reader):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
                if self._current_session is me:
                    self._current_session = None
                self._connected.clear()
                self._purge_outbound()
                self.state = LinkState(connected=False, role=role)
                LINK_UP.set(0)
                log.warning("WAN link down", extra={"fields": {"peer": certified.uri}})
                await self.router.fail_all("WAN link to the peer cluster was lost")

    def _purge_outbound(self) -> None:
        """Drop frames queued for a link that is gone: their edges are failed, and a half-sent
        tensor replayed on the next session would only confuse the peer's reassembly."""
        while not self._outbound.empty():
            self._outbound.get_nowait()

    async def _pump_out(self, write: WriteFn) -> None:
        while True:
            message = await self._outbound.get()
            await write(message)
            self.sent.count(message)

    async def _pump_in(self, read: ReadFn) -> None:
        while True:
            message = await read()
            if message is grpc.aio.EOF:
                return
            if not isinstance(message, link_pb2.LinkMessage):
                raise HandshakeError("unexpected object on the link")
            self.received.count(message)
            kind = message.WhichOneof("body")
            if kind == "frame":
                routed = message.frame
                edge_message = relay_pb2.EdgeMessage(frame=routed.frame)
                await self.router.deliver((routed.job_id, routed.edge), edge_message)
            elif kind == "close":
                close = message.close
                edge_message = relay_pb2.EdgeMessage(
                    close=relay_pb2.EdgeClose(reason=close.reason, error=close.error)
                )
                await self.router.deliver((close.job_id, close.edge), edge_message)
            else:
                raise HandshakeError(f"unexpected {kind!r} message after the handshake")

    # ----- dialer role ----------------------------------------------------------------------
    async def dial_forever(
        self,
        address: str,
        credentials: grpc.ChannelCredentials,
        options: list[tuple[str, object]],
    ) -> None:
        """Keep one link to the peer up, reconnecting with capped exponential backoff."""
        backoff = 0.2
        while not self._stopping:
            try:
                async with grpc.aio.secure_channel(address, credentials, options=options) as channel:
                    stub = link_pb2_grpc.SwitchLinkStub(channel)
                    call = stub.Link()
                    await call.write(self.hello())
                    reply = await asyncio.wait_for(call.read(), HANDSHAKE_TIMEOUT_S)
                    if reply is grpc.aio.EOF:
                        raise HandshakeError("peer closed the link during the handshake")
                    # TLS already verified the server's certificate names the expected peer
                    # (target-name override); the handshake must agree with it.
                    self.check_hello(reply, self.expected_peer)
                    backoff = 0.2
                    await self.run_session(call.read, call.write, self.expected_peer, "dialer")
                    call.cancel()
            except asyncio.CancelledError:
                raise
            except (grpc.aio.AioRpcError, HandshakeError, TimeoutError, OSError) as exc:
                detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                log.warning("cannot link to peer at %s: %s (retry in %.1fs)", address, detail, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    def stop(self) -> None:
        self._stopping = True
