"""Which route's item the link writer sends next: acks, then the switch's closes, then fair shares.

One link carries every job, so the order in which routes reach it decides whether a small item of one
job waits behind a big tensor of another. The link writer takes items with
:meth:`LinkScheduler.next_outbound`: pending acks first (tiny, they unblock senders; an ack and an item
that could pass as well take turns, so a route that keeps acks coming cannot hold the others), then
closes of routes the switch dropped, then the routes' items by deficit round robin over bytes (Shreedhar
and Varghese, 1995): each route with items gets a quantum of bytes per round (times its account's
weight), so a big tensor of one job never holds up a small item of another, and two busy routes share
the link by bytes, not by items; an item costs at least ``ITEM_COST_BYTES``, so a flood of tiny items
takes a few dozen per turn, not thousands. A route that had nothing queued goes first, as a new flow in
FQ-CoDel (RFC 8290). On a paced link (``pacing.py``, :meth:`LinkScheduler.next_paced`) items larger
than the link's fragment size leave as fragments, one per turn, while the pacer has room; over a full
cap only acks and such a new flow's items within its first quantum, each no longer than a fragment, may
pass (one fragment over the cap at most, all of them together), so a small job does not wait for the
next acknowledgement behind a link a big job keeps full; on a session with an express connection
(``express.py``) such items cross there. Within a route, frames, signals and close keep their order.
"""

from __future__ import annotations

import time

from nebula_common.proto.nebula.v1 import link_pb2
from nebula_common.rpc.framing import FramedChunk
from services.switch.pacing import Fragment, LinkPacer
from services.switch.route_state import Item, Outbound, Route
from services.switch.route_table import RouteTable

BULK_HOLD_S = 1.0
"""How long a route that sent a fragment stays off the express connection: a big job's small signals
and last pieces between its tensors are its bulk's, and on the express connection they would take the
path's one unqueued slot from the small jobs it is for."""
QUANTUM_BYTES = 256 << 10
"""A route's bytes per round of the scheduler on a link that is not paced (a paced link: one fragment)."""
ITEM_COST_BYTES = 4 << 10
"""What an item costs its route's deficit at least: the peer's switch spends about as much on a 60-byte
header frame as on a fragment, so by bytes alone a flood of tiny items took a quantum of thousands of
them per turn, seconds of the peer's work ahead of every other job's next message."""


class LinkScheduler(RouteTable):
    """The routes' queues toward the peer, and the deficit round robin that empties them."""

    #: The last message picked was an ack (``_ack_turn``).
    _after_ack: bool = False

    def _push_outbound(self, route: Route, item: Item) -> None:
        route.outbound.append(item)
        route.outbound_bytes += item.size
        self.buffered_out += item.size
        if not route.in_ready:
            # A route that had nothing queued goes first, as a new flow in FQ-CoDel (RFC 8290): a
            # job that sends little waits for no busy route's turn. It gets one quantum like any
            # other, then joins the round; a busy route is never empty, so it never jumps the queue.
            route.in_ready = True
            route.sparse = True
            self._ready.appendleft(route)
        self.outbound_wake.set()

    def next_outbound(
        self, fragment_bytes: int | None = None, cut_above: int | None = None, room: bool = True
    ) -> Outbound | Fragment | None:
        """The next message for the peer: acks, then closes of dropped routes, then the routes' items.

        Every item is tagged with the epoch of the stream it came from (``RoutedItem.epoch``); a
        framed chunk already carries its stream's job, edge and epoch and is returned as it came.
        With ``fragment_bytes`` (a paced link) an item larger than ``cut_above`` (default: the
        fragment size) leaves in fragments of that size.
        """
        limit = min(fragment_bytes, cut_above or fragment_bytes) if fragment_bytes is not None else 0
        if self._ack_turn(limit, room):
            return self._pop_ack()
        self._after_ack = False
        if self._control:
            control = self._control.popleft()
            self.picked = (control.routed.job_id, control.routed.edge)
            return control
        while self._ready:
            route = self._ready[0]
            if not route.outbound:
                self._leave_ready()
                continue
            if not route.turn:  # its turn begins: a quantum of bytes, weighted by its account
                weight = self.weights.get(route.owner, 1)
                route.deficit += weight * (fragment_bytes or QUANTUM_BYTES)
                route.turn = True
                if route.deficit <= 0:  # still paying for an item larger than its quanta
                    route.turn = False
                    route.sparse = False
                    self._ready.rotate(-1)
                    continue
            piece, size = self._piece(route, fragment_bytes, cut_above or fragment_bytes)
            self.picked = route.key
            route.deficit -= max(size, ITEM_COST_BYTES)
            if not route.outbound:
                self._leave_ready()
            elif route.deficit <= 0:
                route.turn = False
                route.sparse = False  # a new flow's first quantum is spent: it joins the round
                self._ready.rotate(-1)
            return piece
        return self._pop_ack() if self._acks else None

    def _ack_turn(self, limit: int, room: bool) -> bool:
        """Whether an ack goes next. Acks go before items, but an ack and the front route's item take turns
        where the item may go now as well: with ``room`` (a link that is not paced, or a pacer with room),
        or a sparse item (``sparse_next``, at most ``limit`` bytes) over a full cap; a busy route's
        fragment that waits for the pacer must not hold an ack with it. A route that keeps receiving (a
        flood into a route with no peer) keeps an ack queued, which would otherwise hold the other routes'
        items for as long as it lasts."""
        if not self._acks:
            return False
        if not self._after_ack or not self._ready:
            return True
        return not room and not self._sparse_head(limit)

    def _sparse_head(self, limit: int) -> bool:
        route = self._ready[0]
        return (
            route.sparse
            and route.sending is None
            and bool(route.outbound)
            and route.outbound[0].size <= limit
        )

    def _pop_ack(self) -> link_pb2.LinkMessage:
        (job_id, edge), item = self._acks.popitem(last=False)
        self.buffered_out -= item.size
        self.picked = (job_id, edge)
        self._after_ack = True
        return link_pb2.LinkMessage(
            routed=link_pb2.RoutedItem(job_id=job_id, edge=edge, item=item.message, epoch=item.epoch)
        )

    def next_paced(self, pacer: LinkPacer, express: bool = False) -> Outbound | Fragment | None:
        """The next message for a paced link: while ``pacer`` has room, or a sparse source's small one
        (``sparse_next``) over a full cap, one fragment over it at most for all of them together.

        With ``express`` (the session's express connection runs, ``express.py``) a sparse item of a
        route that is not bulk is left to that connection's writer (:meth:`next_express`); acks stay
        here, so a loss on the one express connection never holds them all.
        """
        room = pacer.has_room()
        limit = min(pacer.fragment_bytes, pacer.cut_above)
        if express and self._express_head(limit, room):
            return None
        sparse = self.sparse_next(limit, room) and pacer.may_pass()
        if not room and not sparse:
            return None
        message = self.next_outbound(pacer.fragment_bytes, pacer.cut_above, room)
        if message is None:
            pacer.on_idle()  # room and nothing to send: the next samples measure us, not the path
        return message

    def next_express(self, pacer: LinkPacer) -> Outbound | Fragment | None:
        """The next message for the express connection: a sparse item (``sparse_next``) of a route that
        is not bulk, whole, while the pacer lets a sparse message pass; None otherwise."""
        room = pacer.inflight < pacer.cap()
        if not self._express_head(min(pacer.fragment_bytes, pacer.cut_above), room) or not pacer.may_pass():
            return None
        return self.next_outbound(pacer.fragment_bytes, pacer.cut_above, room)

    def _express_head(self, limit: int, room: bool) -> bool:
        """Whether the next message is an item for the express connection: no ack or close goes first,
        and the front route is sparse (``_sparse_head``) and has sent no fragment for ``BULK_HOLD_S``."""
        if self._ack_turn(limit, room) or self._control or not self._ready:
            return False
        return self._sparse_head(limit) and self._ready[0].bulk_until <= time.monotonic()

    def sparse_next(self, limit: int, room: bool = False) -> bool:
        """Whether the next message is small and from a source that sends little: an ack, or an item (at
        most ``limit`` bytes) of a route that joined the round with nothing queued, within its first
        quantum (FQ-CoDel's new flow: a message and the signal right behind it both count).

        Such a message may pass a full pacer (``link_pumps``): behind a link kept full by a big job, a
        small job's message would otherwise wait for the next acknowledgement, a fragment's link time,
        on every crossing. A busy route is never sparse, so this cannot carry a big job's bytes.
        """
        if self._ack_turn(limit, room):  # ``room``: whether the pacer has room (``_ack_turn``)
            return True
        if self._control or not self._ready:
            return False
        return self._sparse_head(limit)

    def _leave_ready(self) -> None:
        """The route at the front has nothing more to send: out of the round, its deficit forgotten."""
        route = self._ready.popleft()
        route.in_ready = False
        route.sparse = False
        route.turn = False
        route.deficit = 0
        route.sending, route.sending_raw = None, b""  # an item cut short was purged: forget its bytes

    def _piece(
        self, route: Route, fragment_bytes: int | None, cut_above: int | None
    ) -> tuple[Outbound | Fragment, int]:
        """The next piece of the route's first item (the item itself, or its next fragment), and its size."""
        item = route.outbound[0]
        whole: Outbound | None = None
        if route.sending is not item:
            route.sending, route.sent_offset = None, 0
            whole = self._as_outbound(route, item)
            if fragment_bytes is None or cut_above is None or item.size <= cut_above:
                self._pop_outbound(route)
                return whole, item.size
            route.sending = item
            route.sending_raw = whole.raw if isinstance(whole, FramedChunk) else whole.SerializeToString()
        raw, offset = route.sending_raw, route.sent_offset
        end = min(offset + (fragment_bytes or len(raw)), len(raw))
        last = end >= len(raw)
        piece = Fragment(route.stream, offset, memoryview(raw)[offset:end], last, whole)
        route.bulk_until = time.monotonic() + BULK_HOLD_S
        route.sent_offset = end
        if last:
            route.sending, route.sending_raw = None, b""
            self._pop_outbound(route)
        return piece, end - offset

    def _pop_outbound(self, route: Route) -> None:
        item = route.outbound.popleft()
        route.outbound_bytes -= item.size
        self.buffered_out -= item.size

    @staticmethod
    def _as_outbound(route: Route, item: Item) -> Outbound:
        if isinstance(item.message, FramedChunk):
            return item.message
        return link_pb2.LinkMessage(
            routed=link_pb2.RoutedItem(
                job_id=route.key[0], edge=route.key[1], item=item.message, epoch=item.epoch
            )
        )

    def has_outbound(self) -> bool:
        return bool(self._acks or self._control or any(route.outbound for route in self._ready))
