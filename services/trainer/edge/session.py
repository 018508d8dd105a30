"""The trainer's end of one job edge (edge protocol 2): the delivery contract, whatever the transport.

Each end of an edge sends one direction (the upstream stage FORWARD, the downstream stage BACKWARD)
and receives the other. ``EdgeSession`` implements, for both halves, what
``proto/nebula/v1/relay.proto`` calls the delivery contract. It is one class with one lock (a
condition) over both halves, because a message of either kind may change both; its parts are base
classes in modules of one concern each, each owning the state it initialises and naming (as
annotations only) what it uses of the others:

* ``send_window`` (``EdgeSender``): every outgoing item (a tensor frame -- its header and chunks --
  or a signal) gets the next number of the direction's sequence; a message is transmitted only within
  the peer's absolute credit, and every unacknowledged item is kept for replay;
* ``replay`` (``EdgeReplay``, ``RetransmitTimer``): rewinds on a resume ack, a re-opened stream, or
  the sender's measured retransmit timeout;
* ``receive_window`` (``EdgeReceiver``): only the next item in sequence is accepted, acks are
  coalesced, at most one window is granted beyond what is held, none while the queue is full;
* ``link_state`` (``EdgeLinkState``): link up/down, outages (which pause waits and end the edge with
  ``EdgeOutage`` past ``max_outage_s``), the peer's close, the edge's failure, the timer thread;
* ``tensor_frames``: the messages a tensor travels as (framed chunks to the switch) and its
  reassembly buffer; ``settings``, ``errors`` and ``transport``: the tunables, how an edge ends, and
  the interface its transports implement.

This module keeps what ties the parts together: opening and closing the edge, and the transport's
callbacks. After every ready and every link-up notice both ends send a resume ack, and a sender
receiving one resends every item after ``received``, in order.

Epochs (relay.proto, "Epochs"): a session belongs to one epoch (``EdgeOpen.epoch``). An
``EdgeReady.epoch`` above it, or an ``EdgeRestart``, means the other side moved on: the edge ends
with ``EdgeRestartRequired(epoch)`` and nothing more is sent on it. The transport (gRPC to the
switch, or the in-memory pair of the tests) calls the ``on_*`` methods from its own thread; ``send``
on the transport must never block.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from nebula_common.proto.nebula.v1 import relay_pb2, tensor_pb2
from nebula_common.rpc.framing import FramedChunk
from services.trainer.edge.errors import (
    EdgeClosedError,
    EdgeOutage,
    EdgeRestartRequired,
    EdgeTimeout,
    ProtocolError,
    renewed,
)
from services.trainer.edge.link_state import EdgeLinkState
from services.trainer.edge.receive_window import EdgeReceiver
from services.trainer.edge.replay import EdgeReplay, RetransmitTimer
from services.trainer.edge.send_window import EdgeSender
from services.trainer.edge.settings import INITIAL_WINDOW_BYTES, MAX_FRAME_BYTES, EdgeSettings
from services.trainer.edge.tensor_frames import wire_size
from services.trainer.edge.transport import Transport, TransportHandler


class EdgeSession(EdgeLinkState, EdgeSender, EdgeReplay, EdgeReceiver):
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
        #: (job id, edge) of this stream: with it, chunks may be sent framed (``tensor_frames``).
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
        self._window = self.settings.window_bytes  # the receiver's grant, capped by the switch's ready
        self._init_link_state()
        self._init_sending()
        self._init_replay()
        self._init_receiving()
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

    def close(self, reason: str = "finished", timeout: float = 30.0) -> None:
        """Wait until the peer holds all we sent, close our side, wait (bounded) for the peer's close."""
        with self._cond:
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
            if self._ever_ready:
                self._rewind_for_new_stream_locked()  # our stream to the switch was re-opened
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
                        message.placed,
                    )
                except ProtocolError as exc:
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
            except ProtocolError as exc:
                violation: str | None = str(exc)
            else:
                violation = None
        if violation is not None:
            self.fail(violation)

    def _on_link_up_locked(self) -> None:
        """A fresh link (or stream): what was in flight may be lost. The retransmit timer starts over,
        we ask the peer to replay after what we hold, and transmit what its credit allows."""
        self._restart_timer_locked()
        self._send_ack_locked(resume=True, force=True)
        self._pump_locked()


__all__ = [
    "INITIAL_WINDOW_BYTES",
    "MAX_FRAME_BYTES",
    "EdgeClosedError",
    "EdgeOutage",
    "EdgeRestartRequired",
    "EdgeSession",
    "EdgeSettings",
    "EdgeTimeout",
    "RetransmitTimer",
    "Transport",
    "TransportHandler",
    "renewed",
    "wire_size",
]
