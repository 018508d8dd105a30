"""Relay servicer: the internal port where local trainers open their job edges.

The switch never decodes tensors; it checks who is asking (a token from this
cluster's auth service), binds the stream to (job, edge), and moves frames.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import grpc

from nebula_common.auth.interceptor import caller
from nebula_common.proto.nebula.v1 import link_pb2, relay_pb2, relay_pb2_grpc
from services.switch.certs import CertificateManager
from services.switch.link import PeerLink
from services.switch.metrics import EDGES_OPEN
from services.switch.routing import Route, RouteInUseError, Router

LINK_WAIT_S = 60.0
log = logging.getLogger(__name__)


class RelayServicer(relay_pb2_grpc.RelayServicer):
    def __init__(
        self,
        cluster_id: str,
        link: PeerLink,
        router: Router,
        certificates: CertificateManager | None = None,
    ) -> None:
        self.cluster_id = cluster_id
        self.link = link
        self.router = router
        self.certificates = certificates

    async def OpenEdge(
        self, request_iterator: AsyncIterator[relay_pb2.EdgeMessage], context: grpc.aio.ServicerContext
    ) -> None:
        principal = caller().principal  # verified by the token interceptor: this cluster's accounts only
        first = await context.read()
        if first is grpc.aio.EOF or first.WhichOneof("body") != "open":
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "the first message on an edge must be 'open'"
            )
        job_id, edge = first.open.job_id, first.open.edge
        if not job_id or not edge:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "open.job_id and open.edge are required")
        key = (job_id, edge)
        try:
            route = self.router.attach(key, owner=principal.username)
        except RouteInUseError as exc:
            self.link.record(
                "edge.open",
                outcome="refused",
                account=principal.username,
                job_id=job_id,
                edge=edge,
                reason=str(exc),
            )
            await context.abort(grpc.StatusCode.ALREADY_EXISTS, str(exc))
        self.link.record("edge.open", account=principal.username, job_id=job_id, edge=edge)
        EDGES_OPEN.set(self.router.open_routes())
        log.info(
            "edge opened",
            extra={"fields": {"job_id": job_id, "edge": edge, "account": principal.username}},
        )
        finished_cleanly = False
        try:
            if not await self.link.wait_connected(LINK_WAIT_S):
                await context.abort(grpc.StatusCode.UNAVAILABLE, "no WAN link to the peer cluster")
            await context.write(
                relay_pb2.EdgeMessage(
                    ready=relay_pb2.EdgeReady(peer_cluster=self.link.expected_peer.cluster_id)
                )
            )
            await self._pump(context, route)
            finished_cleanly = True
        finally:
            if not finished_cleanly:
                # The trainer vanished (cancelled call, crash): tell the peer so its side stops waiting.
                self.link.send_nowait(
                    link_pb2.LinkMessage(
                        close=link_pb2.RouteClose(
                            job_id=job_id,
                            edge=edge,
                            reason="the other cluster's stage disconnected",
                            error=True,
                        )
                    )
                )
            self.link.ledger.flush_edge(job_id, edge)
            self.link.record(
                "edge.close",
                outcome="ok" if finished_cleanly else "failure",
                account=principal.username,
                job_id=job_id,
                edge=edge,
            )
            self.router.detach(key)
            EDGES_OPEN.set(self.router.open_routes())

    async def _pump(self, context: grpc.aio.ServicerContext, route: Route) -> None:
        job_id, edge = route.key
        downstream = asyncio.create_task(self._downstream(context, route))
        try:
            while True:
                message = await context.read()
                if message is grpc.aio.EOF:
                    await self.link.send(
                        link_pb2.LinkMessage(
                            close=link_pb2.RouteClose(job_id=job_id, edge=edge, reason="closed")
                        )
                    )
                    break
                kind = message.WhichOneof("body")
                if kind == "frame":
                    await self.link.send(
                        link_pb2.LinkMessage(
                            frame=link_pb2.RoutedFrame(job_id=job_id, edge=edge, frame=message.frame)
                        )
                    )
                elif kind == "close":
                    await self.link.send(
                        link_pb2.LinkMessage(
                            close=link_pb2.RouteClose(
                                job_id=job_id,
                                edge=edge,
                                reason=message.close.reason,
                                error=message.close.error,
                            )
                        )
                    )
                    break
                elif kind in ("signal", "ack"):
                    await self.link.send(
                        link_pb2.LinkMessage(
                            routed=link_pb2.RoutedItem(job_id=job_id, edge=edge, item=message)
                        )
                    )
                else:
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT, f"unexpected {kind!r} on an open edge"
                    )
            # The local side is done sending; keep delivering until the peer closes too.
            await downstream
        finally:
            downstream.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await downstream

    async def _downstream(self, context: grpc.aio.ServicerContext, route: Route) -> None:
        while True:
            message = await route.inbound.get()
            await context.write(message)
            if message.WhichOneof("body") == "close":
                return

    async def GetLinkStatus(
        self, request: relay_pb2.GetLinkStatusRequest, context: grpc.aio.ServicerContext
    ) -> relay_pb2.LinkStatus:
        state = self.link.state
        return relay_pb2.LinkStatus(
            cluster_id=self.cluster_id,
            expected_peer=self.link.expected_peer.cluster_id,
            connected=state.connected,
            verified_peer_identity=state.peer_identity,
            link_role=state.role,
            sent=self.link.sent.to_proto(),
            received=self.link.received.to_proto(),
            peer_certificate_serial=f"{state.peer_serial:x}" if state.peer_serial else "",
            link_sessions=state.sessions,
            **self._own_certificate(),
        )

    def _own_certificate(self) -> dict[str, object]:
        if self.certificates is None:
            return {}
        material = self.certificates.current
        return {
            "certificate_serial": f"{material.serial:x}",
            "certificate_not_after": int(material.cert.not_valid_after_utc.timestamp()),
            "certificate_generation": material.generation,
        }
