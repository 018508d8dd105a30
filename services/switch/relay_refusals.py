"""Refusing an edge open: the audited refusal every check of OpenEdge ends in, and finding the edge's link.

A refused open is one ``edge.open`` audit record (outcome refused, with the reason and what the open
named) followed by the abort the trainer sees, so the audit log and the trainer's error always agree.
The checks themselves stay with the open (``relay_servicer.py``) and the penalty backoff
(``relay_penalties.py``); this is what they share, plus the one check that needs the switch's peers:
an edge names the peer cluster it goes to (or none, on a switch with only one peer).
"""

from __future__ import annotations

from typing import NoReturn

import grpc

from services.switch.edge_stream import EdgeStream
from services.switch.link import PeerLink
from services.switch.peers import PeerLinks, PeerNotNamedError, UnknownPeerError


class OpenRefusals:
    """The refusals of an edge open (see the module doc); part of ``RelayServicer``."""

    links: PeerLinks
    #: The audit records of the switch (every link writes the same audit log).
    link: PeerLink

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
