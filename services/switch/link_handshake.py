"""The link handshake and the peer's identity: what a switch must check before a session starts.

Identity comes from the peer's verified certificate only: the handshake's claimed cluster id must match
it, or the link is refused; the certificate itself must name exactly the configured peer switch
(:func:`check_identity`). Each side announces ``Handshake.link_framing`` (link framing,
``nebula_common/rpc/framing.py``); a handshake announcing another value than ``LINK_FRAMING_VERSION`` is
refused like one of another protocol version (:func:`check_hello`).

The dialer also learns the certificate the peer's WAN port presents before it links
(:func:`fetch_server_certificate`), because gRPC's client API does not expose it and revocation needs
its serial. :class:`PeerChecks` is the part of :class:`~services.switch.link.PeerLink` that applies all
of this to its one peer, and counts and audits every refusal.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from pathlib import Path

import grpc
from cryptography import x509

from nebula_common.audit.aggregate import RefusalAggregator
from nebula_common.pki import Identity, identity_from_certificate
from nebula_common.proto.nebula.v1 import link_pb2
from nebula_common.rpc.framing import LINK_FRAMING_VERSION, framing_refusal
from services.switch.link_transport import ReadFn
from services.switch.metrics import AUTH_REFUSALS
from services.switch.peer_trust import PeerTrust

PROTOCOL_VERSION = 2
SOFTWARE_VERSION = "nebula/0.1.0"
HANDSHAKE_TIMEOUT_S = 10.0
RAW_LINK_VERSION = 1
"""``Handshake.raw_link`` of a switch whose link carrier is records (an acceptor serves it, a dialer
wants it)."""


def carrier_name(records: bool) -> str:
    """The ``link_carrier`` setting's value for a switch that does (not) carry the link in records."""
    return "records" if records else "grpc"


def carrier_mismatch(*, ours: bool, peer_offers: bool) -> str:
    """Why a link whose two switches chose different carriers is refused (both carriers named)."""
    return (
        f"the peer's link carrier is {carrier_name(peer_offers)}, this switch's is {carrier_name(ours)}: "
        "set NEBULA_SWITCH_LINK_CARRIER the same on both switches"
    )


class HandshakeError(Exception):
    """The peer's handshake contradicts its certificate or our protocol."""


class PreambleError(HandshakeError):
    """The raw link's preamble (exchanged in clear) is not the one sent: rewritten on path, or no raw peer."""


def parse_link_message(raw: object) -> link_pb2.LinkMessage:
    """A link message from the raw bytes read off the stream (a protocol error if they are not one)."""
    if not isinstance(raw, bytes | memoryview):
        raise HandshakeError("unexpected object on the link")
    try:
        return link_pb2.LinkMessage.FromString(raw)
    except Exception as exc:  # protobuf's DecodeError
        raise HandshakeError(f"peer sent bytes that are not a link message: {exc}") from exc


def hello_message(
    cluster_id: str,
    *,
    lanes: bool = True,
    session_id: bytes = b"",
    lane: int = 0,
    raw_link: int = 0,
    raw_preamble: bytes = b"",
) -> link_pb2.LinkMessage:
    """This switch's handshake: its protocol, cluster and what it offers (lanes, raw, witness, pacing,
    express)."""
    return link_pb2.LinkMessage(
        hello=link_pb2.Handshake(
            protocol_version=PROTOCOL_VERSION,
            cluster_id=cluster_id,
            software_version=SOFTWARE_VERSION,
            link_framing=LINK_FRAMING_VERSION,
            lanes=lanes,
            session_id=session_id,
            lane=lane,
            raw_link=raw_link,
            raw_preamble=raw_preamble,
            audit_witness=True,
            paced=True,
            express=True,
        )
    )


def check_hello(message: object, certified: Identity) -> None:
    """Refuse a peer whose handshake disagrees with its certificate or protocol."""
    if not isinstance(message, link_pb2.LinkMessage) or message.WhichOneof("body") != "hello":
        raise HandshakeError("peer did not start with a handshake")
    hello = message.hello
    if hello.protocol_version != PROTOCOL_VERSION:
        raise HandshakeError(
            f"peer speaks link protocol {hello.protocol_version}, this switch speaks {PROTOCOL_VERSION}"
        )
    if (refusal := framing_refusal("Handshake.link_framing", hello.link_framing)) is not None:
        raise HandshakeError(f"peer's {refusal}")
    if hello.cluster_id != certified.cluster_id:
        raise HandshakeError(
            f"peer claims cluster {hello.cluster_id!r} but its certificate says {certified.cluster_id!r}"
        )


def raw_peer_identity(cert: x509.Certificate | None, who: str) -> Identity:
    """The Nebula identity a raw link connection's verified certificate names (``who``: "peer" on the
    dialer, "caller" on the acceptor); a PermissionError saying why there is none."""
    if cert is None:
        raise PermissionError(f"{who} presented no verified certificate on the raw link")
    try:
        return identity_from_certificate(cert)
    except ValueError as exc:
        raise PermissionError(
            f"{who}'s verified certificate carries no valid Nebula identity: {exc}"
        ) from exc


async def read_hello(
    read: ReadFn,
    check: Callable[[link_pb2.LinkMessage, Identity], None],
    certified: Identity,
    timeout_s: float = HANDSHAKE_TIMEOUT_S,
) -> link_pb2.LinkMessage:
    """The dialer's hello on an accepted connection of either carrier, checked (``check``: the link's
    :func:`check_hello`) against the identity its certificate names; a HandshakeError or TimeoutError
    saying why not."""
    raw = await asyncio.wait_for(read(), timeout_s)
    if raw is grpc.aio.EOF:
        raise HandshakeError("peer closed the link during the handshake")
    hello = parse_link_message(raw)
    check(hello, certified)
    return hello


def check_identity(certified: Identity, expected: Identity) -> None:
    """Refuse (PermissionError) a certificate that names anything but the ``expected`` peer switch."""
    if certified != expected:
        raise PermissionError(f"peer certificate names {certified.uri}, but only {expected.uri} may connect")


async def fetch_server_certificate(
    address: str, cert: Path, key: Path, bundle: Path, server_name: str, timeout: float = HANDSHAKE_TIMEOUT_S
) -> x509.Certificate:
    """Complete a TLS handshake with the peer's WAN port and return the certificate it presented.

    gRPC's client API does not expose the server's certificate, but the dialer must know its serial
    to enforce revocation. This probe uses the same trust bundle, client certificate and pinned
    name as the real channel. Limit: an attacker holding a revoked server key who can also forward
    this probe to the genuine switch could pass the probe; short certificate lifetimes bound that.
    """
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(bundle))
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(str(cert), str(key))
    context.set_alpn_protocols(["h2"])
    host, _, port = address.rpartition(":")
    _, writer = await asyncio.wait_for(
        asyncio.open_connection(host.strip("[]"), int(port), ssl=context, server_hostname=server_name),
        timeout,
    )
    try:
        ssl_object = writer.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None
    finally:
        # Drop the connection without TLS's closing exchange: a gRPC server answers no close_notify
        # before its HTTP/2 preface wait ends (wan_handshake_timeout_s), and a graceful close waited
        # for that, which delayed every link (re)connect by 10 s.
        writer.transport.abort()
    if not der:
        raise HandshakeError(f"peer at {address} presented no certificate")
    return x509.load_der_x509_certificate(der)


class PeerChecks:
    """The handshake and identity checks of one peer link, and the refusals they audit."""

    cluster_id: str
    expected_peer: Identity
    revocation: PeerTrust | None
    refusals: RefusalAggregator | None

    def hello(
        self,
        *,
        lanes: bool = True,
        session_id: bytes = b"",
        lane: int = 0,
        raw_link: int = 0,
        raw_preamble: bytes = b"",
    ) -> link_pb2.LinkMessage:
        return hello_message(
            self.cluster_id,
            lanes=lanes,
            session_id=session_id,
            lane=lane,
            raw_link=raw_link,
            raw_preamble=raw_preamble,
        )

    def check_hello(self, message: object, certified: Identity) -> None:
        """Refuse a peer whose handshake disagrees with its certificate or protocol."""
        check_hello(message, certified)

    def check_identity(self, certified: Identity) -> None:
        check_identity(certified, self.expected_peer)

    def refuse(self, layer: str, reason: str, **details: object) -> None:
        """Count and audit a refused peer: each new (source, layer, reason) is written at once, its
        repeats within the minute as one record with their count (``RefusalAggregator``)."""
        AUTH_REFUSALS.labels("wan", layer).inc()
        if self.refusals is not None:
            self.refusals.refused("link.refused", layer, reason, dict(details))

    def is_revoked(self, cert: x509.Certificate | None) -> bool:
        return cert is not None and self.revocation is not None and self.revocation.is_revoked(cert)

    def refusal(self, cert: x509.Certificate | None) -> tuple[str, str] | None:
        """(audit layer, reason) when the peer's ``cert`` is not accepted: ``revoked`` (its CRL, a
        closed gate) or ``trust`` (no CA pinned to this peer issued it); None to accept it."""
        if cert is None or self.revocation is None:
            return None
        return self.revocation.check(cert)
