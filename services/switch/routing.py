"""Routes between local trainer streams and the WAN link, keyed by (job, edge): a bounded relay.

Each model edge crosses the cluster boundary exactly once, so a cluster holds exactly one end of it:
everything arriving from the peer for (job, edge) goes to the one local stream that opened that edge.
Items may arrive before the local trainer attaches (the clusters start independently), so a route is
created by whichever comes first.

Nothing here ever waits. The link reader hands each item to :meth:`Router.deliver`, which appends it
to the route's buffer toward the local trainer (or closes the route when a bound is exceeded); the
relay servicer hands each item of its trainer to :meth:`Router.accept_local`; the link writer takes
items with :meth:`Router.next_outbound`, which shares the link among routes by deficit round robin
over bytes. Within a route, frames, signals and close keep their order.

End-to-end reliability (sequence numbers, acks, credit, replay) belongs to the two trainers (edge
protocol 2, ``proto/nebula/v1/relay.proto``); the switch only enforces its bounds.

A vanished trainer ("A vanished trainer" in relay.proto). A stream that ends without a close leaves
its route **orphaned** for ``orphan_timeout_s`` instead of failing the peer: a reconnect (same epoch)
or a restarted trainer (higher epoch) re-attaches and continues; on timeout the route is closed like
any route over a bound (error close to the peer naming this cluster and the timeout, ``route.closed``
audited with the owning account, ``nebula_switch_routes_closed_total{reason="orphan_timeout"}``).
While orphaned, frames and signals of the vanished stream's epoch are not buffered (a reconnecting
trainer's resume ack makes the peer replay them; a restarted one voids them); items of a higher epoch
(the peer's RESUME), the peer's latest ack and its close are kept, within the unattached bounds.

:class:`Router` is the two sides of that relay (the local trainers', the peer's) and the link's
sessions; its other parts are modules of their own, each a base of it over the one route table:

* ``route_state.py``: a route, its attached stream, its items, and the router's errors;
* ``route_limits.py``: the bounds (:class:`Limits`) and the memory bound they add up to;
* ``route_table.py``: the routes, their buffers and byte counts, and replays superseding queued items;
* ``route_scheduler.py``: what the link writer sends next (acks, closes, deficit round robin);
* ``route_closing.py``: closing a route over a bound, past its timeout or with a revoked credential;
* ``route_epochs.py``: attaching trainer streams, take-overs, and a route's epoch rising.

The names other modules imported from here before the split still import from here.
"""

from __future__ import annotations

from nebula_common.proto.nebula.v1 import relay_pb2
from services.switch.metrics import ITEMS_DROPPED, STALE_ITEMS
from services.switch.route_closing import RouteClosing
from services.switch.route_epochs import RouteEpochs
from services.switch.route_limits import (
    ATTACHED_MAX_ITEMS,
    CONTROL_MAX,
    INITIAL_WINDOW_BYTES,
    JOB_OWNERS_REMEMBERED,
    REPLAY_FACTOR,
    SLACK_BYTES,
    TOMBSTONE_S,
    TOMBSTONES_MAX,
    UNATTACHED_MAX_ITEMS,
    Limits,
)
from services.switch.route_scheduler import QUANTUM_BYTES, LinkScheduler
from services.switch.route_state import (
    ORPHANED,
    RESTARTED,
    Attachment,
    EdgeItem,
    Item,
    Outbound,
    Position,
    Route,
    RouteInUseError,
    RouteKey,
    RouteLimitError,
    StaleEpochError,
    counts_as_item,
    is_held,
    item_size,
    merge_ack,
    stream_position,
)
from services.switch.route_table import Record, SharedRoutes

__all__ = [
    "ATTACHED_MAX_ITEMS",
    "CONTROL_MAX",
    "INITIAL_WINDOW_BYTES",
    "JOB_OWNERS_REMEMBERED",
    "ORPHANED",
    "QUANTUM_BYTES",
    "REPLAY_FACTOR",
    "RESTARTED",
    "SLACK_BYTES",
    "TOMBSTONES_MAX",
    "TOMBSTONE_S",
    "UNATTACHED_MAX_ITEMS",
    "Attachment",
    "EdgeItem",
    "Item",
    "Limits",
    "Outbound",
    "Position",
    "Record",
    "Route",
    "RouteInUseError",
    "RouteKey",
    "RouteLimitError",
    "Router",
    "SharedRoutes",
    "StaleEpochError",
    "item_size",
]


class Router(RouteEpochs, RouteClosing, LinkScheduler):
    """The routes of one peer link: what the local trainers and the peer send, and the link's sessions."""

    # ----- local trainers --------------------------------------------------------------------
    def accept_local(self, route: Route, attachment: Attachment, message: EdgeItem) -> bool:
        """Queue an item of the local trainer for the peer; False if the route is (now) closed."""
        if route.attachment is not attachment or route.closed_reason is not None:
            return False
        kind = message.WhichOneof("body")
        if kind == "ack":
            assert isinstance(message, relay_pb2.EdgeMessage)
            old = self._acks.pop(route.key, None)
            if old is not None:
                self.buffered_out -= old.size
            merged = merge_ack(old, message, attachment.epoch)
            self._acks[route.key] = merged
            self.buffered_out += merged.size
            self.outbound_wake.set()
            return True
        size = item_size(message)
        position = stream_position(message, attachment.epoch)
        if position is not None:
            last, route.last_outbound = route.last_outbound, position
            if last is not None and position <= last:
                self._supersede(route, position, inbound=False)
        self._push_outbound(route, Item(message, size, attachment.epoch))
        bound = self.limits.route_bound_bytes
        if route.outbound_bytes > bound:
            self.close_route(
                route,
                "credit",
                f"{route.outbound_bytes} bytes sent by the local trainer are waiting for the link, "
                f"above the route's bound of {bound} ({REPLAY_FACTOR} x max_window_bytes "
                f"{self.limits.max_window_bytes} + slack {SLACK_BYTES}): the trainer sent beyond the "
                "credit it was granted",
            )
            return False
        return True

    def pop_inbound(self, route: Route, attachment: Attachment) -> EdgeItem | None:
        """The next item for the local trainer (acks first), or None when there is none for it."""
        if route.attachment is not attachment:
            return None
        if route.inbound_ack is not None:
            item = route.inbound_ack
            route.inbound_ack = None
        elif route.inbound:
            item = route.inbound.popleft()
            if counts_as_item(item.message):
                route.inbound_items -= 1
        else:
            return None
        route.inbound_bytes -= item.size
        self.buffered_in -= item.size
        return item.message

    def end_stream(
        self,
        route: Route,
        attachment: Attachment,
        close: relay_pb2.EdgeClose | None,
        *,
        vanished: bool = False,
    ) -> None:
        """The stream of ``attachment`` ended; ``close`` (if given) goes to the peer after purging.

        The route leaves the table (a superseded or restarted stream's route stays: it belongs to its
        successor); items already queued toward the peer still drain through the link writer. A
        ``vanished`` stream (no close: a crash, a kill) leaves its route orphaned for its owner for
        ``orphan_timeout_s`` and tells the peer nothing yet (relay.proto, "A vanished trainer").
        """
        if route.attachment is not attachment:
            return
        route.attachment = None
        if vanished and route.closed_reason is None:
            route.detached = ORPHANED
            route.detached_epoch = attachment.epoch
            route.unattached_since = self._clock()
            # A reconnecting trainer's resume ack makes the peer replay these; a restarted one voids them.
            self._drop_inbound(route)
            return
        if close is not None and route.closed_reason is None:
            self._purge_outbound(route, keep_close=False)
            self._push_outbound(route, Item(relay_pb2.EdgeMessage(close=close), 0, attachment.epoch))
        self._drop_inbound(route)
        if self._routes.get(route.key) is route:
            del self._routes[route.key]

    # ----- the peer --------------------------------------------------------------------------
    def deliver(self, key: RouteKey, message: EdgeItem, epoch: int = 0) -> None:
        """Buffer an item of the peer's stream at ``epoch`` for the local end; never waits.

        Closes the route if over a bound; drops (and counts) items below the route's epoch; an item
        above it raises the route's epoch first.
        """
        tombstone = self._tombstones.get(key)
        if tombstone is not None:
            expiry, closed_epoch = tombstone
            if expiry > self._clock() and epoch <= closed_epoch:
                ITEMS_DROPPED.inc()
                return
            del self._tombstones[key]  # expired, or a newer attempt of the edge: a new route
        kind = message.WhichOneof("body")
        route = self._routes.get(key)
        if route is None:
            if kind == "close":
                return  # nobody here holds this edge: nothing to close
            unattached = sum(1 for r in self._routes.values() if not is_held(r))
            if unattached >= self.limits.max_unattached_routes:
                self._refuse_new(
                    key,
                    "unattached_routes",
                    f"{unattached} routes with no attached receiver already exist, the limit "
                    f"(max_unattached_routes = {self.limits.max_unattached_routes})",
                    epoch,
                )
                return
            route = self._routes[key] = self._new_route(key, epoch)
        if epoch < route.epoch:
            STALE_ITEMS.inc()
            return
        if epoch > route.epoch:
            self._raise_epoch(
                route,
                epoch,
                f"cluster {self.peer_cluster_id or 'peer'!r}'s stage restarted edge {key[1]!r} of job "
                f"{key[0]!r} at epoch {epoch}",
            )
        if route.attachment is None:
            if kind == "close" and route.detached is None:
                # Nobody here ever opened this edge: drop what was buffered for it.
                self._drop_inbound(route)
                del self._routes[key]
                return
            if route.detached == ORPHANED and epoch == route.detached_epoch and counts_as_item(message):
                # Not buffered: a reconnecting trainer's resume ack makes the peer replay it.
                ITEMS_DROPPED.inc()
                return
        if kind == "ack":
            assert isinstance(message, relay_pb2.EdgeMessage)
            old = route.inbound_ack
            if old is not None:
                route.inbound_bytes -= old.size
                self.buffered_in -= old.size
            route.inbound_ack = merge_ack(old, message, epoch)
            size = route.inbound_ack.size
        else:
            size = item_size(message)
            position = stream_position(message, epoch)
            if position is not None:
                last, route.last_inbound = route.last_inbound, position
                if last is not None and position <= last:
                    self._supersede(route, position, inbound=True)
            route.inbound.append(Item(message, size, epoch))
            if kind != "close":
                route.inbound_items += 1
        route.inbound_bytes += size
        self.buffered_in += size
        if not self._within_bounds(route) or route.attachment is None:
            return
        route.attachment.wake.set()

    # ----- link sessions ---------------------------------------------------------------------
    def link_down(self, reason: str) -> None:
        """The session ended: purge buffers both ways (trainers replay) and tell attached trainers.

        Routes stay attached; routes kept for their owner (orphaned or restarted) stay with their epoch
        and timeout; other unattached routes are dropped.
        """
        self.link_up = False
        for route in list(self._ready):
            self._purge_outbound(route)
        for key, route in list(self._routes.items()):
            self._purge_outbound(route)
            if route.attachment is None:
                self._drop_inbound(route)
                if route.detached is None:
                    del self._routes[key]
                continue
            self._drop_inbound(route, keep_close=True)
            self._push_inbound(
                route, relay_pb2.EdgeMessage(notice=relay_pb2.LinkNotice(up=False, reason=reason))
            )
        self._acks.clear()

    def link_came_up(self) -> None:
        """A session is up: attached trainers get a notice (and resume with an ack)."""
        self.link_up = True
        for route in self._routes.values():
            if route.attachment is not None:
                # Items sent during the outage are replayed by the trainer after the peer's resume ack.
                self._purge_outbound(route)
                self._push_inbound(route, relay_pb2.EdgeMessage(notice=relay_pb2.LinkNotice(up=True)))
