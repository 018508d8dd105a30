"""An in-memory edge transport: two connected ends in one process, with fault controls.

It stands in for "trainer -> switch -> WAN -> switch -> trainer" so the pipeline loop
and the delivery contract can be tested fast and deterministically:

* ``cut()`` drops everything in flight and everything sent until ``restore()``; both
  ends get ``LinkNotice(up=False)``, then ``LinkNotice(up=True)`` on restore;
* ``drop_next(n)`` loses the next ``n`` sequenced items or acks in flight, and
  ``drop_probability`` loses each at random (seeded);
* ``delay_s`` holds every item that crosses the link that long (one way) before its end delivers
  it, in order: a round trip for tests of what the schedule does about one;
* ``bytes_in_flight`` per direction counts what was sent and not yet delivered, so tests
  can check that credit is never exceeded.

Epochs (relay.proto, "Epochs") are emulated as the two switches apply them, each side
keeping its own route epoch (the highest it has seen), so a side learns of the other's
new epoch only from an item that crosses the link, never during a cut:

* ``open_end(index, epoch)`` makes a new end; when it starts, its side's route epoch
  rises to its epoch if higher, and it gets ``EdgeReady(epoch=route epoch)`` (and at once
  an ``EdgeRestart`` if its epoch is lower);
* an item is dropped when its epoch is below its own side's or the receiving side's route
  epoch; a higher one raises the receiving side's route epoch, discards what was held
  for older epochs and sends an attached end of an older epoch an ``EdgeRestart``;
* items for a side whose end is not attached (not started yet, vanished, or of an older
  epoch) are held until an end of their epoch attaches;
* ``MemoryTransport.vanish()`` is a dead process: no close, nothing sent or delivered any
  more, and the route stays for the other side (which notices nothing).

Each end delivers on its own thread, in order, like a stream.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Callable
from typing import NamedTuple

from nebula_common.proto.nebula.v1 import relay_pb2
from services.trainer.edge.tensor_frames import wire_size
from services.trainer.edge.transport import TransportHandler

_STOP = object()
_SEQUENCED = ("frame", "signal")


class _Delayed(NamedTuple):
    due: float  # time.monotonic() at which the item arrives
    message: relay_pb2.EdgeMessage


class MemoryTransport:
    """One end of a ``MemoryLink`` (index 0 upstream or 1 downstream) in one epoch."""

    def __init__(self, link: MemoryLink, index: int, epoch: int = 0) -> None:
        self.link = link
        self.index = index
        self.epoch = epoch
        self.inbox: queue.Queue[object] = queue.Queue()
        self._handler: TransportHandler | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.vanished = False
        self.closed_with: tuple[str, bool] | None = None

    @property
    def peer(self) -> MemoryTransport:
        return self.link.ends[1 - self.index]

    def start(self, handler: TransportHandler) -> None:
        self._handler = handler
        self._thread = threading.Thread(
            target=self._deliver, name=f"memory-edge-{self.index}-e{self.epoch}", daemon=True
        )
        self._thread.start()
        self.link.attach(self)

    def _deliver(self) -> None:
        while True:
            item = self.inbox.get()
            if item is _STOP:
                return
            if isinstance(item, _Delayed):  # constant delay: waiting in order keeps the order
                time.sleep(max(0.0, item.due - time.monotonic()))
                item = item.message
            assert isinstance(item, relay_pb2.EdgeMessage)
            self.link.delivered(self.index, item)
            handler = self._handler
            if handler is None:
                continue
            if item.WhichOneof("body") == "ready":
                handler.on_ready(item.ready)
            else:
                handler.on_message(item)
            if item.WhichOneof("body") in ("close", "restart"):
                return

    def send(self, message: relay_pb2.EdgeMessage) -> None:
        if not self._stopped:
            self.link.carry(self, message)

    def close(self, reason: str, error: bool) -> None:
        if self._stopped or self.closed_with is not None:
            return
        self.closed_with = (reason, error)
        self.link.carry(self, relay_pb2.EdgeMessage(close=relay_pb2.EdgeClose(reason=reason, error=error)))

    def wait_close_sent(self, timeout: float) -> None:
        """Nothing to wait for: ``close`` handed the message to the link synchronously."""

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.link.detach(self)
        self.inbox.put(_STOP)

    def vanish(self) -> None:
        """The process holding this end died: no close, nothing more sent or delivered."""
        self.vanished = True
        self.shutdown()


class MemoryLink:
    """A connected pair of in-memory edge ends (``ends[0]`` upstream, ``ends[1]`` downstream).

    ``ends`` are the newest ends opened per side (epoch 0 ones are made up front).
    """

    def __init__(
        self,
        max_window_bytes: int = 4 << 20,
        drop_probability: float = 0.0,
        seed: int = 0,
        delay_s: float = 0.0,
    ) -> None:
        if delay_s < 0:
            raise ValueError(f"delay_s must be >= 0, got {delay_s}")
        self.max_window_bytes = max_window_bytes
        self.delay_s = delay_s
        self.drop_probability = drop_probability
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.up = True
        self._drop_next = 0
        self._cut_at: int | None = None
        self.sequenced = 0  # frames and signals carried
        self.dropped = 0
        self.stale_dropped = 0  # items of an epoch below a route's epoch
        self.restarts_sent = 0
        self.carried = 0
        self.route_epoch = [0, 0]  # per side (each side's switch)
        self._attached: list[MemoryTransport | None] = [None, None]
        self._held: list[list[tuple[int, relay_pb2.EdgeMessage]]] = [[], []]  # per receiving side
        self.ends = [MemoryTransport(self, 0), MemoryTransport(self, 1)]
        self.in_flight_bytes = [0, 0]  # per sending end: sequenced bytes sent and not yet delivered
        self.max_in_flight_bytes = [0, 0]
        self.observers: list[Callable[[int, relay_pb2.EdgeMessage], None]] = []

    def open_end(self, index: int, epoch: int) -> MemoryTransport:
        """A new end for side ``index`` in ``epoch`` (a restarted stage's); it attaches when started."""
        end = MemoryTransport(self, index, epoch)
        with self._lock:
            self.ends[index] = end
        return end

    # ------------------------------------------------------------------ the emulated switches

    def attach(self, end: MemoryTransport) -> None:
        side = end.index
        with self._lock:
            if end.epoch > self.route_epoch[side]:
                self._raise_epoch_locked(side, end.epoch, f"side {side} opened epoch {end.epoch}")
            self._attached[side] = end
            route = self.route_epoch[side]
            ready = relay_pb2.EdgeReady(
                peer_cluster=f"memory-{1 - side}",
                max_window_bytes=self.max_window_bytes,
                link_up=self.up,
                epoch=route,
            )
            end.inbox.put(relay_pb2.EdgeMessage(ready=ready))
            if end.epoch < route:
                self._restart_locked(end, route, f"the route is at epoch {route} already")
                return
            kept: list[tuple[int, relay_pb2.EdgeMessage]] = []
            for epoch, message in self._held[side]:
                if epoch == end.epoch:
                    end.inbox.put(message)
                else:
                    kept.append((epoch, message))
            self._held[side] = kept

    def detach(self, end: MemoryTransport) -> None:
        with self._lock:
            if self._attached[end.index] is end:
                self._attached[end.index] = None

    def _restart_locked(self, end: MemoryTransport, epoch: int, reason: str) -> None:
        self.restarts_sent += 1
        end.inbox.put(relay_pb2.EdgeMessage(restart=relay_pb2.EdgeRestart(epoch=epoch, reason=reason)))

    def _raise_epoch_locked(self, side: int, epoch: int, reason: str) -> None:
        self.route_epoch[side] = epoch
        kept = []
        for held_epoch, message in self._held[side]:
            if held_epoch < epoch:
                self._discard_locked(1 - side, message)
            else:
                kept.append((held_epoch, message))
        self._held[side] = kept
        attached = self._attached[side]
        if attached is not None and attached.epoch < epoch:
            self._restart_locked(attached, epoch, reason)

    def _discard_locked(self, sender: int, message: relay_pb2.EdgeMessage) -> None:
        if message.WhichOneof("body") in _SEQUENCED:
            self.in_flight_bytes[sender] -= wire_size(message)

    def carry(self, end: MemoryTransport, message: relay_pb2.EdgeMessage) -> None:
        kind = message.WhichOneof("body")
        sender, receiver = end.index, 1 - end.index
        with self._lock:
            if end.epoch < self.route_epoch[sender]:
                self.stale_dropped += 1
                return
            if not self.up:
                self.dropped += kind != "close"
                return
            lose = self._drop_next > 0 or (
                self.drop_probability and self._rng.random() < self.drop_probability
            )
            if kind in ("frame", "signal", "ack") and lose:
                self._drop_next = max(0, self._drop_next - 1)
                self.dropped += 1
                return
            if end.epoch < self.route_epoch[receiver]:
                self.stale_dropped += 1
                return
            if end.epoch > self.route_epoch[receiver]:
                why = f"the other side restarted at epoch {end.epoch}"
                self._raise_epoch_locked(receiver, end.epoch, why)
            if kind in _SEQUENCED:
                self.in_flight_bytes[sender] += wire_size(message)
                self.max_in_flight_bytes[sender] = max(
                    self.max_in_flight_bytes[sender], self.in_flight_bytes[sender]
                )
            self.carried += 1
            for observer in self.observers:
                observer(sender, message)
            target = self._attached[receiver]
            if target is not None and target.epoch == end.epoch:
                due = time.monotonic() + self.delay_s
                target.inbox.put(_Delayed(due, message) if self.delay_s else message)
            else:
                self._held[receiver].append((end.epoch, message))
            if kind in _SEQUENCED:
                self.sequenced += 1
                if self._cut_at is not None and self.sequenced >= self._cut_at:
                    self._cut_at = None
                    self._cut_locked("link cut (test)")

    def delivered(self, receiver: int, message: relay_pb2.EdgeMessage) -> None:
        if message.WhichOneof("body") in _SEQUENCED:
            with self._lock:
                self.in_flight_bytes[1 - receiver] -= wire_size(message)

    # ------------------------------------------------------------------ faults

    def drop_next(self, count: int = 1) -> None:
        """Lose the next ``count`` frames, signals or acks sent by either end."""
        with self._lock:
            self._drop_next += count

    def cut_after(self, items: int) -> None:
        """Cut the link right after the ``items``-th frame or signal from now is sent (it is lost too)."""
        with self._lock:
            self._cut_at = self.sequenced + items

    def cut(self, reason: str = "link cut (test)") -> None:
        """Drop everything in flight; both ends get LinkNotice(up=False)."""
        with self._lock:
            self._cut_locked(reason)

    def _cut_locked(self, reason: str) -> None:
        self.up = False
        for side in (0, 1):
            for _, message in self._held[side]:  # a session's end purges every route's buffers
                if message.WhichOneof("body") != "close":
                    self.dropped += 1
                    self._discard_locked(1 - side, message)
            self._held[side] = [(e, m) for e, m in self._held[side] if m.WhichOneof("body") == "close"]
            end = self._attached[side]
            if end is None:
                continue
            kept: list[object] = []
            while True:
                try:
                    item = end.inbox.get_nowait()
                except queue.Empty:
                    break
                kind = item.WhichOneof("body") if isinstance(item, relay_pb2.EdgeMessage) else None
                if kind in ("frame", "signal", "ack"):
                    assert isinstance(item, relay_pb2.EdgeMessage)
                    self.dropped += 1
                    self._discard_locked(1 - side, item)
                    continue
                kept.append(item)
            for item in kept:
                end.inbox.put(item)
            end.inbox.put(relay_pb2.EdgeMessage(notice=relay_pb2.LinkNotice(up=False, reason=reason)))

    def restore(self) -> None:
        """Bring the link back; attached ends get LinkNotice(up=True) and resume."""
        with self._lock:
            self.up = True
            for end in self._attached:
                if end is not None:
                    end.inbox.put(relay_pb2.EdgeMessage(notice=relay_pb2.LinkNotice(up=True)))


__all__ = ["MemoryLink", "MemoryTransport"]
