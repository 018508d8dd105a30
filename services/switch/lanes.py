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

How many lanes (:class:`LaneTuner`, ``NEBULA_SWITCH_LINK_CONNECTIONS=auto``): start with one and
double while the link scales, halve while it does not need them. Only intervals in which the link was
busy count (items waited for a lane most of the interval: queued in the router, or a lane's writer
blocked in a write, ``PeerLink.link_busy``); the first busy interval after an idle one is a start
(slow start, partly idle), neither judged nor a baseline. A change is judged on the mean throughput of
``judge_intervals`` busy intervals after it (the first ``settle_intervals`` after it skipped: new
connections dial, leave slow start, and the link's pacer grows its cap to carry them) against the mean
of as many before it, because on a lossy long path one interval's throughput moves with where the
losses fall by more than one connection adds.

* **Doubling.** Each connection of a loss-limited path gets what loss and RTT allow one TCP flow (about
  MSS / RTT x sqrt(3 / 2p)), so such a path takes as many connections as its capacity holds flows.
  A doubling is kept, and doubling goes on up to ``max_lanes``, while it raised throughput by more than
  ``gain`` (5%): on a loss-limited path the gain is about x2, far above the noise of where losses fall,
  on a full path about nothing. A doubling that gained no more than that is undone. One judged against
  the mean measured right after a kept doubling is judged once more before the undo stands: the count
  before it is measured afresh and the doubling tried again, kept only if both tries beat that mean.
  On a lossy long path the intervals after a doubling carry its new connections' slow-start overshoot
  (each runs far above its steady rate until its first losses halve it), so the mean that becomes the
  next doubling's baseline is inflated, and judged against it a doubling that scales the path can
  measure no gain; an undo then holds the path at a few connections for the next hold.
* **Halving**, after a hold: lanes added while the link was still ramping up, or a path that needs
  fewer later, are walked back while throughput stays within ``gain``; a halving that cost more is
  undone. Holds alternate the direction, so the count follows a path that changes either way, and each
  probe is a change large enough to stand out of the noise. A hold lasts ``hold_intervals`` (10 s)
  after a kept change and doubles with each probe undone in a row, up to ``max_hold_intervals``
  (2 min): a first doubling misjudged while one flow still ran above its steady rate is tried again
  soon, and a count that is right is probed less and less often.
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


MAX_LANES = 32
"""Connections of one link at most: a lossy long path's capacity in loss-limited TCP flows, capped."""


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


@dataclass
class LaneTuner:
    """Chooses the number of lanes from measured throughput (see the module doc)."""

    max_lanes: int = MAX_LANES
    gain: float = 0.05
    hold_intervals: int = 5
    """The hold after a first undone probe; each further one in a row doubles it, up to ``max_hold``."""
    max_hold_intervals: int = 60
    judge_intervals: int = 3
    start_intervals: int = 2
    """Busy intervals after an idle one that are only a start: slow start, and on a lossy path its
    overshoot (a flow runs far above its steady rate until the first few losses halve it)."""
    settle_intervals: int = 1
    """Busy intervals after a change that are not judged: new connections dial and leave slow start,
    and the link's pacer grows its cap to what they can carry (``pacing.py``)."""
    lanes: int = 1
    _window: list[float] = field(default_factory=list)  # busy intervals since the last change or hold
    _baseline: float | None = None  # mean throughput before the change being judged
    _previous: int = 1  # the lane count before that change
    _direction: int = 1  # where the next probe goes: +1 double, -1 halve
    _hold: int = 0
    _undone: int = 0  # probes undone in a row (each doubles the next hold); a kept change resets it
    _settle: int = 0  # intervals left before the change's judging intervals begin
    _busy_run: int = 0  # busy intervals since the last idle one
    _retry: bool = False  # a doubling was undone once: measure the count before it afresh, then retry
    _retrying: bool = False  # the doubling being judged is that retry: no gain undoes it for good
    _first_try: float = 0.0  # the mean the undone doubling measured
    _fresh: bool = False  # the mean just measured followed a kept doubling: its new connections' overshoot
    _suspect: bool = False  # the change being judged was measured against such a mean

    def observe(self, throughput: float, busy: bool) -> int:
        """One interval's throughput (bytes/s) and whether the link was busy; returns the lane count."""
        if not busy:
            self._busy_run = 0
            return self.lanes
        self._busy_run += 1
        if self._busy_run <= self.start_intervals:  # partly idle, ramping up: a start, not a measurement
            self._window.clear()
            return self.lanes
        if self._settle > 0:
            self._settle -= 1
            return self.lanes
        self._window.append(throughput)
        if self._hold > 0:
            self._hold -= 1
            return self.lanes
        if len(self._window) < self.judge_intervals:
            return self.lanes
        mean = sum(self._window[-self.judge_intervals :]) / self.judge_intervals
        self._window.clear()
        if self._baseline is not None:
            self._judge(mean)
            if self._hold > 0 or self._retry:
                return self.lanes  # a hold, or an undone doubling whose count is measured afresh first
        self._probe(mean)
        return self.lanes

    def _judge(self, mean: float) -> None:
        """Keep or undo the change made after ``_baseline`` was measured."""
        assert self._baseline is not None
        baseline, self._baseline = self._baseline, None
        ratio = mean / baseline if baseline > 0 else float("inf")
        retrying, self._retrying = self._retrying, False
        if retrying:
            # Kept only if both tries beat the fresh baseline: on a path the count already fills, two
            # tries must not double the odds that noise keeps a doubling.
            ratio = min(ratio, self._first_try / baseline if baseline > 0 else float("inf"))
        if self.lanes > self._previous:
            if ratio <= 1 + self.gain and self._suspect and not retrying:
                # No gain, judged once: undo it, measure the count before afresh, then try it again
                # against that (see the module doc), without a hold.
                self.lanes = self._previous
                self._settle = self.settle_intervals
                self._retry = True
                self._first_try = mean
                self._window.clear()
                return
            if ratio > 1 + self.gain:
                self._undone = 0
                if self.lanes < self.max_lanes:
                    self._fresh = True
                    return  # the path gives more with more connections: double again (from this mean)
            else:
                self.lanes = self._previous  # no gain: undo
            self._hold_then(-1)
        elif ratio < 1 - self.gain:
            self.lanes = self._previous  # the halving cost throughput: restore
            self._hold_then(1)
        else:
            self._undone = 0
            if self.lanes <= 1:
                self._hold_then(1)

    def _probe(self, baseline: float) -> None:
        """Double or halve from ``baseline``, the mean of the intervals just measured."""
        if self._direction < 0 and self.lanes <= 1:
            self._direction = 1
        if self._direction > 0 and self.lanes >= self.max_lanes:
            self._direction = -1
        self._retrying, self._retry = self._retry, False
        self._suspect, self._fresh = self._fresh, False
        if self._retrying:
            self._direction = 1
        self._previous = self.lanes
        if self._direction > 0:
            self.lanes = min(self.max_lanes, self.lanes * 2)
        else:
            self.lanes = max(1, self.lanes - self.lanes // 2)
        if self.lanes != self._previous:
            self._baseline = baseline
            self._settle = self.settle_intervals

    def _hold_then(self, direction: int) -> None:
        undone = self.lanes == self._previous
        self._settle = self.settle_intervals if undone else 0  # an undo changes the count again
        self._hold = min(self.max_hold_intervals, self.hold_intervals << self._undone)
        self._undone = min(self._undone + 1, 8) if undone else 0
        self._direction = direction
        self._window.clear()


def parse_connections(value: str) -> int | None:
    """``auto`` -> None (self-tuned), else a fixed count of 1 .. 16 (ValueError naming the value)."""
    text = value.strip().lower()
    if text == "auto":
        return None
    try:
        count = int(text)
    except ValueError:
        raise ValueError(
            f"link_connections must be 'auto' or a number of connections, got {value!r}"
        ) from None
    if not 1 <= count <= MAX_LANES:
        raise ValueError(f"link_connections must be between 1 and {MAX_LANES} (or 'auto'), got {count}")
    return count


__all__ = [
    "MAX_LANES",
    "ExpressQueue",
    "LaneGapError",
    "LaneTuner",
    "ReorderBuffer",
    "SessionLanes",
    "SessionOrder",
    "parse_connections",
]
