"""Raw edge tickets (services/switch/raw_edge.py): once, in time, by the certificate that obtained them."""

from __future__ import annotations

import grpc
import pytest

from nebula_common.pki import Identity
from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.rpc.raw_edge import error_record, parse_error_record
from services.switch.raw_edge import EdgeTickets, TicketError

TRAINER = Identity("a", "trainer")
OPEN = relay_pb2.EdgeOpen(job_id="job", edge="up->down", epoch=2, raw_edge=1)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_ticket_opens_its_edge_once_for_its_certificate() -> None:
    tickets = EdgeTickets(ttl_s=10.0, clock=Clock())
    key = tickets.issue(TRAINER, 7, "alice", OPEN)
    assert len(key) == 32
    ticket = tickets.redeem(key, TRAINER, 7)
    assert (ticket.account, ticket.open) == ("alice", OPEN)
    with pytest.raises(TicketError, match="already used"):
        tickets.redeem(key, TRAINER, 7)


def test_expired_foreign_and_unknown_tickets_are_refused() -> None:
    clock = Clock()
    tickets = EdgeTickets(ttl_s=10.0, clock=clock)
    late = tickets.issue(TRAINER, 7, "alice", OPEN)
    clock.now += 10.0
    with pytest.raises(TicketError, match="expired"):
        tickets.redeem(late, TRAINER, 7)
    foreign = tickets.issue(TRAINER, 7, "alice", OPEN)
    with pytest.raises(TicketError, match="presented by"):
        tickets.redeem(foreign, TRAINER, 8)  # same identity, another certificate (serial)
    with pytest.raises(TicketError, match="already used"):
        tickets.redeem(foreign, TRAINER, 7)  # a ticket shown to anyone is spent
    with pytest.raises(TicketError, match="unknown"):
        tickets.redeem(b"\0" * 32, TRAINER, 7)


def test_error_records_are_never_items() -> None:
    record = error_record(grpc.StatusCode.PERMISSION_DENIED, "no")
    assert parse_error_record(record) == ("PERMISSION_DENIED", "no")
    assert parse_error_record(memoryview(record)) == ("PERMISSION_DENIED", "no")
    item = relay_pb2.EdgeMessage(ready=relay_pb2.EdgeReady(epoch=1)).SerializeToString()
    assert parse_error_record(item) is None
    with pytest.raises(Exception):  # noqa: B017 - protobuf's DecodeError: field number 0 is invalid
        relay_pb2.EdgeMessage.FromString(record)


def test_a_ticket_on_the_unix_socket_is_checked_for_use_and_time_not_for_a_certificate() -> None:
    clock = Clock()
    tickets = EdgeTickets(ttl_s=10.0, clock=clock)
    key = tickets.issue(TRAINER, 7, "alice", OPEN)
    assert tickets.redeem(key, None, None).account == "alice"  # the uid was checked instead
    with pytest.raises(TicketError, match="already used"):
        tickets.redeem(key, None, None)
    late = tickets.issue(TRAINER, 7, "alice", OPEN)
    clock.now += 10.0
    with pytest.raises(TicketError, match="expired"):
        tickets.redeem(late, None, None)
