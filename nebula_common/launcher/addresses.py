"""What an operator names when deploying a cluster: a service's ``host:port`` and its switch's peers.

Checked where they enter (``nebula cluster up`` flags, the launchers), so a bad one is refused with
the flag's name before any process starts.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from nebula_common.errors import NebulaError
from nebula_common.pki.identity import validate_cluster_id

__all__ = ["ClusterDeploymentError", "SwitchPeer", "parse_host_port", "parse_peer"]

_HOST_PORT = re.compile(r"^(?P<host>\[[0-9a-fA-F:]+\]|[A-Za-z0-9.-]+):(?P<port>\d{1,5})$")


class ClusterDeploymentError(NebulaError):
    """A cluster cannot be deployed as asked; the message names what was wrong."""


def parse_host_port(value: str, what: str) -> str:
    """``host:port`` checked (port 1-65535), or ``ClusterDeploymentError`` naming ``what``."""
    match = _HOST_PORT.fullmatch(value.strip())
    if match is None or not 0 < int(match["port"]) < 65536:
        raise ClusterDeploymentError(f"{what} must be HOST:PORT (port 1-65535), got {value!r}")
    return value.strip()


def parse_peer(value: str) -> tuple[str, str | None]:
    """``b=HOST:PORT`` (dial or be dialled by b there) or ``b`` (only accept b's link)."""
    peer, _, address = value.partition("=")
    try:
        validate_cluster_id(peer.strip())
    except ValueError as exc:
        raise ClusterDeploymentError(f"--peer {value!r}: {exc}") from None
    return peer.strip(), parse_host_port(address, f"--peer {peer}=...") if address else None


@dataclass(frozen=True)
class SwitchPeer:
    """One peer of a switch with several (``NEBULA_SWITCH_PEERS``): where to dial it, its CA's CRL file."""

    cluster_id: str
    address: str | None = None  # None: the peer dials this switch
    crl: Path | None = None

    def setting(self) -> dict[str, str]:
        entry = {"cluster_id": self.cluster_id}
        if self.address is not None:
            entry["address"] = self.address
        if self.crl is not None:
            entry["crl"] = str(self.crl)
        return entry
