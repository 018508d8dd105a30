"""The delivery contract of one job edge (edge protocol 2), independent of how messages travel.

Each end of an edge sends one direction (the upstream stage FORWARD, the downstream
stage BACKWARD) and receives the other. ``EdgeSession`` implements, for both halves,
what ``proto/nebula/v1/relay.proto`` calls the delivery contract:

* every outgoing item (a tensor frame -- its header and chunks -- or a signal) gets
  the next number of the direction's sequence (``TensorHeader.frame_id`` /
  ``EdgeSignal.seq``);
* the sender transmits a message only while the cumulative wire size of the
  direction through it is within the peer's absolute credit (``INITIAL_WINDOW_BYTES``
  before the first ack), and keeps every unacknowledged item for replay;
* the receiver accepts only the next item in sequence (duplicates and items after a
  gap are ignored; a new header for the frame being assembled restarts it),
  acknowledges coalesced (on each completed item, or when the grant grew by a quarter
  window), grants at most one window beyond what it holds, and none while its queue
  of completed items is full;
* after every ready and every link-up notice both ends send a resume ack, and a sender
  receiving one resends every item after ``received``, in order.

Beyond the contract's minimum: a receiver that sees a gap (an item lost in flight
without a link event) asks for a rewind with a resume ack, and a sender whose
unacknowledged items see no progress for its retransmit timeout (RTO) rewinds on its
own, so a lost last item or a lost ack cannot stall the edge.

The RTO derives from what the sender measures (``RetransmitTimer``): RFC 6298's SRTT
and RTTVAR from send -> ack of items never replayed (Karn), plus the time the bytes in
flight need at the smoothed ack throughput, so a large frame on a slow link is not
rewound while it is still legitimately on the wire. It is clamped to
[``min_retransmit_s``, ``retransmit_s``] (the cap, also used before any sample) and
doubles on consecutive timeouts. After a timeout rewind, neither the timer nor a resume
ack rewinds again until the resent bytes had time to arrive at the measured throughput
(unless the link or the stream was re-established meanwhile): otherwise the receiver,
restarting its assembly on the replayed header, would see the original chunks as gaps
and ask for a rewind of the rewind.

Outages pause: while the link (or the stream to the switch) is down nothing is sent,
and waits do not count the outage against their timeouts; an outage longer than
``max_outage_s`` ends the edge with ``EdgeOutage`` (the stage then restarts from the
last common checkpoint in a new epoch; no close is sent, the peer learns of the new
epoch from its switch).

Epochs (relay.proto, "Epochs"): a session belongs to one epoch (``EdgeOpen.epoch``). An
``EdgeReady.epoch`` above it, or an ``EdgeRestart``, means the other side moved on: the
edge ends with ``EdgeRestartRequired(epoch)`` and nothing more is sent on it. In a
session of epoch > 0 the outage limit only runs once the link has been up (the stage
waits for the link without a deadline before it exchanges RESUME signals). The transport (gRPC to the
switch, or the in-memory pair of the tests) calls the ``on_*`` methods from its own
thread; ``send`` on the transport must never block.

Link framing: when the session knows its route (job, edge) and its transport carries framed chunks
(``transport.frames_chunks``: the gRPC stream to the switch), each payload chunk is built once as its
final wire bytes (``nebula_common/rpc/framing.py``) in chunks of the window / 8 (256 KiB .. 4 MiB), and
replays resend those bytes; chunks from the peer arrive as ``FramedChunk`` views and are copied once, into
the frame's buffer, which becomes the payload without another copy. Other transports (the in-memory pair
of the tests) carry payload chunks as ``TensorFrame`` messages.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from nebula_common.bulk_memory import uninitialized_bytearray
from nebula_common.codec import EncodedTensor, to_frames
from nebula_common.proto.nebula.v1 import relay_pb2, tensor_pb2
from nebula_common.rpc.framing import FramedChunk, chunk_size_for, encode_chunk

log = logging.getLogger(__name__)

INITIAL_WINDOW_BYTES = 1 << 20
MAX_FRAME_BYTES = 1 << 30
"""Largest tensor payload a peer may announce on an edge; a larger header fails the edge."""
"""Credit a sender has before the peer's first ack (relay.proto, delivery contract)."""


class EdgeClosedError(RuntimeError):
    """The edge ended (peer finished, failed, the link stayed down too long) while we expected an item."""


class EdgeTimeout(EdgeClosedError):
    """Nothing arrived within the receive's timeout (of link-up time); the edge itself is still open."""


class EdgeRestartRequired(EdgeClosedError):
    """The other side moved to a higher epoch: this attempt is void, reopen with ``epoch`` (or higher)."""

    def __init__(self, epoch: int, reason: str) -> None:
        super().__init__(reason)
        self.epoch = epoch
        self.reason = reason


class EdgeOutage(EdgeClosedError):
    """The link (or the stream to the switch) stayed down past ``max_outage_s``: this attempt is lost."""


def renewed(error: EdgeClosedError) -> EdgeClosedError:
    """A fresh exception of the same kind and content (to re-raise on another thread or call)."""
    if isinstance(error, EdgeRestartRequired):
        return EdgeRestartRequired(error.epoch, error.reason)
    if isinstance(error, EdgeOutage):
        return EdgeOutage(str(error))
    return EdgeClosedError(str(error))


@dataclass(frozen=True)
class EdgeSettings:
    """Tunables of one edge end (defaults fit production; tests shrink the timers)."""

    window_bytes: int = 16 << 20
    """Window this receiver grants beyond what it holds (capped by EdgeReady.max_window_bytes)."""
    max_frame_bytes: int = MAX_FRAME_BYTES
    """Largest tensor payload a peer may announce; a larger header fails the edge."""
    max_outage_s: float = 300.0
    """How long the link (or the stream to the switch) may stay down before the edge fails."""
    retransmit_s: float = 30.0
    """Cap of the retransmit timeout (and the timeout before any RTT sample): rewind when
    unacknowledged items see no ack progress for the measured RTO (see the module doc; doubles on
    consecutive timeouts up to 10x this). Over gRPC items are lost only with a link notice or a
    reconnect, which resume at once, and a receiver that sees a gap asks for a replay itself."""
    min_retransmit_s: float = 1.0
    """Floor of the measured retransmit timeout (RFC 6298 recommends 1 s)."""
    receive_queue_items: int = 64
    """Completed items (tensors, signals) held for the stage; while full, no new credit is granted."""
    ready_timeout_s: float = 90.0
    """How long the first open may take (switch reachable, edge authorised)."""
    max_recoveries: int = 20
    """How many times a stage may restart from the common checkpoint (new epoch) before it fails."""


class Transport(Protocol):
    """How an edge session's messages travel (gRPC to the local switch, or an in-memory pair).

    A transport whose ``frames_chunks`` attribute is true takes payload chunks framed (``bytes``);
    without it, the session sends them as ``TensorFrame`` messages.
    """

    def start(self, handler: TransportHandler) -> None: ...

    def send(self, message: relay_pb2.EdgeMessage | bytes) -> None:
        """Best effort and non-blocking: a message sent while the link is down may be lost.

        ``bytes`` are a framed chunk, handed over only when ``frames_chunks`` is true."""

    def close(self, reason: str, error: bool) -> None:
        """Send EdgeClose and stop reconnecting; keep delivering until the peer closes."""

    def wait_close_sent(self, timeout: float) -> None:
        """Wait (bounded) until the EdgeClose is handed to the wire (or cannot be)."""

    def shutdown(self) -> None:
        """Tear down now (idempotent)."""


class TransportHandler(Protocol):
    def on_ready(self, ready: relay_pb2.EdgeReady) -> None: ...

    def on_message(self, message: relay_pb2.EdgeMessage | FramedChunk) -> None: ...

    def on_down(self, reason: str) -> None: ...

    def on_failed(self, reason: str) -> None: ...


@dataclass
class _Outgoing:
    seq: int
    message: relay_pb2.EdgeMessage | bytes  # bytes: a framed chunk, sent as is
    size: int  # the contract's wire size of the item's message (credit counts these)
    end: int  # cumulative wire size of the direction through this message
    sent_at: float | None = None  # clock of the last transmission
    replayed: bool = False  # transmitted more than once: no RTT sample from its item (Karn)


class RetransmitTimer:
    """RFC 6298 SRTT/RTTVAR plus a smoothed ack throughput: the sender's retransmit timeout.

    ``rto(in_flight)`` = SRTT + 4*RTTVAR + in_flight / throughput, clamped to [floor, cap];
    the cap before any sample. Not thread-safe: the session calls it under its lock.
    """

    THROUGHPUT_GAIN = 0.25

    def __init__(self, floor: float, cap: float) -> None:
        self.cap = cap
        self.floor = min(floor, cap)
        self.srtt: float | None = None
        self.rttvar = 0.0
        self.throughput: float | None = None  # acked wire bytes per second, smoothed

    def sample(self, rtt: float, acked_bytes: int, interval: float) -> None:
        """One ack of items never replayed: ``rtt`` from the last one's send, ``acked_bytes`` over
        ``interval`` seconds (since the later of the previous ack and the first one's send)."""
        rtt = max(rtt, 0.0)
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt
        if interval > 0 and acked_bytes > 0:
            rate = acked_bytes / interval
            if self.throughput is None:
                self.throughput = rate
            else:
                self.throughput += self.THROUGHPUT_GAIN * (rate - self.throughput)

    def resend_seconds(self, in_flight: int) -> float:
        """How long ``in_flight`` bytes take at the measured throughput (0 before any measure)."""
        if in_flight <= 0 or not self.throughput:
            return 0.0
        return in_flight / self.throughput

    def rto(self, in_flight: int) -> float:
        if self.srtt is None:
            return self.cap
        if in_flight > 0 and not self.throughput:
            return self.cap
        base = self.srtt + 4 * self.rttvar + self.resend_seconds(in_flight)
        return min(self.cap, max(self.floor, base))


@dataclass
class _Assembly:
    header: tensor_pb2.TensorHeader
    payload: bytearray
    received: int = 0


def wire_size(message: relay_pb2.EdgeMessage) -> int:
    """The contract's wire size of an item's message: ByteSize() of its TensorFrame or EdgeSignal."""
    kind = message.WhichOneof("body")
    if kind == "frame":
        return message.frame.ByteSize()
    if kind == "signal":
        return message.signal.ByteSize()
    raise ValueError(f"{kind!r} is not a sequenced item")


class EdgeSession:
    """Sequence, credit, acks, replay and outage handling of one edge end (see the module doc)."""

    def __init__(
        self,
        transport: Transport,
        send_direction: int,
        settings: EdgeSettings | None = None,
        name: str = "edge",
        clock: Callable[[], float] = time.monotonic,
        epoch: int = 0,
        route: tuple[str, str] | None = None,
    ) -> None:
        self.transport = transport
        self.name = name
        #: (job id, edge) of this stream: with it, chunks may be sent framed (see the module doc).
        self.route = route
        self.epoch = epoch
        self.settings = settings or EdgeSettings()
        self.send_direction = send_direction
        self.receive_direction = (
            tensor_pb2.DIRECTION_BACKWARD
            if send_direction == tensor_pb2.DIRECTION_FORWARD
            else tensor_pb2.DIRECTION_FORWARD
        )
        self._clock = clock
        self._cond = threading.Condition()
        # --- link state
        self._ever_ready = False
        self._ever_up = False
        self._link_up = False
        self._down_since: float | None = None
        self._outage_total = 0.0
        self._failed: str | None = None
        self._error: EdgeClosedError | None = None  # what waits raise once failed (kind + reason)
        self._last_down_reason = ""
        self._peer_closed: str | None = None
        self._peer_error = False  # the peer's close said it failed
        self._closing = False
        self._window = self.settings.window_bytes
        # --- sending half
        self._enqueue_lock = threading.Lock()
        self._next_seq = 1
        self._enqueued_bytes = 0
        self._buffer: collections.deque[_Outgoing] = collections.deque()
        self._first_index = 0  # absolute index of _buffer[0]
        self._pointer = 0  # absolute index of the next message to transmit
        self._credit = INITIAL_WINDOW_BYTES
        self._acked = 0
        self._last_progress = clock()
        self._timer_state = RetransmitTimer(self.settings.min_retransmit_s, self.settings.retransmit_s)
        self._backoff = 0  # consecutive retransmit timeouts without progress
        self._last_ack_at: float | None = None
        self._rewind_guard_until = float("-inf")  # after a timeout rewind: no further rewind before
        # --- receiving half
        self._expected = 1
        self._held_bytes = 0  # cumulative wire size through the last complete item
        self._assembly: _Assembly | None = None
        self._assembly_bytes = 0
        self._queue: collections.deque[EncodedTensor | relay_pb2.EdgeSignal] = collections.deque()
        self._granted = INITIAL_WINDOW_BYTES
        self._acked_sent = 0
        self._gap_asked_for = 0
        # --- counters (for tests and status)
        self.retransmitted_messages = 0
        self.acks_sent = 0
        self.max_in_transit_bytes = 0
        self.max_over_grant_bytes = -(1 << 62)  # receiver: max (end of a received message - our grant)
        self._timer = threading.Thread(target=self._tick, name=f"{name}-timer", daemon=True)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Open the transport and wait (bounded) for the first EdgeReady.

        On failure the transport is shut down (it would otherwise keep re-dialling). In an epoch
        > 0 a switch that did not answer in time raises ``EdgeOutage``: a recovering stage opens
        again (its wait for the link has no deadline) instead of failing.
        """
        self._timer.start()
        self.transport.start(self)
        deadline = self._clock() + self.settings.ready_timeout_s
        with self._cond:
            while not self._ever_ready and self._failed is None and self._peer_closed is None:
                left = deadline - self._clock()
                if left <= 0:
                    break
                self._cond.wait(min(left, 0.25))
            if self._failed is None and not self._ever_ready:
                last = f" (last error: {self._last_down_reason})" if self._last_down_reason else ""
                limit = self.settings.ready_timeout_s
                timed_out = self._peer_closed is None
                reason = (
                    self._peer_closed or f"switch did not open edge {self.name!r} within {limit:.0f}s{last}"
                )
                self._fail_locked(reason, EdgeOutage(reason) if timed_out and self.epoch > 0 else None)
            failed = self._failed is not None
            error = self._error_locked() if failed else None
        if error is not None:
            self.transport.shutdown()
            raise error

    @property
    def link_up(self) -> bool:
        return self._link_up

    def outage_seconds(self) -> float:
        """Total time the link has been down since the session started (including a current outage)."""
        with self._cond:
            return self._outage_locked()

    def _outage_locked(self) -> float:
        current = self._clock() - self._down_since if self._down_since is not None else 0.0
        return self._outage_total + current

    def _set_down_locked(self, reason: str) -> None:
        self._last_down_reason = reason
        if self._link_up or self._down_since is None:
            if self._down_since is None:
                self._down_since = self._clock()
            if self._link_up:
                log.warning("edge link down", extra={"fields": {"edge": self.name, "reason": reason}})
        self._link_up = False
        self._cond.notify_all()

    def _set_up_locked(self) -> None:
        if self._down_since is not None:
            self._outage_total += self._clock() - self._down_since
            self._down_since = None
        self._link_up = True
        self._ever_up = True
        self._last_progress = self._clock()
        self._rewind_guard_until = float("-inf")  # a fresh link: a resume ack must be honoured
        # A fresh session: what was in flight may be lost. Ask the peer to replay after what we hold.
        self._send_ack_locked(resume=True, force=True)
        self._pump_locked()
        self._cond.notify_all()

    def _fail_locked(self, reason: str, error: EdgeClosedError | None = None) -> None:
        if self._failed is None:
            self._failed = reason
            self._error = error or EdgeClosedError(reason)
            log.warning("edge failed", extra={"fields": {"edge": self.name, "reason": reason}})
        self._cond.notify_all()

    def _error_locked(self) -> EdgeClosedError:
        if self._error is not None:
            return renewed(self._error)
        return EdgeClosedError(self._failed or self._peer_closed or "edge closed")

    @property
    def failure(self) -> EdgeClosedError | None:
        """How the edge ended (None while it has not): an ``EdgeRestartRequired`` or ``EdgeOutage``
        here after ``close`` means the attempt was lost while closing."""
        with self._cond:
            return self._error

    @property
    def peer_failure(self) -> str | None:
        """The peer's reason when it closed the edge because it failed (None otherwise): a middle
        stage of a chain passes it on to its other edge at once (``runtime.chain``)."""
        with self._cond:
            return self._peer_closed if self._peer_error else None

    def wait_link_up(self) -> None:
        """Block until the link is up, without a deadline; raises if the edge ends first (a cancel
        aborts the edge, so this is cancellable)."""
        with self._cond:
            while not self._link_up:
                self._raise_if_ended_locked()
                self._cond.wait(0.25)
            self._raise_if_ended_locked()

    def fail(self, reason: str, *, tell_peer: bool = True, error: EdgeClosedError | None = None) -> None:
        """End the edge with an error now (safe from any thread, repeatable)."""
        with self._cond:
            first = self._failed is None
            self._fail_locked(reason, error)
        if first and tell_peer:
            self.transport.close(reason, True)
            # Tear down once the close is on the wire (or in 2 s), without holding up the caller.
            threading.Thread(
                target=self._shutdown_after_close, name=f"{self.name}-abort", daemon=True
            ).start()
        else:
            self.transport.shutdown()

    def _shutdown_after_close(self) -> None:
        self.transport.wait_close_sent(2.0)
        self.transport.shutdown()

    def _terminal_reason_locked(self) -> str | None:
        return self._failed or self._peer_closed

    def close(self, reason: str = "finished", timeout: float = 30.0) -> None:
        """Wait until the peer holds all we sent, close our side, wait (bounded) for the peer's close."""
        with self._cond:
            self._closing = True
            started, outage = self._clock(), self._outage_locked()
            while self._buffer and self._terminal_reason_locked() is None:
                if self._clock() - started - (self._outage_locked() - outage) > timeout:
                    break
                self._cond.wait(0.25)
            failed = self._failed is not None
        if failed:
            self.transport.shutdown()
            return
        self.transport.close(reason, False)
        with self._cond:
            deadline = self._clock() + timeout
            while self._peer_closed is None and self._failed is None and self._clock() < deadline:
                self._cond.wait(0.25)
            peer_closed = self._peer_closed is not None
        if peer_closed:  # both closes are out: let the switch end the call cleanly (bounded)
            self.transport.wait_close_sent(5.0)
        self.transport.shutdown()
        with self._cond:
            if self._failed is None:
                self._failed = f"edge closed: {reason}"
                self._error = EdgeClosedError(self._failed)
            self._cond.notify_all()

    # ------------------------------------------------------------------ transport callbacks

    def on_ready(self, ready: relay_pb2.EdgeReady) -> None:
        if ready.epoch > self.epoch:
            why = f"the edge moved on to epoch {ready.epoch} (this stream: {self.epoch})"
            self._restart(ready.epoch, why)
            return
        with self._cond:
            if self._failed is not None:
                return
            if self._ever_ready and self._pointer > self._first_index:
                # Our stream to the switch was re-opened: what we sent on the broken one may be lost,
                # and the peer (whose link stayed up) gets no notice that would make it ask for a
                # replay. Resend everything unacknowledged; the peer ignores what it already holds.
                self.retransmitted_messages += self._pointer - self._first_index
                self._pointer = self._first_index
                self._rewind_guard_until = float("-inf")
            self._ever_ready = True
            if ready.max_window_bytes:
                self._window = max(1, min(self.settings.window_bytes, ready.max_window_bytes))
            # A switch older than edge protocol 2 (max_window_bytes 0) never reports the link.
            if ready.link_up or not ready.max_window_bytes:
                self._set_up_locked()
            else:
                self._set_down_locked("peer link down at open")
            self._cond.notify_all()

    def _restart(self, epoch: int, reason: str) -> None:
        """The other side is in a higher epoch: end this attempt (nothing more is sent on it)."""
        self.fail(reason, tell_peer=False, error=EdgeRestartRequired(epoch, reason))

    def on_down(self, reason: str) -> None:
        with self._cond:
            self._set_down_locked(reason)

    def on_failed(self, reason: str) -> None:
        with self._cond:
            self._fail_locked(reason)

    def on_message(self, message: relay_pb2.EdgeMessage | FramedChunk) -> None:
        """An item from the peer or the switch. ``ready`` is not handled here: each transport turns
        it into ``on_ready`` (with the switch's window and link state), so it is ignored below."""
        if isinstance(message, FramedChunk):
            with self._cond:
                if self._failed is not None:
                    return
                try:
                    self._on_chunk_locked(
                        message.frame_id,
                        message.offset,
                        message.data,
                        message.last,
                        message.frame_size,
                    )
                except _ProtocolError as exc:
                    violation: str | None = str(exc)
                else:
                    violation = None
            if violation is not None:
                self.fail(violation)
            return
        kind = message.WhichOneof("body")
        if kind == "restart":
            restart = message.restart
            self._restart(
                max(restart.epoch, self.epoch + 1),
                restart.reason or f"the other side restarted at epoch {restart.epoch}",
            )
            return
        with self._cond:
            if self._failed is not None:
                return
            try:
                if kind == "frame":
                    self._on_frame_locked(message)
                elif kind == "signal":
                    self._on_signal_locked(message)
                elif kind == "ack":
                    self._on_ack_locked(message.ack)
                elif kind == "notice":
                    if message.notice.up:
                        self._set_up_locked()
                    else:
                        self._set_down_locked(message.notice.reason or "link down")
                elif kind == "close":
                    reason = message.close.reason or "peer closed the edge"
                    if message.close.error:
                        reason = f"peer side failed: {reason}"
                        self._peer_error = True
                    self._peer_closed = reason
                    self._cond.notify_all()
            except _ProtocolError as exc:
                violation: str | None = str(exc)
            else:
                violation = None
        if violation is not None:
            self.fail(violation)

    # ------------------------------------------------------------------ sending half

    def enqueue_tensor(self, build: Callable[[int], EncodedTensor]) -> EncodedTensor:
        """Number, frame and queue one tensor; ``build(frame_id)`` encodes it (once: replays reuse the bytes).

        Returns when at most one window of our items is still waiting to be transmitted.
        """
        with self._enqueue_lock:
            with self._cond:
                self._raise_if_ended_locked()
                seq = self._next_seq
            encoded = build(seq)
            if encoded.header.payload_size > self.settings.max_frame_bytes:
                raise EdgeClosedError(
                    f"tensor of {encoded.header.payload_size} bytes exceeds max_frame_bytes "
                    f"{self.settings.max_frame_bytes} of edge {self.name!r}"
                )
            self._append(self._frame_messages(encoded), seq)
        self._wait_for_transmission()
        return encoded

    def _frame_messages(self, encoded: EncodedTensor) -> list[tuple[relay_pb2.EdgeMessage | bytes, int]]:
        """The header, then the payload's chunks: framed once when the transport carries framed chunks."""
        if self.route is None or not getattr(self.transport, "frames_chunks", False):
            frames = [relay_pb2.EdgeMessage(frame=f) for f in to_frames(encoded)]
            return [(m, wire_size(m)) for m in frames]
        header = relay_pb2.EdgeMessage(frame=tensor_pb2.TensorFrame(header=encoded.header))
        messages: list[tuple[relay_pb2.EdgeMessage | bytes, int]] = [(header, wire_size(header))]
        job_id, edge = self.route
        frame_id = encoded.header.frame_id
        payload = memoryview(encoded.payload)
        size = len(payload)
        step = chunk_size_for(self._window)
        offset = 0
        while True:
            end = min(offset + step, size)
            last = end >= size
            raw, frame_size = encode_chunk(
                job_id, edge, self.epoch, frame_id, offset, payload[offset:end], last
            )
            messages.append((raw, frame_size))
            if last:
                return messages
            offset = end

    def enqueue_signal(self, kind: int, step: int, values: Sequence[float] = ()) -> None:
        with self._enqueue_lock:
            with self._cond:
                self._raise_if_ended_locked()
                seq = self._next_seq
            signal = relay_pb2.EdgeSignal(
                seq=seq, direction=self.send_direction, kind=kind, step=step, values=list(values)
            )
            message = relay_pb2.EdgeMessage(signal=signal)
            self._append([(message, wire_size(message))], seq)
        self._wait_for_transmission()

    def _append(self, messages: list[tuple[relay_pb2.EdgeMessage | bytes, int]], seq: int) -> None:
        with self._cond:
            self._raise_if_ended_locked()
            for message, size in messages:
                self._enqueued_bytes += size
                self._buffer.append(_Outgoing(seq, message, size, self._enqueued_bytes))
            self._next_seq = seq + 1
            self._pump_locked()

    def _raise_if_ended_locked(self) -> None:
        if self._failed is not None:
            raise self._error_locked()
        if self._peer_closed is not None:
            raise EdgeClosedError(self._peer_closed)

    def _wait_for_transmission(self) -> None:
        """Back-pressure: hold the caller while more than a window of our items waits for credit."""
        with self._cond:
            while True:
                self._raise_if_ended_locked()
                pointer_end = self._sent_bytes_locked()
                if self._enqueued_bytes - pointer_end <= self._window:
                    return
                self._cond.wait(0.25)

    def _sent_bytes_locked(self) -> int:
        """Cumulative wire size through the last transmitted message."""
        index = self._pointer - self._first_index
        if index <= 0:
            return self._buffer[0].end - self._buffer[0].size if self._buffer else self._enqueued_bytes
        return self._buffer[index - 1].end

    def _pump_locked(self) -> None:
        if not self._link_up or self._failed is not None:
            return
        while True:
            index = self._pointer - self._first_index
            if index >= len(self._buffer):
                return
            item = self._buffer[index]
            if item.end > self._credit:
                return
            now = self._clock()
            if index == 0:
                # Nothing was in flight: the retransmit timer starts now, not at the last ack (which
                # may be long ago after an idle spell).
                self._last_progress = max(self._last_progress, now)
            if item.sent_at is not None:
                item.replayed = True
            item.sent_at = now
            self.transport.send(item.message)
            self._pointer += 1
            in_transit = item.end - self._acked_bytes_locked()
            self.max_in_transit_bytes = max(self.max_in_transit_bytes, in_transit)

    def _acked_bytes_locked(self) -> int:
        if not self._buffer:
            return self._enqueued_bytes
        first = self._buffer[0]
        return first.end - first.size

    def _on_ack_locked(self, ack: relay_pb2.EdgeAck) -> None:
        progress = False
        now = self._clock()
        if ack.received > self._acked:
            if ack.received >= self._next_seq:
                raise _ProtocolError(
                    f"peer acknowledged item {ack.received} but only {self._next_seq - 1} were sent"
                )
            self._acked = ack.received
            progress = True
        popped: list[_Outgoing] = []
        while self._buffer and self._buffer[0].seq <= self._acked:
            popped.append(self._buffer.popleft())
            self._first_index += 1
        if popped:
            self._sample_locked(popped, now)
        if self._pointer < self._first_index:
            self._pointer = self._first_index
        if ack.max_bytes > self._credit:
            self._credit = ack.max_bytes
            progress = True
        rewind = ack.resume
        if rewind and now < self._rewind_guard_until and not progress:
            # Right after our own timeout rewind: most likely the receiver restarted its assembly on
            # the replayed header and saw the original chunks as a gap. The replay is on its way; if
            # it is lost too, the timer rewinds again.
            rewind = False
        if rewind:
            if self._pointer > self._first_index:
                self.retransmitted_messages += self._pointer - self._first_index
            self._pointer = self._first_index
        if progress or rewind:
            self._last_progress = now
            self._backoff = 0
        self._pump_locked()
        self._cond.notify_all()

    def _sample_locked(self, popped: list[_Outgoing], now: float) -> None:
        """RTT and throughput from the items an ack retired (none if any was replayed: Karn)."""
        previous, self._last_ack_at = self._last_ack_at, now
        if any(item.replayed or item.sent_at is None for item in popped):
            return
        first_sent = popped[0].sent_at
        last_sent = popped[-1].sent_at
        assert first_sent is not None and last_sent is not None
        start = first_sent if previous is None else max(previous, first_sent)
        acked_bytes = sum(item.size for item in popped)
        self._timer_state.sample(now - last_sent, acked_bytes, now - start)

    def _in_flight_bytes_locked(self) -> int:
        """Wire bytes transmitted and not yet acknowledged."""
        return max(0, self._sent_bytes_locked() - self._acked_bytes_locked())

    def _rto_locked(self) -> float:
        base = self._timer_state.rto(self._in_flight_bytes_locked())
        return min(base * (2**self._backoff), self.settings.retransmit_s * 10)

    def retransmit_timeout(self) -> float:
        """The current retransmit timeout in seconds (with the backoff of consecutive timeouts)."""
        with self._cond:
            return self._rto_locked()

    def rtt_estimate(self) -> tuple[float | None, float, float | None]:
        """(SRTT s, RTTVAR s, ack throughput bytes/s); None before the first sample."""
        with self._cond:
            timer = self._timer_state
            return timer.srtt, timer.rttvar, timer.throughput

    def poll_timers(self) -> None:
        """Run the retransmit check now (the timer thread does this every 50 ms; tests with a fake
        clock call it after moving the clock)."""
        with self._cond:
            if self._failed is None:
                self._check_retransmit_locked(self._clock())

    def _check_retransmit_locked(self, now: float) -> None:
        if not self._link_up or self._pointer <= self._first_index:
            return
        if now < self._rewind_guard_until:
            return
        rto = self._rto_locked()
        if now - self._last_progress <= rto:
            return
        in_flight = self._in_flight_bytes_locked()
        timer = self._timer_state
        log.info(
            "edge retransmit timeout: rewinding",
            extra={
                "fields": {
                    "edge": self.name,
                    "rto_s": round(rto, 3),
                    "srtt_s": None if timer.srtt is None else round(timer.srtt, 3),
                    "inflight_bytes": in_flight,
                    "throughput_bps": None if timer.throughput is None else round(timer.throughput),
                    "backoff": self._backoff,
                }
            },
        )
        self.retransmitted_messages += self._pointer - self._first_index
        self._pointer = self._first_index
        self._last_progress = now
        self._backoff += 1
        self._rewind_guard_until = now + timer.resend_seconds(in_flight)
        self._pump_locked()

    # ------------------------------------------------------------------ receiving half

    def _check_credit_locked(self) -> None:
        """Record how far the peer's position is from our grant (the contract keeps it <= 0)."""
        over = self._held_bytes + self._assembly_bytes - self._granted
        self.max_over_grant_bytes = max(self.max_over_grant_bytes, over)

    def _on_frame_locked(self, message: relay_pb2.EdgeMessage) -> None:
        frame = message.frame
        part = frame.WhichOneof("part")
        size = frame.ByteSize()
        if part == "header":
            header = frame.header
            if header.frame_id != self._expected:
                self._out_of_order_locked(header.frame_id)
                return
            if header.direction != self.receive_direction:
                raise _ProtocolError(f"peer sent a frame of direction {header.direction} on our receive side")
            if header.payload_size > self.settings.max_frame_bytes:
                raise _ProtocolError(
                    f"peer announced a tensor of {header.payload_size} bytes (frame {header.frame_id}, step "
                    f"{header.step}), above this edge's max_frame_bytes {self.settings.max_frame_bytes}"
                )
            # A new header (or a replayed one for the frame being assembled) starts the frame afresh.
            # Not zeroed: the chunks write every byte before the frame completes (offsets in order).
            payload = uninitialized_bytearray(header.payload_size)
            self._assembly = _Assembly(header=header, payload=payload)
            self._assembly_bytes = size
            self._check_credit_locked()
            self._maybe_ack_locked(False)
            return
        if part != "chunk":
            raise _ProtocolError("peer sent a frame with neither header nor chunk")
        chunk = frame.chunk
        self._on_chunk_locked(chunk.frame_id, chunk.offset, chunk.data, chunk.last, size)

    def _on_chunk_locked(
        self,
        frame_id: int,
        offset: int,
        data: bytes | memoryview,
        last: bool,
        size: int,
    ) -> None:
        """One payload chunk (a ``TensorChunk`` or framed), copied once into the frame's buffer."""
        assembly = self._assembly
        if assembly is None or frame_id != assembly.header.frame_id or offset != assembly.received:
            if assembly is not None and frame_id == assembly.header.frame_id and offset > assembly.received:
                self._out_of_order_locked(self._expected + 1)  # a chunk of this frame was lost in flight
            return  # a stray chunk (of a replayed or abandoned frame): ignored
        end = assembly.received + len(data)
        if end > assembly.header.payload_size or (last and end != assembly.header.payload_size):
            raise _ProtocolError(
                f"invalid frame from peer: chunks of frame {frame_id} end at {end} bytes but "
                f"{assembly.header.payload_size} were declared"
            )
        assembly.payload[assembly.received : end] = data
        assembly.received = end
        self._assembly_bytes += size
        self._check_credit_locked()
        if not last:
            self._maybe_ack_locked(False)
            return
        self._assembly = None
        # The frame's buffer becomes the payload as is (no copy): nothing else holds it any more.
        self._complete_locked(EncodedTensor(header=assembly.header, payload=assembly.payload))

    def _on_signal_locked(self, message: relay_pb2.EdgeMessage) -> None:
        signal = message.signal
        if signal.seq != self._expected or self._assembly is not None:
            self._out_of_order_locked(signal.seq)
            return
        if signal.direction != self.receive_direction:
            raise _ProtocolError(f"peer sent a signal of direction {signal.direction} on our receive side")
        self._assembly_bytes = signal.ByteSize()
        self._check_credit_locked()
        self._complete_locked(signal)

    def _complete_locked(self, item: EncodedTensor | relay_pb2.EdgeSignal) -> None:
        self._held_bytes += self._assembly_bytes
        self._assembly_bytes = 0
        self._expected += 1
        self._gap_asked_for = 0
        self._queue.append(item)
        self._maybe_ack_locked(True)
        self._cond.notify_all()

    def _out_of_order_locked(self, seq: int) -> None:
        if seq < self._expected:
            self._send_ack_locked(resume=False, force=True)  # a replay: our ack may have been lost
        elif self._gap_asked_for != self._expected:
            # Something before it was lost in flight: ask for a replay once per gap.
            self._gap_asked_for = self._expected
            self._send_ack_locked(resume=True, force=True)

    def _grant_locked(self) -> int:
        if len(self._queue) >= self.settings.receive_queue_items:
            return self._granted
        return max(self._granted, self._held_bytes + self._assembly_bytes + self._window)

    def _maybe_ack_locked(self, completed: bool) -> None:
        grant = self._grant_locked()
        if completed or grant - self._granted >= max(1, self._window // 4):
            self._send_ack_locked(resume=False, force=completed)

    def _send_ack_locked(self, *, resume: bool, force: bool) -> None:
        if not self._link_up or self._failed is not None:
            return
        grant = self._grant_locked()
        received = self._expected - 1
        if not force and grant == self._granted and received == self._acked_sent:
            return
        self._granted = grant
        self._acked_sent = received
        self.acks_sent += 1
        self.transport.send(
            relay_pb2.EdgeMessage(
                ack=relay_pb2.EdgeAck(
                    direction=self.receive_direction, received=received, max_bytes=grant, resume=resume
                )
            )
        )

    def receive_item(self, timeout: float, what: str) -> EncodedTensor | relay_pb2.EdgeSignal:
        """The next complete item; waits up to ``timeout`` seconds of link-up time."""
        with self._cond:
            started, outage = self._clock(), self._outage_locked()
            while True:
                if self._queue:
                    was_full = len(self._queue) >= self.settings.receive_queue_items
                    item = self._queue.popleft()
                    if was_full and self._grant_locked() > self._granted:
                        self._send_ack_locked(resume=False, force=True)  # the stage read: credit again
                    return item
                self._raise_if_ended_locked()
                waited = self._clock() - started - (self._outage_locked() - outage)
                if waited >= timeout:
                    raise EdgeTimeout(f"no {what} in {timeout:.0f}s")
                self._cond.wait(min(timeout - waited, 0.25))

    # ------------------------------------------------------------------ timers

    def _tick(self) -> None:
        while True:
            with self._cond:
                if self._failed is not None:
                    return
                now = self._clock()
                limit = self.settings.max_outage_s
                # A new epoch's session waits for the link without a deadline until it was up once.
                armed = self._ever_ready and (self.epoch == 0 or self._ever_up)
                if self._down_since is not None and now - self._down_since > limit and armed:
                    reason = (
                        f"WAN link to the peer cluster down for {now - self._down_since:.0f} s "
                        f"(limit {limit:g} s)"
                    )
                    failed = True
                else:
                    failed = False
                    self._check_retransmit_locked(now)
                    self._cond.wait(0.05)
            if failed:
                # No close: the peer cannot be reached now, and it learns of our next epoch from its
                # switch once the link is back (a close of this epoch would be void by then anyway).
                self.fail(reason, tell_peer=False, error=EdgeOutage(reason))
                return


class _ProtocolError(Exception):
    """The peer broke the delivery contract; the edge fails with this message."""


__all__ = [
    "INITIAL_WINDOW_BYTES",
    "EdgeClosedError",
    "EdgeOutage",
    "EdgeRestartRequired",
    "EdgeSession",
    "EdgeSettings",
    "RetransmitTimer",
    "Transport",
    "TransportHandler",
    "renewed",
    "wire_size",
]
