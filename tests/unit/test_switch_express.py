"""The express connection's order (services/switch/express.py) and the scheduler's share of it.

A route's items must reach the receiver in the order they were written, though some crossed on the
express connection and some on the striping lanes, and each kind of connection may run ahead of the
other; items of different routes must not wait for each other. A peer that names items it never
sends must end the session (bounded waits), not hold memory forever.
"""

from __future__ import annotations

import asyncio
import random

import pytest

from nebula_common.pki import Identity
from nebula_common.proto.nebula.v1 import link_pb2
from services.switch import route_scheduler
from services.switch.express import EXPRESS_LANE, RouteDependencies
from services.switch.lanes import MAX_WAITING_ITEMS, ExpressQueue, LaneGapError, SessionOrder
from services.switch.link import PeerLink
from services.switch.link_handshake import HandshakeError
from services.switch.pacing import LinkPacer
from services.switch.routing import Router
from tests.unit.test_switch_marks import feed_session
from tests.unit.test_switch_pacing import (
    busy_and_idle_routes,
    framed,
    header,
    many_small_jobs_pass_a_full_cap_by_one_fragment_at_most,
    size_of,
)

Key = tuple[str, str]


class Sender:
    """Writes numbered items of routes on the two kinds of connection, as ``link_pumps._mark`` does."""

    def __init__(self, routes: RouteDependencies | None = None) -> None:
        self.routes = routes or RouteDependencies()
        self.seq = 0
        self.express_no = 0
        self.striping: list[tuple[int, tuple[Key, int], int]] = []  # (seq, item, after)
        self.express: list[tuple[int, tuple[Key, int], int]] = []
        self.written: dict[Key, list[int]] = {}

    def write(self, key: Key, express: bool) -> None:
        index = len(self.written.setdefault(key, []))
        self.written[key].append(index)
        if express:
            self.express_no += 1
            after = self.routes.express(key, self.express_no)
            self.express.append((self.express_no, (key, index), after))
        else:
            self.seq += 1
            after = self.routes.striping(key, self.seq)
            self.striping.append((self.seq, (key, index), after))


def _delivered_per_route(delivered: list[tuple[Key, int]]) -> dict[Key, list[int]]:
    per_route: dict[Key, list[int]] = {}
    for key, index in delivered:
        per_route.setdefault(key, []).append(index)
    return per_route


def test_an_express_item_waits_only_for_its_own_routes_earlier_item() -> None:
    delivered: list[tuple[Key, int]] = []
    order: SessionOrder[tuple[Key, int]] = SessionOrder(delivered.append)
    sender = Sender()
    busy, small = ("big", "e"), ("small", "e")
    sender.write(busy, express=False)  # seq 1
    sender.write(small, express=False)  # seq 2: the small route's item before it went express
    sender.write(busy, express=False)  # seq 3
    sender.write(small, express=True)  # express 1, after seq 2
    sender.write(("other", "e"), express=True)  # express 2, after nothing
    # The express connection runs ahead: its first item must wait for seq 2; the other route's item
    # behind it on that connection does not wait with it.
    for number, item, after in sender.express:
        order.put_express(number, item[0], item, after, 100)
    assert delivered == [(("other", "e"), 0)]
    seq, item, after = sender.striping[0]
    order.put(seq, item, after)
    assert delivered == [(("other", "e"), 0), (busy, 0)]
    seq, item, after = sender.striping[1]
    order.put(seq, item, after)
    assert delivered[2:] == [(small, 0), (small, 1)]
    seq, item, after = sender.striping[2]
    order.put(seq, item, after)
    assert delivered[-1] == (busy, 1)


def test_an_item_of_the_striping_lanes_waits_for_its_routes_express_item() -> None:
    delivered: list[tuple[Key, int]] = []
    order: SessionOrder[tuple[Key, int]] = SessionOrder(delivered.append)
    sender = Sender()
    key = ("job", "e")
    sender.write(key, express=True)
    sender.write(key, express=False)  # after express 1
    sender.write(("job2", "e"), express=False)
    for seq, item, after in sender.striping:
        order.put(seq, item, after)
    assert delivered == []  # seq 1 waits for express 1, and seq 2 behind it (the lanes keep order)
    number, item, after = sender.express[0]
    order.put_express(number, item[0], item, after, 10)
    assert delivered == [(key, 0), (key, 1), (("job2", "e"), 0)]


@pytest.mark.parametrize("seed", range(40))
def test_any_interleaving_delivers_everything_in_each_routes_order(seed: int) -> None:
    rng = random.Random(seed)
    sender = Sender(RouteDependencies(bound=rng.choice([2, 4096])))  # forgetting must stay safe too
    keys = [(f"job{i}", "e") for i in range(rng.randint(1, 6))]
    for _ in range(rng.randint(1, 200)):
        sender.write(rng.choice(keys), express=rng.random() < 0.4)
    delivered: list[tuple[Key, int]] = []
    order: SessionOrder[tuple[Key, int]] = SessionOrder(delivered.append)
    striping = list(sender.striping)
    rng.shuffle(striping)  # several lanes: any order
    express = list(sender.express)  # one connection: its own order
    while striping or express:
        if express and (not striping or rng.random() < 0.5):
            number, item, after = express.pop(0)
            order.put_express(number, item[0], item, after, 10)
        else:
            seq, item, after = striping.pop()
            order.put(seq, item, after)
    assert _delivered_per_route(delivered) == sender.written
    assert not order.express.waiting and not order.lanes.waiting


def test_a_peer_that_skips_or_repeats_an_express_number_breaks_the_protocol() -> None:
    order: SessionOrder[str] = SessionOrder(lambda item: None)
    order.put_express(1, "k", "a", 0, 1)
    with pytest.raises(LaneGapError, match="express item 3 arrived where item 2 was due"):
        order.put_express(3, "k", "c", 0, 1)
    with pytest.raises(LaneGapError, match="express item 1 arrived where item 2 was due"):
        order.put_express(1, "k", "a", 0, 1)


def test_express_items_waiting_for_an_item_that_never_comes_end_the_session() -> None:
    queue: ExpressQueue[str] = ExpressQueue(lambda item: None, ready=lambda after: False)
    for number in range(1, MAX_WAITING_ITEMS + 1):
        queue.put(number, "k", "x", 10**12, 1)
    with pytest.raises(LaneGapError, match="wait for item 1000000000000 of the other lanes"):
        queue.put(MAX_WAITING_ITEMS + 1, "k", "x", 10**12, 1)
    by_bytes: ExpressQueue[str] = ExpressQueue(lambda item: None, ready=lambda after: False)
    by_bytes.put(1, "k", "x", 5, 48 << 20)
    with pytest.raises(LaneGapError, match="express items"):
        by_bytes.put(2, "k", "x", 5, 32 << 20)


def test_a_forgotten_route_waits_for_the_newest_items_forgotten() -> None:
    routes = RouteDependencies(bound=2)
    assert routes.striping(("a", "e"), 5) == 0
    assert routes.express(("b", "e"), 1) == 0
    assert routes.striping(("c", "e"), 6) == 0  # forgets a (seq 5)
    # A route not remembered cannot tell "new" from "forgotten": it waits for the newest forgotten.
    assert routes.express(("d", "e"), 2) == 5  # forgets b (express 1)
    assert routes.express(("a", "e"), 3) == 5  # a's own seq 5, or later: never less
    assert routes.striping(("b", "e"), 7) >= 1  # b's own express 1, or later


def test_with_an_express_connection_its_writer_takes_the_sparse_messages_and_only_those() -> None:
    router, small, small_at = busy_and_idle_routes()
    pacer = LinkPacer(clock=lambda: 0.0)
    assert router.next_express(pacer) is None  # a busy route's bytes never go express
    first = router.next_paced(pacer, express=True)
    assert first is not None and router.picked == ("big", "e")
    pacer.on_sent(size_of(first))
    router.accept_local(small, small_at, header(7))
    assert router.next_paced(pacer, express=True) is None  # left to the express writer
    piece = router.next_express(pacer)
    assert piece is not None and piece.routed.job_id == "small" and router.picked == ("small", "e")
    assert router.next_express(pacer) is None
    assert router.next_paced(pacer, express=True) is not None  # the big route goes on


def test_a_route_that_sent_a_fragment_keeps_its_small_items_off_express_for_the_bulk_hold(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A big job's signal between two tensors is part of its bulk: on the express connection it would
    take the path's unqueued slot from the small jobs it is for."""
    now = [100.0]
    monkeypatch.setattr(
        route_scheduler, "time", type("Clock", (), {"monotonic": staticmethod(lambda: now[0])})
    )
    router = Router(cluster_id="a")
    big, big_at = router.attach(("big", "e"), "alice")
    router.accept_local(big, big_at, framed("big", 1, 256 << 10))
    pacer = LinkPacer(clock=lambda: 0.0)
    pieces = 0
    while router.next_outbound(pacer.fragment_bytes, pacer.cut_above) is not None:
        pieces += 1
    assert pieces > 1  # the tensor left in fragments
    router.accept_local(big, big_at, header(2))  # its route idle again: a new flow, but bulk
    assert router.next_express(pacer) is None
    assert router.next_paced(pacer, express=True) is not None  # on the striping connections
    now[0] += route_scheduler.BULK_HOLD_S + 0.01
    router.accept_local(big, big_at, header(3))
    piece = router.next_express(pacer)
    assert piece is not None and piece.routed.job_id == "big"


def test_the_express_writer_passes_a_full_cap_by_one_fragment_at_most() -> None:
    many_small_jobs_pass_a_full_cap_by_one_fragment_at_most(Router.next_express)


def _routed(seq_after: tuple[int, int]) -> list[bytes]:
    mark = link_pb2.LinkMessage(mark=link_pb2.LaneMark(seq=seq_after[0], after=seq_after[1]))
    item = link_pb2.LinkMessage(
        routed=link_pb2.RoutedItem(job_id="j", edge="e", item=header(1), epoch=0)  # type: ignore[arg-type]
    )
    return [mark.SerializeToString(), item.SerializeToString()]


HOSTILE_EXPRESS = {
    "a fragment": (
        [link_pb2.LinkMessage(fragment=link_pb2.LinkFragment(stream=1, data=b"x")).SerializeToString()],
        "fragment on the express connection",
    ),
    "retiring it": (
        [link_pb2.LinkMessage(mark=link_pb2.LaneMark(last=True)).SerializeToString()],
        "tried to retire connection 32",
    ),
    "a skipped number": (_routed((2, 0)), "express item 2 arrived where item 1 was due"),
    "items that wait forever": (
        [raw for n in range(1, 4100) for raw in _routed((n, 10**9))],
        "wait for item 1000000000 of the other lanes",
    ),
}


@pytest.mark.parametrize("case", HOSTILE_EXPRESS)
def test_a_hostile_peer_on_the_express_connection_ends_the_session_saying_why(case: str) -> None:
    messages, reason = HOSTILE_EXPRESS[case]
    _, notices = feed_session([], messages)
    assert notices and reason in notices[-1], notices


def test_a_peer_cannot_open_an_express_connection_on_a_session_without_one() -> None:
    async def scenario() -> None:
        link = PeerLink("a", "b", Router(cluster_id="a"))
        inbox: asyncio.Queue[object] = asyncio.Queue()

        async def write(message: bytes) -> None:
            return None

        session = asyncio.create_task(
            link.run_session(
                inbox.get, write, Identity("b", "switch"), "acceptor", session_id=b"s", marking=True
            )
        )
        assert await link.wait_connected(5)
        with pytest.raises(HandshakeError, match="no express connection"):
            await link.run_lane(EXPRESS_LANE, inbox.get, write)
        session.cancel()

    asyncio.run(scenario())


def test_a_connection_that_reaches_us_before_its_session_starts_joins_it_and_a_stale_one_never_does() -> None:
    """The dialer opens its express connection right after our reply to its first connection; it may reach
    us while the session before still winds down. It waits for its session (bounded), and a lane bound to
    one session never runs in the next."""

    async def scenario() -> None:
        link = PeerLink("a", "b", Router(cluster_id="a"))
        inbox: asyncio.Queue[object] = asyncio.Queue()

        async def write(message: bytes) -> None:
            return None

        assert not await link.await_session(b"old", 0.05)  # no session at all: refused after the wait
        joining = asyncio.create_task(link.await_session(b"new", 10))
        await asyncio.sleep(0)
        assert not joining.done()
        session = asyncio.create_task(
            link.run_session(
                inbox.get, write, Identity("b", "switch"), "acceptor", session_id=b"new", marking=True
            )
        )
        assert await asyncio.wait_for(joining, 5)
        assert not await link.await_session(b"old", 0.05)
        with pytest.raises(HandshakeError, match="no session to join"):
            await link.run_lane(1, inbox.get, write, b"old")
        session.cancel()

    asyncio.run(scenario())
