"""The receiving half of an edge: in-order acceptance, reassembly, acks and the credit we grant.

The receiver accepts only the next item in sequence (duplicates and items after a gap are ignored;
a new header for the frame being assembled restarts it), acknowledges coalesced (on each completed
item, or when the grant grew by a quarter window), grants at most one window beyond what it holds,
and none while its queue of completed items is full. A gap (an item lost in flight without a link
event) makes it ask once for a rewind with a resume ack (``replay`` on the peer's side).

``EdgeReceiver`` is one part of ``EdgeSession`` (``session``): its state is guarded by the session's
condition.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable

from nebula_common.bulk_memory import uninitialized_bytearray
from nebula_common.codec import EncodedTensor
from nebula_common.proto.nebula.v1 import relay_pb2
from nebula_common.rpc.framing import FramedChunk
from services.trainer.edge.errors import EdgeTimeout, ProtocolError
from services.trainer.edge.settings import INITIAL_WINDOW_BYTES, EdgeSettings
from services.trainer.edge.tensor_frames import FrameAssembly
from services.trainer.edge.transport import Transport


class EdgeReceiver:
    """Sequence checks, reassembly, acks and grants of the peer's direction (part of ``EdgeSession``)."""

    # Provided by the other parts of EdgeSession (annotations only: nothing here shadows them).
    transport: Transport
    settings: EdgeSettings
    receive_direction: int
    _clock: Callable[[], float]
    _cond: threading.Condition
    _window: int
    _link_up: bool
    _failed: str | None
    _outage_locked: Callable[[], float]  # link_state
    _raise_if_ended_locked: Callable[[], None]  # link_state

    def _init_receiving(self) -> None:
        self._expected = 1
        self._held_bytes = 0  # cumulative wire size through the last complete item
        self._assembly: FrameAssembly | None = None
        self._assembly_bytes = 0
        self._queue: collections.deque[EncodedTensor | relay_pb2.EdgeSignal] = collections.deque()
        self._granted = INITIAL_WINDOW_BYTES
        self._acked_sent = 0
        self._gap_asked_for = 0
        self.acks_sent = 0
        self.max_over_grant_bytes = -(1 << 62)  # max (end of a received message - our grant)

    def _check_credit_locked(self) -> None:
        """Record how far the peer's position is from our grant (the contract keeps it <= 0)."""
        over = self._held_bytes + self._assembly_bytes - self._granted
        self.max_over_grant_bytes = max(self.max_over_grant_bytes, over)

    def place_chunk(self, chunk: FramedChunk, size: int) -> tuple[object, memoryview] | None:
        """Where the reader may put this chunk's ``size``-byte payload: the next bytes of the frame
        being assembled, when the chunk is exactly the one expected there (else None: the chunk is
        received whole and judged by ``_on_chunk_locked`` as any other). The reader writes into the
        frame's buffer outside the lock; only its own delivery of this chunk advances the frame, and a
        frame restarted meanwhile gets a new buffer and ignores the chunk (the token differs)."""
        with self._cond:
            assembly = self._assembly
            if self._failed is not None or assembly is None:
                return None
            end = chunk.offset + size
            if (
                chunk.frame_id != assembly.header.frame_id
                or chunk.offset != assembly.received
                or end > assembly.header.payload_size
                or (chunk.last and end != assembly.header.payload_size)
            ):
                return None
            return assembly, memoryview(assembly.payload)[chunk.offset : end]

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
                raise ProtocolError(f"peer sent a frame of direction {header.direction} on our receive side")
            if header.payload_size > self.settings.max_frame_bytes:
                raise ProtocolError(
                    f"peer announced a tensor of {header.payload_size} bytes (frame {header.frame_id}, step "
                    f"{header.step}), above this edge's max_frame_bytes {self.settings.max_frame_bytes}"
                )
            # A new header (or a replayed one for the frame being assembled) starts the frame afresh.
            # Not zeroed: the chunks write every byte before the frame completes (offsets in order).
            payload = uninitialized_bytearray(header.payload_size)
            self._assembly = FrameAssembly(header=header, payload=payload)
            self._assembly_bytes = size
            self._check_credit_locked()
            self._maybe_ack_locked(False)
            return
        if part != "chunk":
            raise ProtocolError("peer sent a frame with neither header nor chunk")
        chunk = frame.chunk
        self._on_chunk_locked(chunk.frame_id, chunk.offset, chunk.data, chunk.last, size)

    def _on_chunk_locked(
        self,
        frame_id: int,
        offset: int,
        data: bytes | memoryview,
        last: bool,
        size: int,
        placed: object = None,
    ) -> None:
        """One payload chunk (a ``TensorChunk`` or framed), copied once into the frame's buffer, or
        already there (``placed``: the assembly ``place_chunk`` gave the reader the buffer of)."""
        assembly = self._assembly
        if placed is not None and placed is not assembly:
            return  # the frame was restarted or abandoned while its chunk was read: a stray
        if assembly is None or frame_id != assembly.header.frame_id or offset != assembly.received:
            if assembly is not None and frame_id == assembly.header.frame_id and offset > assembly.received:
                self._out_of_order_locked(self._expected + 1)  # a chunk of this frame was lost in flight
            return  # a stray chunk (of a replayed or abandoned frame): ignored
        end = assembly.received + len(data)
        if end > assembly.header.payload_size or (last and end != assembly.header.payload_size):
            raise ProtocolError(
                f"invalid frame from peer: chunks of frame {frame_id} end at {end} bytes but "
                f"{assembly.header.payload_size} were declared"
            )
        if placed is None:
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
            raise ProtocolError(f"peer sent a signal of direction {signal.direction} on our receive side")
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


__all__ = ["EdgeReceiver"]
