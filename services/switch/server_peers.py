"""The switch's peers: one trust gate and one PeerLink (with its router) per peer cluster, and the dialers.

Split from server.py so what is per peer is wired in one place: a switch with several peers
(``NEBULA_SWITCH_PEERS``) runs one of each per peer, sharing the route limits, the shared route table
and the WAN refusal counter; the dialing side of a link starts its dialer and CRL exchange here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from cryptography import x509

from nebula_common.audit import AuditLog
from nebula_common.audit.aggregate import RefusalAggregator
from nebula_common.pki import channel_options
from services.switch.certs import CertificateManager
from services.switch.config import PeerSettings, SwitchSettings
from services.switch.crl_exchange import CrlExchange, exchange_forever
from services.switch.link import PeerLink
from services.switch.link_handshake import fetch_server_certificate
from services.switch.link_transport import LINK_WINDOW_BYTES
from services.switch.peer_trust import PeerTrust
from services.switch.peers import PeerLinks
from services.switch.rawlink_connection import RawConnection
from services.switch.rawlink_dialer import dial_raw
from services.switch.route_limits import Limits
from services.switch.route_table import SharedRoutes
from services.switch.routing import Router
from services.switch.server_tasks import cancel
from services.switch.server_wan import window_options

log = logging.getLogger("services.switch.server")  # the name these records always had


def peer_trusts(settings: SwitchSettings, peers: list[PeerSettings]) -> dict[str, PeerTrust]:
    """One trust gate (trust bundle, peer CRL and its cache) per peer cluster."""
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
    return trusts


def peer_links(
    settings: SwitchSettings, peers: list[PeerSettings], trusts: dict[str, PeerTrust], audit: AuditLog
) -> PeerLinks:
    """One PeerLink per peer, each with its own router over the shared limits and route table."""
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
    return PeerLinks(
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


def start_links(
    settings: SwitchSettings,
    stack: contextlib.AsyncExitStack,
    peers: list[PeerSettings],
    links: PeerLinks,
    exchanges: dict[str, CrlExchange],
    certs: CertificateManager,
) -> None:
    """Set each link's transport, stop the links on stop, and dial the peers this switch opens links to."""
    raw = settings.link_carrier == "records"
    for each in links:
        each.serves_raw = raw
    stack.callback(links.stop)
    for peer in peers:
        if peer.dials(settings.cluster_id):
            dial_peer(settings, stack, peer, links, exchanges, certs, raw)


def dial_peer(
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
                certs.openssl_context(server_side=False),
                link.expected_peer.dns_name,
                send_buffer=LINK_WINDOW_BYTES,
            )

        link.raw_dialer = raw_dialer

    dialer = asyncio.create_task(
        link.dial_forever(
            address,
            certs.channel_credentials,
            [*channel_options(link.expected_peer), *window_options()],
            probe=probe,
        ),
        name=f"wan-dialer-{peer.cluster_id}",
    )
    stack.push_async_callback(cancel, dialer)
    crl_dialer = asyncio.create_task(
        exchange_forever(
            address,
            certs.channel_credentials,
            channel_options(link.expected_peer),
            exchanges[peer.cluster_id],
        ),
        name=f"crl-exchange-{peer.cluster_id}",
    )
    stack.push_async_callback(cancel, crl_dialer)
