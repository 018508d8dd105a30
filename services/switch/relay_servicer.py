"""Relay servicer: the internal port where local trainers open their job edges.

The switch never decodes tensors; it checks who is asking (a token from this
cluster's auth service), binds the stream to (job, edge), and moves items: the
trainer's stream is read eagerly into the route's bounded buffer toward the peer
(``Router.accept_local``), and the route's buffer from the peer is written to the
trainer by a task of its own, so no stream ever waits on the link or on another.

Epochs and vanished trainers (relay.proto's delivery contract): a stream opened below its route's
epoch gets EdgeReady and at once EdgeRestart; a stream whose route moved to a higher epoch gets
EdgeRestart as its last message; a stream that vanishes (no close) leaves its route orphaned for the
router's orphan timeout instead of failing the peer at once.

Raw bytes (link framing, ``nebula_common/rpc/framing.py``). OpenEdge is served with identity
serializers (``add_relay_to_server``): small items are parsed here as ``EdgeMessage``; a framed payload
chunk is kept as the bytes it came in, checked only in its header (job, edge and epoch must be this
stream's, else INVALID_ARGUMENT and an ``edge.refused`` audit record) and forwarded to the link as is;
the chunks from the peer go out to the trainer unchanged too. An open whose ``link_framing`` is not
``LINK_FRAMING_VERSION`` is refused (INVALID_ARGUMENT, audited as a refused ``edge.open``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import NoReturn

import grpc

from nebula_common.auth.interceptor import caller
from nebula_common.auth.peer_roles import peer_certificate
from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.rpc.framing import (
    LINK_FRAMING_VERSION,
    FramedChunk,
    FramingError,
    framing_refusal,
    is_framed,
    parse_chunk,
)
from services.switch.bandwidth import BandwidthProbeError
from services.switch.certs import CertificateManager
from services.switch.edge_stream import EdgeStream, GrpcEdgeStream, TrainerVanished
from services.switch.link import PeerLink
from services.switch.metrics import EDGES_OPEN, JOB_SERIES
from services.switch.peers import PeerLinks, PeerNotNamedError, UnknownPeerError
from services.switch.route_state import (
    Attachment,
    Route,
    RouteInUseError,
    RouteLimitError,
    StaleEpochError,
)
from services.switch.routing import Router
from services.switch.throttle import AccountThrottle, Penalties, closed_bound, is_offence

log = logging.getLogger(__name__)
EOF_GRACE_S = 1.0
"""How long an edge whose trainer half-closed without a close waits to learn whether it was cancelled."""

EDGE_DRAIN_S = 10.0
"""How long a stopping switch waits, after its servers stopped, for open edges to record their end."""

# How a trainer stream ended, for the audit record and for what the peer is told.
FINISHED = "finished"  # the trainer closed its side and the peer's close was delivered
SUPERSEDED = "superseded"  # a reconnect of the same account took the route over
CLOSED_BY_SWITCH = "closed_by_switch"  # a bound was exceeded; both sides were told why
RESTARTED = "restarted"  # the route moved to a higher epoch: the trainer was sent EdgeRestart
FAILED = "failed"  # crash, cancel, or a broken stream: the route is orphaned (the peer waits)


def _serialize(message: relay_pb2.EdgeMessage) -> bytes:
    return message.SerializeToString()


def _parse(raw: object) -> relay_pb2.EdgeMessage | None:
    """An EdgeMessage from raw request bytes; None if not one."""
    if not isinstance(raw, bytes | memoryview):
        return None
    try:
        return relay_pb2.EdgeMessage.FromString(raw)
    except Exception:  # protobuf's DecodeError
        return None


class RelayServicer:
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

    def stopping(self) -> None:
        """The switch is stopping: an edge that ends from now on was cut by the stop (its record says so)."""
        self._stopping = True

    async def drain_edges(self, timeout: float = EDGE_DRAIN_S) -> None:
        """Wait until every edge has recorded its end; run after the servers stopped, before the audit closes.

        A gRPC server's ``stop(grace)`` returns once the core cancelled the calls still open, before their
        handlers ran their ``finally`` (the ``edge.close`` record). An edge still running after ``timeout``
        (it cannot be, short of a bug) is cancelled here and waited for as long again.
        """
        self._stopping = True
        pending = {task for task in self._edges if not task.done()}
        if not pending:
            return
        _, pending = await asyncio.wait(pending, timeout=timeout)
        if pending:
            log.warning("edges still open %.0f s after the stop: cancelling them", timeout)
            for task in pending:
                task.cancel()
            await asyncio.wait(pending, timeout=timeout)

    async def OpenEdge(
        self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext
    ) -> None:
        principal = caller().principal  # verified by the token interceptor: this cluster's accounts only
        stream = GrpcEdgeStream(context)
        raw = await stream.read()
        first = None if raw is grpc.aio.EOF else _parse(raw)
        if first is None or first.WhichOneof("body") != "open":
            await stream.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "the first message on an edge must be 'open'"
            )
        if principal.job_id and first.open.job_id != principal.job_id:
            # A job token (auth.proto IssueJobToken) acts for its one job: a stage's token cannot
            # open, take over or close another job's edges, even one of its own account.
            await self._refuse_open(
                stream,
                grpc.StatusCode.PERMISSION_DENIED,
                f"this job token is for job {principal.job_id}, not {first.open.job_id}",
                account=principal.username,
                job_id=first.open.job_id,
                edge=first.open.edge,
                token_job=principal.job_id,
            )
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
        key = (job_id, edge)
        link = await self._link_for(stream, account, job_id, edge, open_.peer_cluster)
        router = link.router
        await self._refuse_if_backing_off(stream, router, account, job_id, edge)
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
            await stream.write(_serialize(relay_pb2.EdgeMessage(ready=self._ready(link, exc.route_epoch))))
            await stream.write(
                _serialize(
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
            await stream.write(_serialize(relay_pb2.EdgeMessage(ready=self._ready(link, route.epoch))))
            outcome = await self._pump(stream, router, route, attachment, account, received)
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

    async def _refuse_open(
        self, stream: EdgeStream, code: grpc.StatusCode, reason: str, *, audit: bool = True, **fields: object
    ) -> NoReturn:
        """Record the refused open (``edge.open``, outcome refused, unless ``audit`` is False), then abort."""
        if audit:
            self.link.record("edge.open", outcome="refused", reason=reason, **fields)
        await stream.abort(code, reason)

    async def _link_for(
        self, stream: EdgeStream, account: str, job_id: str, edge: str, peer_cluster: str
    ) -> PeerLink:
        """The link of the peer the edge names (its only peer when empty); a clear refusal otherwise."""
        try:
            return self.links.for_edge(peer_cluster)
        except (UnknownPeerError, PeerNotNamedError) as exc:
            code = (
                grpc.StatusCode.NOT_FOUND
                if isinstance(exc, UnknownPeerError)
                else grpc.StatusCode.FAILED_PRECONDITION
            )
            await self._refuse_open(
                stream, code, str(exc), account=account, job_id=job_id, edge=edge, peer=peer_cluster
            )

    async def _refuse_if_backing_off(
        self, stream: EdgeStream, router: Router, account: str, job_id: str, edge: str
    ) -> None:
        """Refuse a new edge of an account in its penalty backoff (RESOURCE_EXHAUSTED, naming it).

        Not refused: edges of a job the account already has running here, and edges whose route
        already exists for this account or was created by the peer (a re-attach, a reconnect, or the
        receiving end of a live job), unless that job is the one penalized: its routes are the ones
        a flooder would re-attach to (a stream cancelled after its close leaves its route orphaned
        here). The refusal is audited once per backoff, counted every time.
        """
        if self.penalties is None or self.penalties.job_penalized(account, job_id):
            await self._refuse(stream, account, job_id, edge)
            return
        if (account, job_id) in self._running:
            return
        existing = router.get((job_id, edge))
        if existing is not None and existing.owner in ("", account):
            return
        await self._refuse(stream, account, job_id, edge)

    async def _refuse(self, stream: EdgeStream, account: str, job_id: str, edge: str) -> None:
        """Abort the call if ``account`` is backing off (nothing happens otherwise)."""
        if self.penalties is None:
            return
        refusal = self.penalties.refusal(account)
        if refusal is None:
            return
        await self._refuse_open(
            stream,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            refusal.message(self.cluster_id),
            audit=refusal.first,
            account=account,
            job_id=job_id,
            edge=edge,
            penalty="backoff",
            backoff_s=refusal.backoff_s,
            strikes=refusal.strikes,
            bound=refusal.bound,
            offending_job=refusal.job_id,
        )

    def _penalize(
        self,
        account: str,
        job_id: str,
        edge: str,
        closed_here: str | None,
        received: list[relay_pb2.EdgeClose],
    ) -> None:
        """A route closed for a bound our sender exceeded (here, or at the peer) is a strike."""
        if self.penalties is None:
            return
        if closed_here is not None:
            bound, by_peer = closed_bound(closed_here), False
        elif received and received[0].error:
            bound, by_peer = closed_bound(received[0].reason), True
        else:
            return
        if not is_offence(bound, by_peer):
            return
        assert bound is not None
        state = self.penalties.offend(account, job_id, bound)
        self.link.record(
            "account.penalty",
            outcome="refused",
            account=account,
            job_id=job_id,
            edge=edge,
            bound=bound,
            closed_by="peer" if by_peer else "this switch",
            strikes=state.strikes,
            backoff_s=state.backoff_s,
            rate_factor=self.penalties.rules.rate_factor,
        )

    async def _pump(
        self,
        stream: EdgeStream,
        router: Router,
        route: Route,
        attachment: Attachment,
        account: str,
        received: list[relay_pb2.EdgeClose],
    ) -> str:
        reader = asyncio.create_task(self._upstream(stream, router, route, attachment, account))
        writer = asyncio.create_task(self._downstream(stream, router, route, attachment, received))
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

    async def _upstream(
        self,
        stream: EdgeStream,
        router: Router,
        route: Route,
        attachment: Attachment,
        account: str,
    ) -> None:
        """Read the trainer's items eagerly into the route's buffer toward the peer (never the link).

        Eagerly up to the account's item rate: an account above it is not read for a while.
        """
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
                await self.throttle.pace(account, route.key[0])
            if isinstance(raw, bytes | memoryview) and is_framed(raw):
                chunk = await self._framed(stream, router, route, attachment, account, raw)
                router.accept_local(route, attachment, chunk)
                continue
            message = _parse(raw)
            if message is None:
                await self._refuse_item(
                    stream, router, route, attachment, account, "bytes that are not an edge message"
                )
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
                attachment.local_closed = True
                router.accept_local(
                    route,
                    attachment,
                    relay_pb2.EdgeMessage(
                        close=relay_pb2.EdgeClose(
                            reason=f"the other cluster's stage sent an unexpected {kind!r} item", error=True
                        )
                    ),
                )
                await stream.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected {kind!r} on an open edge")

    async def _framed(
        self,
        stream: EdgeStream,
        router: Router,
        route: Route,
        attachment: Attachment,
        account: str,
        raw: bytes | memoryview,
    ) -> FramedChunk:
        """The framed chunk in ``raw``, if its header is valid and names this stream's job, edge and epoch.

        Anything else is refused like a protocol error (the peer is told, INVALID_ARGUMENT): a
        chunk tagged for another route would otherwise be forwarded into that route as if it
        were its own.
        """
        try:
            chunk = parse_chunk(raw)
        except FramingError as exc:
            await self._refuse_item(
                stream, router, route, attachment, account, f"an invalid framed chunk ({exc})"
            )
        job_id, edge = route.key
        if (chunk.job_id, chunk.edge, chunk.epoch) != (job_id, edge, attachment.epoch):
            await self._refuse_item(
                stream,
                router,
                route,
                attachment,
                account,
                f"a framed chunk tagged job {chunk.job_id!r} edge {chunk.edge!r} epoch {chunk.epoch} on "
                f"the stream of job {job_id!r} edge {edge!r} epoch {attachment.epoch}",
            )
        return chunk

    async def _refuse_item(
        self,
        stream: EdgeStream,
        router: Router,
        route: Route,
        attachment: Attachment,
        account: str,
        what: str,
    ) -> NoReturn:
        """Audit ``edge.refused``, send the peer an error close and abort the call (INVALID_ARGUMENT)."""
        job_id, edge = route.key
        self.link.record(
            "edge.refused",
            outcome="refused",
            account=account,
            job_id=job_id,
            edge=edge,
            reason=f"sent {what}",
        )
        attachment.local_closed = True
        router.accept_local(
            route,
            attachment,
            relay_pb2.EdgeMessage(
                close=relay_pb2.EdgeClose(
                    reason=f"the other cluster's stage sent {what}; its switch closed the edge", error=True
                )
            ),
        )
        await stream.abort(grpc.StatusCode.INVALID_ARGUMENT, f"refused: the stream sent {what}")

    async def _downstream(
        self,
        stream: EdgeStream,
        router: Router,
        route: Route,
        attachment: Attachment,
        received: list[relay_pb2.EdgeClose],
    ) -> None:
        """Write the route's items to the trainer until a close (kept in ``received``) or a restart
        went out, or the stream was superseded. Framed chunks go out as the bytes they came as."""
        while not attachment.superseded:
            if attachment.restart is not None:
                await stream.write(_serialize(relay_pb2.EdgeMessage(restart=attachment.restart)))
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
            await stream.write(_serialize(message))
            if message.WhichOneof("body") == "close":
                received.append(message.close)
                return

    def _ready(self, link: PeerLink, epoch: int) -> relay_pb2.EdgeReady:
        return relay_pb2.EdgeReady(
            peer_cluster=link.expected_peer.cluster_id,
            max_window_bytes=link.router.max_window_bytes,
            link_up=link.router.link_up,
            epoch=epoch,
            link_framing=LINK_FRAMING_VERSION,
        )

    async def GetLinkStatus(
        self, request: relay_pb2.GetLinkStatusRequest, context: grpc.aio.ServicerContext
    ) -> relay_pb2.LinkStatus:
        link = self.links.first
        if request.peer_cluster:
            found = self.links.get(request.peer_cluster)
            if found is None:
                await context.abort(
                    grpc.StatusCode.NOT_FOUND,
                    f"switch {self.cluster_id!r} has no link to cluster {request.peer_cluster!r} "
                    f"(its peers: {', '.join(self.links.peer_ids)})",
                )
            assert found is not None
            link = found
        if request.measure_bandwidth:
            try:
                await link.measure_bandwidth()
            except BandwidthProbeError as exc:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"switch {self.cluster_id!r} could not measure the bandwidth toward "
                    f"{link.expected_peer.cluster_id!r}: {exc}",
                )
        measured = link.bandwidth.last
        state = link.state
        return relay_pb2.LinkStatus(
            cluster_id=self.cluster_id,
            expected_peer=link.expected_peer.cluster_id,
            connected=state.connected,
            verified_peer_identity=state.peer_identity,
            link_role=state.role,
            sent=link.sent.to_proto(),
            received=link.received.to_proto(),
            peer_certificate_serial=f"{state.peer_serial:x}" if state.peer_serial else "",
            link_sessions=state.sessions,
            peers=list(self.links.peer_ids),
            rtt_seconds=link.rtt.srtt or 0.0,
            min_rtt_seconds=link.rtt.min_rtt or 0.0,
            bandwidth_bps=measured.bits_per_second if measured is not None else 0.0,
            bandwidth_age_seconds=time.monotonic() - measured.at if measured is not None else 0.0,
            **self._own_certificate(),
        )

    async def RenewEdges(
        self, request: relay_pb2.RenewEdgesRequest, context: grpc.aio.ServicerContext
    ) -> relay_pb2.RenewEdgesReply:
        """Move the caller's open edges of one job onto the token this call presents (``relay.proto``).

        Only edges the caller's account owns are touched, and a job token only for its own job, so a
        renewal can extend nothing but what that token could have opened itself.
        """
        principal = caller().principal
        if not request.job_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "job_id is required")
        if principal.job_id and principal.job_id != request.job_id:
            await context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"this job token is for job {principal.job_id}, not {request.job_id}",
            )
        renewed = sum(
            link.router.renew(request.job_id, principal.username, principal.issued_at, principal.expires_at)
            for link in self.links
        )
        return relay_pb2.RenewEdgesReply(renewed=renewed, expires_at=int(principal.expires_at))

    def _own_certificate(self) -> dict[str, object]:
        if self.certificates is None:
            return {}
        material = self.certificates.current
        return {
            "certificate_serial": f"{material.serial:x}",
            "certificate_not_after": int(material.cert.not_valid_after_utc.timestamp()),
            "certificate_generation": material.generation,
        }


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
        },
    )
    server.add_generic_rpc_handlers((handler,))
