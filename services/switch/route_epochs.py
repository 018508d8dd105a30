"""Who holds a route's local end: the trainer stream attached at the route's epoch, and take-overs.

A route is created by whichever comes first, the local trainer's open or the peer's first item (the
clusters start independently). Its local end belongs to one account's stream at a time: a second
opener is refused (:class:`RouteInUseError`, also for another account's job), a reconnect of the same
account at the same epoch takes the route over (the old stream ends quietly, buffered items stay),
and a restarted stage takes it over at a higher epoch.

Epochs ("Epochs" in relay.proto). A route's epoch is the highest epoch seen from either side: a local
``EdgeOpen.epoch`` or a ``RoutedItem.epoch`` from the peer. Every buffered item carries the epoch of the
stream it came from and items crossing the link are tagged with it (a close the switch makes carries
the route's epoch). When the epoch rises, buffered items of older epochs are discarded both ways and an
attached trainer of an older epoch gets an ``EdgeRestart`` (its stream then ends and the route waits,
unattached, for the restarted trainer); items from the peer below the route's epoch are dropped and
counted (``nebula_switch_stale_items_total``). A local open below the route's epoch is answered by
``EdgeReady`` and at once ``EdgeRestart`` (:class:`StaleEpochError`). Epoch 0 everywhere is the
behaviour without epochs.
"""

from __future__ import annotations

from collections import deque

from nebula_common.proto.nebula.v1 import relay_pb2
from services.switch.route_limits import JOB_OWNERS_REMEMBERED
from services.switch.route_state import (
    RESTARTED,
    Attachment,
    Item,
    Route,
    RouteInUseError,
    RouteKey,
    RouteLimitError,
    StaleEpochError,
    counts_as_item,
    is_held,
)
from services.switch.route_table import RouteTable


class RouteEpochs(RouteTable):
    """Attaching trainer streams to routes, and moving a route to a higher epoch."""

    def attach(
        self,
        key: RouteKey,
        owner: str,
        reconnect: bool = False,
        epoch: int = 0,
        issued_at: float = 0.0,
        serial: int = 0,
        expires_at: float = 0.0,
    ) -> tuple[Route, Attachment]:
        """Bind the local end of an edge to a trainer stream opened by account ``owner`` at ``epoch``.

        With ``reconnect`` a stream of the same account replaces the one attached at the same epoch
        (which then ends quietly); buffered items stay. Without it a second opener is refused. An epoch
        above the route's raises it: older buffered items are discarded both ways and a stream of the
        older epoch still attached gets an EdgeRestart. An epoch below it raises
        :class:`StaleEpochError` (nothing changes: the route belongs to the newer attempt).
        """
        claimed_by = self._job_owners.get(key[0])
        if claimed_by is not None and claimed_by != owner:
            # Same answer as a busy edge: another account's job is not ours to confirm or deny.
            raise RouteInUseError(f"edge {key[1]!r} of job {key[0]!r} is not available to this account")
        route = self._routes.get(key)
        if route is not None and epoch < route.epoch:
            raise StaleEpochError(
                route.epoch,
                f"edge {key[1]!r} of job {key[0]!r} is at epoch {route.epoch} on switch "
                f"{self.cluster_id!r}; this stream opened at epoch {epoch}, an attempt already replaced",
            )
        if route is not None and route.attachment is not None:
            previous = route.attachment
            if previous.epoch < epoch and route.owner == owner:
                # A restarted stage of the same account: the older attempt's stream is void.
                self._raise_epoch(route, epoch, f"this cluster's stage reopened the edge at epoch {epoch}")
            elif not (reconnect and route.owner == owner):
                raise RouteInUseError(f"edge {key[1]!r} of job {key[0]!r} is already open on this switch")
            else:
                previous.superseded = True
                previous.wake.set()
        if route is None or route.attachment is None:
            # Routes kept for their owner (orphaned or restarted) count as attached: re-attaching to
            # one's own does not need room, but crashing repeatedly cannot pile up routes either.
            # Every route of the switch counts, whichever peer link it belongs to.
            held = [r for r in self.shared.routes() if r is not route and is_held(r)]
            mine = sum(1 for r in held if r.owner == owner)
            if mine >= self.limits.max_routes_per_account:
                raise RouteLimitError(
                    f"account {owner!r} already has {mine} edges open on switch {self.cluster_id!r}, "
                    f"the limit per account (max_routes_per_account = {self.limits.max_routes_per_account})"
                )
            if len(held) >= self.limits.max_attached_routes:
                raise RouteLimitError(
                    f"switch {self.cluster_id!r} already has {len(held)} edges open, its limit "
                    f"(max_attached_routes = {self.limits.max_attached_routes})"
                )
            self._tombstones.pop(key, None)
            if route is None:
                route = self._routes[key] = self._new_route(key, epoch)
        if epoch > route.epoch:
            self._raise_epoch(route, epoch, f"this cluster's stage reopened the edge at epoch {epoch}")
        attachment = Attachment(owner, epoch)
        route.attachment = attachment
        route.detached = None
        route.owner = owner
        route.issued_at = issued_at
        route.serial = serial
        route.expires_at = expires_at
        if route.inbound or route.inbound_ack is not None:
            attachment.wake.set()
        if claimed_by is None:
            self._job_owners[key[0]] = owner
            while len(self._job_owners) > JOB_OWNERS_REMEMBERED:
                del self._job_owners[next(iter(self._job_owners))]
        return route, attachment

    def _raise_epoch(self, route: Route, epoch: int, reason: str) -> None:
        """The route moves to ``epoch``: older items are void both ways, an older attachment restarts."""
        route.epoch = epoch
        self._discard_older(route, epoch)
        attachment = route.attachment
        if attachment is not None and attachment.epoch < epoch:
            attachment.restart = relay_pb2.EdgeRestart(epoch=epoch, reason=reason)
            attachment.wake.set()
            route.attachment = None
            route.detached = RESTARTED
            route.detached_epoch = attachment.epoch
            route.unattached_since = self._clock()

    def _discard_older(self, route: Route, epoch: int) -> None:
        """Drop buffered items (both directions, acks included) of epochs below ``epoch``."""
        kept: deque[Item] = deque()
        for item in route.inbound:
            if item.epoch >= epoch:
                kept.append(item)
                continue
            route.inbound_bytes -= item.size
            self.buffered_in -= item.size
            if counts_as_item(item.message):
                route.inbound_items -= 1
        route.inbound = kept
        if route.inbound_ack is not None and route.inbound_ack.epoch < epoch:
            route.inbound_bytes -= route.inbound_ack.size
            self.buffered_in -= route.inbound_ack.size
            route.inbound_ack = None
        kept = deque()
        for item in route.outbound:
            if item.epoch >= epoch:
                kept.append(item)
                continue
            route.outbound_bytes -= item.size
            self.buffered_out -= item.size
        route.outbound = kept
        ack = self._acks.get(route.key)
        if ack is not None and ack.epoch < epoch:
            del self._acks[route.key]
            self.buffered_out -= ack.size
