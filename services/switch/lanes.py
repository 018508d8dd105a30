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

How many lanes (:class:`LaneTuner`, ``NEBULA_SWITCH_LINK_CONNECTIONS=auto``): start with one; every
measurement interval in which the link was busy (items waited for a lane most of the interval: queued
in the router, or a lane's writer blocked in a write, ``PeerLink.link_busy``) the
throughput of the interval is compared with the one before the last change. Probing up: add a lane
while the last addition raised it by more than ``gain`` (5%); when an addition did not, retire that
lane again and hold for ``hold_intervals``. Probing down (after such a hold, with more than one lane):
retire a lane while throughput stays within ``gain`` of what it was before; when a retirement cost
more, restore the lane and hold. Holds alternate the direction, so a count chosen while the link was
still ramping up (a first busy interval that was partly idle, TCP slow start: every addition looks
like a gain) is walked back to what the path needs, and a path that changes later is followed either
way. The first busy interval after an idle one is only a start: it is neither judged nor a baseline.
Idle intervals say nothing about capacity and are ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


class LaneGapError(Exception):
    """The reorder buffer exceeded its bound: a lane lost an item (the session must end)."""


@dataclass
class ReorderBuffer(Generic[T]):
    """Delivers items numbered 1, 2, 3, ... in order, whatever order they arrive in.

    ``bound`` items may wait for a missing one; beyond that the missing item is taken as lost
    (:class:`LaneGapError`). Duplicates and numbers already delivered are refused the same way: a lane
    never repeats an item, so either means the peer broke the protocol.
    """

    deliver: Callable[[T], None]
    bound: int = 65536
    next_seq: int = 1
    waiting: dict[int, T] = field(default_factory=dict)

    def put(self, seq: int, item: T) -> None:
        if seq < self.next_seq or seq in self.waiting:
            raise LaneGapError(f"lane item {seq} arrived twice (next expected {self.next_seq})")
        if seq != self.next_seq:
            if len(self.waiting) >= self.bound:
                raise LaneGapError(
                    f"{len(self.waiting)} lane items wait for item {self.next_seq}, which a lane lost"
                )
            self.waiting[seq] = item
            return
        self.deliver(item)
        self.next_seq += 1
        while self.next_seq in self.waiting:
            self.deliver(self.waiting.pop(self.next_seq))
            self.next_seq += 1


@dataclass
class LaneTuner:
    """Chooses the number of lanes from measured throughput (see the module doc)."""

    max_lanes: int = 8
    gain: float = 0.05
    hold_intervals: int = 15
    lanes: int = 1
    _baseline: float | None = None  # throughput before the last change
    _probing: int = 0  # the last change not yet judged: +1 an addition, -1 a retirement, 0 none
    _direction: int = 1  # where the next probe goes: +1 add a lane, -1 retire one
    _hold: int = 0
    _started: bool = False  # a busy interval has been seen since the last idle one

    def observe(self, throughput: float, busy: bool) -> int:
        """One interval's throughput (bytes/s) and whether the link was busy; returns the lane count."""
        if not busy:
            self._started = False
            return self.lanes
        if not self._started:  # partly idle, ramping up: a start, not a measurement
            self._started = True
            return self.lanes
        if self._hold > 0:
            self._hold -= 1
            return self.lanes
        if self._probing:
            probe, self._probing = self._probing, 0
            assert self._baseline is not None
            if probe > 0 and throughput <= self._baseline * (1 + self.gain):
                self.lanes -= 1  # the addition did not help: retire it, hold, then try fewer
                return self._hold_then(-1)
            if probe < 0 and throughput < self._baseline * (1 - self.gain):
                self.lanes += 1  # the retirement cost throughput: restore it, hold, then try more
                return self._hold_then(1)
        if self._direction < 0 and self.lanes <= 1:
            self._direction = 1
        if self._direction > 0 and self.lanes >= self.max_lanes:
            self._direction = -1 if self.lanes > 1 else 1
        if (self._direction > 0 and self.lanes < self.max_lanes) or self._direction < 0:
            self._baseline = throughput
            self._probing = self._direction
            self.lanes += self._direction
        return self.lanes

    def _hold_then(self, direction: int) -> int:
        self._hold = self.hold_intervals
        self._direction = direction
        return self.lanes


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
    if not 1 <= count <= 16:
        raise ValueError(f"link_connections must be between 1 and 16 (or 'auto'), got {count}")
    return count


__all__ = ["LaneGapError", "LaneTuner", "ReorderBuffer", "parse_connections"]
