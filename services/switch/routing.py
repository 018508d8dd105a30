"""Routes between local trainer streams and the WAN link, keyed by (job, edge): a bounded relay.

Each model edge crosses the cluster boundary exactly once, so a cluster holds exactly one end of it:
everything arriving from the peer for (job, edge) goes to the one local stream that opened that edge.
Items may arrive before the local trainer attaches (the clusters start independently), so a route is
created by whichever comes first.

Nothing here ever waits. The link reader hands each item to :meth:`Router.deliver`, which appends it
to the route's buffer toward the local trainer (or closes the route when a bound is exceeded); the
relay servicer hands each item of its trainer to :meth:`Router.accept_local`; the link writer takes
items with :meth:`Router.next_outbound`: every pending ack first (tiny, they unblock senders), then
closes of routes the switch dropped, then one item per route in round robin, so a big tensor of one job
never holds up a small item of another. Within a route, frames, signals and close keep their order.

End-to-end reliability (sequence numbers, acks, credit, replay) belongs to the two trainers (edge
protocol 2, ``proto/nebula/v1/relay.proto``); the switch only enforces the bounds below.

Memory bound. Sizes are the contract's wire sizes (``ByteSize()`` of the TensorFrame or EdgeSignal, the
unit credit is counted in; acks, closes and notices count their EdgeMessage size) of the items a switch
holds in its own buffers, per route and direction (W = ``max_window_bytes``, S = ``SLACK_BYTES``):

* attached route: at most 2W + S bytes (``REPLAY_FACTOR``: right after a resume or a reconnect a window
  of replays may sit behind a window of originals) and ``ATTACHED_MAX_ITEMS`` items toward the trainer,
  and 2W + S bytes toward the peer (a trainer sending past that is cheating credit and its route is
  closed);
* route with no attached trainer: at most INITIAL_WINDOW_BYTES + S bytes, ``UNATTACHED_MAX_ITEMS`` items
  and ``unattached_timeout_s`` seconds;
* per switch: ``max_attached_routes`` x 2 x (2W + S) + ``max_unattached_routes`` x (INITIAL_WINDOW_BYTES
  + S), plus ``TOMBSTONES_MAX`` remembered keys, ``CONTROL_MAX`` pending closes and the link's
  HTTP/2 window (``link_window_bytes``) each way (defaults:
  128 x 2 x 16.06 MiB + 256 x 1.06 MiB = 4.3 GiB worst case; conforming trainers keep at most one
  window per direction in transit across both switches, so a healthy route holds at most W here).
  Acks are coalesced, one per route and direction.

A route over any bound is closed: an error close naming this switch, the bound and the numbers goes to
the sender (across the link) and to the local trainer if one is attached, buffered items are dropped,
the key is tombstoned for ``tombstone_s`` (later items for it are dropped), and ``route.closed`` is
audited and counted.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from nebula_common.proto.nebula.v1 import link_pb2, relay_pb2
from services.switch.metrics import BUFFERED_BYTES, ITEMS_DROPPED, ROUTES_CLOSED

RouteKey = tuple[str, str]

INITIAL_WINDOW_BYTES = 1 << 20
"""Credit a sender has before the first ack (relay.proto's delivery contract)."""
SLACK_BYTES = 64 * 1024
"""Room above a window for items credit does not cover (acks, close, notices)."""
UNATTACHED_MAX_ITEMS = 4096
ATTACHED_MAX_ITEMS = 65536
TOMBSTONES_MAX = 4096
CONTROL_MAX = 4096
JOB_OWNERS_REMEMBERED = 100_000
REPLAY_FACTOR = 2
"""Windows a route may hold per direction: right after a resume or a reconnect the sender replays up to
one window while originals of the same items may still be buffered here (receivers drop the copies)."""
"""Job ids whose owning account the switch remembers (oldest forgotten first); far above live jobs."""

Record = Callable[..., None]


class RouteInUseError(Exception):
    """A second local stream tried to open an edge that is already open (or another account's job)."""


class RouteLimitError(Exception):
    """Opening the edge would exceed a route limit of the account or of the switch."""


@dataclass(frozen=True)
class Limits:
    max_window_bytes: int = 8 << 20
    unattached_timeout_s: float = 120.0
    max_routes_per_account: int = 32
    max_attached_routes: int = 128
    max_unattached_routes: int = 256
    tombstone_s: float = 60.0

    @property
    def route_bound_bytes(self) -> int:
        """Bytes one route may hold per direction: a window of replays behind a window of originals."""
        return REPLAY_FACTOR * self.max_window_bytes + SLACK_BYTES


def item_size(message: relay_pb2.EdgeMessage) -> int:
    """The size an item counts for: credit's wire size for frames and signals, else the message size."""
    kind = message.WhichOneof("body")
    if kind == "frame":
        return message.frame.ByteSize()
    if kind == "signal":
        return message.signal.ByteSize()
    return message.ByteSize()


class Attachment:
    """One local trainer stream attached to a route; replaced (superseded) by a reconnect."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self.wake = asyncio.Event()  # items toward the trainer, or the stream must end
        self.superseded = False
        self.local_closed = False  # the trainer sent its close (or ended its stream orderly)


@dataclass(eq=False)
class Route:
    key: RouteKey
    owner: str = ""
    attachment: Attachment | None = None
    created_at: float = 0.0
    # toward the local trainer
    inbound: deque[tuple[relay_pb2.EdgeMessage, int]] = field(default_factory=deque)
    inbound_ack: tuple[relay_pb2.EdgeMessage, int] | None = None
    inbound_bytes: int = 0
    inbound_items: int = 0
    # toward the peer (acks go through the router's ack table, not here)
    outbound: deque[tuple[relay_pb2.EdgeMessage, int]] = field(default_factory=deque)
    outbound_bytes: int = 0
    in_ready: bool = False
    #: Why the switch closed the route itself (None while open).
    closed_reason: str | None = None

    @property
    def attached(self) -> bool:
        return self.attachment is not None


def _merge_ack(
    old: tuple[relay_pb2.EdgeMessage, int] | None, new: relay_pb2.EdgeMessage
) -> tuple[relay_pb2.EdgeMessage, int]:
    """Only the newest ack matters (absolute credit); a pending resume must not be lost."""
    if old is not None and old[0].ack.resume and not new.ack.resume:
        merged = relay_pb2.EdgeMessage()
        merged.CopyFrom(new)
        merged.ack.resume = True
        new = merged
    return new, new.ByteSize()


def _is_close(message: relay_pb2.EdgeMessage) -> bool:
    return message.WhichOneof("body") == "close"


class Router:
    def __init__(
        self,
        limits: Limits | None = None,
        *,
        cluster_id: str = "",
        record: Record | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.limits = limits or Limits()
        self.cluster_id = cluster_id
        self.record = record
        self._clock = clock
        self._routes: dict[RouteKey, Route] = {}
        # job id -> account that first attached an edge of it. A job's edges belong to one account,
        # so once claimed, no other account of this cluster can attach to (and read) any of its edges,
        # even after the owner's stream ended (a restarted stage re-attaches under the same account).
        self._job_owners: dict[str, str] = {}
        self._tombstones: OrderedDict[RouteKey, float] = OrderedDict()
        self._acks: OrderedDict[RouteKey, tuple[relay_pb2.EdgeMessage, int]] = OrderedDict()
        self._control: deque[link_pb2.LinkMessage] = deque(maxlen=CONTROL_MAX)
        self._ready: deque[Route] = deque()
        self.outbound_wake = asyncio.Event()
        self.link_up = False
        self.buffered_in = 0
        self.buffered_out = 0
        BUFFERED_BYTES.labels("to_trainers").set_function(lambda: self.buffered_in)
        BUFFERED_BYTES.labels("to_peer").set_function(lambda: self.buffered_out)

    @property
    def max_window_bytes(self) -> int:
        return self.limits.max_window_bytes

    # ----- local trainers --------------------------------------------------------------------
    def attach(self, key: RouteKey, owner: str, reconnect: bool = False) -> tuple[Route, Attachment]:
        """Bind the local end of an edge to a trainer stream opened by account ``owner``.

        With ``reconnect`` a stream of the same account replaces the one attached (which then ends
        quietly); buffered items stay. Without it a second opener is refused.
        """
        claimed_by = self._job_owners.get(key[0])
        if claimed_by is not None and claimed_by != owner:
            # Same answer as a busy edge: another account's job is not ours to confirm or deny.
            raise RouteInUseError(f"edge {key[1]!r} of job {key[0]!r} is not available to this account")
        route = self._routes.get(key)
        if route is not None and route.attachment is not None:
            if not (reconnect and route.owner == owner):
                raise RouteInUseError(f"edge {key[1]!r} of job {key[0]!r} is already open on this switch")
            previous = route.attachment
            previous.superseded = True
            previous.wake.set()
        else:
            attached = [r for r in self._routes.values() if r.attachment is not None]
            mine = sum(1 for r in attached if r.owner == owner)
            if mine >= self.limits.max_routes_per_account:
                raise RouteLimitError(
                    f"account {owner!r} already has {mine} edges open on switch {self.cluster_id!r}, "
                    f"the limit per account (max_routes_per_account = {self.limits.max_routes_per_account})"
                )
            if len(attached) >= self.limits.max_attached_routes:
                raise RouteLimitError(
                    f"switch {self.cluster_id!r} already has {len(attached)} edges open, its limit "
                    f"(max_attached_routes = {self.limits.max_attached_routes})"
                )
            self._tombstones.pop(key, None)
            if route is None:
                route = self._routes[key] = self._new_route(key)
        attachment = Attachment(owner)
        route.attachment = attachment
        route.owner = owner
        if route.inbound or route.inbound_ack is not None:
            attachment.wake.set()
        if claimed_by is None:
            self._job_owners[key[0]] = owner
            while len(self._job_owners) > JOB_OWNERS_REMEMBERED:
                del self._job_owners[next(iter(self._job_owners))]
        return route, attachment

    def get(self, key: RouteKey) -> Route | None:
        """The route for ``key`` if one exists (attached or still buffering)."""
        return self._routes.get(key)

    def accept_local(self, route: Route, attachment: Attachment, message: relay_pb2.EdgeMessage) -> bool:
        """Queue an item of the local trainer for the peer; False if the route is (now) closed."""
        if route.attachment is not attachment or route.closed_reason is not None:
            return False
        kind = message.WhichOneof("body")
        if kind == "ack":
            old = self._acks.pop(route.key, None)
            if old is not None:
                self.buffered_out -= old[1]
            merged = _merge_ack(old, message)
            self._acks[route.key] = merged
            self.buffered_out += merged[1]
            self.outbound_wake.set()
            return True
        size = item_size(message)
        self._push_outbound(route, message, size)
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

    def _push_outbound(self, route: Route, message: relay_pb2.EdgeMessage, size: int) -> None:
        route.outbound.append((message, size))
        route.outbound_bytes += size
        self.buffered_out += size
        if not route.in_ready:
            route.in_ready = True
            self._ready.append(route)
        self.outbound_wake.set()

    def pop_inbound(self, route: Route, attachment: Attachment) -> relay_pb2.EdgeMessage | None:
        """The next item for the local trainer (acks first), or None when there is none for it."""
        if route.attachment is not attachment:
            return None
        if route.inbound_ack is not None:
            message, size = route.inbound_ack
            route.inbound_ack = None
        elif route.inbound:
            message, size = route.inbound.popleft()
            if not _is_close(message) and message.WhichOneof("body") in ("frame", "signal"):
                route.inbound_items -= 1
        else:
            return None
        route.inbound_bytes -= size
        self.buffered_in -= size
        return message

    def end_stream(self, route: Route, attachment: Attachment, close: relay_pb2.EdgeClose | None) -> None:
        """The stream of ``attachment`` ended; ``close`` (if given) goes to the peer after purging.

        The route leaves the table (a superseded stream's route stays: it belongs to its successor);
        items already queued toward the peer still drain through the link writer.
        """
        if route.attachment is not attachment:
            return
        route.attachment = None
        if close is not None and route.closed_reason is None:
            self._purge_outbound(route, keep_close=False)
            self._push_outbound(route, relay_pb2.EdgeMessage(close=close), 0)
        self._drop_inbound(route)
        if self._routes.get(route.key) is route:
            del self._routes[route.key]

    def open_routes(self) -> int:
        return sum(1 for route in self._routes.values() if route.attachment is not None)

    # ----- the peer --------------------------------------------------------------------------
    def deliver(self, key: RouteKey, message: relay_pb2.EdgeMessage) -> None:
        """Buffer an item from the peer for the local end; never waits (closes the route if over bound)."""
        expiry = self._tombstones.get(key)
        if expiry is not None:
            if expiry > self._clock():
                ITEMS_DROPPED.inc()
                return
            del self._tombstones[key]
        kind = message.WhichOneof("body")
        route = self._routes.get(key)
        if route is None:
            if kind == "close":
                return  # nobody here holds this edge: nothing to close
            unattached = sum(1 for r in self._routes.values() if r.attachment is None)
            if unattached >= self.limits.max_unattached_routes:
                self._refuse_new(
                    key,
                    "unattached_routes",
                    f"{unattached} routes with no attached receiver already exist, the limit "
                    f"(max_unattached_routes = {self.limits.max_unattached_routes})",
                )
                return
            route = self._routes[key] = self._new_route(key)
        if kind == "close" and route.attachment is None:
            # Nobody here ever opened this edge: drop what was buffered for it.
            self._drop_inbound(route)
            del self._routes[key]
            return
        if kind == "ack":
            old = route.inbound_ack
            if old is not None:
                route.inbound_bytes -= old[1]
                self.buffered_in -= old[1]
            route.inbound_ack = _merge_ack(old, message)
            size = route.inbound_ack[1]
        else:
            size = item_size(message)
            route.inbound.append((message, size))
            if kind != "close":
                route.inbound_items += 1
        route.inbound_bytes += size
        self.buffered_in += size
        if not self._within_bounds(route) or route.attachment is None:
            return
        route.attachment.wake.set()

    def _within_bounds(self, route: Route) -> bool:
        """Close ``route`` if its buffer toward the trainer exceeds a bound; True if it is within."""
        if route.attachment is not None:
            bound = self.limits.route_bound_bytes
            if route.inbound_bytes > bound:
                self.close_route(
                    route,
                    "window",
                    f"{route.inbound_bytes} bytes buffered for the receiving trainer, above the route's "
                    f"bound of {bound} ({REPLAY_FACTOR} x max_window_bytes {self.limits.max_window_bytes}"
                    f" + slack {SLACK_BYTES}): the sender exceeded the credit of the receiver, or the "
                    "receiver does not read",
                )
                return False
            if route.inbound_items > ATTACHED_MAX_ITEMS:
                self.close_route(
                    route,
                    "items",
                    f"{route.inbound_items} items buffered for the receiving trainer, above the route's "
                    f"bound of {ATTACHED_MAX_ITEMS} items",
                )
                return False
            return True
        bound = INITIAL_WINDOW_BYTES + SLACK_BYTES
        if route.inbound_bytes > bound:
            self.close_route(
                route,
                "unattached_bytes",
                f"{route.inbound_bytes} bytes buffered with no receiver attached, above the bound of "
                f"{bound} (initial window {INITIAL_WINDOW_BYTES} + slack {SLACK_BYTES})",
            )
            return False
        if route.inbound_items > UNATTACHED_MAX_ITEMS:
            self.close_route(
                route,
                "unattached_items",
                f"{route.inbound_items} items buffered with no receiver attached, above the bound of "
                f"{UNATTACHED_MAX_ITEMS} items",
            )
            return False
        return True

    # ----- closing ---------------------------------------------------------------------------
    def close_route(self, route: Route, label: str, detail: str) -> None:
        """Close a route over a bound: error close to the sender and the local trainer, tombstone, audit."""
        if route.closed_reason is not None:
            return
        job_id, edge = route.key
        reason = (
            f"switch {self.cluster_id!r} closed edge {edge!r} of job {job_id!r} (bound {label}): {detail}"
        )
        route.closed_reason = reason
        close = relay_pb2.EdgeClose(reason=reason, error=True)
        self._drop_inbound(route)
        self._purge_outbound(route, keep_close=False)
        self._queue_control(route.key, close)
        if route.attachment is not None:
            message = relay_pb2.EdgeMessage(close=close)
            size = message.ByteSize()
            route.inbound.append((message, size))
            route.inbound_bytes += size
            self.buffered_in += size
            route.attachment.wake.set()
        if self._routes.get(route.key) is route:
            del self._routes[route.key]
        self._tombstone(route.key)
        self._closed(route.key, route.owner, label, reason)

    def _refuse_new(self, key: RouteKey, label: str, detail: str) -> None:
        reason = (
            f"switch {self.cluster_id!r} refused edge {key[1]!r} of job {key[0]!r} (bound {label}): {detail}"
        )
        self._queue_control(key, relay_pb2.EdgeClose(reason=reason, error=True))
        self._tombstone(key)
        self._closed(key, "", label, reason)

    def _closed(self, key: RouteKey, account: str, label: str, reason: str) -> None:
        ROUTES_CLOSED.labels(label).inc()
        if self.record is not None:
            self.record(
                "route.closed",
                outcome="refused",
                account=account or self._job_owners.get(key[0], ""),
                job_id=key[0],
                edge=key[1],
                bound=label,
                reason=reason,
            )

    def _queue_control(self, key: RouteKey, close: relay_pb2.EdgeClose) -> None:
        self._control.append(
            link_pb2.LinkMessage(
                routed=link_pb2.RoutedItem(
                    job_id=key[0], edge=key[1], item=relay_pb2.EdgeMessage(close=close)
                )
            )
        )
        self.outbound_wake.set()

    def _tombstone(self, key: RouteKey) -> None:
        self._tombstones.pop(key, None)
        self._tombstones[key] = self._clock() + self.limits.tombstone_s
        while len(self._tombstones) > TOMBSTONES_MAX:
            self._tombstones.popitem(last=False)

    def _new_route(self, key: RouteKey) -> Route:
        return Route(key=key, created_at=self._clock())

    def _drop_inbound(self, route: Route, keep_close: bool = False) -> None:
        kept: deque[tuple[relay_pb2.EdgeMessage, int]] = deque()
        for message, size in route.inbound:
            if keep_close and _is_close(message):
                kept.append((message, size))
            else:
                route.inbound_bytes -= size
                self.buffered_in -= size
        route.inbound = kept
        route.inbound_items = 0
        if route.inbound_ack is not None:
            route.inbound_bytes -= route.inbound_ack[1]
            self.buffered_in -= route.inbound_ack[1]
            route.inbound_ack = None

    def _purge_outbound(self, route: Route, keep_close: bool = True) -> None:
        kept: deque[tuple[relay_pb2.EdgeMessage, int]] = deque()
        for message, size in route.outbound:
            if keep_close and _is_close(message):
                kept.append((message, size))
            else:
                route.outbound_bytes -= size
                self.buffered_out -= size
        route.outbound = kept
        ack = self._acks.pop(route.key, None)
        if ack is not None:
            self.buffered_out -= ack[1]

    # ----- the link writer -------------------------------------------------------------------
    def next_outbound(self) -> link_pb2.LinkMessage | None:
        """The next message for the peer: acks, then closes of dropped routes, then round robin."""
        if self._acks:
            (job_id, edge), (message, size) = self._acks.popitem(last=False)
            self.buffered_out -= size
            return link_pb2.LinkMessage(routed=link_pb2.RoutedItem(job_id=job_id, edge=edge, item=message))
        if self._control:
            return self._control.popleft()
        while self._ready:
            route = self._ready.popleft()
            if not route.outbound:
                route.in_ready = False
                continue
            message, size = route.outbound.popleft()
            route.outbound_bytes -= size
            self.buffered_out -= size
            if route.outbound:
                self._ready.append(route)
            else:
                route.in_ready = False
            return link_pb2.LinkMessage(
                routed=link_pb2.RoutedItem(job_id=route.key[0], edge=route.key[1], item=message)
            )
        return None

    def has_outbound(self) -> bool:
        return bool(self._acks or self._control or any(route.outbound for route in self._ready))

    # ----- link sessions ---------------------------------------------------------------------
    def link_down(self, reason: str) -> None:
        """The session ended: purge buffers both ways (trainers replay) and tell attached trainers.

        Routes stay attached; unattached routes are dropped.
        """
        self.link_up = False
        for route in list(self._ready):
            self._purge_outbound(route)
        for key, route in list(self._routes.items()):
            self._purge_outbound(route)
            if route.attachment is None:
                self._drop_inbound(route)
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

    def _push_inbound(self, route: Route, message: relay_pb2.EdgeMessage) -> None:
        size = message.ByteSize()
        route.inbound.append((message, size))
        route.inbound_bytes += size
        self.buffered_in += size
        if route.attachment is not None:
            route.attachment.wake.set()

    # ----- time ------------------------------------------------------------------------------
    def sweep(self) -> None:
        """Expire tombstones and close routes left unattached for longer than allowed."""
        now = self._clock()
        while self._tombstones:
            key, expiry = next(iter(self._tombstones.items()))
            if expiry > now:
                break
            del self._tombstones[key]
        timeout = self.limits.unattached_timeout_s
        for route in list(self._routes.values()):
            if route.attachment is None and now - route.created_at > timeout:
                self.close_route(
                    route,
                    "unattached_timeout",
                    f"no receiver attached within {timeout:g} s (unattached_timeout_s); "
                    f"{route.inbound_bytes} bytes in {route.inbound_items} items dropped",
                )

    async def run_sweeper(self) -> None:
        period = min(1.0, self.limits.unattached_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            self.sweep()
