"""One-time tickets that open an edge as records on the switch's edge socket (``edge_socket.py``).

Why tickets: the edge socket is a Unix socket with no TLS and no gRPC metadata, so nothing on it can
prove who is asking. The proof happens before, on the internal port (``Relay/IssueEdgeTicket``:
mutual TLS, the trainer's role, the token, the open's checks); the ticket carries its result to the
socket. It is a 32-byte random secret, valid once and for ``TICKET_TTL_S``: whoever presents it first
gets exactly the open it was issued for, with the account, credential, token times and certificate
serial of the call that obtained it (so the route ends when that token or certificate is revoked or
expires, as an OpenEdge stream's does).
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from nebula_common.proto.nebula.v1 import relay_pb2

TICKET_TTL_S = 30.0
"""How long a ticket may wait for its connection."""
TICKET_BYTES = 32
MAX_TICKETS = 4096
"""Outstanding tickets at most; issuing beyond it drops the oldest (which then fails as unknown)."""


class TicketError(Exception):
    """A ticket that may not open an edge; the text is what the audit record and the trainer get."""


@dataclass(frozen=True)
class Ticket:
    """What a redeemed ticket opens, and who proved the right to open it."""

    account: str
    open: relay_pb2.EdgeOpen
    credential: str
    """``job`` (a job token of the open's job) or ``account``."""
    issued_at: float
    """``iat`` of the token the ticket was obtained with (the route ends if it is revoked)."""
    serial: int
    """Serial of the caller's certificate (the route ends if it is revoked)."""
    expires_at: float
    """``exp`` of that token (the route ends when it passes unrenewed)."""
    valid_until: float
    """Monotonic time after which the ticket is refused."""


class EdgeTickets:
    """The switch's outstanding tickets: issued after a checked IssueEdgeTicket, redeemed once."""

    def __init__(self, ttl_s: float = TICKET_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self._clock = clock
        self._tickets: OrderedDict[bytes, Ticket] = OrderedDict()

    def issue(
        self,
        account: str,
        open_: relay_pb2.EdgeOpen,
        *,
        credential: str,
        issued_at: float,
        serial: int,
        expires_at: float,
    ) -> bytes:
        """A new ticket for ``open_`` (expired ones are dropped first, then the oldest over the bound)."""
        now = self._clock()
        while self._tickets:
            oldest = next(iter(self._tickets.values()))
            if oldest.valid_until > now and len(self._tickets) < MAX_TICKETS:
                break
            self._tickets.popitem(last=False)
        key = secrets.token_bytes(TICKET_BYTES)
        held = relay_pb2.EdgeOpen()
        held.CopyFrom(open_)
        self._tickets[key] = Ticket(
            account, held, credential, issued_at, serial, expires_at, now + self.ttl_s
        )
        return key

    def redeem(self, key: bytes | memoryview) -> Ticket:
        """The ticket's grant; TicketError if unknown, already used or expired. Gone after this call."""
        presented = bytes(key)
        if len(presented) != TICKET_BYTES:
            raise TicketError(
                f"the first record must be a {TICKET_BYTES}-byte edge ticket, not {len(presented)} bytes"
            )
        ticket = self._tickets.pop(presented, None)
        if ticket is None:
            raise TicketError("unknown or already used edge ticket")
        if ticket.valid_until <= self._clock():
            raise TicketError(f"edge ticket expired (valid {self.ttl_s:g} s)")
        return ticket

    def __len__(self) -> int:
        return len(self._tickets)


__all__ = ["MAX_TICKETS", "TICKET_BYTES", "TICKET_TTL_S", "EdgeTickets", "Ticket", "TicketError"]
