"""Routes between local trainer streams and the WAN link, keyed by (job, edge): a bounded relay.

Each model edge crosses the cluster boundary exactly once, so a cluster holds exactly one end of it:
everything arriving from the peer for (job, edge) goes to the one local stream that opened that edge.
Items may arrive before the local trainer attaches (the clusters start independently), so a route is
created by whichever comes first.

Nothing here ever waits. The link reader hands each item to :meth:`Router.deliver`, which appends it
to the route's buffer toward the local trainer (or closes the route when a bound is exceeded); the
relay servicer hands each item of its trainer to :meth:`Router.accept_local`; the link writer takes
items with :meth:`Router.next_outbound`: every pending ack first (tiny, they unblock senders), then
closes of routes the switch dropped, then the routes' items by deficit round robin over bytes
(Shreedhar and Varghese, 1995): each route with items gets a quantum of bytes per round (times its
account's weight), so a big tensor of one job never holds up a small item of another, and two busy
routes share the link by bytes, not by items. On a paced link (``pacing.py``) items larger than the
link's fragment size leave as fragments, one per turn. Within a route, frames, signals and close keep
their order.

End-to-end reliability (sequence numbers, acks, credit, replay) belongs to the two trainers (edge
protocol 2, ``proto/nebula/v1/relay.proto``); the switch only enforces the bounds below.

Epochs ("Epochs" in relay.proto). A route's epoch is the highest epoch seen from either side: a local
``EdgeOpen.epoch`` or a ``RoutedItem.epoch`` from the peer. Every buffered item carries the epoch of the
stream it came from and items crossing the link are tagged with it (a close the switch makes carries
the route's epoch). When the epoch rises, buffered items of older epochs are discarded both ways and an
attached trainer of an older epoch gets an ``EdgeRestart`` (its stream then ends and the route waits,
unattached, for the restarted trainer); items from the peer below the route's epoch are dropped and
counted (``nebula_switch_stale_items_total``). A local open below the route's epoch is answered by
``EdgeReady`` and at once ``EdgeRestart`` (:class:`StaleEpochError`). Epoch 0 everywhere is the
behaviour without epochs.

A vanished trainer ("A vanished trainer" in relay.proto). A stream that ends without a close leaves
its route **orphaned** for ``orphan_timeout_s`` instead of failing the peer: a reconnect (same epoch)
or a restarted trainer (higher epoch) re-attaches and continues; on timeout the route is closed like
any route over a bound (error close to the peer naming this cluster and the timeout, ``route.closed``
audited with the owning account, ``nebula_switch_routes_closed_total{reason="orphan_timeout"}``).
While orphaned, frames and signals of the vanished stream's epoch are not buffered (a reconnecting
trainer's resume ack makes the peer replay them; a restarted one voids them); items of a higher epoch
(the peer's RESUME), the peer's latest ack and its close are kept, within the unattached bounds.

Memory bound. Sizes are the contract's wire sizes (``ByteSize()`` of the TensorFrame or EdgeSignal, the
unit credit is counted in; acks, closes and notices count their EdgeMessage size) of the items a switch
holds in its own buffers, per route and direction (W = ``max_window_bytes``, S = ``SLACK_BYTES``):

* attached route: at most 2W + S bytes (``REPLAY_FACTOR``: right after a resume or a reconnect a window
  of replays may sit behind a window of originals) and ``ATTACHED_MAX_ITEMS`` items toward the trainer,
  and 2W + S bytes toward the peer (a trainer sending past that is cheating credit and its route is
  closed);
* route with no attached trainer: at most INITIAL_WINDOW_BYTES + S bytes, ``UNATTACHED_MAX_ITEMS`` items
  and ``unattached_timeout_s`` seconds (``orphan_timeout_s`` when its trainer vanished) toward the
  trainer; toward the peer only what its last trainer queued, within the attached bound, draining;
* per switch: ``max_attached_routes`` x 2 x (2W + S) + ``max_unattached_routes`` x (INITIAL_WINDOW_BYTES
  + S) (a route kept for its owner after its trainer vanished or was restarted counts as attached for
  the route limits until it is re-attached or times out), plus ``TOMBSTONES_MAX`` remembered keys,
  ``CONTROL_MAX`` pending closes and the link's HTTP/2 window (``LINK_WINDOW_BYTES``) each way (defaults:
  128 x 2 x 32.06 MiB + 256 x 1.06 MiB = 8.3 GiB worst case; conforming trainers keep at most one
  window per direction in transit across both switches, so a healthy route holds at most W here).
  Acks are coalesced, one per route and direction.

A replay replaces what it resends (``Router._supersede``): a frame part or signal at or below the stream
position last queued in its direction starts a sender's rewind, and the queued frame parts and signals
from that position on (not delivered, so not acknowledged, and resent right behind) are dropped and
counted (``nebula_switch_items_superseded_total``); so rewinds while originals still wait hold one
window, not one per rewind.

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
from typing import NamedTuple

from nebula_common.proto.nebula.v1 import link_pb2, relay_pb2
from nebula_common.rpc.framing import FramedChunk
from services.switch.metrics import (
    BUFFERED_BYTES,
    ITEMS_DROPPED,
    ITEMS_SUPERSEDED,
    ROUTES_CLOSED,
    STALE_ITEMS,
)
from services.switch.pacing import Fragment

RouteKey = tuple[str, str]

INITIAL_WINDOW_BYTES = 1 << 20
"""Credit a sender has before the first ack (relay.proto's delivery contract)."""
SLACK_BYTES = 64 * 1024
"""Room above a window for items credit does not cover (acks, close, notices)."""
UNATTACHED_MAX_ITEMS = 4096
ATTACHED_MAX_ITEMS = 65536
TOMBSTONES_MAX = 4096
TOMBSTONE_S = 60.0
"""How long items for a route the switch closed are dropped without a trace."""
CONTROL_MAX = 4096
JOB_OWNERS_REMEMBERED = 100_000
QUANTUM_BYTES = 256 << 10
"""A route's bytes per round of the scheduler on a link that is not paced (a paced link: one fragment)."""
REPLAY_FACTOR = 2
"""Windows a route may hold per direction: right after a resume or a reconnect the sender replays up to
one window while originals of the same items may still be buffered here (receivers drop the copies)."""
"""Job ids whose owning account the switch remembers (oldest forgotten first); far above live jobs."""

Record = Callable[..., None]


class RouteInUseError(Exception):
    """A second local stream tried to open an edge that is already open (or another account's job)."""


class RouteLimitError(Exception):
    """Opening the edge would exceed a route limit of the account or of the switch."""


class StaleEpochError(Exception):
    """A local stream opened with an epoch below its route's: it gets EdgeReady and at once EdgeRestart."""

    def __init__(self, route_epoch: int, reason: str) -> None:
        super().__init__(reason)
        self.route_epoch = route_epoch
        self.reason = reason


EdgeItem = relay_pb2.EdgeMessage | FramedChunk
"""An edge item as the router holds it: a parsed message, or a framed chunk kept as its wire bytes."""
Outbound = link_pb2.LinkMessage | FramedChunk
"""What the link writer sends: a link message, or a framed chunk forwarded byte for byte."""


Position = tuple[int, int, int]
"""Where a frame part or signal stands in its stream: (epoch, sequence number, 0 for a header or a
signal, chunk offset + 1 for a chunk). A sender's items rise strictly; a lower or equal one is a replay."""


def _position(message: EdgeItem, epoch: int) -> Position | None:
    """The stream position of a sequenced item (frame part, signal); None for acks, closes, notices."""
    if isinstance(message, FramedChunk):
        return (epoch, message.frame_id, message.offset + 1)
    kind = message.WhichOneof("body")
    if kind == "frame":
        frame = message.frame
        if frame.WhichOneof("part") == "header":
            return (epoch, frame.header.frame_id, 0)
        return (epoch, frame.chunk.frame_id, frame.chunk.offset + 1)
    if kind == "signal":
        return (epoch, message.signal.seq, 0)
    return None


class Item(NamedTuple):
    """A buffered edge item: its wire size (what the bounds count) and the epoch of its stream."""

    message: EdgeItem
    size: int
    epoch: int


@dataclass(frozen=True)
class Limits:
    max_window_bytes: int = 16 << 20
    unattached_timeout_s: float = 120.0
    orphan_timeout_s: float = 120.0
    max_routes_per_account: int = 32
    max_attached_routes: int = 128
    max_unattached_routes: int = 256
    tombstone_s: float = TOMBSTONE_S

    @property
    def route_bound_bytes(self) -> int:
        """Bytes one route may hold per direction: a window of replays behind a window of originals."""
        return REPLAY_FACTOR * self.max_window_bytes + SLACK_BYTES


def item_size(message: EdgeItem) -> int:
    """The size an item counts for: credit's wire size for frames and signals, else the message size."""
    if isinstance(message, FramedChunk):
        return message.frame_size
    kind = message.WhichOneof("body")
    if kind == "frame":
        return message.frame.ByteSize()
    if kind == "signal":
        return message.signal.ByteSize()
    return message.ByteSize()


class Attachment:
    """One local trainer stream attached to a route; replaced (superseded) by a reconnect."""

    def __init__(self, owner: str, epoch: int = 0) -> None:
        self.owner = owner
        self.epoch = epoch
        self.wake = asyncio.Event()  # items toward the trainer, or the stream must end
        self.superseded = False
        self.local_closed = False  # the trainer sent its close (or ended its stream orderly)
        #: Set when the route moved to a higher epoch: the last message of this stream, then it ends.
        self.restart: relay_pb2.EdgeRestart | None = None


@dataclass(eq=False)
class Route:
    key: RouteKey
    owner: str = ""
    attachment: Attachment | None = None
    created_at: float = 0.0
    # toward the local trainer
    inbound: deque[Item] = field(default_factory=deque)
    inbound_ack: Item | None = None
    inbound_bytes: int = 0
    inbound_items: int = 0
    # toward the peer (acks go through the router's ack table, not here)
    outbound: deque[Item] = field(default_factory=deque)
    outbound_bytes: int = 0
    in_ready: bool = False
    #: Stream position of the last frame part or signal queued each way (see ``_supersede``).
    last_outbound: Position | None = None
    last_inbound: Position | None = None
    #: Why the switch closed the route itself (None while open).
    closed_reason: str | None = None
    #: The highest epoch either side has opened or sent (relay.proto, "Epochs").
    epoch: int = 0
    #: Why a route that had a trainer is kept without one for its owner: ORPHANED (the stream vanished)
    #: or RESTARTED (the route's epoch rose past it); None otherwise.
    detached: str | None = None
    #: Epoch of the stream that left a detached route.
    detached_epoch: int = 0
    #: Since when no trainer is attached (the unattached and orphan timeouts count from here).
    unattached_since: float = 0.0
    #: ``iat`` of the token the owner's latest stream opened with: the route ends when tokens of the
    #: owner issued before some time are revoked (``close_revoked``).
    issued_at: float = 0.0
    #: Serial of the client certificate that stream presented (0: none): revoking it ends the route.
    serial: int = 0
    #: ``exp`` of that token (0: none known): the route ends once it is past on every service, unless
    #: the owner's trainer renewed it (``renew``).
    expires_at: float = 0.0
    # The scheduler's state (``next_outbound``): bytes this route may still send in its turn, whether
    # its turn has begun, its fragment stream, and the item being sent in fragments (with its bytes
    # and how far they went).
    deficit: int = 0
    turn: bool = False
    stream: int = 0
    sending: Item | None = None
    sending_raw: bytes | memoryview = b""
    sent_offset: int = 0

    @property
    def attached(self) -> bool:
        return self.attachment is not None


ORPHANED = "orphaned"
RESTARTED = "restarted"


def _merge_ack(old: Item | None, new: relay_pb2.EdgeMessage, epoch: int) -> Item:
    """Only the newest ack matters (absolute credit); a pending resume of the same epoch must not be lost."""
    if old is not None and old.epoch == epoch and old.message.ack.resume and not new.ack.resume:
        merged = relay_pb2.EdgeMessage()
        merged.CopyFrom(new)
        merged.ack.resume = True
        new = merged
    return Item(new, new.ByteSize(), epoch)


def _is_close(message: EdgeItem) -> bool:
    return message.WhichOneof("body") == "close"


def _counts_as_item(message: EdgeItem) -> bool:
    """Frames and signals count toward a route's item bound (acks, closes and notices do not)."""
    return message.WhichOneof("body") in ("frame", "signal")


def _held(route: Route) -> bool:
    """A route that has a trainer, or is kept for the owner of one that vanished or restarted."""
    return route.attachment is not None or route.detached is not None


class SharedRoutes:
    """What the routers of one switch (one per peer link) share: the limits count every route of the
    switch, and a job belongs to one account whichever peer its edges lead to."""

    def __init__(self) -> None:
        self.routers: list[Router] = []
        # job id -> account that first attached an edge of it (see Router.attach).
        self.job_owners: dict[str, str] = {}

    def routes(self) -> list[Route]:
        return [route for router in self.routers for route in router._routes.values()]

    def buffered(self, direction: str) -> int:
        return sum(r.buffered_in if direction == "to_trainers" else r.buffered_out for r in self.routers)


class Router:
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

    # ----- local trainers --------------------------------------------------------------------
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
            held = [r for r in self.shared.routes() if r is not route and _held(r)]
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

    def get(self, key: RouteKey) -> Route | None:
        """The route for ``key`` if one exists (attached or still buffering)."""
        return self._routes.get(key)

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
            merged = _merge_ack(old, message, attachment.epoch)
            self._acks[route.key] = merged
            self.buffered_out += merged.size
            self.outbound_wake.set()
            return True
        size = item_size(message)
        position = _position(message, attachment.epoch)
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

    def _push_outbound(self, route: Route, item: Item) -> None:
        route.outbound.append(item)
        route.outbound_bytes += item.size
        self.buffered_out += item.size
        if not route.in_ready:
            # A route that had nothing queued goes first, as a new flow in FQ-CoDel (RFC 8290): a
            # job that sends little waits for no busy route's turn. It gets one quantum like any
            # other, then joins the round; a busy route is never empty, so it never jumps the queue.
            route.in_ready = True
            self._ready.appendleft(route)
        self.outbound_wake.set()

    def pop_inbound(self, route: Route, attachment: Attachment) -> EdgeItem | None:
        """The next item for the local trainer (acks first), or None when there is none for it."""
        if route.attachment is not attachment:
            return None
        if route.inbound_ack is not None:
            item = route.inbound_ack
            route.inbound_ack = None
        elif route.inbound:
            item = route.inbound.popleft()
            if _counts_as_item(item.message):
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

    def open_routes(self) -> int:
        """Edges open on the switch (every peer link's routes)."""
        return sum(1 for route in self.shared.routes() if route.attachment is not None)

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
            unattached = sum(1 for r in self._routes.values() if not _held(r))
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
            if route.detached == ORPHANED and epoch == route.detached_epoch and _counts_as_item(message):
                # Not buffered: a reconnecting trainer's resume ack makes the peer replay it.
                ITEMS_DROPPED.inc()
                return
        if kind == "ack":
            assert isinstance(message, relay_pb2.EdgeMessage)
            old = route.inbound_ack
            if old is not None:
                route.inbound_bytes -= old.size
                self.buffered_in -= old.size
            route.inbound_ack = _merge_ack(old, message, epoch)
            size = route.inbound_ack.size
        else:
            size = item_size(message)
            position = _position(message, epoch)
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
            position = _position(queue[-1].message, queue[-1].epoch)
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
            if _counts_as_item(item.message):
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
        self._queue_control(route.key, close, route.epoch)
        if route.attachment is not None:
            message = relay_pb2.EdgeMessage(close=close)
            size = message.ByteSize()
            route.inbound.append(Item(message, size, route.epoch))
            route.inbound_bytes += size
            self.buffered_in += size
            route.attachment.wake.set()
        if self._routes.get(route.key) is route:
            del self._routes[route.key]
        self._tombstone(route.key, route.epoch)
        self._closed(route.key, route.owner, label, reason)

    def renew(self, job_id: str, owner: str, issued_at: float, expires_at: float) -> int:
        """The open routes of ``owner``'s job ``job_id`` now run on a token issued at ``issued_at`` that
        expires at ``expires_at`` (its trainer renewed the job's token); returns how many."""
        renewed = 0
        for route in self._routes.values():
            if route.key[0] == job_id and route.owner == owner and route.closed_reason is None:
                route.issued_at = max(route.issued_at, issued_at)
                route.expires_at = max(route.expires_at, expires_at)
                renewed += 1
        return renewed

    def close_revoked(
        self,
        reason_of: Callable[[str, float], str | None],
        revoked_serials: frozenset[int] = frozenset(),
        expired_before: float = 0.0,
    ) -> int:
        """Close every route whose credential is revoked now: its owner's token (``reason_of(owner,
        issued_at)`` says why: account disabled, deleted, new password), the certificate its trainer
        presented (its serial on the cluster CA's CRL), or a token that expired before
        ``expired_before`` (wall clock) and was not renewed. Both trainers get the reason; returns how
        many were closed."""
        closed = 0
        for route in list(self._routes.values()):
            if not route.owner or route.closed_reason is not None:
                continue
            reason = reason_of(route.owner, route.issued_at)
            if reason is not None:
                reason = f"account {route.owner!r}: {reason}"
            elif route.serial and route.serial in revoked_serials:
                reason = f"the certificate {route.serial:x} its trainer opened it with is revoked"
            elif route.expires_at and route.expires_at < expired_before:
                expired = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(route.expires_at))
                reason = f"account {route.owner!r}: the token it runs on expired at {expired}, not renewed"
            if reason is not None:
                self.close_route(route, "credential", reason)
                closed += 1
        return closed

    def _refuse_new(self, key: RouteKey, label: str, detail: str, epoch: int) -> None:
        reason = (
            f"switch {self.cluster_id!r} refused edge {key[1]!r} of job {key[0]!r} (bound {label}): {detail}"
        )
        self._queue_control(key, relay_pb2.EdgeClose(reason=reason, error=True), epoch)
        self._tombstone(key, epoch)
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

    def _queue_control(self, key: RouteKey, close: relay_pb2.EdgeClose, epoch: int) -> None:
        self._control.append(
            link_pb2.LinkMessage(
                routed=link_pb2.RoutedItem(
                    job_id=key[0], edge=key[1], item=relay_pb2.EdgeMessage(close=close), epoch=epoch
                )
            )
        )
        self.outbound_wake.set()

    def _tombstone(self, key: RouteKey, epoch: int) -> None:
        self._tombstones.pop(key, None)
        self._tombstones[key] = (self._clock() + self.limits.tombstone_s, epoch)
        while len(self._tombstones) > TOMBSTONES_MAX:
            self._tombstones.popitem(last=False)

    def _new_route(self, key: RouteKey, epoch: int) -> Route:
        self._streams = (self._streams + 1) & 0xFFFFFFFF
        now = self._clock()
        return Route(key=key, created_at=now, unattached_since=now, epoch=epoch, stream=self._streams)

    def _drop_inbound(self, route: Route, keep_close: bool = False) -> None:
        kept: deque[Item] = deque()
        for item in route.inbound:
            if keep_close and _is_close(item.message):
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
            if keep_close and _is_close(item.message):
                kept.append(item)
            else:
                route.outbound_bytes -= item.size
                self.buffered_out -= item.size
        route.outbound = kept
        ack = self._acks.pop(route.key, None)
        if ack is not None:
            self.buffered_out -= ack.size

    # ----- the link writer -------------------------------------------------------------------
    def next_outbound(
        self, fragment_bytes: int | None = None, cut_above: int | None = None
    ) -> Outbound | Fragment | None:
        """The next message for the peer: acks, then closes of dropped routes, then the routes' items.

        Every item is tagged with the epoch of the stream it came from (``RoutedItem.epoch``); a
        framed chunk already carries its stream's job, edge and epoch and is returned as it came.
        With ``fragment_bytes`` (a paced link) an item larger than ``cut_above`` (default: the
        fragment size) leaves in fragments of that size.
        """
        if self._acks:
            (job_id, edge), item = self._acks.popitem(last=False)
            self.buffered_out -= item.size
            return link_pb2.LinkMessage(
                routed=link_pb2.RoutedItem(job_id=job_id, edge=edge, item=item.message, epoch=item.epoch)
            )
        if self._control:
            return self._control.popleft()
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
                    self._ready.rotate(-1)
                    continue
            piece, size = self._piece(route, fragment_bytes, cut_above or fragment_bytes)
            route.deficit -= size
            if not route.outbound:
                self._leave_ready()
            elif route.deficit <= 0:
                route.turn = False
                self._ready.rotate(-1)
            return piece
        return None

    def _leave_ready(self) -> None:
        """The route at the front has nothing more to send: out of the round, its deficit forgotten."""
        route = self._ready.popleft()
        route.in_ready = False
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

    def _push_inbound(self, route: Route, message: relay_pb2.EdgeMessage) -> None:
        size = message.ByteSize()
        route.inbound.append(Item(message, size, route.epoch))
        route.inbound_bytes += size
        self.buffered_in += size
        if route.attachment is not None:
            route.attachment.wake.set()

    # ----- time ------------------------------------------------------------------------------
    def sweep(self) -> None:
        """Expire tombstones and close routes left without a trainer for longer than allowed."""
        now = self._clock()
        while self._tombstones:
            key, (expiry, _) = next(iter(self._tombstones.items()))
            if expiry > now:
                break
            del self._tombstones[key]
        timeout = self.limits.unattached_timeout_s
        orphan_timeout = self.limits.orphan_timeout_s
        for route in list(self._routes.values()):
            if route.attachment is not None:
                continue
            waited = now - route.unattached_since
            if route.detached == ORPHANED:
                if waited > orphan_timeout:
                    self.close_route(
                        route,
                        "orphan_timeout",
                        f"the stage of cluster {self.cluster_id!r} vanished (its stream ended without a "
                        f"close) and did not re-attach within {orphan_timeout:g} s (orphan_timeout_s)",
                    )
            elif waited > timeout:
                self.close_route(
                    route,
                    "unattached_timeout",
                    f"no receiver attached within {timeout:g} s (unattached_timeout_s); "
                    f"{route.inbound_bytes} bytes in {route.inbound_items} items dropped",
                )

    async def run_sweeper(self) -> None:
        period = min(1.0, self.limits.unattached_timeout_s / 4, self.limits.orphan_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            self.sweep()
