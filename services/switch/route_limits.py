"""The bounds a switch keeps on what it holds for the routes it relays, and why they add up.

The router (``routing.py``) never waits, so nothing but these bounds stops a sender from filling the
switch's memory. A route over any of them is closed (``route_closing.py``).

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
"""

from __future__ import annotations

from dataclasses import dataclass

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
"""Job ids whose owning account the switch remembers (oldest forgotten first); far above live jobs."""
REPLAY_FACTOR = 2
"""Windows a route may hold per direction: right after a resume or a reconnect the sender replays up to
one window while originals of the same items may still be buffered here (receivers drop the copies)."""


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
