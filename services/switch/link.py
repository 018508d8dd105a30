"""The WAN link to the peer switch: one session at a time, surviving reconnects of its connections.

One bidirectional gRPC stream carries every job's items (link protocol 2: RoutedItem, Ping, Pong); a
raw connection can carry the same messages instead (``rawlink.py``). The cluster whose id sorts first
dials (through the WAN, via mTLS); the other accepts. Either way the session is the same code
(:meth:`PeerLink.run_session`): a new session supersedes the current one, and its end tells every
attached route why (``Router.link_down``).

:class:`PeerLink` is composed of one module per concern:

* the handshake and the peer's identity: ``link_handshake.py`` (refusals audited here);
* what carries a session, gRPC or raw: ``link_transport.py``;
* the item pumps, the writer and reader of each connection: ``link_pumps.py`` (pacing: ``pacing.py``);
* liveness from the measured round-trip time, pings and the dead-peer timeout: ``liveness.py``;
* the lanes, further connections of one session: ``link_lanes.py`` (their protocol: ``lanes.py``);
* the dialer's role, connecting and reconnecting: ``link_dialer.py``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from cryptography import x509

from nebula_common.audit import AuditLog
from nebula_common.audit.aggregate import RefusalAggregator
from nebula_common.pki import Identity
from nebula_common.proto.nebula.v1 import link_pb2
from services.switch.acks import AckSchedule
from services.switch.bandwidth import BandwidthMeter, BandwidthProbeError, Measurement
from services.switch.express import ExpressLane
from services.switch.lanes import SessionLanes, SessionOrder
from services.switch.link_dialer import LinkDialer
from services.switch.link_handshake import (
    HANDSHAKE_TIMEOUT_S,
    PROTOCOL_VERSION,
    RAW_LINK_VERSION,
    SOFTWARE_VERSION,
    HandshakeError,
    PreambleError,
    fetch_server_certificate,
    parse_link_message,
)
from services.switch.link_pumps import ROUTED_KINDS
from services.switch.link_transport import LINK_METHOD, Closeable, RawDialFn, ReadFn, WriteFn, grpc_writer
from services.switch.liveness import DeadPeerError, Keepalive, LivenessPolicy
from services.switch.metrics import (
    LINK_CONNECTIONS,
    LINK_DELIVERY_RATE,
    LINK_INFLIGHT,
    LINK_INFLIGHT_LIMIT,
    LINK_UP,
    PEER_LINK_UP,
    DirectionCounters,
)
from services.switch.pacing import LinkPacer, Reassembler
from services.switch.peer_trust import PeerTrust
from services.switch.routing import Router
from services.switch.transfers import StepTotals, TransferKey, TransferLedger
from services.switch.witness import AuditWitness

__all__ = [
    # Where these live now; kept importable from here for callers of the one-module link.
    "HANDSHAKE_TIMEOUT_S",
    "LINK_METHOD",
    "PROTOCOL_VERSION",
    "RAW_LINK_VERSION",
    "ROUTED_KINDS",
    "SOFTWARE_VERSION",
    "DeadPeerError",
    "HandshakeError",
    "LinkState",
    "PeerLink",
    "PreambleError",
    "fetch_server_certificate",
    "grpc_writer",
    "parse_link_message",
]

log = logging.getLogger(__name__)

READER_GRACE_S = 1.0
"""How long a session whose write failed waits for its reader to say why the connection ended."""


@dataclass
class LinkState:
    connected: bool = False
    peer_identity: str = ""
    role: str = ""
    #: Serial of the certificate the peer authenticated this session with (0 when unknown).
    peer_serial: int = 0
    #: Sessions established since start: a rotation that kept the link up leaves this unchanged.
    sessions: int = 0
    #: What carries the session: "records" (rawlink.py) or "grpc" (a gRPC stream per connection).
    transport: str = ""


class PeerLink(LinkDialer):
    """The switch's one link to its peer, surviving reconnects of the underlying stream.

    Its parts (see the module doc): the dialer (``LinkDialer``), on the lanes (``LinkLanes``), on the
    item pumps (``LinkPumps``), and the identity checks (``PeerChecks``); the session and its audit
    are here.
    """

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
        #: Acceptor: this switch's WAN port takes raw connections (wan_frontend.WanFrontend).
        self.serves_raw = serves_raw
        #: Connections the dialer keeps per session: a fixed count, or None to self-tune (lanes.py).
        self.connections = connections
        self._lanes: SessionLanes | None = None
        self._lane_channels: dict[int, tuple[Closeable, asyncio.Task[None]]] = {}
        self._lanes_changed = asyncio.Event()
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
        self._acks = AckSchedule(self._acks_owed)
        self._reassembly = Reassembler()
        # Refusals by strangers on the WAN port: one record per source, layer and reason per interval
        # (the switch shares one aggregator among its links).
        self.refusals = refusals or (RefusalAggregator(audit.append) if audit is not None else None)
        self._priority: deque[link_pb2.LinkMessage] = deque()  # pings and pongs, ahead of every item
        self._writing = 0  # writers inside a write: with several lanes the backlog waits there
        self.liveness = liveness or LivenessPolicy()
        self.keepalive = Keepalive(self.liveness, self._queue_priority, self._ping_queued)
        self.rtt = self.keepalive.rtt
        self.bandwidth = BandwidthMeter(self._queue_priority)  # on demand: services/switch/bandwidth.py
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

    def record(
        self, event: str, *, outcome: str = "ok", account: str = "", job_id: str = "", **details: object
    ) -> None:
        """Append to the switch's audit log (no-op when the link runs without one, as in unit tests)."""
        if self.audit is not None:
            self.audit.append(event, outcome=outcome, account=account, job_id=job_id, details=details)

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

    # ----- the session, shared by both roles -------------------------------------------
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
        express: bool = False,
    ) -> None:
        """Pump frames both ways until either side ends; only one session runs at a time.

        ``read`` returns the raw bytes of each message (or EOF), ``write`` takes raw bytes;
        ``peer_witness``, ``peer_paced`` and ``express`` are what the peer's handshake announced. This
        connection is lane 0; with ``marking`` (both ends announced lanes) further connections may join with
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
            self._acks.reset()
            self._acked_last = False
            self.witness.session_started()
            self.keepalive.session_started()
            lanes = self._lanes = SessionLanes(
                session_id=session_id,
                marking=marking,
                order=SessionOrder(lambda item: self._in_order(*item)),
                express=ExpressLane() if marking and express and self._pacer is not None else None,
            )
            self.session_started()
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
                self._acks.reset()  # no timer of this session fires into the next
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

    async def _keepalive(self) -> None:
        """Ping at the RTT-derived interval; end the session when the peer has gone silent."""
        await self.keepalive.run(self._send_audit_head)

    def _send_audit_head(self, now: float) -> None:
        """This switch's audit head to a witnessing peer, when due (witness.py)."""
        if self._peer_witness and (head := self.witness.due(now)) is not None:
            self._queue_priority(head)

    async def measure_bandwidth(self, timeout: float = 8.0) -> Measurement:
        """The bandwidth toward the peer, measured now (or a fresh result); see ``bandwidth.py``."""
        if not self.connected:
            raise BandwidthProbeError(f"the link to {self.expected_peer.cluster_id} is down")
        return await self.bandwidth.measure(timeout)

    def stop(self) -> None:
        self._stopping = True
        if self.refusals is not None:
            self.refusals.flush()
