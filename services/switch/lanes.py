"""Several connections (lanes) under one link session: in-order delivery on top, and how many to use.

One TCP connection cannot fill a fast or lossy long-haul path (its congestion window, one HTTP/2 flow
control window, one writer waiting for each write). The link therefore stripes items over N parallel
mTLS connections of one session: each lane has its own writer pulling the router's next item as soon
as its previous write completed, so writes are pipelined across lanes. Every item is preceded on its
lane by a ``LaneMark{seq}`` (one sequence per direction and session), and the receiving switch hands
items to the router strictly in ``seq`` order (:class:`ReorderBuffer`), so each route sees its items in
the order its trainer sent them -- the trainers' own sequence numbers, acks and replay (edge protocol 2)
then give exactly-once delivery as with one connection.

Losing any lane ends the session: items written to the dead connection may be lost, which leaves a gap
no other lane can fill. Routes then get the usual link-down notice, the link reconnects, and the
trainers' resume replays everything unacknowledged, so no data is lost and nothing is applied twice.

How many lanes: ``lane_tuner.py``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

if TYPE_CHECKING:
    from services.switch.express import ExpressLane

T = TypeVar("T")


class LaneGapError(Exception):
    """The reorder buffer exceeded its bound: a lane lost an item (the session must end)."""


@dataclass
class ReorderBuffer(Generic[T]):
    """Delivers items numbered 1, 2, 3, ... in order, whatever order they arrive in.

    ``bound`` items may wait for a missing one; beyond that the missing item is taken as lost
    (:class:`LaneGapError`). Duplicates and numbers already delivered are refused the same way: a lane
    never repeats an item, so either means the peer broke the protocol. An item may also name what it
    must follow elsewhere (``after``, the express connection's numbering, ``express.py``): it waits,
    and everything behind it, until ``ready(after)``; :meth:`pump` delivers what became ready.
    """

    deliver: Callable[[T], None]
    bound: int = 65536
    next_seq: int = 1
    waiting: dict[int, tuple[T, int]] = field(default_factory=dict)
    ready: Callable[[int], bool] = field(default=lambda after: True)

    def put(self, seq: int, item: T, after: int = 0) -> None:
        if seq < self.next_seq or seq in self.waiting:
            raise LaneGapError(f"lane item {seq} arrived twice (next expected {self.next_seq})")
        if seq != self.next_seq or not self.ready(after):
            if len(self.waiting) >= self.bound:
                raise LaneGapError(
                    f"{len(self.waiting)} lane items wait for item {self.next_seq}, which a lane lost"
                )
            self.waiting[seq] = (item, after)
            self.pump()
            return
        self.deliver(item)
        self.next_seq += 1
        self.pump()

    def pump(self) -> bool:
        """Deliver the items now next in order and ready; whether any was."""
        delivered = False
        while self.next_seq in self.waiting and self.ready(self.waiting[self.next_seq][1]):
            self.deliver(self.waiting.pop(self.next_seq)[0])
            self.next_seq += 1
            delivered = True
        return delivered


MAX_WAITING_ITEMS = 4096
MAX_WAITING_BYTES = 64 << 20
"""What express items may wait for their routes' items on the other lanes (``express.py``): beyond
it the peer broke the protocol."""


@dataclass
class ExpressQueue(Generic[T]):
    """The receiver's express items: each route's in their order, each once ``ready(after)``.

    An item that waits holds up only the later express items of its own route (``key``), never another
    route's: the express connection is there so that one route's small items do not wait for another's.
    """

    deliver: Callable[[T], None]
    ready: Callable[[int], bool]
    next_no: int = 1
    waiting: dict[object, deque[tuple[int, int, T, int]]] = field(default_factory=dict)
    waiting_items: int = 0
    waiting_bytes: int = 0
    #: Every express number below this one was delivered; ``_done`` holds those delivered above it.
    done_below: int = 1
    _done: set[int] = field(default_factory=set)

    def is_delivered(self, number: int) -> bool:
        return number < self.done_below or number in self._done

    def put(self, number: int, key: object, item: T, after: int, size: int) -> None:
        if number != self.next_no:
            raise LaneGapError(f"express item {number} arrived where item {self.next_no} was due")
        self.next_no += 1
        if key not in self.waiting and self.ready(after):
            self._deliver(number, item)
            return
        if self.waiting_items >= MAX_WAITING_ITEMS or self.waiting_bytes + size > MAX_WAITING_BYTES:
            raise LaneGapError(
                f"{self.waiting_items} express items ({self.waiting_bytes} bytes) wait for item {after} of "
                "the other lanes, which does not arrive"
            )
        self.waiting.setdefault(key, deque()).append((number, after, item, size))
        self.waiting_items += 1
        self.waiting_bytes += size

    def pump(self) -> bool:
        """Deliver the waiting items now ready; whether any was."""
        delivered = False
        for key in list(self.waiting):
            queue = self.waiting[key]
            while queue and self.ready(queue[0][1]):
                number, _, item, size = queue.popleft()
                self.waiting_items -= 1
                self.waiting_bytes -= size
                self._deliver(number, item)
                delivered = True
            if not queue:
                del self.waiting[key]
        return delivered

    def _deliver(self, number: int, item: T) -> None:
        self.deliver(item)
        self._done.add(number)
        while self.done_below in self._done:
            self._done.discard(self.done_below)
            self.done_below += 1


class SessionOrder(Generic[T]):
    """The receiver's order over the striping lanes and the express lane (see the module doc)."""

    def __init__(self, deliver: Callable[[T], None]) -> None:
        self.lanes: ReorderBuffer[T] = ReorderBuffer(deliver, ready=self._express_delivered)
        self.express: ExpressQueue[T] = ExpressQueue(deliver, ready=self._lanes_delivered)

    def _express_delivered(self, number: int) -> bool:
        return number == 0 or self.express.is_delivered(number)

    def _lanes_delivered(self, seq: int) -> bool:
        return self.lanes.next_seq > seq

    def put(self, seq: int, item: T, after: int = 0) -> None:
        """An item of the striping lanes, number ``seq``, to follow express item ``after``."""
        self.lanes.put(seq, item, after)
        self._settle()

    def put_express(self, number: int, key: object, item: T, after: int, size: int) -> None:
        """Express item ``number`` of route ``key``, to follow item ``after`` of the striping lanes."""
        self.express.put(number, key, item, after, size)
        self._settle()

    def _settle(self) -> None:
        while self.express.pump() | self.lanes.pump():
            pass


@dataclass
class SessionLanes:
    """The lanes of one link session: marks, reordering, retiring, failure (``link_lanes.py`` runs them).

    ``marking`` is set when both ends announced lanes: items then carry marks and further connections
    may join. An item on the first connection goes without one while no other striping connection
    joined and its route names no new express item (``RouteDependencies.striping``): it is numbered
    after the item read there before it, so a single connection pays no mark per fragment. Any lane's
    failure ends the whole session (``failed``).
    """

    session_id: bytes
    marking: bool
    #: The receiver's order over the lanes (and the express lane, ``express.py``).
    order: SessionOrder[tuple[tuple[str, str], object, int]]
    #: The express connection, when both ends announced it (``express.py``).
    express: ExpressLane | None = None
    send_seq: int = 0
    #: A striping connection besides the first joined: from then on every item is marked.
    striped: bool = False
    #: The receiver's number of the last item read on the first connection (an unmarked one follows it).
    first_seq: int = 0
    active: set[int] = field(default_factory=lambda: {0})
    retiring: set[int] = field(default_factory=set)
    failed: asyncio.Event = field(default_factory=asyncio.Event)
    failure: str = ""
    #: Items written per lane (a lane's share of the striping, for status and tests).
    written: dict[int, int] = field(default_factory=dict)
    #: A paced session's data bytes per lane: written, acknowledged by the peer on that lane, and read
    #: (``LinkReceived.lane_bytes``), and the lanes whose reads we have yet to acknowledge.
    sent_bytes: dict[int, int] = field(default_factory=dict)
    acked_bytes: dict[int, int] = field(default_factory=dict)
    read_bytes: dict[int, int] = field(default_factory=dict)
    acks_due: set[int] = field(default_factory=set)
    #: The peer acknowledges per lane (a switch that does not leaves each lane unbounded, as before).
    lane_acks: bool = False

    def unacked(self, lane: int) -> int:
        """Data bytes written on ``lane`` that the peer has not acknowledged reading there."""
        return self.sent_bytes.get(lane, 0) - self.acked_bytes.get(lane, 0)

    def fail(self, reason: str) -> None:
        if not self.failed.is_set():
            self.failure = reason
            self.failed.set()


__all__ = [
    "ExpressQueue",
    "LaneGapError",
    "ReorderBuffer",
    "SessionLanes",
    "SessionOrder",
]
