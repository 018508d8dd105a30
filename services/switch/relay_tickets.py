"""IssueEdgeTicket: the open of an edge authenticated on the internal port, redeemed on the edge socket.

The caller was authenticated by the same interceptors as OpenEdge (trainer certificate, token of this
cluster, a job token only for its job) and the open gets the same checks an OpenEdge runs before its
route exists (``RelayServicer.check_open``), each refusal audited as a refused ``edge.open``. The
ticket (``edge_tickets.py``) then carries the result to the switch's edge socket (``edge_socket.py``),
where the route is attached (and checked again) as on any open.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NoReturn

import grpc

from nebula_common.auth.interceptor import caller
from nebula_common.auth.peer_roles import peer_certificate
from nebula_common.auth.verifier import Principal
from nebula_common.proto.nebula.v1 import relay_pb2
from services.switch.edge_stream import EdgeStream
from services.switch.edge_tickets import EdgeTickets
from services.switch.link import PeerLink


class _UnaryCall:
    """The ``EdgeStream`` the open's checks abort on, for a unary call (they never read or write)."""

    transport = "records"

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self.context = context

    async def read(self) -> object:
        raise AssertionError("an open's checks never read")

    async def write(self, data: bytes) -> None:
        raise AssertionError("an open's checks never write")

    async def abort(self, code: grpc.StatusCode, message: str) -> NoReturn:
        await self.context.abort(code, message)
        raise AssertionError("unreachable: the call was aborted")

    def cancelled(self) -> bool:
        return self.context.cancelled()


class EdgeTicketService:
    """The Relay's IssueEdgeTicket (see the module doc); part of ``RelayServicer``."""

    #: The tickets the edge socket redeems; None when this switch serves no edge socket.
    tickets: EdgeTickets | None

    if TYPE_CHECKING:  # the open's checks, from RelayServicer

        async def _refuse_other_job(
            self, stream: EdgeStream, principal: Principal, open_: relay_pb2.EdgeOpen
        ) -> None: ...

        async def check_open(
            self, stream: EdgeStream, account: str, open_: relay_pb2.EdgeOpen
        ) -> PeerLink: ...

    async def IssueEdgeTicket(
        self, request: relay_pb2.EdgeTicketRequest, context: grpc.aio.ServicerContext
    ) -> relay_pb2.EdgeTicket:
        """A one-time ticket for ``request.open`` (``relay.proto``); refused as its OpenEdge would be."""
        if self.tickets is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                "this switch serves no edge socket (NEBULA_SWITCH_EDGE_SOCKET is empty): "
                "open edges on OpenEdge",
            )
        assert self.tickets is not None
        principal = caller().principal
        stream = _UnaryCall(context)
        await self._refuse_other_job(stream, principal, request.open)
        await self.check_open(stream, principal.username, request.open)
        certified = peer_certificate(context)  # verified by the role interceptor; None in plaintext
        ticket = self.tickets.issue(
            principal.username,
            request.open,
            credential="job" if principal.job_id else "account",
            issued_at=principal.issued_at,
            serial=certified[1] if certified is not None else 0,
            expires_at=principal.expires_at,
        )
        return relay_pb2.EdgeTicket(ticket=ticket, expires_in_ms=int(self.tickets.ttl_s * 1000))


__all__ = ["EdgeTicketService"]
