"""SwitchLink servicer: the WAN port's only RPC, for the peer switch to attach its link.

By the time this runs, gRPC's TLS stack has verified the peer's chain, validity window and the
CA's name constraint. What remains is checked here, before a single frame is relayed: the
certificate names exactly a configured peer switch (cluster *and* role; the cluster picks that peer's
link, services/switch/peers.py), it is not on that peer CA's revocation list, and the handshake agrees
with it. Every refusal is audited.

The method is registered with raw-bytes (identity) serializers (``add_link_to_server``): the session
parses link messages itself and forwards framed chunks without re-encoding them (link_pumps.py).
Both switches carry the link the same way (``link_carrier``): a dialer of the records carrier offers it
(``Handshake.raw_link``), is told yes and the call ends; the session then runs over a records connection
(services/switch/rawlink.py). A dialer whose carrier differs from this switch's is refused and audited
(layer ``transport``): the link never runs on a carrier one side did not choose.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import grpc

from nebula_common.pki import peer_certificate, peer_identity
from services.switch.link_handshake import (
    HANDSHAKE_TIMEOUT_S,
    RAW_LINK_VERSION,
    HandshakeError,
    carrier_mismatch,
    read_hello,
)
from services.switch.link_transport import grpc_writer
from services.switch.peers import PeerLinks

log = logging.getLogger(__name__)


class SwitchLinkServicer:
    def __init__(self, links: PeerLinks) -> None:
        self.links = links

    async def Link(self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        cert = peer_certificate(context)
        serial = f"{cert.serial_number:x}" if cert is not None else ""
        try:
            certified = peer_identity(context)
            link = self.links.select(certified)
        except PermissionError as exc:
            self.links.refuse("identity", str(exc), address=context.peer(), serial=serial)
            log.warning("refused WAN link: %s", exc, extra={"fields": {"peer": context.peer()}})
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
        if (refused := link.refusal(cert)) is not None:
            layer, reason = refused
            link.refuse(layer, reason, address=context.peer(), serial=serial, identity=certified.uri)
            log.warning("refused WAN link: %s", reason, extra={"fields": {"peer": context.peer()}})
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, reason)
        try:
            hello = await read_hello(context.read, link.check_hello, certified)
            lane, session_id = hello.hello.lane, hello.hello.session_id
            if lane and not await link.await_session(session_id, HANDSHAKE_TIMEOUT_S):
                raise HandshakeError(f"connection {lane} names no running session of this link")
        except (HandshakeError, TimeoutError) as exc:
            link.refuse(
                "handshake", str(exc) or "no handshake in time", address=context.peer(), serial=serial
            )
            log.warning("refused WAN link from %s: %s", certified.uri, exc)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"handshake refused: {exc}")
        if not lane and bool(hello.hello.raw_link) != link.serves_raw:
            reason = carrier_mismatch(ours=link.serves_raw, peer_offers=bool(hello.hello.raw_link))
            link.refuse("transport", reason, address=context.peer(), serial=serial)
            log.warning("refused WAN link from %s: %s", certified.uri, reason)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, reason)
        if not lane and link.serves_raw:
            # The dialer offered the raw transport and this port takes it (rawlink.py): say so and end the
            # call; the dialer reconnects raw to the same address. No session starts on this call.
            await context.write(
                link.hello(session_id=session_id, raw_link=RAW_LINK_VERSION).SerializeToString()
            )
            return
        await context.write(link.hello(session_id=session_id, lane=lane).SerializeToString())
        if lane:
            await link.run_lane(lane, context.read, grpc_writer(context.write), session_id)
            return
        await link.run_session(
            context.read,
            grpc_writer(context.write),
            certified,
            "acceptor",
            cert,
            session_id=session_id,
            marking=hello.hello.lanes and bool(session_id),
            peer_witness=hello.hello.audit_witness,
            peer_paced=hello.hello.paced,
            express=hello.hello.express,
        )


def add_link_to_server(servicer: SwitchLinkServicer, server: grpc.aio.Server) -> None:
    """Serve ``nebula.v1.SwitchLink`` with raw-bytes serializers (the session parses messages itself)."""
    handler = grpc.method_handlers_generic_handler(
        "nebula.v1.SwitchLink", {"Link": grpc.stream_stream_rpc_method_handler(servicer.Link)}
    )
    server.add_generic_rpc_handlers((handler,))
