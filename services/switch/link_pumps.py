"""The link's item pumps: what each connection of a session writes and what it does with what it reads.

The reader hands each item to the router, which never waits (it buffers per route, or closes a route
over its bound); the writer takes the router's next message (acks first, then the routes by deficit
round robin over bytes), on a paced session only while what the peer has not read yet is under the
pacer's cap, cutting large items into fragments (``pacing.py``). Ahead of every item go this switch's
acknowledgement of bytes read (a paced session, every second data message: ``acks.py``), then Pings
and Pongs (``liveness.py``), bandwidth probes (``bandwidth.py``) and audit heads (``witness.py``).

Raw bytes on the stream (link framing, ``nebula_common/rpc/framing.py``): a trainer's framed chunk
(``LinkMessage.framed``) is forwarded byte for byte, reading only its header, so no payload is decoded
or re-encoded here. With lanes (``lanes.py``), each item is preceded on its connection by its lane mark
and delivered to the router in mark order.

:class:`LinkPumps` is part of :class:`~services.switch.link.PeerLink`, whose ``__init__`` and
``run_session`` set the state it declares.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable

import grpc

from nebula_common.pki import Identity
from nebula_common.proto.nebula.v1 import link_pb2
from nebula_common.rpc.framing import FramedChunk, FramingError, is_framed, parse_chunk
from services.switch.acks import AckSchedule
from services.switch.bandwidth import BandwidthMeter
from services.switch.express import EXPRESS_LANE
from services.switch.lanes import LaneGapError, SessionLanes
from services.switch.link_handshake import HandshakeError, parse_link_message
from services.switch.link_transport import LINK_WINDOW_BYTES, ReadFn, WriteFn
from services.switch.liveness import Keepalive, RttEstimator
from services.switch.metrics import LINK_RTT, DirectionCounters
from services.switch.pacing import Fragment, LinkPacer, PacingError, Reassembler
from services.switch.route_state import Outbound
from services.switch.routing import Router
from services.switch.transfers import TransferLedger
from services.switch.witness import AuditWitness

ROUTED_KINDS = ("frame", "signal", "ack", "close")
"""Edge items that may cross the link (never open, ready or notice)."""


READ_SLICE_S = 0.002
"""How long one connection's reader may run before the other tasks of the loop get a turn."""


class LinkPumps:
    """The writer and reader loops of a session's connections (see the module doc)."""

    router: Router
    expected_peer: Identity
    keepalive: Keepalive
    rtt: RttEstimator
    bandwidth: BandwidthMeter
    witness: AuditWitness
    sent: DirectionCounters
    received: DirectionCounters
    ledger: TransferLedger
    _lanes: SessionLanes | None
    _priority: deque[link_pb2.LinkMessage]  # pings and pongs, ahead of every item
    _writing: int  # writers inside a write: with several lanes the backlog waits there
    # A paced session (pacing.py): what we may write, what we read (acknowledged to the peer).
    _pacer: LinkPacer | None
    _rx_bytes: int
    _ack_due: bool
    _acks: AckSchedule  # when what we read is acknowledged (acks.py)
    _reassembly: Reassembler

    # ----- writing ---------------------------------------------------------------------------
    def _next_message(self, lane: int = 0) -> Outbound | Fragment | None:
        """Our acknowledgement, pings and pongs first; then items while the pacer has room (and this
        connection its share of it, ``LinkPacer.lane_has_room``). The express connection carries sparse
        items only (``express.py``), never an acknowledgement: a loss on it would hold every one."""
        lanes = self._lanes
        pacer = self._pacer
        if lane == EXPRESS_LANE:
            message = self.router.next_express(pacer) if pacer is not None else None
            if message is not None:
                self.router.outbound_wake.set()  # the other writers may have left it to this one
            return message
        if self._ack_due or (lanes is not None and lane in lanes.acks_due):
            self._ack_due = False
            lane_bytes = 0
            if lanes is not None and lanes.marking:
                lanes.acks_due.discard(lane)
                lane_bytes = lanes.read_bytes.get(lane, 0)
                self._acks.sent(lane)
            else:
                self._acks.sent(None)
            return link_pb2.LinkMessage(
                received=link_pb2.LinkReceived(bytes=self._rx_bytes, lane_bytes=lane_bytes)
            )
        if self._priority:
            return self._priority.popleft()
        if pacer is None:
            return self.router.next_outbound()
        if lanes is not None:
            pacer.set_flows(max(1, len(lanes.active)))
            if lanes.lane_acks and not pacer.lane_has_room(lanes.unacked(lane)):
                return None  # its acknowledgement, on this connection, wakes the writers
        express = lanes is not None and lanes.express is not None and lanes.express.up
        return self.router.next_paced(pacer, express)  # None: an acknowledgement or a new item wakes them

    async def _pump_out(self, write: WriteFn, lane: int = 0) -> None:
        wake = self.router.outbound_wake
        lanes = self._lanes
        while True:
            if lanes is not None and lane in lanes.retiring:
                await write(link_pb2.LinkMessage(mark=link_pb2.LaneMark(last=True)).SerializeToString())
                return
            message = self._next_message(lane)
            if message is None:
                wake.clear()
                message = self._next_message(lane)  # anything queued between the check and the clear
                if message is None:
                    await wake.wait()
                    continue
            key = self.router.picked
            self._writing += 1
            try:
                await self._write_item(write, message, lanes, lane, key)
            finally:
                self._writing -= 1

    async def _write_item(
        self,
        write: WriteFn,
        message: Outbound | Fragment,
        lanes: SessionLanes | None,
        lane: int,
        key: tuple[str, str] = ("", ""),
    ) -> None:
        data = isinstance(message, FramedChunk | Fragment) or message.WhichOneof("body") == "routed"
        if lanes is not None and lanes.marking and data:
            lanes.written[lane] = lanes.written.get(lane, 0) + 1
            mark = self._mark(lanes, lane, key)
            if mark is not None:
                await write(mark.SerializeToString())
        if isinstance(message, Fragment):
            raw = message.encode()
            self._on_sent(lanes, lane, len(raw))
            await write(raw)
            if message.whole is not None:
                self._count_sent(message.whole)  # type: ignore[arg-type]
            return
        if isinstance(message, FramedChunk):
            raw = message.raw
            self._on_sent(lanes, lane, len(raw))
            await write(raw)
            self._count_sent(message)
            return
        if data and self._pacer is not None:
            raw = message.SerializeToString()
            self._on_sent(lanes, lane, len(raw))
            await write(raw)
            self._count_sent(message)
            return
        if message.WhichOneof("body") == "ping" and not BandwidthMeter.is_probe(message.ping.nonce):
            self.keepalive.ping_sent(message.ping.nonce)
        await write(message.SerializeToString())
        self._count_sent(message)

    def _on_sent(self, lanes: SessionLanes | None, lane: int, size: int) -> None:
        """``size`` bytes of a data message go out on ``lane`` (a paced session counts them)."""
        if self._pacer is None:
            return
        self._pacer.on_sent(size)
        if lanes is not None and lanes.marking:
            lanes.sent_bytes[lane] = lanes.sent_bytes.get(lane, 0) + size

    @staticmethod
    def _mark(lanes: SessionLanes, lane: int, key: tuple[str, str]) -> link_pb2.LinkMessage | None:
        """The lane mark of the next item of route ``key`` on ``lane``: its number, and what of its route
        it must follow on the other kind of connection (``express.py``); None where the receiver can tell
        both (the first connection, alone, nothing new to follow: ``SessionLanes``)."""
        express = lanes.express
        if lane == EXPRESS_LANE and express is not None:
            express.send_no += 1
            after = express.routes.express(key, express.send_no)
            return link_pb2.LinkMessage(mark=link_pb2.LaneMark(seq=express.send_no, after=after))
        lanes.send_seq += 1
        after = express.routes.striping(key, lanes.send_seq) if express is not None else 0
        if lane == 0 and not lanes.striped and not after:
            return None
        return link_pb2.LinkMessage(mark=link_pb2.LaneMark(seq=lanes.send_seq, after=after))

    def _count_sent(self, message: Outbound) -> None:
        if isinstance(message, FramedChunk):
            self.sent.count_chunk(message)
            self.ledger.observe_chunk("sent", message)
        else:
            self.sent.count(message)
            self.ledger.observe("sent", message)

    def link_busy(self) -> bool:
        """Items wait for the link (queued in the router, or a writer inside a write: with several
        connections the backlog sits in their writes) while what is written and unread fills the path
        (``LinkPacer.fills_pipe``; on an unpaced session, always). A backlog that does not fill the
        path waits for this switch's CPU, which more connections cannot speed up (``lane_tuner.py``)."""
        backlog = self.router.has_outbound() or self._writing > 0
        if not backlog or self._pacer is None:
            return backlog
        return self._pacer.fills_pipe(LINK_WINDOW_BYTES)

    def _queue_priority(self, message: link_pb2.LinkMessage) -> None:
        self._priority.append(message)
        self.router.outbound_wake.set()

    def _ping_queued(self) -> bool:
        """A Ping waits in the priority queue (the keepalive then sends none this interval)."""
        return any(m.WhichOneof("body") == "ping" for m in self._priority)

    def _on_pong(self, nonce: int) -> None:
        if BandwidthMeter.is_probe(nonce):
            self.bandwidth.on_pong(nonce)
            return
        if self.keepalive.on_pong(nonce):
            LINK_RTT.labels(self.expected_peer.cluster_id).set(self.rtt.srtt or 0.0)

    # ----- reading ---------------------------------------------------------------------------
    def _deliver(
        self,
        key: tuple[str, str],
        item: object,
        epoch: int,
        mark: link_pb2.LaneMark | None,
        lane: int = 0,
        size: int = 0,
    ) -> None:
        """Hand an item to the router, in lane-mark order when the session stripes over lanes."""
        lanes = self._lanes
        if lanes is None or not lanes.marking:
            self._in_order(key, item, epoch)
            return
        if mark is not None:
            seq, after = mark.seq, mark.after
        elif lane == 0:  # unmarked: the item after the one read on this connection before (SessionLanes)
            seq, after = lanes.first_seq + 1, 0
        else:
            raise HandshakeError(f"peer sent an item without its lane mark on connection {lane}")
        try:
            if lane == EXPRESS_LANE:
                lanes.order.put_express(seq, key, (key, item, epoch), after, size)
                return
            if lane == 0:
                lanes.first_seq = seq
            lanes.order.put(seq, (key, item, epoch), after)
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

    def _read_data(self, size: int, lane: int) -> None:
        """``size`` bytes of data messages were read on ``lane``: on a paced session they are acknowledged
        when ``acks.py`` says (the session's count on any connection, this connection's on itself)."""
        self._rx_bytes += size
        if self._pacer is not None:
            lanes = self._lanes
            if lanes is not None and lanes.marking:
                lanes.read_bytes[lane] = lanes.read_bytes.get(lane, 0) + size
            self._acks.read(lane, size)

    def _acks_owed(self, lanes_read: Iterable[int]) -> None:
        """Acknowledgements are due (``AckSchedule``): the next writer sends the session's, each of
        ``lanes_read`` its own."""
        self._ack_due = True
        lanes = self._lanes
        if lanes is not None and lanes.marking:
            lanes.acks_due.update(lanes_read)
        self.router.outbound_wake.set()

    @staticmethod
    def _lane_acked(lanes: SessionLanes, lane: int, lane_bytes: int) -> None:
        """The peer has read ``lane_bytes`` of our data on ``lane`` (it says so on that connection)."""
        if lane_bytes > lanes.sent_bytes.get(lane, 0):
            raise HandshakeError(
                f"peer acknowledged {lane_bytes} bytes on connection {lane}, "
                f"but only {lanes.sent_bytes.get(lane, 0)} were sent there"
            )
        lanes.acked_bytes[lane] = max(lanes.acked_bytes.get(lane, 0), lane_bytes)
        lanes.lane_acks = lanes.lane_acks or lane_bytes > 0

    async def _pump_in(self, read: ReadFn, lane: int = 0) -> None:
        lanes = self._lanes
        mark: link_pb2.LaneMark | None = None  # the lane mark of the next item on this connection
        slice_end = time.monotonic() + READ_SLICE_S
        while True:
            if time.monotonic() >= slice_end:
                # A read returns at once while its connection has messages buffered: without a turn for the
                # others, one busy connection's reader would keep the loop for seconds while the express
                # connection's small items (and our writers' acknowledgements) wait behind it.
                await asyncio.sleep(0)
                slice_end = time.monotonic() + READ_SLICE_S
            raw = await read()
            if raw is grpc.aio.EOF:
                if lane:
                    raise HandshakeError(f"the peer ended connection {lane} without retiring it")
                return
            if isinstance(raw, bytes | memoryview) and is_framed(raw):
                self.keepalive.heard()
                self._read_data(len(raw), lane)
                key, item, epoch = self._data_item(raw)
                self._deliver(key, item, epoch, mark, lane, len(raw))
                mark = None
                continue
            message = parse_link_message(raw)
            self.keepalive.heard()
            if message.WhichOneof("body") == "mark":
                if lanes is None or not lanes.marking:
                    raise HandshakeError("peer sent a lane mark on a session without lanes")
                if message.mark.last:
                    if lane in (0, EXPRESS_LANE):
                        raise HandshakeError(f"peer tried to retire connection {lane}, which stays")
                    if lane not in lanes.retiring:  # the peer retires it: answer with our own last mark
                        lanes.retiring.add(lane)
                        self.router.outbound_wake.set()
                    return
                if mark is not None:
                    raise HandshakeError("peer sent two lane marks in a row")
                mark = message.mark
                continue
            kind = message.WhichOneof("body")
            if kind not in ("routed", "fragment"):  # items are counted whole (_data_item)
                self.received.count(message)
                self.ledger.observe("received", message)
            if kind == "routed":
                self._read_data(len(raw), lane)  # type: ignore[arg-type]
                # Never waits; drops items of an epoch the route has left behind.
                self._deliver(*self._routed(message), mark, lane, len(raw))  # type: ignore[arg-type]
                mark = None
            elif kind == "fragment":
                if self._pacer is None:
                    raise HandshakeError("peer sent a fragment on a session that is not paced")
                if lane == EXPRESS_LANE:
                    raise HandshakeError("peer sent a fragment on the express connection (whole items only)")
                self._read_data(len(raw), lane)  # type: ignore[arg-type]
                self._deliver(("", ""), message.fragment, 0, mark, lane)
                mark = None
            elif kind == "received":
                if self._pacer is None:
                    raise HandshakeError("peer acknowledged bytes on a session that is not paced")
                try:
                    self._pacer.on_ack(message.received.bytes)
                except PacingError as exc:
                    raise HandshakeError(f"peer broke the paced link protocol: {exc}") from exc
                if lanes is not None and lanes.marking:
                    self._lane_acked(lanes, lane, message.received.lane_bytes)
                self.router.outbound_wake.set()
            elif kind == "ping":
                self._queue_priority(link_pb2.LinkMessage(pong=link_pb2.Pong(nonce=message.ping.nonce)))
            elif kind == "pong":
                self._on_pong(message.pong.nonce)
            elif kind == "audit_head":
                self.witness.received(message.audit_head)
            else:
                raise HandshakeError(f"unexpected {kind!r} message after the handshake")
