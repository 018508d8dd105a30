"""The switch's WAN port: its gRPC server (SwitchLink, SwitchTrust) and the frontend listening in front of it.

Split from server.py so the WAN carriers are wired in one place: the gRPC server listens on loopback only,
and the frontend (wan_frontend.py) owns the public port, passing a gRPC peer's TLS bytes through and, with the
records link carrier (the default), serving records link connections itself.
"""

from __future__ import annotations

import contextlib

from nebula_common.pki import server_options
from nebula_common.rpc import ServiceServer
from nebula_common.service.resources import grpc_server
from services.switch.certs import CertificateManager
from services.switch.config import SwitchSettings
from services.switch.crl_exchange import CrlExchange, OwnCrl, add_trust_to_server
from services.switch.link_transport import LINK_WINDOW_BYTES
from services.switch.peer_trust import PeerTrust
from services.switch.peers import PeerLinks
from services.switch.server_internal import STOP_GRACE_SECONDS
from services.switch.wan_frontend import WanFrontend
from services.switch.wan_servicer import SwitchLinkServicer, add_link_to_server


def window_options() -> list[tuple[str, object]]:
    """A fixed HTTP/2 window on the link (no BDP probing).

    Everything the link writer has handed to gRPC is first-in first-out below the scheduler (HTTP/2
    window, socket buffers, the path); a fixed window bounds it, at the price of capping one link's
    throughput at window / RTT.
    """
    return [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", LINK_WINDOW_BYTES)]


def wan_server(
    settings: SwitchSettings,
    stack: contextlib.AsyncExitStack,
    links: PeerLinks,
    trusts: dict[str, PeerTrust],
    certs: CertificateManager,
) -> tuple[ServiceServer, dict[str, CrlExchange], int]:
    """The WAN gRPC server with SwitchLink and SwitchTrust (one CRL exchange per peer), bound on loopback.

    Returns the server (not started), the CRL exchanges by peer cluster and the loopback port the
    frontend passes gRPC connections to.
    """
    # The WAN port has no token interceptor: the peer switch holds no token of this cluster; mTLS and
    # the certificate's SPIFFE identity authenticate it (services/switch/link_handshake.py).
    # A client that connects and never finishes TLS (and HTTP/2 settings) is dropped after
    # wan_handshake_timeout_s instead of gRPC's default 120 s.
    wan_options = [
        *server_options(),
        ("grpc.server_handshake_timeout_ms", int(settings.wan_handshake_timeout_s * 1000)),
        ("grpc.max_allowed_incoming_connections", settings.wan_max_connections),
        *window_options(),
    ]
    wan = grpc_server(
        stack,
        ["nebula.v1.SwitchLink", "nebula.v1.SwitchTrust"],
        grace=STOP_GRACE_SECONDS,
        options=wan_options,
    )
    add_link_to_server(SwitchLinkServicer(links), wan.server)
    own_crl = OwnCrl(settings.own_crl) if settings.own_crl is not None else None
    exchanges = {
        each.expected_peer.cluster_id: CrlExchange(each, trusts[each.expected_peer.cluster_id], own_crl)
        for each in links
    }
    add_trust_to_server(links, exchanges, wan.server)
    # The WAN port is the frontend's (wan_frontend.py, source_limits.py): strangers get a few slots per
    # address before their handshake completes, so none can crowd the peer out. gRPC's WAN server
    # listens on loopback only, reached through the frontend, which passes a gRPC peer's TLS bytes
    # through untouched (the link handshake, a gRPC link and the CRL exchange); with the records carrier
    # the frontend also serves records link connections itself.
    grpc_wan_port = wan.add_secure_port("wan", "127.0.0.1:0", certs.server_credentials())
    return wan, exchanges, grpc_wan_port


async def start_frontend(
    settings: SwitchSettings,
    stack: contextlib.AsyncExitStack,
    wan: ServiceServer,
    grpc_wan_port: int,
    links: PeerLinks,
    certs: CertificateManager,
) -> WanFrontend:
    """Start the frontend on the WAN port (recorded in ``wan.ports``); it closes before both servers."""
    frontend = WanFrontend(
        links,
        f"127.0.0.1:{grpc_wan_port}",
        lambda: certs.openssl_context(server_side=True),
        handshake_timeout_s=settings.wan_handshake_timeout_s,
        send_buffer=LINK_WINDOW_BYTES,
        serves_raw=settings.link_carrier == "records",
        grpc_max_connections=settings.wan_max_connections,
    )
    wan.ports["wan"] = await frontend.start(settings.wan_listen)
    wan.ports["wan_grpc_backend"] = grpc_wan_port
    stack.push_async_callback(frontend.stop)
    return frontend
