"""The WAN link to the peer switch: handshake, identity checks, liveness and the item pumps.

One bidirectional gRPC stream carries every job's items (link protocol 2: RoutedItem, Ping, Pong).
The cluster whose id sorts first dials (through the WAN, via mTLS); the other accepts. Either way the
session is the same code: the reader hands each item to the router, which never waits (it buffers
per route, or closes a route over its bound); the writer takes the router's next message (acks first,
then the routes by deficit round robin over bytes), on a paced session only while what the peer has
not read yet is under the pacer's cap, cutting large items into fragments (``pacing.py``). Identity
comes from the peer's verified certificate only: the handshake's claimed cluster id must match it, or
the link is refused.

Raw bytes on the stream (link framing, ``nebula_common/rpc/framing.py``). The Link method is served and
called with identity (de)serializers: the switch parses small link messages itself and forwards a
trainer's framed chunk (``LinkMessage.framed``) byte for byte, reading only its header, so no payload is
decoded or re-encoded here. Each side announces ``Handshake.link_framing``; a handshake announcing
another value than ``LINK_FRAMING_VERSION`` is refused like one of another protocol version.

Liveness from the measured round-trip time: ``liveness.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import grpc
from cryptography import x509

from nebula_common.audit import AuditLog
from nebula_common.audit.aggregate import RefusalAggregator
from nebula_common.pki import Identity, identity_from_certificate
from nebula_common.proto.nebula.v1 import link_pb2
from nebula_common.rpc.framing import (
    LINK_FRAMING_VERSION,
    FramedChunk,
    FramingError,
    framing_refusal,
    is_framed,
    parse_chunk,
)
from services.switch.bandwidth import BandwidthMeter, BandwidthProbeError, Measurement
from services.switch.lanes import MAX_LANES, LaneGapError, LaneTuner, ReorderBuffer
from services.switch.liveness import LivenessPolicy, RttEstimator
from services.switch.metrics import (
    AUTH_REFUSALS,
    LINK_CONNECTIONS,
    LINK_DELIVERY_RATE,
    LINK_INFLIGHT,
    LINK_INFLIGHT_LIMIT,
    LINK_RTT,
    LINK_UP,
    PEER_LINK_UP,
    DirectionCounters,
)
from services.switch.pacing import Fragment, LinkPacer, PacingError, Reassembler
from services.switch.peer_trust import PeerTrust
from services.switch.route_state import Outbound
from services.switch.routing import Router
from services.switch.transfers import StepTotals, TransferKey, TransferLedger
from services.switch.witness import AuditWitness

PROTOCOL_VERSION = 2
ROUTED_KINDS = ("frame", "signal", "ack", "close")
"""Edge items that may cross the link (never open, ready or notice)."""
SOFTWARE_VERSION = "nebula/0.1.0"
HANDSHAKE_TIMEOUT_S = 10.0
LINK_METHOD = "/nebula.v1.SwitchLink/Link"
log = logging.getLogger(__name__)

LANE_SAMPLE_S = 0.1
LANE_INTERVAL_S = 2.0
"""The lane tuner's measurement interval (busy is sampled every LANE_SAMPLE_S within it)."""
ReadFn = Callable[[], Awaitable[object]]
WriteFn = Callable[[bytes], Awaitable[None]]
CredentialsFn = Callable[[], grpc.ChannelCredentials]
ProbeFn = Callable[[], Awaitable[x509.Certificate]]
READER_GRACE_S = 1.0
"""How long a session whose write failed waits for its reader to say why the connection ended."""
RAW_LINK_VERSION = 1
"""``Handshake.raw_link`` of a switch that serves (acceptor) or wants (dialer) the raw transport."""


class RawConnectionLike(Protocol):
    """A raw link connection (services/switch/rawlink.py): whole messages both ways, the peer's cert."""

    peer_cert: x509.Certificate | None
    preamble: bytes
    """The preamble exchanged in clear before TLS (``rawlink.PREAMBLE`` or ``PREAMBLE_SEALED``)."""

    async def read(self) -> object: ...

    async def write(self, data: bytes) -> None: ...

    async def close(self) -> None: ...


class Closeable(Protocol):
    async def close(self) -> None: ...


RawDialFn = Callable[[], Awaitable[RawConnectionLike]]
LaneOpenFn = Callable[[int], Awaitable[tuple[Closeable, "asyncio.Task[None]"]]]


class HandshakeError(Exception):
    """The peer's handshake contradicts its certificate or our protocol."""


class PreambleError(HandshakeError):
    """The raw link's preamble (exchanged in clear) is not the one sent: rewritten on path, or no raw peer."""


class DeadPeerError(Exception):
    """Nothing arrived from the peer for the dead-peer timeout."""


def grpc_writer(write: WriteFn) -> WriteFn:
    """``write`` of a gRPC call, taking the views a raw transport hands on too (gRPC wants bytes)."""

    async def write_bytes(data: bytes) -> None:
        await write(data if isinstance(data, bytes) else bytes(data))

    return write_bytes


def parse_link_message(raw: object) -> link_pb2.LinkMessage:
    """A link message from the raw bytes read off the stream (a protocol error if they are not one)."""
    if not isinstance(raw, bytes | memoryview):
        raise HandshakeError("unexpected object on the link")
    try:
        return link_pb2.LinkMessage.FromString(raw)
    except Exception as exc:  # protobuf's DecodeError
        raise HandshakeError(f"peer sent bytes that are not a link message: {exc}") from exc


@dataclass
class _Lanes:
    """The lanes of one session (see services/switch/lanes.py): marks, reordering, retiring, failure."""

    session_id: bytes
    marking: bool
    reorder: ReorderBuffer[tuple[tuple[str, str], object, int]]
    send_seq: int = 0
    active: set[int] = field(default_factory=lambda: {0})
    retiring: set[int] = field(default_factory=set)
    failed: asyncio.Event = field(default_factory=asyncio.Event)
    failure: str = ""
    #: Items written per lane (a lane's share of the striping, for status and tests).
    written: dict[int, int] = field(default_factory=dict)

    def fail(self, reason: str) -> None:
        if not self.failed.is_set():
            self.failure = reason
            self.failed.set()


@dataclass
class LinkState:
    connected: bool = False
    peer_identity: str = ""
    role: str = ""
    #: Serial of the certificate the peer authenticated this session with (0 when unknown).
    peer_serial: int = 0
    #: Sessions established since start: a rotation that kept the link up leaves this unchanged.
    sessions: int = 0
    #: What carries the session: "grpc" (a gRPC stream per connection) or "raw" (rawlink.py).
    transport: str = ""


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


class PeerLink:
    """The switch's one link to its peer, surviving reconnects of the underlying stream."""

    def __init__(
        self,
        cluster_id: str,
        peer_cluster_id: str,
        router: Router,
        *,
        audit: AuditLog | None = None,
        revocation: PeerTrust | None = None,
        liveness: LivenessPolicy | None = None,
        connections: int | None = 1,
        raw_dialer: RawDialFn | None = None,
        serves_raw: bool = False,
        refusals: RefusalAggregator | None = None,
    ) -> None:
        self.cluster_id = cluster_id
        #: Dialer: opens a raw connection to the peer (offered in the handshake; None: gRPC only).
        self.raw_dialer = raw_dialer
        #: Acceptor: this switch's WAN port takes raw connections (rawlink.WanFrontend).
        self.serves_raw = serves_raw
        #: Connections the dialer keeps per session: a fixed count, or None to self-tune (lanes.py).
        self.connections = connections
        self._lanes: _Lanes | None = None
        self._lane_channels: dict[int, tuple[Closeable, asyncio.Task[None]]] = {}
        self.expected_peer = Identity(cluster_id=peer_cluster_id, role="switch")
        self.router = router
        if router.record is None:
            router.record = self.record
        if not router.cluster_id:
            router.cluster_id = cluster_id
        if not router.peer_cluster_id:
            router.peer_cluster_id = peer_cluster_id
        self.audit = audit
        #: Witnessed audit (witness.py): this switch's head to the peer, the peer's into our log.
        self.witness = AuditWitness(audit, peer_cluster_id, self.record)
        self._peer_witness = False  # the session's peer takes audit heads (Handshake.audit_witness)
        # A paced session (pacing.py): what we may write, what we read (acknowledged to the peer).
        self._pacer: LinkPacer | None = None
        self._rx_bytes = 0
        self._ack_due = False
        self._reassembly = Reassembler()
        # Refusals by strangers on the WAN port: one record per source, layer and reason per interval
        # (the switch shares one aggregator among its links).
        self.refusals = refusals or (RefusalAggregator(audit.append) if audit is not None else None)
        self.liveness = liveness or LivenessPolicy()
        self.rtt = RttEstimator()
        self._priority: deque[link_pb2.LinkMessage] = deque()  # pings and pongs, ahead of every item
        self._writing = 0  # writers inside a write: with several lanes the backlog waits there
        self._ping_nonce = 0
        self._ping_outstanding: tuple[int, float] | None = None
        self.bandwidth = BandwidthMeter(self._queue_priority)  # on demand: services/switch/bandwidth.py
        self._last_received = 0.0
        self.revocation = revocation
        self.ledger = TransferLedger(self._emit_transfer)
        self._sessions = 0
        self._close_session = asyncio.Event()
        self.sent = DirectionCounters("sent", peer_cluster_id)
        self.received = DirectionCounters("received", peer_cluster_id)
        self.state = LinkState()
        self._connected = asyncio.Event()
        self._session_lock = asyncio.Lock()
        self._current_session: asyncio.Task[None] | None = None
        self._stopping = False
        #: Called when the link goes up or down instead of setting nebula_switch_link_up directly
        #: (a switch with several peers sets it from all its links: services/switch/peers.py).
        self.on_up_change: Callable[[], None] | None = None
        PEER_LINK_UP.labels(peer_cluster_id).set(0)
        LINK_CONNECTIONS.labels(peer_cluster_id).set(0)
        LINK_INFLIGHT.labels(peer_cluster_id).set_function(lambda: self._pacer.inflight if self._pacer else 0)
        LINK_INFLIGHT_LIMIT.labels(peer_cluster_id).set_function(
            lambda: self._pacer.cap() if self._pacer else 0
        )
        LINK_DELIVERY_RATE.labels(peer_cluster_id).set_function(
            lambda: self._pacer.rate if self._pacer else 0
        )

    def _publish_up(self, up: bool) -> None:
        PEER_LINK_UP.labels(self.expected_peer.cluster_id).set(1 if up else 0)
        if self.on_up_change is not None:
            self.on_up_change()
        else:
            LINK_UP.set(1 if up else 0)

    # ----- used by the relay servicer -------------------------------------------------
    async def wait_connected(self, timeout: float) -> bool:
        try:
            await asyncio.wait_for(self._connected.wait(), timeout)
        except TimeoutError:
            return False
        return True

    @property
    def connected(self) -> bool:
        return self.state.connected

    # ----- the session, shared by both roles -------------------------------------------
    def hello(
        self,
        *,
        lanes: bool = True,
        session_id: bytes = b"",
        lane: int = 0,
        raw_link: int = 0,
        raw_preamble: bytes = b"",
    ) -> link_pb2.LinkMessage:
        return link_pb2.LinkMessage(
            hello=link_pb2.Handshake(
                protocol_version=PROTOCOL_VERSION,
                cluster_id=self.cluster_id,
                software_version=SOFTWARE_VERSION,
                link_framing=LINK_FRAMING_VERSION,
                lanes=lanes,
                session_id=session_id,
                lane=lane,
                raw_link=raw_link,
                raw_preamble=raw_preamble,
                audit_witness=True,
                paced=True,
            )
        )

    def joins_current_session(self, session_id: bytes) -> bool:
        """True if a further connection with ``session_id`` may join the running session as a lane."""
        lanes = self._lanes
        return lanes is not None and lanes.marking and bool(session_id) and lanes.session_id == session_id

    def check_hello(self, message: object, certified: Identity) -> None:
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

    def check_identity(self, certified: Identity) -> None:
        if certified != self.expected_peer:
            raise PermissionError(
                f"peer certificate names {certified.uri}, but only {self.expected_peer.uri} may connect"
            )

    def record(
        self, event: str, *, outcome: str = "ok", account: str = "", job_id: str = "", **details: object
    ) -> None:
        """Append to the switch's audit log (no-op when the link runs without one, as in unit tests)."""
        if self.audit is not None:
            self.audit.append(event, outcome=outcome, account=account, job_id=job_id, details=details)

    def refuse(self, layer: str, reason: str, **details: object) -> None:
        """Count and audit a refused peer: each new (source, layer, reason) is written at once, its
        repeats within the minute as one record with their count (``RefusalAggregator``)."""
        AUTH_REFUSALS.labels("wan", layer).inc()
        if self.refusals is not None:
            self.refusals.refused("link.refused", layer, reason, dict(details))

    def _emit_transfer(self, key: TransferKey, totals: StepTotals) -> None:
        job_id, edge, direction = key
        route = self.router.get((job_id, edge))
        self.record(
            "transfer",
            account=route.owner if route is not None else "",
            job_id=job_id,
            edge=edge,
            direction=direction,
            step=totals.step,
            frames=totals.frames,
            payload_bytes=totals.payload_bytes,
            raw_bytes=totals.raw_bytes,
            wire_bytes=totals.wire_bytes,
            codec=",".join(sorted(totals.codecs)),
            peer=self.state.peer_identity or self.expected_peer.uri,
        )

    def is_revoked(self, cert: x509.Certificate | None) -> bool:
        return cert is not None and self.revocation is not None and self.revocation.is_revoked(cert)

    def refusal(self, cert: x509.Certificate | None) -> tuple[str, str] | None:
        """(audit layer, reason) when the peer's ``cert`` is not accepted: ``revoked`` (its CRL, a
        closed gate) or ``trust`` (no CA pinned to this peer issued it); None to accept it."""
        if cert is None or self.revocation is None:
            return None
        return self.revocation.check(cert)

    def enforce_revocation(self) -> bool:
        """Close the live session if its peer certificate is now revoked; True if one was closed."""
        serial = self.state.peer_serial
        session = self._current_session
        if not serial or self.revocation is None or serial not in self.revocation.revoked:
            return False
        if session is None or session.done():
            return False
        self.refuse(
            "revoked", "peer certificate revoked during the session; link closed", serial=f"{serial:x}"
        )
        log.warning("closing the WAN link: the peer's certificate %x was revoked", serial)
        self._close_session.set()  # ends the session; the dialer then retries (and its probe refuses)
        return True

    async def run_session(
        self,
        read: ReadFn,
        write: WriteFn,
        certified: Identity,
        role: str,
        peer_cert: x509.Certificate | None = None,
        session_id: bytes = b"",
        marking: bool = False,
        transport: str = "grpc",
        peer_witness: bool = False,
        peer_paced: bool = False,
    ) -> None:
        """Pump frames both ways until either side ends; only one session runs at a time.

        ``read`` returns the raw bytes of each message (or EOF), ``write`` takes raw bytes;
        ``peer_witness`` and ``peer_paced`` are what the peer's handshake announced. This connection
        is lane 0; with ``marking`` (both ends announced lanes) further connections may join with
        ``run_lane``.

        A new session supersedes the current one: when a peer reconnects, the old stream is
        usually a dead TCP flow that keepalive has not noticed yet, and waiting for it would
        stall every job for tens of seconds.
        """
        me = asyncio.current_task()
        stale = self._current_session
        if stale is not None and stale is not me and not stale.done():
            stale.cancel()
        self._current_session = me
        async with self._session_lock:
            serial = peer_cert.serial_number if peer_cert is not None else 0
            self._sessions += 1
            self.state = LinkState(
                connected=True,
                peer_identity=certified.uri,
                role=role,
                peer_serial=serial,
                sessions=self._sessions,
                transport=transport,
            )
            self._connected.set()
            self._publish_up(True)
            self.record(
                "link.up", peer=certified.uri, role=role, peer_serial=f"{serial:x}", transport=transport
            )
            log.info("WAN link up", extra={"fields": {"peer": certified.uri, "role": role}})
            self._priority.clear()
            self._peer_witness = peer_witness
            self._pacer = LinkPacer() if peer_paced else None
            self._rx_bytes, self._ack_due, self._reassembly = 0, False, Reassembler()
            self.witness.session_started()
            self._ping_outstanding = None
            self._last_received = time.monotonic()
            lanes = self._lanes = _Lanes(
                session_id=session_id,
                marking=marking,
                reorder=ReorderBuffer(lambda item: self._in_order(*item)),
            )
            LINK_CONNECTIONS.labels(self.expected_peer.cluster_id).set(1)
            self.router.link_came_up()
            writer = asyncio.create_task(self._pump_out(write), name="link-writer")
            reader = asyncio.create_task(self._pump_in(read), name="link-reader")
            keepalive = asyncio.create_task(self._keepalive(), name="link-keepalive")
            self._close_session = asyncio.Event()
            closer = asyncio.create_task(self._close_session.wait(), name="link-closer")
            lane_lost = asyncio.create_task(lanes.failed.wait(), name="link-lane-lost")
            reason = "the WAN link session ended"
            try:
                done, _ = await asyncio.wait(
                    {writer, reader, keepalive, closer, lane_lost}, return_when=asyncio.FIRST_COMPLETED
                )
                if writer in done and writer.exception() is not None and reader not in done:
                    # A write into a connection that broke says only that it is closed; the reader
                    # learns why (a cut, a tampered record, the peer's close): give it a moment.
                    finished, _ = await asyncio.wait({reader}, timeout=READER_GRACE_S)
                    done = {*done, *finished}
                # The most telling reason is assigned last: this switch's close, a lost lane, then
                # what the reader saw, then any other task's failure.
                rank = {reader: 1, lane_lost: 2, closer: 3}
                for task in sorted(done, key=lambda t: rank.get(t, 0)):
                    if task is closer:
                        reason = "the WAN link session was closed by this switch"
                    elif task is lane_lost:
                        log.warning("WAN link session ended: %s", lanes.failure)
                        reason = f"the WAN link to the peer cluster was lost: {lanes.failure}"
                    elif task.exception() is not None:
                        log.warning("WAN link session ended: %r", task.exception())
                        reason = f"the WAN link to the peer cluster was lost: {task.exception()}"
                    elif task is reader:
                        reason = "the peer switch ended the WAN link session"
            except asyncio.CancelledError:
                reason = "the WAN link session was replaced or stopped"
                raise
            finally:
                lanes.fail("the session ended")  # ends every other lane of this session
                for task in (writer, reader, keepalive, closer, lane_lost):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
                if self._lanes is lanes:
                    self._lanes = None
                LINK_CONNECTIONS.labels(self.expected_peer.cluster_id).set(0)
                if self._current_session is me:
                    self._current_session = None
                self._connected.clear()
                self._priority.clear()
                self.ledger.flush_all()
                self.state = LinkState(connected=False, role=role, sessions=self._sessions)
                self._publish_up(False)
                with contextlib.suppress(Exception):
                    self.record(
                        "link.down", peer=certified.uri, role=role, peer_serial=f"{serial:x}", reason=reason
                    )
                log.warning("WAN link down", extra={"fields": {"peer": certified.uri}})
                # Buffers are purged both ways (the trainers replay) and attached routes told.
                self.router.link_down(reason)

    def _next_message(self) -> Outbound | Fragment | None:
        """Our acknowledgement, pings and pongs first; then items while the pacer has room."""
        if self._ack_due:
            self._ack_due = False
            return link_pb2.LinkMessage(received=link_pb2.LinkReceived(bytes=self._rx_bytes))
        if self._priority:
            return self._priority.popleft()
        pacer = self._pacer
        if pacer is None:
            return self.router.next_outbound()
        if not pacer.has_room():
            return None  # an acknowledgement wakes the writers
        return self.router.next_outbound(pacer.fragment_bytes, pacer.cut_above)

    async def run_lane(self, lane: int, read: ReadFn, write: WriteFn) -> None:
        """Carry the current session's items over one more connection until it is retired or lost.

        A lane that fails (read or write error, EOF without a retiring mark) ends the whole session:
        items written to it may be lost, a gap no other lane can fill (lanes.py). A lane that is
        retired (``retire_lane``, or the peer's last mark) ends alone once both last marks crossed.
        """
        lanes = self._lanes
        if lanes is None or not lanes.marking:
            raise HandshakeError(f"lane {lane} has no session to join")
        lanes.active.add(lane)
        LINK_CONNECTIONS.labels(self.expected_peer.cluster_id).set(len(lanes.active))
        writer = asyncio.create_task(self._pump_out(write, lane), name=f"link-writer-{lane}")
        reader = asyncio.create_task(self._pump_in(read, lane), name=f"link-reader-{lane}")
        ended = asyncio.create_task(lanes.failed.wait(), name=f"link-lane-{lane}-session")
        try:
            pending: set[asyncio.Task[object]] = {writer, reader}  # type: ignore[arg-type]
            while pending:
                done, pending = await asyncio.wait({*pending, ended}, return_when=asyncio.FIRST_COMPLETED)
                if ended in done:
                    return
                pending.discard(ended)
                for task in done:
                    error = task.exception()
                    if error is not None:
                        lanes.fail(f"connection {lane} of the link failed: {error}")
                        return
        except asyncio.CancelledError:
            # The call was cancelled under us (the peer dropped this connection): unless the lane was
            # being retired, what it carried may be lost, so the session must end.
            if lane not in lanes.retiring:
                lanes.fail(f"connection {lane} of the link was cancelled")
            raise
        finally:
            for task in (writer, reader, ended):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            lanes.active.discard(lane)
            lanes.retiring.discard(lane)
            if self._lanes is lanes:
                LINK_CONNECTIONS.labels(self.expected_peer.cluster_id).set(len(lanes.active))

    def lane_counts(self) -> dict[int, int]:
        """Items written per connection in the current session ({} without lanes)."""
        lanes = self._lanes
        return dict(lanes.written) if lanes is not None else {}

    async def drop_connection(self, lane: int) -> bool:
        """Fault control: close one extra connection abruptly (no retiring). The session ends, the
        link reconnects and the trainers replay (lanes.py). False if this switch has no such lane."""
        entry = self._lane_channels.get(lane)
        if entry is None:
            return False
        await entry[0].close()
        return True

    def retire_lane(self, lane: int) -> None:
        """Stop sending on ``lane``: its writer sends a last mark, the peer answers with its own."""
        lanes = self._lanes
        if lanes is not None and lane in lanes.active and lane != 0:
            lanes.retiring.add(lane)
            self.router.outbound_wake.set()

    async def _pump_out(self, write: WriteFn, lane: int = 0) -> None:
        wake = self.router.outbound_wake
        lanes = self._lanes
        while True:
            if lanes is not None and lane in lanes.retiring:
                await write(link_pb2.LinkMessage(mark=link_pb2.LaneMark(last=True)).SerializeToString())
                return
            message = self._next_message()
            if message is None:
                wake.clear()
                message = self._next_message()  # anything queued between the check and the clear
                if message is None:
                    await wake.wait()
                    continue
            self._writing += 1
            try:
                await self._write_item(write, message, lanes, lane)
            finally:
                self._writing -= 1

    async def _write_item(
        self, write: WriteFn, message: Outbound | Fragment, lanes: _Lanes | None, lane: int
    ) -> None:
        data = isinstance(message, FramedChunk | Fragment) or message.WhichOneof("body") == "routed"
        if lanes is not None and lanes.marking and data:
            lanes.send_seq += 1
            lanes.written[lane] = lanes.written.get(lane, 0) + 1
            await write(link_pb2.LinkMessage(mark=link_pb2.LaneMark(seq=lanes.send_seq)).SerializeToString())
        if isinstance(message, Fragment):
            raw = message.encode()
            if self._pacer is not None:
                self._pacer.on_sent(len(raw))
            await write(raw)
            if message.whole is not None:
                self._count_sent(message.whole)  # type: ignore[arg-type]
            return
        if isinstance(message, FramedChunk):
            raw = message.raw
            if self._pacer is not None:
                self._pacer.on_sent(len(raw))
            await write(raw)
            self._count_sent(message)
            return
        if data and self._pacer is not None:
            raw = message.SerializeToString()
            self._pacer.on_sent(len(raw))
            await write(raw)
            self._count_sent(message)
            return
        if message.WhichOneof("body") == "ping" and not BandwidthMeter.is_probe(message.ping.nonce):
            self._ping_outstanding = (message.ping.nonce, time.monotonic())
        await write(message.SerializeToString())
        self._count_sent(message)

    def _count_sent(self, message: Outbound) -> None:
        if isinstance(message, FramedChunk):
            self.sent.count_chunk(message)
            self.ledger.observe_chunk("sent", message)
        else:
            self.sent.count(message)
            self.ledger.observe("sent", message)

    def link_busy(self) -> bool:
        """Items wait for the link: queued in the router, or a writer is blocked in a write.

        With one connection a full link shows as a router backlog; with several, the backlog moves
        into the connections' writes (their HTTP/2 and socket buffers) and the router is empty
        although the link is full. The lane tuner only judges busy intervals (lanes.py).
        """
        return self.router.has_outbound() or self._writing > 0

    def _queue_priority(self, message: link_pb2.LinkMessage) -> None:
        self._priority.append(message)
        self.router.outbound_wake.set()

    async def _keepalive(self) -> None:
        """Ping at the RTT-derived interval; end the session when the peer has gone silent."""
        next_ping = time.monotonic()
        while True:
            now = time.monotonic()
            dead_after = self.liveness.dead_after(self.rtt)
            silent = now - self._last_received
            if silent > dead_after:
                raise DeadPeerError(
                    f"nothing received from the peer switch for {silent:.1f} s (dead-peer timeout "
                    f"{dead_after:.1f} s from SRTT {self.rtt.srtt or 0:.3f} s)"
                )
            if now >= next_ping:
                if self._ping_outstanding is None and not any(
                    m.WhichOneof("body") == "ping" for m in self._priority
                ):
                    self._ping_nonce += 1
                    self._queue_priority(link_pb2.LinkMessage(ping=link_pb2.Ping(nonce=self._ping_nonce)))
                next_ping = now + self.liveness.interval(self.rtt)
            if self._peer_witness and (head := self.witness.due(now)) is not None:
                self._queue_priority(head)
            await asyncio.sleep(max(0.01, min(next_ping, self._last_received + dead_after) - now))

    async def measure_bandwidth(self, timeout: float = 8.0) -> Measurement:
        """The bandwidth toward the peer, measured now (or a fresh result); see ``bandwidth.py``."""
        if not self.connected:
            raise BandwidthProbeError(f"the link to {self.expected_peer.cluster_id} is down")
        return await self.bandwidth.measure(timeout)

    def _on_pong(self, nonce: int) -> None:
        if BandwidthMeter.is_probe(nonce):
            self.bandwidth.on_pong(nonce)
            return
        outstanding = self._ping_outstanding
        if outstanding is None or outstanding[0] != nonce:
            return
        self._ping_outstanding = None
        self.rtt.sample(time.monotonic() - outstanding[1])
        LINK_RTT.labels(self.expected_peer.cluster_id).set(self.rtt.srtt or 0.0)

    def _deliver(self, key: tuple[str, str], item: object, epoch: int, seq: int | None) -> None:
        """Hand an item to the router, in lane-mark order when the session stripes over lanes."""
        lanes = self._lanes
        if lanes is None or not lanes.marking:
            self._in_order(key, item, epoch)
            return
        if seq is None:
            raise HandshakeError("peer sent an item without its lane mark")
        try:
            lanes.reorder.put(seq, (key, item, epoch))
        except LaneGapError as exc:
            raise HandshakeError(str(exc)) from exc

    def _in_order(self, key: tuple[str, str], item: object, epoch: int) -> None:
        """An item in the session's order: to the router (a fragment: once its item is whole)."""
        if isinstance(item, link_pb2.LinkFragment):
            try:
                whole = self._reassembly.add(item)
            except PacingError as exc:
                raise HandshakeError(f"peer broke the paced link protocol: {exc}") from exc
            if whole is None:
                return
            key, item, epoch = self._data_item(whole)
        self.router.deliver(key, item, epoch)  # type: ignore[arg-type]

    def _data_item(self, raw: bytes | memoryview) -> tuple[tuple[str, str], object, int]:
        """(route key, item, epoch) of a framed chunk or a routed message, counted as received."""
        if is_framed(raw):
            try:
                chunk = parse_chunk(raw)
            except FramingError as exc:
                raise HandshakeError(f"peer sent an invalid framed chunk: {exc}") from exc
            self.received.count_chunk(chunk)
            self.ledger.observe_chunk("received", chunk)
            return (chunk.job_id, chunk.edge), chunk, chunk.epoch
        message = parse_link_message(raw)
        if message.WhichOneof("body") != "routed":
            raise HandshakeError("peer's fragments joined into something else than an item")
        return self._routed(message)

    def _routed(self, message: link_pb2.LinkMessage) -> tuple[tuple[str, str], object, int]:
        self.received.count(message)
        self.ledger.observe("received", message)
        routed = message.routed
        if routed.item.WhichOneof("body") not in ROUTED_KINDS:
            raise HandshakeError("peer routed an item that may not cross the link")
        return (routed.job_id, routed.edge), routed.item, routed.epoch

    def _read_data(self, size: int) -> None:
        """``size`` bytes of data messages were read: acknowledge them (a paced session)."""
        self._rx_bytes += size
        if self._pacer is not None:
            self._ack_due = True
            self.router.outbound_wake.set()

    async def _pump_in(self, read: ReadFn, lane: int = 0) -> None:
        lanes = self._lanes
        seq: int | None = None  # the lane mark of the next item on this connection
        while True:
            raw = await read()
            if raw is grpc.aio.EOF:
                if lane:
                    raise HandshakeError(f"the peer ended connection {lane} without retiring it")
                return
            if isinstance(raw, bytes | memoryview) and is_framed(raw):
                self._last_received = time.monotonic()
                self._read_data(len(raw))
                key, item, epoch = self._data_item(raw)
                self._deliver(key, item, epoch, seq)
                seq = None
                continue
            message = parse_link_message(raw)
            self._last_received = time.monotonic()
            if message.WhichOneof("body") == "mark":
                if lanes is None or not lanes.marking:
                    raise HandshakeError("peer sent a lane mark on a session without lanes")
                if message.mark.last:
                    if lane == 0:
                        raise HandshakeError("peer tried to retire the session's first connection")
                    if lane not in lanes.retiring:  # the peer retires it: answer with our own last mark
                        lanes.retiring.add(lane)
                        self.router.outbound_wake.set()
                    return
                if seq is not None:
                    raise HandshakeError("peer sent two lane marks in a row")
                seq = message.mark.seq
                continue
            kind = message.WhichOneof("body")
            if kind not in ("routed", "fragment"):  # items are counted whole (_data_item)
                self.received.count(message)
                self.ledger.observe("received", message)
            if kind == "routed":
                self._read_data(len(raw))  # type: ignore[arg-type]
                # Never waits; drops items of an epoch the route has left behind.
                self._deliver(*self._routed(message), seq)
                seq = None
            elif kind == "fragment":
                if self._pacer is None:
                    raise HandshakeError("peer sent a fragment on a session that is not paced")
                self._read_data(len(raw))  # type: ignore[arg-type]
                self._deliver(("", ""), message.fragment, 0, seq)
                seq = None
            elif kind == "received":
                if self._pacer is None:
                    raise HandshakeError("peer acknowledged bytes on a session that is not paced")
                try:
                    self._pacer.on_ack(message.received.bytes)
                except PacingError as exc:
                    raise HandshakeError(f"peer broke the paced link protocol: {exc}") from exc
                self.router.outbound_wake.set()
            elif kind == "ping":
                self._queue_priority(link_pb2.LinkMessage(pong=link_pb2.Pong(nonce=message.ping.nonce)))
            elif kind == "pong":
                self._on_pong(message.pong.nonce)
            elif kind == "audit_head":
                self.witness.received(message.audit_head)
            else:
                raise HandshakeError(f"unexpected {kind!r} message after the handshake")

    # ----- dialer role ----------------------------------------------------------------------
    async def dial_forever(
        self,
        address: str,
        credentials: CredentialsFn,
        options: list[tuple[str, object]],
        probe: ProbeFn | None = None,
    ) -> None:
        """Keep one link to the peer up, reconnecting with capped exponential backoff.

        ``credentials`` is called on every attempt so a renewed certificate is used at the next
        reconnect; ``probe`` (when given) learns the certificate the peer presents, so a revoked
        peer is refused before the link starts and the session can be closed if it is revoked later.
        With a ``raw_dialer`` the gRPC handshake offers the raw transport; a peer that takes it ends
        the call and the session runs over a raw connection instead (rawlink.py).
        """
        backoff = 0.2
        while not self._stopping:
            try:
                peer_cert = await probe() if probe is not None else None
                if (refused := self.refusal(peer_cert)) is not None:
                    assert peer_cert is not None
                    self.refuse(*refused, serial=f"{peer_cert.serial_number:x}")
                    raise HandshakeError(refused[1])
                offer_raw = self.raw_dialer is not None
                session_id = os.urandom(16)
                striping = self.connections != 1
                async with grpc.aio.secure_channel(address, credentials(), options=options) as channel:
                    # Raw bytes both ways: messages are (de)serialized by the session itself.
                    call = channel.stream_stream(LINK_METHOD)()
                    hello = self.hello(
                        lanes=striping, session_id=session_id, raw_link=RAW_LINK_VERSION if offer_raw else 0
                    )
                    await call.write(hello.SerializeToString())
                    raw = await asyncio.wait_for(call.read(), HANDSHAKE_TIMEOUT_S)
                    if raw is grpc.aio.EOF:
                        raise HandshakeError("peer closed the link during the handshake")
                    # TLS already verified the server's certificate names the expected peer
                    # (target-name override); the handshake must agree with it.
                    try:
                        reply = parse_link_message(raw)
                        self.check_hello(reply, self.expected_peer)
                    except HandshakeError as exc:
                        self.refuse("handshake", str(exc))
                        raise
                    use_raw = offer_raw and bool(reply.hello.raw_link)
                    if not use_raw:
                        backoff = 0.2
                        marking = striping and reply.hello.lanes and reply.hello.session_id == session_id

                        async def open_grpc_lane(
                            index: int, session_id: bytes = session_id
                        ) -> tuple[Closeable, asyncio.Task[None]]:
                            return await self._open_lane(index, address, credentials, options, session_id)

                        try:
                            await self._dialer_session(
                                call.read,
                                grpc_writer(call.write),
                                peer_cert,
                                reply,
                                session_id,
                                marking,
                                open_grpc_lane,
                                "grpc",
                            )
                        finally:
                            call.cancel()
                    else:
                        call.cancel()  # the peer takes the raw transport: this call carried only the offer
                if use_raw:
                    await self._dial_raw_session(session_id, striping)
                    backoff = 0.2
            except asyncio.CancelledError:
                raise
            except (grpc.aio.AioRpcError, HandshakeError, TimeoutError, OSError) as exc:
                if isinstance(exc, ssl.SSLError):
                    self.refuse("tls", f"peer's TLS certificate refused: {exc}")
                detail = exc.details() if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
                log.warning("cannot link to peer at %s: %s (retry in %.1fs)", address, detail, backoff)
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, 5.0)

    async def _dialer_session(
        self,
        read: ReadFn,
        write: WriteFn,
        peer_cert: x509.Certificate | None,
        reply: link_pb2.LinkMessage,
        session_id: bytes,
        marking: bool,
        open_lane: LaneOpenFn,
        transport: str,
    ) -> None:
        """Run the dialer's session on its first connection, with the lane manager beside it."""
        session = asyncio.create_task(
            self.run_session(
                read,
                write,
                self.expected_peer,
                "dialer",
                peer_cert,
                session_id=session_id,
                marking=marking,
                transport=transport,
                peer_witness=reply.hello.audit_witness,
                peer_paced=reply.hello.paced,
            ),
            name="link-session",
        )
        manager = None
        if marking:
            manager = asyncio.create_task(self._manage_lanes(open_lane), name="link-lanes")
        try:
            await session
        finally:
            if manager is not None:
                manager.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await manager
            if not session.done():  # we were cancelled: let the session wind down first
                session.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await session

    async def _raw_connect(
        self, session_id: bytes, lane: int
    ) -> tuple[RawConnectionLike, link_pb2.LinkMessage]:
        """A raw connection whose peer passed every check of the gRPC link, after the link handshake.

        TLS verified the chain and the DNS name; here the certificate must name the expected peer
        switch and not be revoked, and the handshake must agree with it (each refusal audited).
        """
        assert self.raw_dialer is not None
        try:
            connection = await self.raw_dialer()
        except ssl.SSLError as exc:
            self.refuse("tls", f"peer's TLS certificate refused on the raw link: {exc}")
            raise
        except PreambleError as exc:
            self.refuse("transport", str(exc))
            raise
        try:
            cert = connection.peer_cert
            serial = f"{cert.serial_number:x}" if cert is not None else ""
            try:
                if cert is None:
                    raise PermissionError("peer presented no certificate on the raw link")
                try:
                    certified = identity_from_certificate(cert)
                except ValueError as exc:
                    raise PermissionError(
                        f"peer's certificate carries no valid Nebula identity: {exc}"
                    ) from exc
                self.check_identity(certified)
            except PermissionError as exc:
                self.refuse("identity", str(exc), serial=serial)
                raise HandshakeError(str(exc)) from exc
            if (refused := self.refusal(cert)) is not None:
                self.refuse(*refused, serial=serial)
                raise HandshakeError(refused[1])
            hello = self.hello(
                lanes=self.connections != 1,
                session_id=session_id,
                lane=lane,
                raw_link=RAW_LINK_VERSION,
                raw_preamble=connection.preamble,
            )
            await connection.write(hello.SerializeToString())
            raw = await asyncio.wait_for(connection.read(), HANDSHAKE_TIMEOUT_S)
            if raw is grpc.aio.EOF:
                raise HandshakeError(f"peer closed raw connection {lane} during the handshake")
            try:
                reply = parse_link_message(raw)
                self.check_hello(reply, self.expected_peer)
            except HandshakeError as exc:
                self.refuse("handshake", str(exc), serial=serial)
                raise
            if reply.hello.raw_preamble != connection.preamble:
                reason = (
                    f"the raw link preamble was rewritten on path: sent {connection.preamble!r}, the peer "
                    f"confirms {reply.hello.raw_preamble!r} inside TLS"
                )
                self.refuse("transport", reason, serial=serial)
                raise PreambleError(reason)
        except BaseException:
            await connection.close()
            raise
        return connection, reply

    async def _dial_raw_session(self, session_id: bytes, striping: bool) -> None:
        """The session over a raw connection (its lanes raw too).

        The peer agreed to the raw transport inside the authenticated gRPC handshake, so a raw connection
        that cannot start (a rewritten preamble, a path that drops it) is an error to retry, never a
        reason to run the gRPC link instead: nothing said in clear chooses the transport.
        """
        try:
            connection, reply = await self._raw_connect(session_id, 0)
        except (HandshakeError, TimeoutError, OSError) as exc:
            raise HandshakeError(f"raw link connection failed: {exc}") from exc
        marking = striping and reply.hello.lanes and reply.hello.session_id == session_id

        async def open_raw_lane(index: int) -> tuple[Closeable, asyncio.Task[None]]:
            lane, _ = await self._raw_connect(session_id, index)
            return lane, asyncio.create_task(
                self.run_lane(index, lane.read, lane.write), name=f"link-lane-{index}"
            )

        try:
            await self._dialer_session(
                connection.read,
                connection.write,
                connection.peer_cert,
                reply,
                session_id,
                marking,
                open_raw_lane,
                connection.transport,
            )
        finally:
            await connection.close()

    async def _manage_lanes(self, open_lane: LaneOpenFn) -> None:
        """Keep the session's connection count at its target: fixed, or self-tuned (lanes.py)."""
        tuner = LaneTuner() if self.connections is None else None
        target = self.connections or 1
        lanes: dict[int, tuple[Closeable, asyncio.Task[None]]] = {}
        self._lane_channels = lanes
        try:
            while True:
                for index, (channel, task) in list(lanes.items()):
                    if task.done():
                        del lanes[index]
                        await channel.close()
                missing = target - len(lanes) - 1
                if missing > 0:  # dialled together: a doubling waits one handshake, not one each
                    free = [i for i in range(1, MAX_LANES) if i not in lanes][:missing]
                    opened = await asyncio.gather(*(open_lane(i) for i in free), return_exceptions=True)
                    for index, lane in zip(free, opened, strict=True):
                        if isinstance(lane, grpc.aio.AioRpcError | HandshakeError | TimeoutError | OSError):
                            log.warning("cannot open link connection %d: %s (retry later)", index, lane)
                        elif isinstance(lane, BaseException):
                            raise lane
                        else:
                            lanes[index] = lane
                for index in sorted(lanes, reverse=True)[: max(0, len(lanes) + 1 - target)]:
                    self.retire_lane(index)
                sent, busy, samples = self.sent.bytes + self.received.bytes, 0, 0
                started = time.monotonic()
                while time.monotonic() - started < LANE_INTERVAL_S:
                    await asyncio.sleep(LANE_SAMPLE_S)
                    samples += 1
                    busy += self.link_busy()
                if tuner is not None:
                    rate = (self.sent.bytes + self.received.bytes - sent) / (time.monotonic() - started)
                    target = tuner.observe(rate, busy * 2 >= samples)
                elif self.connections is not None:
                    target = self.connections  # a changed fixed count applies from the next interval
        finally:
            for channel, task in lanes.values():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                await channel.close()

    async def _open_lane(
        self,
        index: int,
        address: str,
        credentials: CredentialsFn,
        options: list[tuple[str, object]],
        session_id: bytes,
    ) -> tuple[Closeable, asyncio.Task[None]]:
        """Dial one more connection (a channel of its own: distinct arguments, its own TCP connection)."""
        lane_options = [*options, ("grpc.use_local_subchannel_pool", 1), ("nebula.link_lane", index)]
        channel = grpc.aio.secure_channel(address, credentials(), options=lane_options)
        try:
            call = channel.stream_stream(LINK_METHOD)()
            await call.write(self.hello(session_id=session_id, lane=index).SerializeToString())
            raw = await asyncio.wait_for(call.read(), HANDSHAKE_TIMEOUT_S)
            if raw is grpc.aio.EOF:
                raise HandshakeError(f"peer refused connection {index} of the link")
            reply = parse_link_message(raw)
            self.check_hello(reply, self.expected_peer)
        except BaseException:
            await channel.close()
            raise
        return channel, asyncio.create_task(
            self.run_lane(index, call.read, grpc_writer(call.write)), name=f"link-lane-{index}"
        )

    def stop(self) -> None:
        self._stopping = True
        if self.refusals is not None:
            self.refusals.flush()
