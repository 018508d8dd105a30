"""The acceptor's checks of a raw link connection after TLS, then its session or lane.

The same checks, in the same order, as the gRPC link's ``SwitchLinkServicer.Link``
(``wan_servicer.py``): the certificate must name a configured peer switch, not be revoked, and the
link handshake must agree with it; a raw connection also confirms inside TLS the preamble that
crossed in clear. Every refusal is audited ``link.refused`` with its layer.
"""

from __future__ import annotations

import logging

from services.switch.link_handshake import RAW_LINK_VERSION, HandshakeError, raw_peer_identity, read_hello
from services.switch.peers import PeerLinks
from services.switch.rawlink_connection import RawConnection

log = logging.getLogger(__name__)


async def serve_raw(links: PeerLinks, connection: RawConnection, handshake_timeout_s: float) -> None:
    """The acceptor's side of a raw connection after TLS: the checks of ``SwitchLinkServicer.Link``."""
    cert = connection.peer_cert
    serial = f"{cert.serial_number:x}" if cert is not None else ""
    peer = connection.peer
    try:
        certified = raw_peer_identity(cert, "caller")
        link = links.select(certified)
    except PermissionError as exc:
        links.refuse("identity", str(exc), address=peer, serial=serial)
        log.warning("refused raw WAN link: %s", exc, extra={"fields": {"peer": peer}})
        return
    if (refused := link.refusal(cert)) is not None:
        layer, reason = refused
        link.refuse(layer, reason, address=peer, serial=serial, identity=certified.uri)
        log.warning("refused raw WAN link: %s", reason, extra={"fields": {"peer": peer}})
        return
    try:
        hello = await read_hello(connection.read, link.check_hello, certified, handshake_timeout_s)
        lane, session_id = hello.hello.lane, hello.hello.session_id
        if hello.hello.raw_preamble != connection.preamble:
            reason = (
                f"the raw link preamble was rewritten on path: received {connection.preamble!r}, the peer "
                f"says inside TLS it sent {hello.hello.raw_preamble!r}"
            )
            link.refuse("transport", reason, address=peer, serial=serial, identity=certified.uri)
            log.warning("refused raw WAN link from %s: %s", certified.uri, reason)
            return
        if lane and not await link.await_session(session_id, handshake_timeout_s):
            raise HandshakeError(f"connection {lane} names no running session of this link")
    except (HandshakeError, TimeoutError) as exc:
        link.refuse("handshake", str(exc) or "no handshake in time", address=peer, serial=serial)
        log.warning("refused raw WAN link from %s: %s", certified.uri, exc)
        return
    await connection.write(
        link.hello(
            session_id=session_id, lane=lane, raw_link=RAW_LINK_VERSION, raw_preamble=connection.preamble
        ).SerializeToString()
    )
    if lane:
        await link.run_lane(lane, connection.read, connection.write, session_id)
        return
    await link.run_session(
        connection.read,
        connection.write,
        certified,
        "acceptor",
        cert,
        session_id=session_id,
        marking=hello.hello.lanes and bool(session_id),
        transport=connection.transport,
        peer_witness=hello.hello.audit_witness,
        peer_paced=hello.hello.paced,
        express=hello.hello.express,
    )


__all__ = ["serve_raw"]
