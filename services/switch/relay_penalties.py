"""Account penalties at the edge: refusing new edges of an account in its backoff, and striking it.

A route closed for a bound the account's sender exceeded (here, or at the peer, which names the bound
in its close) is a strike (``throttle.Penalties``), which puts the account in a backoff during which
its new edges are refused with RESOURCE_EXHAUSTED, naming the backoff. Jobs the account already
has running here keep their edges (re-attaches, reconnects, the receiving end), except the penalized
job itself, so one flooding job cannot take its account's other work down with it.
"""

from __future__ import annotations

import grpc

from nebula_common.proto.nebula.v1 import relay_pb2
from services.switch.edge_stream import EdgeStream
from services.switch.relay_refusals import OpenRefusals
from services.switch.routing import Router
from services.switch.throttle import Penalties, closed_bound, is_offence


class EdgePenalties(OpenRefusals):
    """The backoff refusal and the strikes of an account (see the module doc); part of ``RelayServicer``."""

    cluster_id: str
    penalties: Penalties | None
    # Edge streams open per (account, job): a job already running here is never refused by its
    # account's penalty backoff (only edges of jobs new to this switch are).
    _running: dict[tuple[str, str], int]

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
