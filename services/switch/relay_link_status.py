"""GetLinkStatus: how the switch's link to a peer cluster stands, asked on the internal relay port.

Connected or not, the identity and certificate serial it verified, its counters, RTT, a bandwidth
measurement on request, and this switch's own certificate (serial, expiry, generation). The link is
the one to the named peer cluster, or the first one; naming a peer this switch has no link to is
NOT_FOUND, listing the peers it has.
"""

from __future__ import annotations

import time

import grpc

from nebula_common.proto.nebula.v1 import relay_pb2
from services.switch.bandwidth import BandwidthProbeError
from services.switch.certs import CertificateManager
from services.switch.peers import PeerLinks


class LinkStatusService:
    """The Relay's GetLinkStatus (see the module doc); part of ``RelayServicer``."""

    cluster_id: str
    links: PeerLinks
    certificates: CertificateManager | None

    async def GetLinkStatus(
        self, request: relay_pb2.GetLinkStatusRequest, context: grpc.aio.ServicerContext
    ) -> relay_pb2.LinkStatus:
        link = self.links.first
        if request.peer_cluster:
            found = self.links.get(request.peer_cluster)
            if found is None:
                await context.abort(
                    grpc.StatusCode.NOT_FOUND,
                    f"switch {self.cluster_id!r} has no link to cluster {request.peer_cluster!r} "
                    f"(its peers: {', '.join(self.links.peer_ids)})",
                )
            assert found is not None
            link = found
        if request.measure_bandwidth:
            try:
                await link.measure_bandwidth()
            except BandwidthProbeError as exc:
                await context.abort(
                    grpc.StatusCode.UNAVAILABLE,
                    f"switch {self.cluster_id!r} could not measure the bandwidth toward "
                    f"{link.expected_peer.cluster_id!r}: {exc}",
                )
        measured = link.bandwidth.last
        state = link.state
        return relay_pb2.LinkStatus(
            cluster_id=self.cluster_id,
            expected_peer=link.expected_peer.cluster_id,
            connected=state.connected,
            verified_peer_identity=state.peer_identity,
            link_role=state.role,
            sent=link.sent.to_proto(),
            received=link.received.to_proto(),
            peer_certificate_serial=f"{state.peer_serial:x}" if state.peer_serial else "",
            link_sessions=state.sessions,
            link_carrier=state.transport if state.connected else "",
            peers=list(self.links.peer_ids),
            rtt_seconds=link.rtt.srtt or 0.0,
            min_rtt_seconds=link.rtt.min_rtt or 0.0,
            bandwidth_bps=measured.bits_per_second if measured is not None else 0.0,
            bandwidth_age_seconds=time.monotonic() - measured.at if measured is not None else 0.0,
            **self._own_certificate(),
        )

    def _own_certificate(self) -> dict[str, object]:
        if self.certificates is None:
            return {}
        material = self.certificates.current
        return {
            "certificate_serial": f"{material.serial:x}",
            "certificate_not_after": int(material.cert.not_valid_after_utc.timestamp()),
            "certificate_generation": material.generation,
        }
