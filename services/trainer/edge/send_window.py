"""The sending half of an edge: numbering items, the peer's credit, and the buffer of unacknowledged items.

Every outgoing item (a tensor frame -- its header and chunks -- or a signal) gets the next number of
the direction's sequence (``TensorHeader.frame_id`` / ``EdgeSignal.seq``). A message is transmitted
only while the cumulative wire size of the direction through it is within the peer's absolute credit
(``INITIAL_WINDOW_BYTES`` before the first ack), and every item stays in the buffer until the peer
acknowledges it, so ``replay`` can resend it by moving the transmit pointer back.

``EdgeSender`` is one part of ``EdgeSession`` (``session``): its state is guarded by the session's
condition.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from nebula_common.codec import EncodedTensor
from nebula_common.proto.nebula.v1 import relay_pb2
from services.trainer.edge.errors import EdgeClosedError, ProtocolError
from services.trainer.edge.settings import INITIAL_WINDOW_BYTES, EdgeSettings
from services.trainer.edge.tensor_frames import OutgoingMessage, frame_messages, wire_size
from services.trainer.edge.transport import Transport


@dataclass
class Outgoing:
    """One message of an item in the send buffer, kept until the peer acknowledges the item."""

    seq: int
    message: relay_pb2.EdgeMessage | bytes  # bytes: a framed chunk, sent as is
    size: int  # the contract's wire size of the item's message (credit counts these)
    end: int  # cumulative wire size of the direction through this message
    sent_at: float | None = None  # clock of the last transmission
    replayed: bool = False  # transmitted more than once: no RTT sample from its item (Karn)


class EdgeSender:
    """Sequence numbers, credit and transmission of our direction (part of ``EdgeSession``)."""

    # Provided by the other parts of EdgeSession (annotations only: nothing here shadows them).
    transport: Transport
    name: str
    route: tuple[str, str] | None
    epoch: int
    settings: EdgeSettings
    send_direction: int
    _clock: Callable[[], float]
    _cond: threading.Condition
    _window: int
    _link_up: bool
    _failed: str | None
    _raise_if_ended_locked: Callable[[], None]
    _start_timer_locked: Callable[[float], None]  # replay
    _sample_locked: Callable[[list[Outgoing], float], None]  # replay
    _after_ack_locked: Callable[[bool, bool, float], None]  # replay

    def _init_sending(self) -> None:
        self._enqueue_lock = threading.Lock()
        self._next_seq = 1
        self._enqueued_bytes = 0
        self._buffer: collections.deque[Outgoing] = collections.deque()
        self._first_index = 0  # absolute index of _buffer[0]
        self._pointer = 0  # absolute index of the next message to transmit
        self._credit = INITIAL_WINDOW_BYTES
        self._acked = 0
        self.max_in_transit_bytes = 0

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

    def _frame_messages(self, encoded: EncodedTensor) -> list[OutgoingMessage]:
        """The header, then the payload's chunks: framed once when the transport carries framed chunks."""
        framed = self.route is not None and getattr(self.transport, "frames_chunks", False)
        return frame_messages(encoded, self.route if framed else None, self.epoch, self._window)

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

    def _append(self, messages: list[OutgoingMessage], seq: int) -> None:
        with self._cond:
            self._raise_if_ended_locked()
            for message, size in messages:
                self._enqueued_bytes += size
                self._buffer.append(Outgoing(seq, message, size, self._enqueued_bytes))
            self._next_seq = seq + 1
            self._pump_locked()

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
                self._start_timer_locked(now)
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

    def _in_flight_bytes_locked(self) -> int:
        """Wire bytes transmitted and not yet acknowledged."""
        return max(0, self._sent_bytes_locked() - self._acked_bytes_locked())

    def _on_ack_locked(self, ack: relay_pb2.EdgeAck) -> None:
        """The peer's ack: retire what it holds, take its credit, and (``replay``) rewind if it asks."""
        progress = False
        now = self._clock()
        if ack.received > self._acked:
            if ack.received >= self._next_seq:
                raise ProtocolError(
                    f"peer acknowledged item {ack.received} but only {self._next_seq - 1} were sent"
                )
            self._acked = ack.received
            progress = True
        popped: list[Outgoing] = []
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
        self._after_ack_locked(ack.resume, progress, now)
        self._pump_locked()
        self._cond.notify_all()


__all__ = ["EdgeSender", "Outgoing"]
