"""An in-memory edge transport: two connected ends in one process, with fault controls.

It stands in for "trainer -> switch -> WAN -> switch -> trainer" so the pipeline loop
and the delivery contract can be tested fast and deterministically:

* ``cut()`` drops everything in flight and everything sent until ``restore()``; both
  ends get ``LinkNotice(up=False)``, then ``LinkNotice(up=True)`` on restore;
* ``drop_next(n)`` loses the next ``n`` sequenced items or acks in flight, and
  ``drop_probability`` loses each at random (seeded);
* ``bytes_in_flight`` per direction counts what was sent and not yet delivered, so tests
  can check that credit is never exceeded.

Each end delivers on its own thread, in order, like a stream.
"""

from __future__ import annotations

import queue
import random
import threading
from collections.abc import Callable

from nebula_common.proto.nebula.v1 import relay_pb2
from services.trainer.edge.session import TransportHandler, wire_size

_STOP = object()


class MemoryTransport:
    """One end of a ``MemoryLink`` (index 0 or 1)."""

    def __init__(self, link: MemoryLink, index: int) -> None:
        self.link = link
        self.index = index
        self.inbox: queue.Queue[object] = queue.Queue()
        self._handler: TransportHandler | None = None
        self._thread: threading.Thread | None = None
        self._stopped = False
        self.closed_with: tuple[str, bool] | None = None

    @property
    def peer(self) -> MemoryTransport:
        return self.link.ends[1 - self.index]

    def start(self, handler: TransportHandler) -> None:
        self._handler = handler
        self._thread = threading.Thread(target=self._deliver, name=f"memory-edge-{self.index}", daemon=True)
        self._thread.start()
        ready = relay_pb2.EdgeReady(
            peer_cluster=f"memory-{1 - self.index}",
            max_window_bytes=self.link.max_window_bytes,
            link_up=self.link.up,
        )
        self.inbox.put(relay_pb2.EdgeMessage(ready=ready))

    def _deliver(self) -> None:
        while True:
            item = self.inbox.get()
            if item is _STOP:
                return
            assert isinstance(item, relay_pb2.EdgeMessage)
            self.link.delivered(self.index, item)
            handler = self._handler
            if handler is None:
                continue
            if item.WhichOneof("body") == "ready":
                handler.on_ready(item.ready)
            else:
                handler.on_message(item)
            if item.WhichOneof("body") == "close":
                return

    def send(self, message: relay_pb2.EdgeMessage) -> None:
        if not self._stopped:
            self.link.carry(self.index, message)

    def close(self, reason: str, error: bool) -> None:
        if self._stopped or self.closed_with is not None:
            return
        self.closed_with = (reason, error)
        self.link.carry(
            self.index, relay_pb2.EdgeMessage(close=relay_pb2.EdgeClose(reason=reason, error=error))
        )

    def wait_close_sent(self, timeout: float) -> None:
        """Nothing to wait for: ``close`` handed the message to the link synchronously."""

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.inbox.put(_STOP)


class MemoryLink:
    """A connected pair of in-memory edge ends (``ends[0]`` upstream, ``ends[1]`` downstream)."""

    def __init__(self, max_window_bytes: int = 4 << 20, drop_probability: float = 0.0, seed: int = 0) -> None:
        self.max_window_bytes = max_window_bytes
        self.drop_probability = drop_probability
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.up = True
        self._drop_next = 0
        self._cut_at: int | None = None
        self.sequenced = 0  # frames and signals carried
        self.dropped = 0
        self.carried = 0
        self.ends = (MemoryTransport(self, 0), MemoryTransport(self, 1))
        self.in_flight_bytes = [0, 0]  # per sending end: sequenced bytes sent and not yet delivered
        self.max_in_flight_bytes = [0, 0]
        self.observers: list[Callable[[int, relay_pb2.EdgeMessage], None]] = []

    def carry(self, sender: int, message: relay_pb2.EdgeMessage) -> None:
        kind = message.WhichOneof("body")
        with self._lock:
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
            if kind in ("frame", "signal"):
                self.in_flight_bytes[sender] += wire_size(message)
                self.max_in_flight_bytes[sender] = max(
                    self.max_in_flight_bytes[sender], self.in_flight_bytes[sender]
                )
            self.carried += 1
            for observer in self.observers:
                observer(sender, message)
            self.ends[1 - sender].inbox.put(message)
            if kind in ("frame", "signal"):
                self.sequenced += 1
                if self._cut_at is not None and self.sequenced >= self._cut_at:
                    self._cut_at = None
                    self._cut_locked("link cut (test)")

    def delivered(self, receiver: int, message: relay_pb2.EdgeMessage) -> None:
        if message.WhichOneof("body") in ("frame", "signal"):
            with self._lock:
                self.in_flight_bytes[1 - receiver] -= wire_size(message)

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
        for end in self.ends:
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
                    if kind != "ack":
                        self.in_flight_bytes[1 - end.index] -= wire_size(item)
                    continue
                kept.append(item)
            for item in kept:
                end.inbox.put(item)
            end.inbox.put(relay_pb2.EdgeMessage(notice=relay_pb2.LinkNotice(up=False, reason=reason)))

    def restore(self) -> None:
        """Bring the link back; both ends get LinkNotice(up=True) and resume."""
        with self._lock:
            self.up = True
            for end in self.ends:
                end.inbox.put(relay_pb2.EdgeMessage(notice=relay_pb2.LinkNotice(up=True)))


__all__ = ["MemoryLink", "MemoryTransport"]
