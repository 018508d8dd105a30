"""Switch process: two gRPC servers (internal relay, mTLS WAN) around one PeerLink per peer cluster.

They are two servers, not two ports of one, because gRPC registers services
per server: the Relay API must not be reachable on the WAN port at all.
Alongside them one maintenance task re-reads the peer trust (trust bundle, CRL
file, CRL staleness; closing a link whose peer was just revoked or no longer
trusted) and checks, renews and hot-reloads this switch's own certificate. The
WAN port also serves nebula.v1.SwitchTrust: both switches send each other their
CA's CRL over it (services/switch/crl_exchange.py), so revocation needs no file copy.

A switch with several peers (``NEBULA_SWITCH_PEERS``; chains across more than two clusters) runs one
link, router, trust gate and CRL exchange per peer (services/switch/peers.py); both servers are shared
and a WAN caller's certificate picks its peer's link.

``start_switch`` only orders the steps; each concern is wired in a module of its own: server_peers.py
(trust gates, links, dialers), server_internal.py (Relay servicer, internal server), server_wan.py (WAN
gRPC server, frontend), server_tasks.py (maintenance, route sweepers). Their names stay importable here.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from nebula_common.audit import AuditLog
from nebula_common.pki import Identity
from nebula_common.rpc import ServiceServer
from nebula_common.service.host import ServiceDefinition, Started, before_process_end
from nebula_common.service.identity import service_identity
from nebula_common.service.resources import service_audit, token_verifier
from services.switch.certs import CertificateManager
from services.switch.config import SwitchSettings
from services.switch.edge_socket import EdgeSocket
from services.switch.link import PeerLink
from services.switch.link_transport import LINK_WINDOW_BYTES
from services.switch.peer_trust import PeerTrust
from services.switch.peers import PeerLinks
from services.switch.routing import Router
from services.switch.server_internal import (
    STOP_GRACE_SECONDS,
    internal_server,
    relay_servicer,
    start_edge_socket,
)
from services.switch.server_peers import dial_peer, peer_links, peer_trusts, start_links
from services.switch.server_tasks import (
    CERT_CHECK_INTERVAL_S,
    MAINTENANCE_INTERVAL_S,
    cancel,
    maintain,
    start_background,
)
from services.switch.server_wan import start_frontend, wan_server, window_options
from services.switch.tls_refusals import StderrTap
from services.switch.wan_frontend import WanFrontend

__all__ = [
    "CERT_CHECK_INTERVAL_S",
    "LINK_WINDOW_BYTES",
    "MAINTENANCE_INTERVAL_S",
    "SERVICE",
    "STOP_GRACE_SECONDS",
    "RunningSwitch",
    "start_switch",
]
# The names these helpers had while they lived here.
_cancel = cancel
_maintain = maintain
_window_options = window_options
_dial = dial_peer


@dataclass
class RunningSwitch:
    """In-process handle of a started switch (tests and tools reach its link and servers here).

    ``link``, ``router`` and ``revocation`` are the first peer's (the only one of a two-cluster
    switch); ``links`` holds every peer's link (each with its ``router``), ``trusts`` every gate.
    """

    internal: ServiceServer
    wan: ServiceServer
    link: PeerLink
    router: Router
    audit: AuditLog
    certificates: CertificateManager
    revocation: PeerTrust
    links: PeerLinks
    trusts: dict[str, PeerTrust]
    #: The WAN port's listener (wan_frontend.py): per-source slots, raw connections, gRPC ones passed through.
    frontend: WanFrontend | None = None
    #: The edge socket (edge_socket.py), when served.
    edge_socket: EdgeSocket | None = None

    @property
    def internal_port(self) -> int:
        return self.internal.ports["internal"]

    @property
    def wan_port(self) -> int:
        return self.wan.ports["wan"]


async def start_switch(settings: SwitchSettings, stack: contextlib.AsyncExitStack) -> Started[RunningSwitch]:
    """Token keys, audit log, certificates, both servers, then the dialer and maintenance tasks.

    Stopped in reverse: background tasks first, then the link, then both servers
    drain, then the edges they cut record their end, then the audit log is sealed and the verifier closed.
    """
    identity = await service_identity(stack, settings, "switch")
    verifier = await token_verifier(stack, settings.auth_address, settings.cluster_id, tls=identity.client)
    audit = await service_audit(
        stack,
        settings.data_dir,
        service="switch",
        cluster=settings.cluster_id,
        signer=settings.audit_signer,
        # Records reach the kernel at once (a crashed process loses none); fsync happens at each seal
        # so the relay's event loop never waits on the disk per transfer record.
        fsync_each=False,
    )
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    peers = settings.peer_list()
    trusts = peer_trusts(settings, peers)
    certs = _certificates(settings, audit)
    links = peer_links(settings, peers, trusts, audit)
    _audit_start(settings, audit, certs, links, trusts)
    relay = relay_servicer(settings, stack, links, certs)
    internal = internal_server(settings, stack, identity, verifier, audit, relay)
    wan, exchanges, grpc_wan_port = wan_server(settings, stack, links, trusts, certs)
    await internal.start()
    await wan.start()
    edge_socket = await start_edge_socket(settings, stack, relay, identity) if settings.edge_socket else None
    frontend = await start_frontend(settings, stack, wan, grpc_wan_port, links, certs)
    start_links(settings, stack, peers, links, exchanges, certs)
    start_background(settings, stack, links, trusts, certs, verifier.revocation_reason, identity)
    stack.callback(relay.stopping)  # first of all: edges ending from here on were cut by the stop
    internal.start_metrics(settings.metrics_port, settings.internal_listen, identity.metrics_tls())
    link = links.first
    running = RunningSwitch(
        internal=internal,
        wan=wan,
        link=link,
        router=link.router,
        audit=audit,
        certificates=certs,
        revocation=trusts[link.expected_peer.cluster_id],
        links=links,
        trusts=trusts,
        frontend=frontend,
        edge_socket=edge_socket,
    )
    return Started(running, _ports(settings, running))


def _certificates(settings: SwitchSettings, audit: AuditLog) -> CertificateManager:
    """This switch's own certificate (checked, renewed and hot-reloaded by the maintenance task)."""
    return CertificateManager(
        settings.tls_cert,
        settings.tls_key,
        settings.trust_bundle,
        Identity(settings.cluster_id, "switch"),
        audit=audit,
        ca_cert_path=settings.ca_cert,
        ca_key_path=settings.ca_key,
    )


def _audit_start(
    settings: SwitchSettings,
    audit: AuditLog,
    certs: CertificateManager,
    links: PeerLinks,
    trusts: dict[str, PeerTrust],
) -> None:
    """Record ``switch.start``: the certificate, peers and CRL set-up this run began with."""
    several = settings.peers != []
    link = links.first
    revocation = trusts[link.expected_peer.cluster_id]
    material = certs.current
    audit.append(
        "switch.start",
        details={
            "certificate_serial": f"{material.serial:x}",
            "certificate_not_after": material.cert.not_valid_after_utc.isoformat(),
            "peer": link.expected_peer.uri,
            **({"peers": [each.expected_peer.uri for each in links]} if several else {}),
            "peer_crl": str(settings.peer_crl or ""),
            "peer_crl_number": revocation.loaded.number if revocation.loaded is not None else None,
            "own_crl": str(settings.own_crl or ""),
            "crl_fail_closed": settings.crl_fail_closed,
            "self_renewal": settings.ca_key is not None,
        },
    )


def _ports(settings: SwitchSettings, running: RunningSwitch) -> dict[str, int | str | None]:
    """The ports a started switch reports (health only when it listens on one)."""
    internal = running.internal
    return {
        "internal_port": running.internal_port,
        "service_port": internal.ports["service"],
        **({"health_port": internal.ports["health"]} if settings.health_listen else {}),
        "wan_port": running.wan_port,
        "metrics_port": internal.metrics_port,
        "metrics_scheme": internal.metrics_scheme,
    }


def _tap_tls_refusals(running: RunningSwitch) -> None:
    """TLS refusals happen inside gRPC core; its stderr report is the only trace, so audit that."""
    tap = StderrTap(lambda reason: running.links.refuse("tls", reason))
    before_process_end(tap.close)  # the last log lines pass the tap before the process ends


SERVICE = ServiceDefinition("switch", SwitchSettings, start_switch, on_serve=_tap_tls_refusals)
