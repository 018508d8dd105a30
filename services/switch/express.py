"""The express connection: a link session's small items do not queue behind a busy route's bytes.

The pacer (``pacing.py``) keeps one to two fragments of the link queued at the bottleneck, so that the
link never idles while a big job has bytes to send. On one connection a small job's message waits
behind those fragments on every crossing, a few milliseconds each, however fairly the switch's
scheduler picked it. Where the bottleneck queues per connection (fair queueing, as Linux's default
``fq_codel`` and the WAN emulator do), a second connection that carries only small messages passes
that queue; where it is one FIFO, the message waits as it did, never longer.

So a paced session with lanes whose both ends announce ``express`` gets one more connection, lane
:data:`EXPRESS_LANE`, opened by the dialer. Both ends write on it only what
``LinkScheduler.next_express`` hands out: items of a route that had nothing queued, within its first
quantum and each no longer than a fragment, unless the route sent a fragment in the last
``BULK_HOLD_S`` (a big job's small signals between its tensors are its bulk's), under the same pacer
as every lane. Acknowledgements stay on the other connections, so a loss on this one never holds
them all.

Order. Items of different routes need none; a route's items must reach the receiver in the order its
trainer sent them, though some went express and some not. Each item's lane mark names the one item it
must follow on the other kind of connection: an express item the ``seq`` of its route's last item on
the other lanes, any other item the number of its route's last express item (``LaneMark.after``). The
receiver delivers the other lanes in ``seq`` order and the express lane in its own order, each item
once what it names was delivered (``lanes.SessionOrder``). Every dependency points to an item written
earlier, so the earliest undelivered item can always go once it arrived: no wait can close a circle.
The sender remembers per route only its last item of each kind (:class:`RouteDependencies`, bounded;
a route it forgot waits for the newest items it forgot, which is always safe). A peer that names
items it never sends fills the bounded waits and ends the session.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

Key = tuple[str, str]

EXPRESS_LANE = 32
"""The express connection's lane number: above every striping lane (1 .. MAX_LANES - 1)."""

MAX_ROUTES_REMEMBERED = 4096


class RouteDependencies:
    """The sender's side: per route, its last item on the striping lanes and on the express lane.

    At most ``bound`` routes are remembered; a route forgotten (the least recently used) is answered
    with the newest numbers forgotten, which were written after everything it sent, so it waits at
    most for more than it needs, never for less.
    """

    def __init__(self, bound: int = MAX_ROUTES_REMEMBERED) -> None:
        self.bound = bound
        self._last: OrderedDict[Key, list[int]] = OrderedDict()
        self._forgotten = [0, 0]  # [striping seq, express number]

    def _entry(self, key: Key) -> list[int]:
        """[its last striping seq, its last express number, the express number its last striping item
        named or followed]."""
        entry = self._last.get(key)
        if entry is None:
            entry = self._last[key] = [*self._forgotten, 0]
            if len(self._last) > self.bound:
                _, old = self._last.popitem(last=False)
                self._forgotten = [max(a, b) for a, b in zip(self._forgotten, old[:2], strict=True)]
        else:
            self._last.move_to_end(key)
        return entry

    def striping(self, key: Key, seq: int) -> int:
        """Item ``seq`` of ``key`` goes on a striping lane: the express number it must name, 0 when its
        route's striping item before it named or followed that one already (the receiver delivers the
        striping lanes in ``seq`` order, so this item follows it too)."""
        entry = self._entry(key)
        entry[0] = seq
        if entry[1] == entry[2]:
            return 0
        entry[2] = entry[1]
        return entry[1]

    def express(self, key: Key, number: int) -> int:
        """Express item ``number`` of ``key``: the striping seq it must follow."""
        entry = self._entry(key)
        entry[1] = number
        return entry[0]


@dataclass
class ExpressLane:
    """A session's express connection: whether it runs, the sender's numbering, the receiver's order."""

    up: bool = False
    send_no: int = 0
    routes: RouteDependencies = field(default_factory=RouteDependencies)


__all__ = ["EXPRESS_LANE", "ExpressLane", "RouteDependencies"]
