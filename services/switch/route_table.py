"""The router's table of routes and its buffers both ways, with the byte counts the bounds rest on.

Every part of the router (``routing.py``: the scheduler, closing, epochs, both sides) adds and removes
buffered items; the switch-wide gauge ``nebula_switch_buffered_bytes`` and the bounds are only true if
each of them keeps the route's and the router's byte counts with its queues. So the state lives here,
with the few primitives that move items in and out of it together with their counts, and the parts
(:class:`~services.switch.route_scheduler.LinkScheduler`,
:class:`~services.switch.route_closing.RouteClosing`, :class:`~services.switch.route_epochs.RouteEpochs`)
each extend :class:`RouteTable` with their concern alone.

A replay replaces what it resends (:meth:`RouteTable._supersede`): a frame part or signal at or below
the stream position last queued in its direction starts a sender's rewind, and the queued frame parts
and signals from that position on (not delivered, so not acknowledged, and resent right behind) are
dropped and counted (``nebula_switch_items_superseded_total``); so rewinds while originals still wait
hold one window, not one per rewind.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from nebula_common.proto.nebula.v1 import link_pb2, relay_pb2
from services.switch.metrics import BUFFERED_BYTES, ITEMS_SUPERSEDED
from services.switch.route_limits import CONTROL_MAX, Limits
from services.switch.route_state import Item, Position, Route, RouteKey, is_close, stream_position

Record = Callable[..., None]


class SharedRoutes:
    """What the routers of one switch (one per peer link) share: the limits count every route of the
    switch, and a job belongs to one account whichever peer its edges lead to."""

    def __init__(self) -> None:
        self.routers: list[RouteTable] = []
        # job id -> account that first attached an edge of it (see Router.attach).
        self.job_owners: dict[str, str] = {}

    def routes(self) -> list[Route]:
        return [route for router in self.routers for route in router._routes.values()]

    def buffered(self, direction: str) -> int:
        return sum(r.buffered_in if direction == "to_trainers" else r.buffered_out for r in self.routers)


class RouteTable:
    """The routes of one peer link, what they buffer each way, and the router's queues toward the peer."""

    def __init__(
        self,
        limits: Limits | None = None,
        *,
        cluster_id: str = "",
        record: Record | None = None,
        clock: Callable[[], float] = time.monotonic,
        shared: SharedRoutes | None = None,
        weights: dict[str, int] | None = None,
    ) -> None:
        self.limits = limits or Limits()
        self.cluster_id = cluster_id
        #: The peer cluster's id, for EdgeRestart reasons (set by the PeerLink).
        self.peer_cluster_id = ""
        self.record = record
        self._clock = clock
        self._routes: dict[RouteKey, Route] = {}
        # job id -> account that first attached an edge of it. A job's edges belong to one account,
        # so once claimed, no other account of this cluster can attach to (and read) any of its edges,
        # even after the owner's stream ended (a restarted stage re-attaches under the same account).
        # Shared by the routers of every peer link of the switch (SharedRoutes).
        self.shared = shared if shared is not None else SharedRoutes()
        self.shared.routers.append(self)
        self._job_owners = self.shared.job_owners
        # key -> (expiry, epoch of the closed route): items of a higher epoch start a new route.
        self._tombstones: OrderedDict[RouteKey, tuple[float, int]] = OrderedDict()
        self._acks: OrderedDict[RouteKey, Item] = OrderedDict()
        self._control: deque[link_pb2.LinkMessage] = deque(maxlen=CONTROL_MAX)
        self._ready: deque[Route] = deque()
        #: The route of the message ``next_outbound`` returned last (a lane mark names its route).
        self.picked: RouteKey = ("", "")
        #: Account -> weight of its routes in the deficit round robin (absent: 1).
        self.weights: dict[str, int] = dict(weights or {})
        self._streams = 0
        self.outbound_wake = asyncio.Event()
        self.link_up = False
        self.buffered_in = 0
        self.buffered_out = 0
        shared_routes = self.shared
        BUFFERED_BYTES.labels("to_trainers").set_function(lambda: shared_routes.buffered("to_trainers"))
        BUFFERED_BYTES.labels("to_peer").set_function(lambda: shared_routes.buffered("to_peer"))

    @property
    def max_window_bytes(self) -> int:
        return self.limits.max_window_bytes

    def get(self, key: RouteKey) -> Route | None:
        """The route for ``key`` if one exists (attached or still buffering)."""
        return self._routes.get(key)

    def open_routes(self) -> int:
        """Edges open on the switch (every peer link's routes)."""
        return sum(1 for route in self.shared.routes() if route.attachment is not None)

    def _new_route(self, key: RouteKey, epoch: int) -> Route:
        self._streams = (self._streams + 1) & 0xFFFFFFFF
        now = self._clock()
        return Route(key=key, created_at=now, unattached_since=now, epoch=epoch, stream=self._streams)

    def _push_inbound(self, route: Route, message: relay_pb2.EdgeMessage) -> None:
        size = message.ByteSize()
        route.inbound.append(Item(message, size, route.epoch))
        route.inbound_bytes += size
        self.buffered_in += size
        if route.attachment is not None:
            route.attachment.wake.set()

    def _drop_inbound(self, route: Route, keep_close: bool = False) -> None:
        kept: deque[Item] = deque()
        for item in route.inbound:
            if keep_close and is_close(item.message):
                kept.append(item)
            else:
                route.inbound_bytes -= item.size
                self.buffered_in -= item.size
        route.inbound = kept
        route.inbound_items = 0
        if route.inbound_ack is not None:
            route.inbound_bytes -= route.inbound_ack.size
            self.buffered_in -= route.inbound_ack.size
            route.inbound_ack = None

    def _purge_outbound(self, route: Route, keep_close: bool = True) -> None:
        kept: deque[Item] = deque()
        for item in route.outbound:
            if keep_close and is_close(item.message):
                kept.append(item)
            else:
                route.outbound_bytes -= item.size
                self.buffered_out -= item.size
        route.outbound = kept
        ack = self._acks.pop(route.key, None)
        if ack is not None:
            self.buffered_out -= ack.size

    def _supersede(self, route: Route, replay: Position, *, inbound: bool) -> None:
        """A replay starts at ``replay``: drop the queued frame parts and signals it will resend.

        A sender rewinds (its retransmit timeout, a resume ack, a reconnect) to its first
        unacknowledged item and resends everything after it in order, at once and within credit
        it already had. Whatever of that stream still waits in this buffer was not delivered, so
        not acknowledged, so it sits at or after the replay's start and its copy follows: keeping
        the original too would hold a window per rewind (a second rewind before the first drained
        overran the route's bound of two windows). Dropping it keeps the order the
        receiver sees (what already left, then the replay from its start) and delivery exactly once;
        a session that ends mid-replay purges both and the trainers resume.
        """
        queue = route.inbound if inbound else route.outbound
        dropped_bytes = dropped = 0
        # A sender's stream is queued in rising order, so what the replay resends is the queue's tail:
        # popping it costs one step per dropped item (a scan per replayed item would be quadratic).
        while queue:
            position = stream_position(queue[-1].message, queue[-1].epoch)
            if position is None or position[0] != replay[0] or position < replay:
                break
            dropped_bytes += queue.pop().size
            dropped += 1
        if not dropped:
            return
        if inbound:
            route.inbound_bytes -= dropped_bytes
            route.inbound_items -= dropped
            self.buffered_in -= dropped_bytes
        else:
            route.outbound_bytes -= dropped_bytes
            self.buffered_out -= dropped_bytes
        ITEMS_SUPERSEDED.labels("to_trainers" if inbound else "to_peer").inc(dropped)
