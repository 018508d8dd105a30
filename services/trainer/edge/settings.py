"""The tunables and fixed limits of one edge end, apart so transports and tests size things alike."""

from __future__ import annotations

from dataclasses import dataclass

INITIAL_WINDOW_BYTES = 1 << 20
"""Credit a sender has before the peer's first ack (relay.proto, delivery contract)."""
MAX_FRAME_BYTES = 1 << 30
"""Largest tensor payload a peer may announce on an edge; a larger header fails the edge."""


@dataclass(frozen=True)
class EdgeSettings:
    """Tunables of one edge end (defaults fit production; tests shrink the timers)."""

    window_bytes: int = 16 << 20
    """Window this receiver grants beyond what it holds (capped by EdgeReady.max_window_bytes)."""
    max_frame_bytes: int = MAX_FRAME_BYTES
    """Largest tensor payload a peer may announce; a larger header fails the edge."""
    max_outage_s: float = 300.0
    """How long the link (or the stream to the switch) may stay down before the edge fails."""
    retransmit_s: float = 30.0
    """Cap of the retransmit timeout (and the timeout before any RTT sample): rewind when
    unacknowledged items see no ack progress for the measured RTO (see ``replay``; doubles on
    consecutive timeouts up to 10x this). Over gRPC items are lost only with a link notice or a
    reconnect, which resume at once, and a receiver that sees a gap asks for a replay itself."""
    min_retransmit_s: float = 1.0
    """Floor of the measured retransmit timeout (RFC 6298 recommends 1 s)."""
    receive_queue_items: int = 64
    """Completed items (tensors, signals) held for the stage; while full, no new credit is granted."""
    ready_timeout_s: float = 90.0
    """How long the first open may take (switch reachable, edge authorised)."""
    max_recoveries: int = 20
    """How many times a stage may restart from the common checkpoint (new epoch) before it fails."""


__all__ = ["INITIAL_WINDOW_BYTES", "MAX_FRAME_BYTES", "EdgeSettings"]
