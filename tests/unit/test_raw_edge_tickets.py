"""Raw edge tickets (services/switch/raw_edge.py): once, in time, by the certificate that obtained them;
and the Unix socket edge's socket: private to the switch's user."""

from __future__ import annotations

import asyncio
import ssl
import stat
from pathlib import Path

import grpc
import pytest

from nebula_common.pki import Identity
from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.rpc.raw_edge import error_record, parse_error_record
from services.switch.raw_edge import EdgeTickets, RawEdgeListener, TicketError

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


def test_the_unix_socket_is_private_and_a_shared_directory_is_refused(tmp_path: Path) -> None:
    """``start_unix``: a 0600 socket in a 0700 directory it creates; an open directory is an error."""

    async def body() -> None:
        listener = RawEdgeListener(None, "a", ssl.create_default_context, audit=None)  # type: ignore[arg-type]
        path = tmp_path / "run" / "edge.sock"
        assert await listener.start_unix(str(path)) == str(path)
        try:
            assert stat.S_ISSOCK(path.lstat().st_mode)
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        finally:
            await listener.stop()
        assert not path.exists()

        shared = tmp_path / "shared"
        shared.mkdir(mode=0o755)
        shared.chmod(0o755)
        with pytest.raises(ValueError, match="open to others"):
            await RawEdgeListener(None, "a", ssl.create_default_context, audit=None).start_unix(  # type: ignore[arg-type]
                str(shared / "edge.sock")
            )
        blocked = tmp_path / "blocked"
        blocked.mkdir(mode=0o700)
        (blocked / "edge.sock").write_text("not a socket")
        with pytest.raises(ValueError, match="not a socket"):
            await RawEdgeListener(None, "a", ssl.create_default_context, audit=None).start_unix(  # type: ignore[arg-type]
                str(blocked / "edge.sock")
            )

    asyncio.run(body())
