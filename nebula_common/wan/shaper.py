"""One shared, fair token bucket per direction: the aggregate of all connections gets the link's rate.

A WAN circuit between two clusters is one pipe. Shaping each TCP connection on its own would let N
connections carry N times the configured bandwidth, so any "more connections are faster" result
measured through the emulator would be an artefact. Here every connection of one direction feeds one
:class:`AggregateLink`:

- **One serialization clock.** A chunk of ``n`` payload bytes occupies the link for
  ``wire_bytes(n) * 8 / rate`` seconds (headers counted per segment, as the kernel counts them). It
  is a token bucket of depth ``burst_bytes`` (one full-size segment) charged from each chunk's
  *arrival* time: an idle link banks no more than one segment's time, and an event loop that wakes
  up late (a loaded machine) does not idle a link that had data queued -- it catches up, as the real
  link would have kept sending. Its bytes arrive as they are serialised, in pieces of whole segments of
  about ``PIECE_SECONDS`` of link time, not all at the chunk's end.
- **Fair turns.** Connections with queued data take turns of one chunk (16 KiB) each, round robin,
  like a fair-queueing router; a connection with nothing queued may always queue one chunk, so a
  bulk sender cannot starve a light one by filling the shared queue first.
- **A bounded queue.** The backlog waiting for the link is bounded (``QUEUE_BYTES``); readers wait
  *before* reading, so TCP flow control pushes back on the senders.
- **Loss, Reno-style (optional).** The proxy terminates TCP on both sides, so it cannot drop a byte
  (nothing would retransmit it). It models what a lost segment costs a Reno sender instead: the
  connection's window (slow start from 10 segments, +1 segment per window per RTT) halves once per
  loss event, the retransmission takes link time again, and the chunk holding the lost segment -- and,
  in order, everything behind it on that connection -- arrives one RTT late (fast retransmit).
  Timeouts (RTO) are not modelled. Which segments are lost depends only on each connection's byte
  offsets and the seed, not on how reads happened to be chunked, so a seeded run loses the same
  segments every time.
"""

from __future__ import annotations

import asyncio
import math
import random
from collections import deque
from collections.abc import Callable

from nebula_common.wan.shape import QUEUE_BYTES, LinkShape

CHUNK_BYTES = 16 * 1024
PIECE_SECONDS = 0.01
"""Link time of the pieces a chunk is delivered in: a slow link's bytes arrive as they are serialised
(a 16 KiB chunk is 0.9 s at 0.15 Mbit/s; delivered whole, four small messages read together would
arrive together), at no more than about 100 deliveries a second per direction."""
# Reno's initial window (RFC 6928: 10 segments).
_INITIAL_WINDOW_SEGMENTS = 10


class LinkGate:
    """Whether the emulated path is up; every direction of every connection waits on it."""

    def __init__(self) -> None:
        self._up = asyncio.Event()
        self._up.set()
        self.restored_at = 0.0

    @property
    def up(self) -> bool:
        return self._up.is_set()

    def cut(self) -> None:
        self._up.clear()

    def restore(self) -> None:
        if not self._up.is_set():
            self.restored_at = asyncio.get_running_loop().time()
            self._up.set()

    async def wait_up(self) -> None:
        if not self._up.is_set():
            await self._up.wait()


class SegmentLoss:
    """Which TCP segments of one connection's byte stream are lost: a seeded Bernoulli process.

    Segment ``i`` covers stream bytes ``[i * mss, (i + 1) * mss)``. Gaps between losses are drawn
    from the geometric distribution, so the cost is per loss, not per segment.
    """

    def __init__(self, probability: float, mss: int, seed: str) -> None:
        self._p = probability
        self._mss = mss
        self._rng = random.Random(seed)
        self._next_lost = self._gap() - 1 if probability > 0 else math.inf
        self._counted_through = -1  # highest segment index already judged

    def _gap(self) -> int:
        # Inverse-CDF draw of a geometric variable >= 1 (segments until and including the next loss).
        u = self._rng.random()
        return int(math.log1p(-u) / math.log1p(-self._p)) + 1

    def lost_in(self, start: int, end: int) -> int:
        """Lost segments among those ending in stream bytes ``[start, end)`` not judged before."""
        if end <= start or self._p <= 0:
            return 0
        last = (end - 1) // self._mss
        lost = 0
        while self._next_lost <= last:
            if self._next_lost > self._counted_through:
                lost += 1
            self._next_lost += self._gap()
        self._counted_through = max(self._counted_through, last)
        return lost


class Flow:
    """One direction of one connection inside an :class:`AggregateLink`.

    The proxy's reader calls :meth:`wait_room` before each read and :meth:`submit` after it; its
    writer takes ``(deliver_at, chunk)`` pairs from :attr:`deliveries` (``chunk`` None is EOF) and
    calls :meth:`written` once a chunk is handed to the destination socket.
    """

    def __init__(self, link: AggregateLink, index: int) -> None:
        self._link = link
        shape = link.shape
        self.deliveries: asyncio.Queue[tuple[float, bytes | None]] = asyncio.Queue()
        # (arrival time, chunk): the token bucket charges from arrival, not from when the pacer ran.
        self.pending: deque[tuple[float, bytes | None]] = deque()
        self.pending_bytes = 0
        self._held = 0  # submitted and not yet written to the destination
        self._held_limit = shape.queue_limit_bytes
        self._room = asyncio.Event()
        self._offset = 0  # stream bytes submitted so far
        self._loss = SegmentLoss(shape.loss, shape.mss, f"{shape.seed}:{link.name}:{index}")
        # Reno state, used only when the link is lossy (a loss-free proxy needs no window of its own:
        # TCP on either side already runs one).
        self.windowed = shape.loss > 0
        self._mss = shape.mss
        self.cwnd = float(_INITIAL_WINDOW_SEGMENTS * shape.mss)
        self._ssthresh = math.inf
        self._unacked = 0
        self._recovery_until = -math.inf

    def _may_read(self) -> bool:
        if self._held + CHUNK_BYTES > self._held_limit:
            return False
        if self.pending and (
            self._link.backlog + CHUNK_BYTES > QUEUE_BYTES
            or self.pending_bytes + CHUNK_BYTES > QUEUE_BYTES // self._link.active_flows
        ):
            # Each connection may queue its share of the queue (and always one chunk), so a pacer
            # catching up after a late wake-up serves every connection alike.
            return False
        # Like TCP, send while the window has room for a full segment (always, with nothing in flight).
        return not (self.windowed and self._unacked > 0 and self.cwnd - self._unacked < self._mss)

    def read_size(self) -> int:
        """How much the next read may take: a turn, or what the window allows in whole segments.

        Reading whole turns against a window of a few segments would waste up to a turn of it, so
        a lossy link would look slower than the Reno sender it models.
        """
        if not self.windowed:
            return CHUNK_BYTES
        segments = max(1, int((self.cwnd - self._unacked) // self._mss))
        return min(CHUNK_BYTES, segments * self._mss)

    async def wait_room(self) -> None:
        """Wait until this connection may read another chunk (queue, hold and window bounds)."""
        while not self._may_read():
            self._room.clear()
            self._link.waiting.add(self)
            try:
                await self._room.wait()
            finally:
                self._link.waiting.discard(self)

    def wake(self) -> None:
        self._room.set()

    def submit(self, chunk: bytes | None) -> None:
        """Queue a chunk read from the source (None: the source ended) for its turn on the link."""
        self.pending.append((asyncio.get_running_loop().time(), chunk))
        if chunk is not None:
            n = len(chunk)
            self.pending_bytes += n
            self._held += n
            self._unacked += n
        self._link.enqueue(self)

    def lost_segments(self, n: int) -> int:
        lost = self._loss.lost_in(self._offset, self._offset + n)
        self._offset += n
        return lost

    def on_loss(self, now: float, rtt: float) -> None:
        # One halving per loss event: further losses within the same RTT belong to the same event.
        if now >= self._recovery_until:
            self._ssthresh = max(self.cwnd / 2, 2.0 * self._mss)
            self.cwnd = self._ssthresh
            self._recovery_until = now + rtt

    def acked(self, n: int) -> None:
        self._unacked -= n
        if self.cwnd < self._ssthresh:
            self.cwnd += n  # slow start: the window doubles every RTT
        else:
            self.cwnd += self._mss * n / self.cwnd  # congestion avoidance: +1 segment per RTT
        self.wake()

    def written(self, n: int) -> None:
        self._held -= n
        self.wake()


class AggregateLink:
    """The shared bucket of one direction; :meth:`run` is its pacer task."""

    def __init__(self, shape: LinkShape, gate: LinkGate, name: str) -> None:
        self.shape = shape
        self.name = name
        self._gate = gate
        self._seconds_per_bit = 1.0 / shape.bits_per_second
        self._burst_s = shape.burst_bytes * 8 * self._seconds_per_bit
        self._delay_s = shape.delay_s
        # Whole segments of about PIECE_SECONDS of link time: what a chunk is delivered in (below
        # about 13 Mbit/s a 16 KiB chunk takes longer than that; faster, a chunk is one piece).
        segments = int(PIECE_SECONDS * shape.bits_per_second / 8 / shape.wire_bytes(shape.mss))
        self._piece_bytes = max(1, segments) * shape.mss
        self._clock = -math.inf  # when the link finishes what it has already been given
        self._turns: deque[Flow] = deque()  # flows with pending data, in turn order
        self._work = asyncio.Event()
        self._flows = 0
        self.backlog = 0
        self.waiting: set[Flow] = set()
        self.wire_bytes = 0
        self.losses = 0
        self.on_delivered: Callable[[int], None] | None = None

    @property
    def active_flows(self) -> int:
        """Connections with data queued for the link (at least 1, for share arithmetic)."""
        return max(1, len(self._turns))

    def flow(self) -> Flow:
        self._flows += 1
        return Flow(self, self._flows)

    def enqueue(self, flow: Flow) -> None:
        chunk = flow.pending[-1][1]
        if chunk is not None:
            self.backlog += len(chunk)
        if len(flow.pending) == 1:
            self._turns.append(flow)
        self._work.set()

    def drop(self, flow: Flow) -> None:
        """Forget a closed connection's queued chunks, so they take no link time from the others."""
        if flow in self._turns:
            self._turns.remove(flow)
        self.backlog -= flow.pending_bytes
        flow.pending.clear()
        flow.pending_bytes = 0
        for waiter in list(self.waiting):
            waiter.wake()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self._turns:
                self._work.clear()
                await self._work.wait()
                continue
            await self._gate.wait_up()
            if not self._turns:
                # Every queued connection was dropped while the link was cut (an outage resets
                # them): nothing is left to pace, so wait for new work instead of taking a turn.
                continue
            now = loop.time()
            # The next turn is chosen when the link frees, as a router's scheduler chooses the next
            # packet, so a connection that just became active waits for the chunk on the wire only.
            # A pacer that wakes late loses no link time: chunks that arrived while it slept start
            # on the virtual clock, when the link became free, not when the pacer woke.
            ahead = self._clock - now
            if ahead > 0:
                await asyncio.sleep(ahead)
                continue
            flow = self._turns.popleft()
            arrived, chunk = flow.pending.popleft()
            # A chunk held by a cut entered the link no earlier than the restore.
            arrived = max(arrived, self._gate.restored_at)
            if flow.pending:
                self._turns.append(flow)  # round robin: one chunk per turn
            # Token bucket of depth burst, charged from the chunk's arrival: a pacer that woke up late
            # does not idle a link that had data queued; it catches up, and deliveries already due
            # go out at once.
            start = max(self._clock, arrived - self._burst_s)
            if chunk is None:
                # EOF takes no link time; the connection's deliveries are in order, so it follows the data.
                flow.deliveries.put_nowait((arrived + self._delay_s, None))
                continue
            self._send(loop, flow, chunk, start, arrived, now)
            # Let readers refill between turns even while catching up, or a catch-up burst would
            # serve whichever connections happened to have the deepest queues.
            await asyncio.sleep(0)

    def _send(
        self,
        loop: asyncio.AbstractEventLoop,
        flow: Flow,
        chunk: bytes,
        start: float,
        arrived: float,
        now: float,
    ) -> None:
        n = len(chunk)
        flow.pending_bytes -= n
        self.backlog -= n
        for waiter in list(self.waiting):
            waiter.wake()
        wire = self.shape.wire_bytes(n)
        late = 0.0
        lost = flow.lost_segments(n)
        if lost:
            rtt = 2 * self._delay_s
            self.losses += lost
            # Retransmissions take link time again; fast retransmit repairs the hole one RTT later.
            wire += lost * self.shape.wire_bytes(self.shape.mss)
            late = rtt
            flow.on_loss(now, rtt)
        self.wire_bytes += wire
        self._clock = start + wire * 8 * self._seconds_per_bit
        # A link delivers a chunk's bytes as they come off the wire, not all at its end: each piece
        # leaves when its own segments have been serialised (tokens let it pass at once, never before
        # the chunk arrived); a lost segment's retransmission delays the last piece, and every piece
        # arrives ``late`` as fast retransmit holds the stream behind the hole.
        clock, piece = start, self._piece_bytes
        for offset in range(0, n - piece, piece):
            clock += self.shape.wire_bytes(piece) * 8 * self._seconds_per_bit
            part = chunk[offset : offset + piece]
            flow.deliveries.put_nowait((max(clock, arrived) + self._delay_s + late, part))
        tail = chunk[(n - 1) // piece * piece :] if n > piece else chunk
        deliver_at = max(self._clock, arrived) + self._delay_s + late
        flow.deliveries.put_nowait((deliver_at, tail))
        if flow.windowed:
            # The sender learns of delivery one propagation delay after it.
            loop.call_at(deliver_at + self._delay_s, flow.acked, n)
