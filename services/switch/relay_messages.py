"""The Relay's edge messages as the switch handles them: raw request bytes in, bytes out, and EdgeReady.

OpenEdge is served with identity serializers (``add_relay_to_server``) so that a framed payload chunk
passes through as the bytes it came in; the small items are therefore parsed and serialized here, not
by gRPC. ``EdgeReady`` is the first thing every edge is sent (``relay.proto``), whether it is then
pumped or at once restarted for a stale epoch, so both paths build it in one place.
"""

from __future__ import annotations

from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.rpc.framing import LINK_FRAMING_VERSION
from services.switch.link import PeerLink


def serialize_edge_message(message: relay_pb2.EdgeMessage) -> bytes:
    return message.SerializeToString()


def parse_edge_message(raw: object) -> relay_pb2.EdgeMessage | None:
    """An EdgeMessage from raw request bytes; None if not one."""
    if not isinstance(raw, bytes | memoryview):
        return None
    try:
        return relay_pb2.EdgeMessage.FromString(raw)
    except Exception:  # protobuf's DecodeError
        return None


def edge_ready(link: PeerLink, epoch: int) -> relay_pb2.EdgeReady:
    """What a trainer learns on opening an edge: the peer, the window, the link's state, the epoch."""
    return relay_pb2.EdgeReady(
        peer_cluster=link.expected_peer.cluster_id,
        max_window_bytes=link.router.max_window_bytes,
        link_up=link.router.link_up,
        epoch=epoch,
        link_framing=LINK_FRAMING_VERSION,
    )
