"""Relay servicer: the internal port where local trainers open their job edges.

The switch never decodes tensors; it checks who is asking (a token from this cluster's auth service),
binds the stream to (job, edge), and moves items both ways without any stream waiting on the link or
on another (``relay_edge_pump.py``).

Epochs and vanished trainers (relay.proto's delivery contract): a stream opened below its route's
epoch gets EdgeReady and at once EdgeRestart; a stream whose route moved to a higher epoch gets
EdgeRestart as its last message; a stream that vanishes (no close) leaves its route orphaned for the
router's orphan timeout instead of failing the peer at once.

Raw bytes (link framing, ``nebula_common/rpc/framing.py``). OpenEdge is served with identity
serializers (``add_relay_to_server``): small items are parsed as ``EdgeMessage`` (``relay_messages.py``)
and a framed payload chunk is forwarded as the bytes it came in (``relay_edge_pump.py``). An open whose
``link_framing`` is not ``LINK_FRAMING_VERSION`` is refused (INVALID_ARGUMENT, audited as a refused
``edge.open``).

``RelayServicer`` is made of one part per concern; here are the open of an edge (its checks, the
attach, the ``edge.open`` and ``edge.close`` records) and the wiring of the service:

- ``relay_messages.py``: parsing and serializing edge messages, the ``EdgeReady`` every edge gets;
- ``relay_refusals.py``: the audited refusal of an open, and the link of the peer an edge names;
- ``relay_penalties.py``: the penalty backoff that refuses an account's new edges, and its strikes;
- ``relay_edge_pump.py``: pumping one open edge both ways, and how its stream ended;
- ``relay_drain.py``: waiting, at the switch's stop, for every edge to record its end;
- ``relay_link_status.py``: GetLinkStatus;
- ``relay_renewals.py``: RenewEdges, moving open edges onto a renewed token;
- ``relay_tickets.py``: IssueEdgeTicket, an open checked here and redeemed on the edge socket.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc

from nebula_common.auth.interceptor import caller
from nebula_common.auth.peer_roles import peer_certificate
from nebula_common.auth.verifier import Principal
from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.rpc.framing import framing_refusal
from services.switch.certs import CertificateManager
from services.switch.edge_stream import EdgeStream, GrpcEdgeStream, TrainerVanished
from services.switch.edge_tickets import EdgeTickets
from services.switch.link import PeerLink
from services.switch.metrics import EDGES_OPEN, JOB_SERIES
from services.switch.peers import PeerLinks
from services.switch.relay_drain import EDGE_DRAIN_S, EdgeDrain
from services.switch.relay_edge_pump import (
    CLOSED_BY_SWITCH,
    EOF_GRACE_S,
    FAILED,
    FINISHED,
    RESTARTED,
    SUPERSEDED,
    EdgePump,
)
from services.switch.relay_link_status import LinkStatusService
from services.switch.relay_messages import edge_ready, parse_edge_message, serialize_edge_message
from services.switch.relay_penalties import EdgePenalties
from services.switch.relay_renewals import EdgeRenewals
from services.switch.relay_tickets import EdgeTicketService
from services.switch.route_state import RouteInUseError, RouteLimitError, StaleEpochError
from services.switch.throttle import AccountThrottle, Penalties

__all__ = [
    # The servicer, and what moved to its parts (kept importable here for callers of the one-module servicer).
    "CLOSED_BY_SWITCH",
    "EDGE_DRAIN_S",
    "EOF_GRACE_S",
    "FAILED",
    "FINISHED",
    "RESTARTED",
    "SUPERSEDED",
    "RelayServicer",
    "add_relay_to_server",
]

log = logging.getLogger(__name__)


class RelayServicer(EdgePenalties, EdgeDrain, LinkStatusService, EdgeRenewals, EdgeTicketService):
    """The switch's ``nebula.v1.Relay`` service; its parts are listed in the module doc."""

    def __init__(
        self,
        cluster_id: str,
        links: PeerLinks,
        certificates: CertificateManager | None = None,
        throttle: AccountThrottle | None = None,
    ) -> None:
        self.cluster_id = cluster_id
        self.throttle = throttle
        self.penalties: Penalties | None = throttle.penalties if throttle is not None else None
        # Edge streams open per (account, job): a job already running here is never refused by its
        # account's penalty backoff (only edges of jobs new to this switch are).
        self._running: dict[tuple[str, str], int] = {}
        self.links = links
        #: The audit and penalty records of the switch (every link writes the same audit log).
        self.link = links.first
        self.certificates = certificates
        # The tasks serving an edge (any transport), so a stopping switch can wait for their records.
        self._edges: set[asyncio.Task[object]] = set()
        self._stopping = False
        #: Tickets of the edge socket (``edge_socket.py``), set when this switch serves one.
        self.tickets: EdgeTickets | None = None

    async def OpenEdge(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> None:
        principal = caller().principal  # verified by the token interceptor: this cluster's accounts only
        stream = GrpcEdgeStream(context)
        raw = await stream.read()
        first = None if raw is grpc.aio.EOF else parse_edge_message(raw)
        if first is None or first.WhichOneof("body") != "open":
            await stream.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "the first message on an edge must be 'open'"
            )
        await self._refuse_other_job(stream, principal, first.open)
        certified = peer_certificate(context)  # verified by the role interceptor; None in plaintext
        await self.serve_edge(
            stream,
            principal.username,
            first.open,
            credential="job" if principal.job_id else "account",
            issued_at=principal.issued_at,
            serial=certified[1] if certified is not None else 0,
            expires_at=principal.expires_at,
        )

    async def _refuse_other_job(
        self, stream: EdgeStream, principal: Principal, open_: relay_pb2.EdgeOpen
    ) -> None:
        """A job token (auth.proto IssueJobToken) acts for its one job: a stage's token cannot open,
        take over or close another job's edges, even one of its own account."""
        if principal.job_id and open_.job_id != principal.job_id:
            await self._refuse_open(
                stream,
                grpc.StatusCode.PERMISSION_DENIED,
                f"this job token is for job {principal.job_id}, not {open_.job_id}",
                account=principal.username,
                job_id=open_.job_id,
                edge=open_.edge,
                token_job=principal.job_id,
            )

    async def check_open(self, stream: EdgeStream, account: str, open_: relay_pb2.EdgeOpen) -> PeerLink:
        """The checks of an open that need no route: job and edge named, link framing, the peer's link
        and the account's penalty backoff; each refusal audited and aborted on ``stream``. Run at every
        open and when a ticket for one is issued (``relay_tickets.py``)."""
        job_id, edge = open_.job_id, open_.edge
        if not job_id or not edge:
            await stream.abort(grpc.StatusCode.INVALID_ARGUMENT, "open.job_id and open.edge are required")
        if (refusal := framing_refusal("EdgeOpen.link_framing", open_.link_framing)) is not None:
            await self._refuse_open(
                stream,
                grpc.StatusCode.INVALID_ARGUMENT,
                refusal,
                account=account,
                job_id=job_id,
                edge=edge,
                link_framing=open_.link_framing,
            )
        link = await self._link_for(stream, account, job_id, edge, open_.peer_cluster)
        await self._refuse_if_backing_off(stream, link.router, account, job_id, edge)
        return link

    async def serve_edge(
        self,
        stream: EdgeStream,
        account: str,
        open_: relay_pb2.EdgeOpen,
        *,
        credential: str = "",
        issued_at: float = 0.0,
        serial: int = 0,
        expires_at: float = 0.0,
    ) -> None:
        """The body of an edge after its open, on any transport: checks, attach, then pump both ways.

        ``account`` is the caller the transport authenticated (the token interceptor's principal);
        ``credential`` what it proved it with (``job``: a job token of this edge's job; ``account``),
        named in the audit record when known; ``issued_at`` that token's ``iat`` and ``serial`` the
        caller's certificate, so the route ends when either is revoked (``Router.close_revoked``), and
        ``expires_at`` the token's ``exp``, so it ends when that passes unrenewed (``RenewEdges``).
        """
        task = asyncio.current_task()
        assert task is not None
        self._edges.add(task)
        try:
            await self._serve_edge(stream, account, open_, credential, (issued_at, serial, expires_at))
        finally:
            self._edges.discard(task)

    async def _serve_edge(
        self,
        stream: EdgeStream,
        account: str,
        open_: relay_pb2.EdgeOpen,
        credential: str,
        held: tuple[float, int, float],
    ) -> None:
        issued_at, serial, expires_at = held
        job_id, edge, reconnect = open_.job_id, open_.edge, open_.reconnect
        epoch = open_.epoch
        key = (job_id, edge)
        link = await self.check_open(stream, account, open_)
        router = link.router
        try:
            route, attachment = router.attach(
                key,
                owner=account,
                reconnect=reconnect,
                epoch=epoch,
                issued_at=issued_at,
                serial=serial,
                expires_at=expires_at,
            )
        except StaleEpochError as exc:
            # The route belongs to a newer attempt: this stream is void from the start.
            self.link.record(
                "edge.open",
                outcome="refused",
                account=account,
                job_id=job_id,
                edge=edge,
                epoch=epoch,
                route_epoch=exc.route_epoch,
                reason=exc.reason,
            )
            await stream.write(
                serialize_edge_message(relay_pb2.EdgeMessage(ready=edge_ready(link, exc.route_epoch)))
            )
            await stream.write(
                serialize_edge_message(
                    relay_pb2.EdgeMessage(
                        restart=relay_pb2.EdgeRestart(epoch=exc.route_epoch, reason=exc.reason)
                    )
                )
            )
            return
        except (RouteInUseError, RouteLimitError) as exc:
            code = (
                grpc.StatusCode.RESOURCE_EXHAUSTED
                if isinstance(exc, RouteLimitError)
                else grpc.StatusCode.ALREADY_EXISTS
            )
            await self._refuse_open(stream, code, str(exc), account=account, job_id=job_id, edge=edge)
        self.link.record(
            "edge.open",
            account=account,
            job_id=job_id,
            edge=edge,
            reconnect=reconnect,
            epoch=epoch,
            peer=link.expected_peer.cluster_id,
            **({} if stream.transport == "grpc" else {"transport": stream.transport}),
            **({"credential": credential} if credential else {}),
        )
        running = (account, job_id)
        self._running[running] = self._running.get(running, 0) + 1
        JOB_SERIES.opened(job_id)  # its per-job series stay while an edge of it is open here
        EDGES_OPEN.set(router.open_routes())
        log.info(
            "edge opened",
            extra={
                "fields": {
                    "job_id": job_id,
                    "edge": edge,
                    "account": account,
                    "reconnect": reconnect,
                    "epoch": epoch,
                }
            },
        )
        outcome = FAILED
        received: list[relay_pb2.EdgeClose] = []  # the close this stream was sent, if any
        try:
            # Ready at once, whatever the link's state: a LinkNotice follows when it comes (back) up.
            await stream.write(
                serialize_edge_message(relay_pb2.EdgeMessage(ready=edge_ready(link, route.epoch)))
            )
            pump = EdgePump(
                stream, router, route, attachment, account, received, throttle=self.throttle, link=self.link
            )
            outcome = await pump.run()
        except TrainerVanished:
            outcome = FAILED
        finally:
            JOB_SERIES.closed(job_id)
            if self._running[running] <= 1:
                del self._running[running]
            else:
                self._running[running] -= 1
            # A trainer that vanished (cancelled call, crash) orphans its route: the peer is told only
            # if nobody re-attaches within the orphan timeout (the router's sweeper).
            vanished = outcome == FAILED and not attachment.local_closed
            router.end_stream(route, attachment, None, vanished=vanished)
            if outcome != SUPERSEDED:
                link.ledger.flush_edge(job_id, edge)
            # One record names the account and why the edge ended: a close the switch sent (a bound
            # of this switch, or the peer switch's close of the route, which only names the job).
            why: dict[str, object] = {}
            if route.closed_reason is not None:
                why = {"reason": route.closed_reason, "closed_by": "this switch"}
            elif received and received[0].error:
                why = {"reason": received[0].reason, "closed_by": "peer"}
            elif outcome == FAILED and self._stopping:
                why = {"reason": "the switch stopped", "closed_by": "this switch"}
            self.link.record(
                "edge.close",
                outcome="ok" if outcome in (FINISHED, SUPERSEDED, RESTARTED) else "failure",
                account=account,
                job_id=job_id,
                edge=edge,
                ended=outcome,
                **why,
                orphaned=vanished,
                epoch=epoch,
            )
            self._penalize(account, job_id, edge, route.closed_reason, received)
            EDGES_OPEN.set(router.open_routes())


def add_relay_to_server(servicer: RelayServicer, server: grpc.aio.Server) -> None:
    """Serve ``nebula.v1.Relay``: OpenEdge with raw-bytes serializers (items are parsed, or forwarded
    as framed bytes, by the servicer), GetLinkStatus with the generated protobuf ones."""
    handler = grpc.method_handlers_generic_handler(
        "nebula.v1.Relay",
        {
            "OpenEdge": grpc.stream_stream_rpc_method_handler(servicer.OpenEdge),
            "GetLinkStatus": grpc.unary_unary_rpc_method_handler(
                servicer.GetLinkStatus,
                request_deserializer=relay_pb2.GetLinkStatusRequest.FromString,
                response_serializer=relay_pb2.LinkStatus.SerializeToString,
            ),
            "RenewEdges": grpc.unary_unary_rpc_method_handler(
                servicer.RenewEdges,
                request_deserializer=relay_pb2.RenewEdgesRequest.FromString,
                response_serializer=relay_pb2.RenewEdgesReply.SerializeToString,
            ),
            "IssueEdgeTicket": grpc.unary_unary_rpc_method_handler(
                servicer.IssueEdgeTicket,
                request_deserializer=relay_pb2.EdgeTicketRequest.FromString,
                response_serializer=relay_pb2.EdgeTicket.SerializeToString,
            ),
        },
    )
    server.add_generic_rpc_handlers((handler,))
