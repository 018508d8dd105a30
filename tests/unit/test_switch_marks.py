"""Lane marks only where the receiver cannot tell an item's place (services/switch/lanes.py SessionLanes).

Every session is marked (its express connection joins it), but on the first connection, while no other
striping connection joined, an item whose route names nothing new on the express connection goes
without a mark: the receiver numbers it after the item read there before it. A big job's fragments on
one connection then cost one message each, not two. A peer that leaves out marks where they are due,
or numbers an item twice this way, ends the session.
"""

from __future__ import annotations

import asyncio

import pytest

from nebula_common.pki import Identity
from nebula_common.proto.nebula.v1 import link_pb2
from services.switch.express import EXPRESS_LANE, ExpressLane
from services.switch.lanes import SessionLanes, SessionOrder
from services.switch.link import PeerLink
from services.switch.link_handshake import HandshakeError
from services.switch.link_pumps import LinkPumps
from services.switch.routing import Router
from tests.unit.test_switch_pacing import header


def _item(frame_id: int) -> bytes:
    return link_pb2.LinkMessage(
        routed=link_pb2.RoutedItem(job_id="j", edge="e", item=header(frame_id), epoch=0)  # type: ignore[arg-type]
    ).SerializeToString()


def _mark(seq: int, after: int = 0) -> bytes:
    return link_pb2.LinkMessage(mark=link_pb2.LaneMark(seq=seq, after=after)).SerializeToString()


def feed_session(
    first: list[bytes], express: list[bytes] | None = None, want: int | None = None
) -> tuple[list[int], list[str]]:
    """Feed a marked, paced session with express connection ``first`` (and ``express``) as the peer
    wrote them (the peer's second express connection refused on the way); the frame ids the route
    received, in order, and the notices it got. With ``want`` the
    session is ended (by a message that is none) once that many frames arrived; without, the peer's
    messages must end it."""

    async def scenario() -> tuple[list[int], list[str]]:
        router = Router(cluster_id="a")
        link = PeerLink("a", "b", router)
        route, attachment = router.attach(("j", "e"), "alice")
        inbox: asyncio.Queue[object] = asyncio.Queue()
        express_inbox: asyncio.Queue[object] = asyncio.Queue()

        async def write(message: bytes) -> None:
            return None

        session = asyncio.create_task(
            link.run_session(
                inbox.get,
                write,
                Identity("b", "switch"),
                "acceptor",
                session_id=b"s",
                marking=True,
                peer_paced=True,
                express=True,
            )
        )
        assert await link.wait_connected(5)
        lane = asyncio.create_task(link.run_lane(EXPRESS_LANE, express_inbox.get, write))
        await asyncio.sleep(0)
        with pytest.raises(HandshakeError, match="runs one already"):  # one express connection a session
            await link.run_lane(EXPRESS_LANE, express_inbox.get, write)
        for raw in express or []:
            await express_inbox.put(raw)
        for raw in first:
            await inbox.put(raw)
        frames: list[int] = []
        notices: list[str] = []
        if want is not None:
            deadline = asyncio.get_running_loop().time() + 5
            while len(frames) < want:
                assert asyncio.get_running_loop().time() < deadline, f"only frames {frames} arrived"
                assert not session.done(), "the session ended early"
                await asyncio.sleep(0.01)
                while (got := router.pop_inbound(route, attachment)) is not None:
                    if got.WhichOneof("body") == "frame":
                        frames.append(got.frame.header.frame_id)
            await inbox.put(b"")  # an empty message is no link message: the session ends
        await asyncio.wait_for(session, 5)
        lane.cancel()
        while (got := router.pop_inbound(route, attachment)) is not None:
            if got.WhichOneof("body") == "notice":
                notices.append(got.notice.reason)
            elif got.WhichOneof("body") == "frame":
                frames.append(got.frame.header.frame_id)
        return frames, notices

    return asyncio.run(scenario())


def test_unmarked_items_on_the_first_connection_follow_the_item_read_there_before() -> None:
    frames, _ = feed_session([_item(1), _mark(2), _item(2), _item(3)], want=3)
    assert frames == [1, 2, 3]


def test_an_unmarked_item_waits_like_any_other_for_an_earlier_one_on_another_lane() -> None:
    # The second item follows express item 1 (frame 2), itself behind the first item: the third item,
    # unmarked, waits behind the second. (A frame behind a later one of its route would be dropped.)
    frames, _ = feed_session(
        [_item(1), _mark(2, after=1), _item(3), _item(4)], express=[_mark(1, after=1), _item(2)], want=4
    )
    assert frames == [1, 2, 3, 4]


@pytest.mark.parametrize(
    ("first", "express", "reason"),
    [
        ([_item(1), _mark(1), _item(2)], [], "lane item 1 arrived twice"),
        ([_item(1)], [_item(2)], "without its lane mark on connection 32"),
    ],
    ids=["numbered twice", "unmarked on the express connection"],
)
def test_a_peer_that_leaves_out_marks_where_they_are_due_ends_the_session(
    first: list[bytes], express: list[bytes], reason: str
) -> None:
    _, notices = feed_session(first, express)
    assert notices and reason in notices[-1], notices


def test_the_sender_marks_only_what_the_receiver_cannot_number() -> None:
    lanes = SessionLanes(
        session_id=b"s", marking=True, order=SessionOrder(lambda item: None), express=ExpressLane()
    )
    big, small = ("big", "e"), ("small", "e")
    assert LinkPumps._mark(lanes, 0, big) is None  # alone on the first connection: numbered by the receiver
    express = LinkPumps._mark(lanes, EXPRESS_LANE, small)
    assert express is not None and (express.mark.seq, express.mark.after) == (1, 0)
    named = LinkPumps._mark(lanes, 0, small)  # the small route's next item must follow its express one
    assert named is not None and (named.mark.seq, named.mark.after) == (2, 1)
    assert LinkPumps._mark(lanes, 0, small) is None  # its item before named it already
    assert LinkPumps._mark(lanes, 0, big) is None
    lanes.striped = True  # a second striping connection joined: every item says its number
    marked = [LinkPumps._mark(lanes, lane, big) for lane in (0, 1, 0)]
    assert [m.mark.seq for m in marked if m is not None] == [5, 6, 7]
