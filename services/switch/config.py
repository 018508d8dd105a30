"""Switch settings, read from NEBULA_SWITCH_* environment variables (containers set them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from nebula_common.rpc.edge_tls import edge_address
from nebula_common.service.settings import AuditedServiceSettings, ClusterId, HostPort
from services.switch.lane_tuner import parse_connections

LinkRole = Literal["auto", "dial", "accept"]


class PeerSettings(BaseModel):
    """One peer cluster this switch links to (``NEBULA_SWITCH_PEERS`` holds a list of them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    cluster_id: ClusterId = Field(description="The peer cluster's id; only its switch may use this link.")
    address: HostPort | None = Field(
        None, description="host:port of the peer's WAN port; unset: the peer dials this switch."
    )
    link_role: LinkRole = Field("auto", description="As link_role, for this peer's link.")
    crl: Path | None = Field(None, description="As peer_crl, for this peer's CA (trust/<peer>.crl.pem).")

    def dials(self, own_cluster_id: str) -> bool:
        """Whether this switch opens the link to this peer (otherwise it waits for the peer)."""
        if self.link_role == "dial":
            return True
        if self.link_role == "accept":
            return False
        return self.address is not None and own_cluster_id < self.cluster_id


def parse_peers(value: object) -> object:
    """``NEBULA_SWITCH_PEERS``: a JSON list of peers, or the short form ``b=HOST:PORT,c`` (c dials us)."""
    if not isinstance(value, str):
        return value
    text = value.strip()
    if not text:
        return []
    if text.startswith("["):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"peers is not a valid JSON list: {exc}") from exc
    peers: list[dict[str, str]] = []
    for entry in text.split(","):
        cluster, sep, address = entry.strip().partition("=")
        if not cluster.strip():
            raise ValueError(f"peers entry {entry!r} names no cluster (expected ID or ID=HOST:PORT)")
        peer = {"cluster_id": cluster.strip()}
        if sep and address.strip():
            peer["address"] = address.strip()
        peers.append(peer)
    return peers


class SwitchSettings(AuditedServiceSettings):
    """The cluster's gateway: its internal relay port, its mTLS WAN port and its certificates."""

    model_config = SettingsConfigDict(env_prefix="NEBULA_SWITCH_")

    peer_cluster_id: ClusterId | None = Field(
        None,
        description="The only cluster whose switch may connect to the WAN port (a switch with one peer; "
        "several peers: set peers instead).",
    )
    peers: Annotated[list[PeerSettings], NoDecode] = Field(
        default_factory=list,
        description="Every peer cluster this switch links to, one WAN link each: a JSON list of "
        '{"cluster_id", "address", "link_role", "crl"} or the short form "b=HOST:PORT,c" (no address: '
        "that peer dials this switch). All peers' CAs go in trust_bundle. Exclusive with peer_cluster_id, "
        "peer_address and peer_crl (one peer: either form).",
    )
    internal_listen: HostPort = Field("127.0.0.1:0", description="Cluster-internal port for local trainers.")
    edge_socket: str = Field(
        "",
        description="Where stage processes carry their edges as records (services/switch/edge_socket.py): "
        "a path (with a '/') is a Unix socket for trainers on this host (length-prefixed records); host:port "
        "a TCP port for trainers elsewhere (sealed records after mutual TLS 1.3 with this switch's internal "
        "identity, a trainer certificate of the cluster CA required). Either way the trainer obtains a "
        "one-time ticket on Relay/IssueEdgeTicket (mutual TLS, its token, the checks of OpenEdge), presents "
        "it as the first record and hands the connection to its stage; its trainers name the same place "
        "(NEBULA_TRAINER_SWITCH_EDGE_SOCKET). Empty: not served (edges on Relay/OpenEdge only).",
    )
    wan_listen: HostPort = Field("127.0.0.1:0", description="WAN port (mTLS only) for the peer switch.")
    peer_address: HostPort | None = Field(
        None, description="host:port at which the peer's WAN port is reached."
    )
    link_role: LinkRole = Field(
        "auto", description="auto: the cluster whose id sorts first dials, the other accepts."
    )
    tls_cert: Path = Field(description="PEM certificate of this switch (SAN names cluster and role).")
    tls_key: Path = Field(description="PEM private key of this switch.")
    trust_bundle: Path = Field(description="PEM CA certificates of the peer cluster(s) trusted on the WAN.")
    auth_address: HostPort = Field(description="host:port of this cluster's auth service (token keys).")
    max_window_bytes: int = Field(
        16 << 20,
        ge=64 * 1024,
        description="Largest receive window (bytes) a trainer may grant on a route; the switch holds at "
        "most twice this much (a window of replays behind one of originals, +64 KiB for acks and close) "
        "per route and direction and closes a route above it. 16 MiB (the trainer's own default window, "
        "so 2 MiB chunks): with 8 MiB the four-process relay waited for credit (docs/bench/relay.md).",
    )
    unattached_timeout_s: float = Field(
        120.0, gt=0, description="How long a route may buffer items before a local trainer attaches to it."
    )
    orphan_timeout_s: float = Field(
        120.0,
        gt=0,
        description="How long a route whose local trainer vanished (its stream ended without a close) is "
        "kept for a reconnect or a restarted trainer before the peer is sent an error close.",
    )
    max_routes_per_account: int = Field(
        32, ge=1, description="Edges one account may have open on this switch at once."
    )
    account_item_rate: float = Field(
        2000.0,
        gt=0,
        description="Items (frames, 256 KiB chunks, signals, acks) a second the switch reads from one "
        "account's edges, all together; above it the account's streams are not read for a while (gRPC "
        "flow control pushes back on the sender). Nothing is closed and no other account is slowed.",
    )
    account_weights: Annotated[dict[str, int], NoDecode] = Field(
        default_factory=dict,
        description="Shares of the WAN link by account: `alice=4,bob=2` (or a JSON object). While the link "
        "is busy, each route of an account gets this many quanta of bytes per round of the scheduler "
        "(deficit round robin); accounts not named get 1.",
    )
    account_item_burst: int = Field(
        4000, ge=1, description="Items one account may send at once above its rate before it is paced."
    )
    penalty_rate_factor: float = Field(
        0.1,
        gt=0,
        le=1,
        description="A job whose route was closed for a bound its sender exceeded (this switch's credit, "
        "or the peer's window/items/unattached bounds) reads at this fraction of account_item_rate until "
        "penalty_quiet_s pass without a new offence.",
    )
    penalty_backoff_min_s: float = Field(
        1.0,
        gt=0,
        description="First backoff of an account whose route was closed for such a bound: its new edges "
        "(of jobs it has no edge of running here) are refused with RESOURCE_EXHAUSTED for this long; "
        "doubled per further strike.",
    )
    penalty_backoff_max_s: float = Field(60.0, gt=0, description="Cap of the doubling open backoff.")
    penalty_quiet_s: float = Field(
        300.0,
        gt=0,
        description="An account's strikes are forgotten this long after its last backoff ended (the "
        "next offence starts again at penalty_backoff_min_s).",
    )
    max_attached_routes: int = Field(
        128, ge=1, description="Edges open on this switch at once, all accounts."
    )
    max_unattached_routes: int = Field(
        256, ge=1, description="Routes the peer may create that no local trainer has attached to yet."
    )
    link_connections: str = Field(
        "auto",
        description="Connections the dialing switch stripes the link over: 'auto' (start with one; while "
        "items wait for the link in nine samples of ten, double while that raises throughput by more "
        "than 5%, as on a lossy long path, and halve while it does not need them; up to 32) or a fixed "
        "number (1-32).",
    )
    link_carrier: Literal["records", "grpc"] = Field(
        "records",
        description="What carries the WAN link, the same on both switches: 'records' (after a mutual "
        "TLS 1.3 handshake, AES-256-GCM records of up to 1 MiB on the bare TCP connection, keyed from "
        "the TLS exporter of the verified session with RFC 8446 nonces; services/switch/rawlink.py, "
        "nebula_common/rpc/sealed_records.py) or 'grpc' (a gRPC stream per connection, for a path that "
        "passes only HTTP/2). The carrier is agreed inside the authenticated gRPC handshake: a peer "
        "that chose the other one is refused and audited (link.refused, layer transport), never "
        "carried some other way.",
    )
    wan_handshake_timeout_s: float = Field(
        10.0,
        gt=0,
        le=120,
        description="A connection to the WAN port that has not finished TLS and HTTP/2 set-up by then "
        "is dropped.",
    )
    wan_max_connections: int = Field(
        128,
        ge=33,
        le=100_000,
        description="Connections the WAN port holds at once, TLS finished or not (each peer needs at most 32 "
        "lanes plus reconnects); further ones are closed at accept.",
    )
    data_dir: Path = Field(description="Writable directory for the audit log, its seal and the audit key.")
    peer_crl: Path | None = Field(
        None,
        description="PEM CRL of the peer cluster's CA (trust/<peer>.crl.pem). Without it revoked peer "
        "certificates are accepted until they expire; the switch warns at start-up.",
    )
    refusal_audit_interval_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description=(
            "WAN refusals are audited once per source, layer and reason per this interval: the first at "
            "once, its repeats as one record with their count at the interval's end "
            "(nebula_common/audit/aggregate.py), so a stranger cannot fill the audit disk."
        ),
    )
    own_crl: Path | None = Field(
        None,
        description="PEM CRL of this cluster's own CA (<pki>/<cluster>/crl.pem). Sent to the peer switch "
        "over the WAN port (nebula.v1.SwitchTrust), again each time it changes; without it the peer "
        "learns of no revocation of this cluster's certificates.",
    )
    crl_fail_closed: bool = Field(
        False,
        description="Refuse (and close) the peer link while the peer's CRL is past its nextUpdate or none "
        "was received yet. Off: a stale CRL is an alarm (metric nebula_switch_crl_stale, error log) but "
        "is still enforced and the link stays up.",
    )
    ca_cert: Path | None = Field(None, description="This cluster's CA certificate (enables self-renewal).")
    ca_key: Path | None = Field(
        None, description="This cluster's CA key (enables self-renewal; dev PKI only)."
    )

    @field_validator("edge_socket")
    @classmethod
    def _edge_socket(cls, value: str) -> str:
        if value:
            edge_address(value, "NEBULA_SWITCH_EDGE_SOCKET")
        return value

    @field_validator("peer_address", mode="before")
    @classmethod
    def _empty_address_is_unset(cls, value: object) -> object:
        # A compose file cannot leave a variable out for one organisation only: "" means not set.
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("account_weights", mode="before")
    @classmethod
    def _parse_weights(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        text = value.strip()
        if not text:
            return {}
        if text.startswith("{"):
            return json.loads(text)
        weights: dict[str, str] = {}
        for entry in text.split(","):
            account, sep, weight = entry.partition("=")
            if not sep or not account.strip():
                raise ValueError(f"account_weights entry {entry.strip()!r} is not ACCOUNT=WEIGHT")
            weights[account.strip()] = weight.strip()
        return weights

    @field_validator("account_weights")
    @classmethod
    def _weights_in_range(cls, value: dict[str, int]) -> dict[str, int]:
        for account, weight in value.items():
            if not 1 <= weight <= 1000:
                raise ValueError(f"account_weights: weight {weight} of {account!r} is not in 1..1000")
        return value

    @field_validator("link_connections")
    @classmethod
    def _connections(cls, value: str) -> str:
        parse_connections(value)  # a clear error naming the value
        return value.strip().lower()

    def connections(self) -> int | None:
        """The fixed connection count, or None for auto."""
        return parse_connections(self.link_connections)

    @field_validator("peer_cluster_id")
    @classmethod
    def _peer_differs(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and value == info.data.get("cluster_id"):
            raise ValueError("peer_cluster_id must differ from cluster_id")
        return value

    @field_validator("peers", mode="before")
    @classmethod
    def _parse_peers(cls, value: object) -> object:
        return parse_peers(value)

    @model_validator(mode="after")
    def _one_peer_form(self) -> SwitchSettings:
        if self.peers:
            if self.peer_cluster_id is not None or self.peer_address is not None or self.peer_crl is not None:
                raise ValueError(
                    "set either peers or peer_cluster_id/peer_address/peer_crl, not both "
                    f"(peers names {', '.join(p.cluster_id for p in self.peers)})"
                )
            ids = [p.cluster_id for p in self.peers]
            if len(set(ids)) != len(ids):
                raise ValueError(f"peers names a cluster twice: {', '.join(ids)}")
            if self.cluster_id in ids:
                raise ValueError(f"peers must not name this switch's own cluster {self.cluster_id!r}")
            for peer in self.peers:
                if peer.link_role == "dial" and peer.address is None:
                    raise ValueError(f"peer {peer.cluster_id!r} has link_role 'dial' but no address")
        elif self.peer_cluster_id is None:
            raise ValueError("no peer configured: set peer_cluster_id (one peer) or peers (several)")
        return self

    def peer_list(self) -> list[PeerSettings]:
        """Every peer this switch links to; the single-peer settings are a list of one."""
        if self.peers:
            return list(self.peers)
        assert self.peer_cluster_id is not None  # _one_peer_form refuses a switch without a peer
        return [
            PeerSettings(
                cluster_id=self.peer_cluster_id,
                address=self.peer_address,
                link_role=self.link_role,
                crl=self.peer_crl,
            )
        ]

    @field_validator("ca_key")
    @classmethod
    def _ca_pair(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        if (value is None) != (info.data.get("ca_cert") is None):
            raise ValueError("ca_cert and ca_key must be set together (both enable self-renewal)")
        return value

    @model_validator(mode="after")
    def _dialer_knows_where(self) -> SwitchSettings:
        if self.link_role == "dial" and self.peer_address is None:
            raise ValueError("link_role 'dial' needs peer_address (where the peer's WAN port is reached)")
        return self

    @model_validator(mode="after")
    def _backoff_order(self) -> SwitchSettings:
        if self.penalty_backoff_min_s > self.penalty_backoff_max_s:
            raise ValueError(
                f"penalty_backoff_min_s ({self.penalty_backoff_min_s}) must not exceed "
                f"penalty_backoff_max_s ({self.penalty_backoff_max_s})"
            )
        return self

    def dials(self) -> bool:
        """Whether this switch opens the WAN link to its first peer (otherwise it waits for the peer)."""
        return self.peer_list()[0].dials(self.cluster_id)
