"""A switch's links, one per peer cluster: which link a WAN caller or a local edge belongs to.

A switch in the middle of a chain (a -> b -> c) links to several peers. Each peer has its own
:class:`~services.switch.link.PeerLink` (dialed or accepted, its own keepalive, lanes, counters and
session), its own :class:`~services.switch.routing.Router` (so items arriving from peer X are
delivered only on routes of X's link, and a dead link to c purges and notifies only c's routes),
and its own revocation gate and CRL exchange. The routers share one :class:`SharedRoutes` (route
limits count every route of the switch; a job belongs to one account whichever peer it reaches).

Who is who: a WAN caller's verified certificate names its cluster, which picks the link
(:meth:`PeerLinks.select`); any other identity is refused. A local edge names the cluster at its
other end (``EdgeOpen.peer_cluster``); empty means the only peer, which is what every two-cluster
deployment and older trainer sends (:meth:`PeerLinks.for_edge`).
"""

from __future__ import annotations

from collections.abc import Iterator

from nebula_common.pki import Identity
from services.switch.link import PeerLink
from services.switch.metrics import LINK_UP


class UnknownPeerError(LookupError):
    """An edge names a cluster this switch has no link to (NOT_FOUND to the trainer)."""


class PeerNotNamedError(ValueError):
    """An edge names no peer cluster on a switch with several (FAILED_PRECONDITION to the trainer)."""


class PeerLinks:
    """The links of one switch, keyed by the peer's cluster id, in configuration order."""

    def __init__(self, cluster_id: str, links: list[PeerLink]) -> None:
        if not links:
            raise ValueError("a switch needs at least one peer link")
        self.cluster_id = cluster_id
        self._links: dict[str, PeerLink] = {}
        for link in links:
            peer = link.expected_peer.cluster_id
            if peer in self._links:
                raise ValueError(f"two links to peer {peer!r}")
            self._links[peer] = link
        if len(links) > 1:
            for link in links:
                link.on_up_change = self._publish_up
        self._publish_up()

    def _publish_up(self) -> None:
        # nebula_switch_link_up keeps its meaning for dashboards: 1 while every configured link is up.
        if len(self._links) > 1:
            LINK_UP.set(1 if all(link.connected for link in self._links.values()) else 0)

    # ------------------------------------------------------------------ lookup
    def __iter__(self) -> Iterator[PeerLink]:
        return iter(self._links.values())

    def __len__(self) -> int:
        return len(self._links)

    @property
    def first(self) -> PeerLink:
        """The first configured peer's link (the only one on a two-cluster switch)."""
        return next(iter(self._links.values()))

    @property
    def peer_ids(self) -> list[str]:
        return list(self._links)

    def get(self, peer_cluster: str) -> PeerLink | None:
        return self._links.get(peer_cluster)

    def select(self, certified: Identity) -> PeerLink:
        """The link a WAN caller with verified identity ``certified`` may use (PermissionError if none)."""
        link = self._links.get(certified.cluster_id)
        if link is None:
            if len(self._links) == 1:
                self.first.check_identity(certified)  # the single-peer refusal, word for word
            allowed = ", ".join(link.expected_peer.uri for link in self._links.values())
            raise PermissionError(f"peer certificate names {certified.uri}, but only {allowed} may connect")
        link.check_identity(certified)  # the role must be switch too
        return link

    def for_edge(self, peer_cluster: str) -> PeerLink:
        """The link a local edge naming ``peer_cluster`` (EdgeOpen.peer_cluster) goes over."""
        if not peer_cluster:
            if len(self._links) == 1:
                return self.first
            raise PeerNotNamedError(
                f"switch {self.cluster_id!r} links to clusters {', '.join(self._links)}: the edge must "
                "name the cluster at its other end (EdgeOpen.peer_cluster)"
            )
        link = self._links.get(peer_cluster)
        if link is None:
            raise UnknownPeerError(
                f"switch {self.cluster_id!r} has no link to cluster {peer_cluster!r} "
                f"(its peers: {', '.join(self._links)})"
            )
        return link

    # ------------------------------------------------------------------ shared
    def refuse(self, layer: str, reason: str, **details: object) -> None:
        """Audit and count a WAN refusal that no link can be named for yet (TLS, unknown identity)."""
        self.first.refuse(layer, reason, **details)

    def stop(self) -> None:
        for link in self._links.values():
            link.stop()
