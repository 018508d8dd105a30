"""Prometheus metrics of the switch and the byte accounting behind GetLinkStatus.

The same numbers feed both, so a dashboard and the demo's JSON summary can
never disagree about how many bytes crossed the WAN.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import Counter, Gauge

from nebula_common.proto.nebula.v1 import link_pb2, relay_pb2
from nebula_common.rpc.framing import FramedChunk

WAN_BYTES = Counter(
    "nebula_switch_wan_bytes",
    "Serialized link-message bytes exchanged with the peer switch.",
    ["direction"],
)
WAN_PAYLOAD_BYTES = Counter(
    "nebula_switch_wan_payload_bytes", "Encoded tensor payload bytes exchanged with the peer.", ["direction"]
)
WAN_RAW_BYTES = Counter(
    "nebula_switch_wan_raw_bytes",
    "Bytes the relayed tensors would have taken without compression.",
    ["direction"],
)
FRAMES_RELAYED = Counter("nebula_switch_frames_relayed", "Tensor frames relayed over the WAN.", ["direction"])
LINK_UP = Gauge("nebula_switch_link_up", "1 while an authenticated link to the peer switch is up.")
LINK_CONNECTIONS = Gauge(
    "nebula_switch_link_connections",
    "Connections (lanes) the link to the peer switch stripes items over right now (0 while down; "
    "NEBULA_SWITCH_LINK_CONNECTIONS on the dialing switch: a fixed count or auto).",
)
EDGES_OPEN = Gauge("nebula_switch_edges_open", "Local trainer edge streams currently open.")
AUTH_REFUSALS = Counter(
    "nebula_switch_refusals", "WAN link attempts refused by the switch, by layer.", ["port", "reason"]
)
for _layer in ("tls", "identity", "handshake", "revoked"):
    AUTH_REFUSALS.labels("wan", _layer)  # export zeros from the start: dashboards and alerts see the series
ROUTES_CLOSED = Counter(
    "nebula_switch_routes_closed",
    "Routes the switch closed itself because a bound was exceeded, by bound.",
    ["reason"],
)
for _bound in (
    "window",
    "items",
    "credit",
    "unattached_bytes",
    "unattached_items",
    "unattached_timeout",
    "unattached_routes",
    "orphan_timeout",
):
    ROUTES_CLOSED.labels(_bound)
ITEMS_DROPPED = Counter(
    "nebula_switch_items_dropped",
    "Items from the peer dropped because their route was closed by the switch, or because the local "
    "trainer of their epoch vanished (its reconnect makes the peer replay them).",
)
STALE_ITEMS = Counter(
    "nebula_switch_stale_items",
    "Items from the peer dropped because their epoch is below their route's (an attempt already "
    "replaced by a restart; relay.proto, 'Epochs').",
)
BUFFERED_BYTES = Gauge(
    "nebula_switch_buffered_bytes",
    "Bytes of edge items this switch holds in its route buffers (to_trainers: from the peer; to_peer: "
    "from local trainers, waiting for the link).",
    ["direction"],
)
ITEMS_READ = Counter(
    "nebula_switch_items_read",
    "Items (frames, chunks, signals, acks) read from local trainers' edges, by account.",
    ["account"],
)
THROTTLED_SECONDS = Counter(
    "nebula_switch_throttled_seconds",
    "Time the switch stopped reading an account's edges because it exceeded its item rate "
    "(NEBULA_SWITCH_ACCOUNT_ITEM_RATE), by account.",
    ["account"],
)
PENALTIES = Counter(
    "nebula_switch_penalties",
    "Routes of this switch's accounts closed for a bound their sender exceeded (each one a strike toward "
    "the account's open backoff and a reduced item rate for the job), by bound.",
    ["bound"],
)
OPENS_REFUSED = Counter(
    "nebula_switch_penalty_refusals",
    "OpenEdge calls refused because the account is in a penalty backoff, by account.",
    ["account"],
)
LINK_RTT = Gauge(
    "nebula_switch_link_rtt_seconds",
    "Smoothed round-trip time to the peer switch (RFC 6298 SRTT, Ping/Pong).",
)


@dataclass
class DirectionCounters:
    """Byte accounting for one direction of the WAN link."""

    direction: str
    bytes: int = 0
    payload_bytes: int = 0
    raw_bytes: int = 0
    frames: int = 0

    def count(self, message: link_pb2.LinkMessage) -> None:
        size = message.ByteSize()
        self.bytes += size
        WAN_BYTES.labels(self.direction).inc(size)
        if message.WhichOneof("body") != "routed" or message.routed.item.WhichOneof("body") != "frame":
            return
        part = message.routed.item.frame
        if part.HasField("chunk"):
            payload = len(part.chunk.data)
            self.payload_bytes += payload
            WAN_PAYLOAD_BYTES.labels(self.direction).inc(payload)
        elif part.HasField("header"):
            self.frames += 1
            self.raw_bytes += part.header.raw_size
            FRAMES_RELAYED.labels(self.direction).inc()
            WAN_RAW_BYTES.labels(self.direction).inc(part.header.raw_size)

    def count_chunk(self, chunk: FramedChunk) -> None:
        """A framed chunk: its bytes on the link and its payload (no header, so no frame is counted)."""
        size = len(chunk.raw)
        self.bytes += size
        WAN_BYTES.labels(self.direction).inc(size)
        payload = len(chunk.data)
        self.payload_bytes += payload
        WAN_PAYLOAD_BYTES.labels(self.direction).inc(payload)

    def to_proto(self) -> relay_pb2.LinkCounters:
        return relay_pb2.LinkCounters(
            bytes=self.bytes, payload_bytes=self.payload_bytes, raw_bytes=self.raw_bytes, frames=self.frames
        )
