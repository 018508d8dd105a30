"""RenewEdges: moving a caller's open edges onto a fresh token, so long jobs outlive their tokens.

Every route remembers the token its trainer opened it with and ends when that token expires unrenewed
(``Router.close_revoked``); a trainer renews by presenting its new token here. The checks are those
of an open: only the caller's own account's edges, and with a job token only that job's.
"""

from __future__ import annotations

import grpc

from nebula_common.auth.interceptor import caller
from nebula_common.proto.nebula.v1 import relay_pb2
from services.switch.peers import PeerLinks


class EdgeRenewals:
    """The Relay's RenewEdges (see the module doc); part of ``RelayServicer``."""

    links: PeerLinks

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
