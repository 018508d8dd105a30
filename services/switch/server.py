"""Switch process: two gRPC servers (internal relay, mTLS WAN) around one PeerLink.

They are two servers, not two ports of one, because gRPC registers services
per server: the Relay API must not be reachable on the WAN port at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from dataclasses import dataclass

from nebula_common.auth import TokenVerifier
from nebula_common.logging import configure_logging
from nebula_common.pki import (
    channel_credentials_from_files,
    channel_options,
    server_credentials_from_files,
    server_options,
)
from nebula_common.proto.nebula.v1 import link_pb2_grpc, relay_pb2_grpc
from nebula_common.rpc import ServiceServer, create_server
from nebula_common.rpc.lifecycle import serve_until_signalled
from services.switch.config import SwitchSettings
from services.switch.link import PeerLink
from services.switch.relay_servicer import RelayServicer
from services.switch.routing import Router
from services.switch.wan_servicer import SwitchLinkServicer

log = logging.getLogger(__name__)
AUTH_WAIT_S = 30.0


@dataclass
class RunningSwitch:
    internal: ServiceServer
    wan: ServiceServer
    link: PeerLink
    dialer: asyncio.Task[None] | None

    @property
    def internal_port(self) -> int:
        return self.internal.ports["internal"]

    @property
    def wan_port(self) -> int:
        return self.wan.ports["wan"]

    async def stop(self, grace: float = 2.0) -> None:
        self.link.stop()
        if self.dialer is not None:
            self.dialer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.dialer
        await asyncio.gather(self.wan.stop(grace), self.internal.stop(grace))


async def run_switch(settings: SwitchSettings) -> RunningSwitch:
    verifier = await TokenVerifier.from_auth_service_async(
        settings.auth_address, settings.cluster_id, timeout=AUTH_WAIT_S
    )
    router = Router(settings.route_buffer_messages)
    link = PeerLink(settings.cluster_id, settings.peer_cluster_id, router)

    internal = create_server(["nebula.v1.Relay"])
    relay_pb2_grpc.add_RelayServicer_to_server(
        RelayServicer(settings.cluster_id, link, router, verifier), internal.server
    )
    internal.add_insecure_port("internal", settings.internal_listen)

    wan = create_server(["nebula.v1.SwitchLink"], options=server_options())
    link_pb2_grpc.add_SwitchLinkServicer_to_server(SwitchLinkServicer(link), wan.server)
    wan.add_secure_port(
        "wan",
        settings.wan_listen,
        server_credentials_from_files(settings.tls_cert, settings.tls_key, settings.trust_bundle),
    )
    await internal.start()
    await wan.start()

    dialer = None
    if settings.dials():
        if settings.peer_address is None:
            raise ValueError("NEBULA_SWITCH_PEER_ADDRESS is required when this switch dials the link")
        credentials = channel_credentials_from_files(
            settings.tls_cert, settings.tls_key, settings.trust_bundle
        )
        dialer = asyncio.create_task(
            link.dial_forever(settings.peer_address, credentials, channel_options(link.expected_peer)),
            name="wan-dialer",
        )
    internal.start_metrics(settings.metrics_port, settings.internal_listen)
    return RunningSwitch(internal=internal, wan=wan, link=link, dialer=dialer)


async def _serve(settings: SwitchSettings) -> None:
    running = await run_switch(settings)
    ready = {
        "service": "switch",
        "cluster_id": settings.cluster_id,
        "internal_port": running.internal_port,
        "wan_port": running.wan_port,
        "metrics_port": running.internal.metrics_port,
    }
    await serve_until_signalled(ready, running.stop)


def main() -> None:
    try:
        settings = SwitchSettings()
    except Exception as exc:
        print(f"nebula-switch: invalid configuration:\n{exc}", file=sys.stderr)
        sys.exit(2)
    configure_logging("switch", settings.log_level)
    asyncio.run(_serve(settings))


if __name__ == "__main__":
    main()
