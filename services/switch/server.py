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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from cryptography import x509

from nebula_common.audit import AuditLog
from nebula_common.audit.aggregate import RefusalAggregator
from nebula_common.audit.servicer import AUDIT_SERVICE_NAME, add_audit_api
from nebula_common.auth.interceptor import TokenAuthInterceptor
from nebula_common.auth.verifier import LEEWAY_SECONDS
from nebula_common.pki import Identity, channel_options, server_options
from nebula_common.rpc import ServiceServer
from nebula_common.service.host import ServiceDefinition, Started, before_process_end
from nebula_common.service.identity import service_identity
from nebula_common.service.resources import (
    bind_internal,
    grpc_server,
    internal_server_options,
    service_audit,
    token_verifier,
)
from services.switch.certs import CertificateManager
from services.switch.config import PeerSettings, SwitchSettings
from services.switch.crl_exchange import CrlExchange, OwnCrl, add_trust_to_server, exchange_forever
from services.switch.link import PeerLink
from services.switch.link_handshake import fetch_server_certificate
from services.switch.peer_trust import PeerTrust
from services.switch.peers import PeerLinks
from services.switch.rawlink_connection import RawConnection
from services.switch.rawlink_dialer import dial_raw
from services.switch.relay_servicer import RelayServicer, add_relay_to_server
from services.switch.route_limits import Limits
from services.switch.route_table import SharedRoutes
from services.switch.routing import Router
from services.switch.throttle import AccountThrottle, Penalties, PenaltyRules
from services.switch.tls_refusals import StderrTap
from services.switch.wan_frontend import WanFrontend
from services.switch.wan_servicer import SwitchLinkServicer, add_link_to_server

log = logging.getLogger(__name__)
STOP_GRACE_SECONDS = 2.0
MAINTENANCE_INTERVAL_S = 1.0
"""How often peer trust (bundle, CRL, staleness), live edges' credentials and refusal counts are polled:
a revoked peer or trainer is cut within about this."""
CERT_CHECK_INTERVAL_S = 5.0
"""How often the switch's own certificate files are checked for a change, renewal and expiry."""
LINK_WINDOW_BYTES = 1 << 20
"""Fixed HTTP/2 receive window (and raw link send buffer) of a WAN link: it bounds what waits first-in
first-out below the switch's fair scheduler, and caps one link connection at window / RTT (1 MiB:
84 Mbit/s at 100 ms RTT; the link stripes over more connections for more)."""


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

    @property
    def internal_port(self) -> int:
        return self.internal.ports["internal"]

    @property
    def wan_port(self) -> int:
        return self.wan.ports["wan"]


async def _cancel(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def _maintain(
    settings: SwitchSettings,
    gates: list[tuple[PeerLink, PeerTrust]],
    certs: CertificateManager,
    revoked: Callable[[str, float], str | None],
    revoked_serials: Callable[[], frozenset[int]],
) -> None:
    """Poll each peer's trust (bundle, CRL file, staleness; enforced on its live link), own certificate,
    and the credentials behind live edges (``revoked(account, token iat)``: a disabled account's edges
    end; ``revoked_serials()``: the cluster CA's CRL, a revoked trainer certificate's edges end; a token
    that every verifier refuses by now, its ``exp`` plus the clock-skew leeway past, ends its edges unless
    the trainer renewed them)."""
    loop = asyncio.get_running_loop()
    next_cert_check = loop.time() + CERT_CHECK_INTERVAL_S
    several = len(gates) > 1
    while True:
        await asyncio.sleep(MAINTENANCE_INTERVAL_S)
        try:
            for link, trust in gates:
                peer = {"peer": trust.peer_cluster_id} if several else {}
                for event, details in await asyncio.to_thread(trust.refresh):
                    link.record(event, outcome="alarm" if event == "crl.stale" else "ok", **details, **peer)
                if link.enforce_revocation() and (reason := trust.closed_reason()) is not None:
                    link.record("trust.closed", outcome="refused", reason=reason, **peer)
                link.router.close_revoked(revoked, revoked_serials(), time.time() - LEEWAY_SECONDS)
                if link.refusals is not None:
                    link.refusals.tick()  # a minute's repeated refusals, as one record each
            if loop.time() >= next_cert_check:
                next_cert_check = loop.time() + CERT_CHECK_INTERVAL_S
                await asyncio.to_thread(certs.check)
        except Exception:  # one bad poll must not end revocation enforcement for good
            log.exception("switch maintenance step failed")


def _window_options() -> list[tuple[str, object]]:
    """A fixed HTTP/2 window on the link (no BDP probing).

    Everything the link writer has handed to gRPC is first-in first-out below the scheduler (HTTP/2
    window, socket buffers, the path); a fixed window bounds it, at the price of capping one link's
    throughput at window / RTT.
    """
    return [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", LINK_WINDOW_BYTES)]


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
    several = settings.peers != []
    trusts: dict[str, PeerTrust] = {}
    for peer in peers:
        trusts[peer.cluster_id] = PeerTrust(
            peer.cluster_id,
            settings.trust_bundle,
            # One peer (the two-cluster layout) keeps its CRL where it always did.
            cache_path=settings.data_dir / (f"peer-crl-{peer.cluster_id}.pem" if several else "peer-crl.pem"),
            crl_file=peer.crl,
            fail_closed=settings.crl_fail_closed,
        )
        if trusts[peer.cluster_id].loaded is None:
            log.warning(
                "no CRL of peer %s yet: it arrives over the WAN port once its switch is reachable",
                peer.cluster_id,
            )
    certs = CertificateManager(
        settings.tls_cert,
        settings.tls_key,
        settings.trust_bundle,
        Identity(settings.cluster_id, "switch"),
        audit=audit,
        ca_cert_path=settings.ca_cert,
        ca_key_path=settings.ca_key,
    )
    limits = Limits(
        max_window_bytes=settings.max_window_bytes,
        unattached_timeout_s=settings.unattached_timeout_s,
        orphan_timeout_s=settings.orphan_timeout_s,
        max_routes_per_account=settings.max_routes_per_account,
        max_attached_routes=settings.max_attached_routes,
        max_unattached_routes=settings.max_unattached_routes,
    )
    shared = SharedRoutes()
    # One per switch: refusals on the WAN port, counted per source, layer and reason.
    refusals = RefusalAggregator(audit.append, interval_s=settings.refusal_audit_interval_s)
    links = PeerLinks(
        settings.cluster_id,
        [
            PeerLink(
                settings.cluster_id,
                peer.cluster_id,
                Router(
                    limits, cluster_id=settings.cluster_id, shared=shared, weights=settings.account_weights
                ),
                audit=audit,
                revocation=trusts[peer.cluster_id],
                connections=settings.connections(),
                refusals=refusals,
            )
            for peer in peers
        ],
    )
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
    # The WAN port has no token interceptor: the peer switch holds no token of this cluster; mTLS and
    # the certificate's SPIFFE identity authenticate it (services/switch/link_handshake.py).
    # A client that connects and never finishes TLS (and HTTP/2 settings) is dropped after
    # wan_handshake_timeout_s instead of gRPC's default 120 s.
    wan_options = [
        *server_options(),
        ("grpc.server_handshake_timeout_ms", int(settings.wan_handshake_timeout_s * 1000)),
        ("grpc.max_allowed_incoming_connections", settings.wan_max_connections),
        *_window_options(),
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
    raw = settings.link_transport == "raw"
    # The WAN port is the frontend's (wan_frontend.py, source_limits.py): strangers get a few slots per
    # address before their handshake completes, so none can crowd the peer out. gRPC's WAN server
    # listens on loopback only, reached through the frontend, which passes a gRPC peer's TLS bytes
    # through untouched (the gRPC link and the CRL exchange); with the raw transport the frontend also
    # serves raw link connections itself.
    grpc_wan_port = wan.add_secure_port("wan", "127.0.0.1:0", certs.server_credentials())
    await internal.start()
    await wan.start()
    frontend = WanFrontend(
        links,
        f"127.0.0.1:{grpc_wan_port}",
        lambda: certs.ssl_context(server_side=True),
        handshake_timeout_s=settings.wan_handshake_timeout_s,
        send_buffer=LINK_WINDOW_BYTES,
        sealed_records=settings.link_records == "sealed",
        serves_raw=raw,
        grpc_max_connections=settings.wan_max_connections,
    )
    wan.ports["wan"] = await frontend.start(settings.wan_listen)
    wan.ports["wan_grpc_backend"] = grpc_wan_port
    stack.push_async_callback(frontend.stop)
    for each in links:
        each.serves_raw = raw
    stack.callback(links.stop)
    for peer in peers:
        if peer.dials(settings.cluster_id):
            _dial(settings, stack, peer, links, exchanges, certs, raw)
    maintenance = asyncio.create_task(
        _maintain(
            settings,
            [(each, trusts[each.expected_peer.cluster_id]) for each in links],
            certs,
            verifier.revocation_reason,
            lambda: identity.revoked,
        ),
        name="switch-maintenance",
    )
    stack.push_async_callback(_cancel, maintenance)
    for each in links:
        sweeper = asyncio.create_task(each.router.run_sweeper(), name=f"route-sweeper-{each.expected_peer}")
        stack.push_async_callback(_cancel, sweeper)
    stack.callback(relay.stopping)  # first of all: edges ending from here on were cut by the stop
    internal.start_metrics(settings.metrics_port, settings.internal_listen, identity.metrics_tls())
    running = RunningSwitch(
        internal=internal,
        wan=wan,
        link=link,
        router=link.router,
        audit=audit,
        certificates=certs,
        revocation=revocation,
        links=links,
        trusts=trusts,
        frontend=frontend,
    )
    ports = {
        "internal_port": running.internal_port,
        "service_port": internal.ports["service"],
        **({"health_port": internal.ports["health"]} if settings.health_listen else {}),
        "wan_port": running.wan_port,
        "metrics_port": internal.metrics_port,
        "metrics_scheme": internal.metrics_scheme,
    }
    return Started(running, ports)


def _dial(
    settings: SwitchSettings,
    stack: contextlib.AsyncExitStack,
    peer: PeerSettings,
    links: PeerLinks,
    exchanges: dict[str, CrlExchange],
    certs: CertificateManager,
    raw: bool,
) -> None:
    """Start the dialer and the CRL exchange of the link to ``peer`` (this switch opens it)."""
    link = links.get(peer.cluster_id)
    assert link is not None and peer.address is not None  # PeerSettings refuses a dialer without one
    address = peer.address

    async def probe() -> x509.Certificate:
        return await fetch_server_certificate(
            address, certs.cert_path, certs.key_path, certs.bundle_path, link.expected_peer.dns_name
        )

    if raw:

        async def raw_dialer() -> RawConnection:
            return await dial_raw(
                address,
                certs.ssl_context(server_side=False),
                link.expected_peer.dns_name,
                send_buffer=LINK_WINDOW_BYTES,
                sealed=settings.link_records == "sealed",
            )

        link.raw_dialer = raw_dialer

    dialer = asyncio.create_task(
        link.dial_forever(
            address,
            certs.channel_credentials,
            [*channel_options(link.expected_peer), *_window_options()],
            probe=probe,
        ),
        name=f"wan-dialer-{peer.cluster_id}",
    )
    stack.push_async_callback(_cancel, dialer)
    crl_dialer = asyncio.create_task(
        exchange_forever(
            address,
            certs.channel_credentials,
            channel_options(link.expected_peer),
            exchanges[peer.cluster_id],
        ),
        name=f"crl-exchange-{peer.cluster_id}",
    )
    stack.push_async_callback(_cancel, crl_dialer)


def _tap_tls_refusals(running: RunningSwitch) -> None:
    """TLS refusals happen inside gRPC core; its stderr report is the only trace, so audit that."""
    tap = StderrTap(lambda reason: running.links.refuse("tls", reason))
    before_process_end(tap.close)  # the last log lines pass the tap before the process ends


SERVICE = ServiceDefinition("switch", SwitchSettings, start_switch, on_serve=_tap_tls_refusals)
