"""The switch's internal gRPC server: the Relay API (and its servicer) and the audit API, token-checked.

Split from server.py so the cluster-facing side is wired in one place; it is a server of its own, not a
port of the WAN one, because gRPC registers services per server and the Relay API must not be reachable
on the WAN port at all.
"""

from __future__ import annotations

import contextlib
import logging

from nebula_common.audit import AuditLog
from nebula_common.audit.servicer import AUDIT_SERVICE_NAME, add_audit_api
from nebula_common.auth.interceptor import TokenAuthInterceptor
from nebula_common.auth.verifier import TokenVerifier
from nebula_common.rpc import ServiceServer
from nebula_common.rpc.edge_tls import TLS, edge_address
from nebula_common.service.identity import ServiceIdentity
from nebula_common.service.resources import bind_internal, grpc_server, internal_server_options
from services.switch.certs import CertificateManager
from services.switch.config import SwitchSettings
from services.switch.edge_socket import MAX_UNTICKETED, EdgeSocket
from services.switch.edge_tickets import EdgeTickets
from services.switch.edge_tls_accept import EdgeTlsAcceptor
from services.switch.peers import PeerLinks
from services.switch.relay_servicer import RelayServicer, add_relay_to_server
from services.switch.throttle import AccountThrottle, Penalties, PenaltyRules

log = logging.getLogger(__name__)
EDGE_SETTING = "NEBULA_SWITCH_EDGE_SOCKET"
STOP_GRACE_SECONDS = 2.0
"""How long each of the switch's gRPC servers lets calls finish on stop."""


def relay_servicer(
    settings: SwitchSettings, stack: contextlib.AsyncExitStack, links: PeerLinks, certs: CertificateManager
) -> RelayServicer:
    """The Relay API's servicer, with its per-account throttle; its edges drain after both servers stop."""
    relay = RelayServicer(
        settings.cluster_id,
        links,
        certs,
        AccountThrottle(
            settings.account_item_rate,
            settings.account_item_burst,
            Penalties(
                PenaltyRules(
                    rate_factor=settings.penalty_rate_factor,
                    backoff_min_s=settings.penalty_backoff_min_s,
                    backoff_max_s=settings.penalty_backoff_max_s,
                    quiet_s=settings.penalty_quiet_s,
                )
            ),
        ),
    )
    # Stopped after both servers: the edges they cut record their end in the
    # audit log before it closes (a server's stop returns before its cancelled handlers finish).
    stack.push_async_callback(relay.drain_edges)
    return relay


def internal_server(
    settings: SwitchSettings,
    stack: contextlib.AsyncExitStack,
    identity: ServiceIdentity,
    verifier: TokenVerifier,
    audit: AuditLog,
    relay: RelayServicer,
) -> ServiceServer:
    """The internal server (not started) with the Relay and audit APIs, bound on its ports (and health's)."""
    internal = grpc_server(
        stack,
        ["nebula.v1.Relay", AUDIT_SERVICE_NAME],
        grace=STOP_GRACE_SECONDS,
        interceptors=[*identity.interceptors(audit), TokenAuthInterceptor("switch", verifier, audit=audit)],
        options=internal_server_options(),
    )
    add_relay_to_server(relay, internal.server)
    add_audit_api(internal, audit, "switch", settings.cluster_id)
    # The internal port (users: TLS, token) and the service port (trainers: mutual TLS, role checked).
    bind_internal(internal, identity, settings.internal_listen, settings.service_listen, name="internal")
    if settings.health_listen:
        internal.add_health_port(settings.health_listen)
    return internal


async def start_edge_socket(
    settings: SwitchSettings,
    stack: contextlib.AsyncExitStack,
    relay: RelayServicer,
    identity: ServiceIdentity,
) -> EdgeSocket:
    """Serve the edge socket (``edge_socket.py``) in this event loop; the relay then issues its tickets.

    On a TCP port its connections take mutual TLS with this switch's internal identity (a trainer's
    certificate, checked against the cluster CA and its CRL: ``edge_tls_accept.py``). Stopped before
    the servers drain the edges: its connections end like cancelled calls and record their end.
    """
    tls = None
    if identity.server is not None and edge_address(settings.edge_socket, EDGE_SETTING)[0] == TLS:
        tls = EdgeTlsAcceptor(
            identity.server.pem, settings.cluster_id, lambda: identity.revoked, workers=MAX_UNTICKETED
        )
    edge_socket = EdgeSocket(relay, EdgeTickets(), tls=tls)
    path = await edge_socket.start(settings.edge_socket)
    stack.push_async_callback(edge_socket.stop)
    log.info("edge socket listening", extra={"fields": {"path": path}})
    return edge_socket
