"""What the router keeps per route: the route, its attached trainer stream, and the items it buffers.

A route is keyed by (job, edge): each model edge crosses the cluster boundary exactly once, so a
cluster holds exactly one end of it. Here are the route's fields (its buffers both ways, its epoch and
who holds it, the scheduler's turn) and the small facts about items every part of the router needs
(their wire size, their stream position, acks merge, what counts toward the item bound), so that each
part (``route_table.py``, ``route_scheduler.py``, ``route_closing.py``, ``route_epochs.py``,
``routing.py``) reads them from one place.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from nebula_common.proto.nebula.v1 import link_pb2, relay_pb2
from nebula_common.rpc.framing import FramedChunk

RouteKey = tuple[str, str]

EdgeItem = relay_pb2.EdgeMessage | FramedChunk
"""An edge item as the router holds it: a parsed message, or a framed chunk kept as its wire bytes."""
Outbound = link_pb2.LinkMessage | FramedChunk
"""What the link writer sends: a link message, or a framed chunk forwarded byte for byte."""


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


Position = tuple[int, int, int]
"""Where a frame part or signal stands in its stream: (epoch, sequence number, 0 for a header or a
signal, chunk offset + 1 for a chunk). A sender's items rise strictly; a lower or equal one is a replay."""


def stream_position(message: EdgeItem, epoch: int) -> Position | None:
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
    #: It joined the round with nothing queued before and its turn has not begun (FQ-CoDel's new flow):
    #: a small first item of it may pass a full pacer (``LinkScheduler.sparse_next``).
    sparse: bool = False
    #: Until when (monotonic seconds) it counts as bulk: it sent a fragment since then minus
    #: ``BULK_HOLD_S``. Its small items never take the express connection (``express.py``).
    bulk_until: float = 0.0
    #: Stream position of the last frame part or signal queued each way (see ``RouteTable._supersede``).
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


def merge_ack(old: Item | None, new: relay_pb2.EdgeMessage, epoch: int) -> Item:
    """Only the newest ack matters (absolute credit); a pending resume of the same epoch must not be lost."""
    if old is not None and old.epoch == epoch and old.message.ack.resume and not new.ack.resume:
        merged = relay_pb2.EdgeMessage()
        merged.CopyFrom(new)
        merged.ack.resume = True
        new = merged
    return Item(new, new.ByteSize(), epoch)


def is_close(message: EdgeItem) -> bool:
    return message.WhichOneof("body") == "close"


def counts_as_item(message: EdgeItem) -> bool:
    """Frames and signals count toward a route's item bound (acks, closes and notices do not)."""
    return message.WhichOneof("body") in ("frame", "signal")


def is_held(route: Route) -> bool:
    """A route that has a trainer, or is kept for the owner of one that vanished or restarted."""
    return route.attachment is not None or route.detached is not None
