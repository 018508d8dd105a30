"""SwitchLink servicer: the WAN port's only RPC, for the peer switch to attach its link."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from nebula_common.pki import peer_identity
from nebula_common.proto.nebula.v1 import link_pb2, link_pb2_grpc
from services.switch.link import HANDSHAKE_TIMEOUT_S, HandshakeError, PeerLink
from services.switch.metrics import AUTH_REFUSALS

log = logging.getLogger(__name__)


class SwitchLinkServicer(link_pb2_grpc.SwitchLinkServicer):
    def __init__(self, link: PeerLink) -> None:
        self.link = link

    async def Link(
        self, request_iterator: AsyncIterator[link_pb2.LinkMessage], context: grpc.aio.ServicerContext
    ) -> None:
        try:
            certified = peer_identity(context)
            self.link.check_identity(certified)
        except PermissionError as exc:
            AUTH_REFUSALS.labels("wan", "identity").inc()
            log.warning("refused WAN link: %s", exc, extra={"fields": {"peer": context.peer()}})
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        try:
            hello = await asyncio.wait_for(context.read(), HANDSHAKE_TIMEOUT_S)
            self.link.check_hello(hello, certified)
        except (HandshakeError, TimeoutError) as exc:
            AUTH_REFUSALS.labels("wan", "handshake").inc()
            log.warning("refused WAN link from %s: %s", certified.uri, exc)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"handshake refused: {exc}")
        await context.write(self.link.hello())
        await self.link.run_session(context.read, context.write, certified, "acceptor")
