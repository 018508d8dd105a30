"""Pacing the WAN link: little unsent data below the scheduler, items cut to a few ms of link time.

The router's scheduler (deficit round robin by bytes, ``route_scheduler.py``) can only be fair with what it
still holds. Every byte a switch has written but the peer has not read yet waits, in order, in gRPC's
buffers, the sockets and whatever queue the path has (a router's, or the WAN emulator's), and a small
job's message written after it waits behind all of it. Measured without pacing: beside a job sending
4 MiB per micro-batch at 60 Mbit/s, a small job's step took 10x as long.

So each side of a paced session (both announced ``Handshake.paced``) acknowledges the data bytes it
reads (``LinkReceived``), and the sender keeps what is written but unacknowledged (``inflight``)
under a cap that leaves about two fragments queued on the path:

* **Start-up** as BBR's (Cardwell et al., "BBR: Congestion-Based Congestion Control", ACM Queue 14(5),
  2016): cap = 2 x rate x min_rtt, the rate being the highest delivery-rate sample (bytes acknowledged
  since a write was sent, over the longer of its send and acknowledgement intervals), until three
  round trips in a row fail to raise it by a quarter (round trips, not samples: acknowledgements come
  several a round trip, and three of them pass before any write sent at the larger cap is acknowledged).
* **Start-up again when connections are added** (:meth:`LinkPacer.set_flows`), never below the cap it
  had: the lane tuner adds connections because more may carry more, and judges them on what they
  carried two seconds later. The controller alone grows one unit a round trip, and on a lossy long path
  it reads each connection's loss recovery as a queue and holds the cap where fewer connections left
  it: a doubling that scales the path then measures no gain, and 100 Mbit/s with 80 ms and 0.1% loss
  stays at 0.06 of the link (``docs/bench/wan-link.md``).
* **Then a standing-queue controller** as TCP Vegas's (Brakmo and Peterson, IEEE JSAC 13(8), 1995):
  once per round trip, the bytes the cap keeps queued are ``cap x (1 - min_rtt / rtt)``, where ``rtt``
  is the round's lowest sample and ``min_rtt`` the lowest of the last ``MIN_RTT_WINDOW_S``; fewer
  than one fragment grows the cap by one, more than two shrinks it by the excess. As Vegas's, the
  target is per flow: a session striped over ``flows`` connections (``lanes.py``) keeps one to two
  fragments per connection, because on a lossy long path each loss-limited connection holds its few
  fragments in its own send queue, and a target of two for all of them starves most. Rate estimates
  from acknowledgement timing are thrown off by every burst on the path (a shaper's bucket, a late
  reader catching up), and a cap set from them keeps that error queued; the round trip itself says
  how much is queued. It only grows while the cap, not the senders, limited the round. Over a
  bottleneck shared with loss-based TCP flows the link yields to the queue they build (it keeps at
  least ``MIN_INFLIGHT_BYTES`` in flight).
* **A share per connection.** On a session striped over several connections (``lanes.py``) each side
  also acknowledges, on each connection, what it read there (``LinkReceived.lane_bytes``), and a
  connection takes items only while it holds less than its share of the cap and a fragment
  (:meth:`LinkPacer.lane_has_room`). A loss halves one connection's window and holds its bytes a round
  trip; a writer that kept handing that connection items would park most of the cap in its socket,
  the others idle; the controller would read that backlog as a queue and cut the cap, and on a lossy
  long path more connections would carry no more (``docs/bench/wan-link.md``).
* **Application-limited samples** as BBR's: a delivery-rate sample of bytes written after the writer found
  nothing to send measures the sender, not the path, so it may raise the estimate but never lowers it
  or ends start-up (a link's first traffic is a job's small control messages, then its tensors).

Items that take more than ``CUT_ABOVE_S`` of link time at the estimated rate are cut into
``LinkFragment``s of ``FRAGMENT_TIME_S`` (16 KiB to 4 MiB), so a small item waits behind at most one
fragment per busy route, not behind a whole 2 MiB chunk; on a fast link nothing is cut or copied. The
receiver joins fragments (:class:`Reassembler`), bounded in streams and bytes, and treats anything out
of order as a broken protocol (the session ends; the trainers replay). Nothing here adds latency to an
idle link: with room under the cap an item is written at once.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from nebula_common.proto.nebula.v1 import link_pb2

MIN_INFLIGHT_BYTES = 128 << 10
MAX_INFLIGHT_BYTES = 256 << 20
INITIAL_INFLIGHT_BYTES = 1 << 20
"""Cap before the first delivery-rate sample (one MiB: a fast link's start is not held back long)."""
FRAGMENT_TIME_S = 0.002
CUT_ABOVE_S = 0.050
"""Items that take longer than this on the link are cut; shorter ones leave whole (a fast link then
copies nothing: a 2 MiB chunk is 7 ms at 300 MB/s)."""
MIN_FRAGMENT_BYTES = 16 << 10
MAX_FRAGMENT_BYTES = 4 << 20
INITIAL_FRAGMENT_BYTES = 64 << 10
RATE_WINDOW_S = 2.0
"""Rate samples older than this are forgotten (unless no newer one exists): a path that slows is followed."""
MIN_RTT_WINDOW_S = 10.0
MIN_RATE_INTERVAL_S = 0.005
STARTUP_GAIN = 2.0
STARTUP_GROWTH = 1.25
STARTUP_ROUNDS = 3
"""Start-up ends after this many rate samples in a row that did not raise the estimate by STARTUP_GROWTH."""
QUEUE_LOW_FRAGMENTS, QUEUE_HIGH_FRAGMENTS = 1.0, 2.0
"""The standing queue the controller keeps on the path, in fragments."""

MAX_STREAMS = 4096
MAX_ITEM_BYTES = 65 << 20
"""Largest item a fragment stream may build (a gRPC message's 64 MiB limit, with room for headers)."""
MAX_PARTIAL_BYTES = 256 << 20
"""Bytes of unfinished items a receiver holds at once, over every stream."""


class PacingError(Exception):
    """The peer broke the paced protocol (an acknowledgement or a fragment that cannot be right)."""


@dataclass(frozen=True)
class _Write:
    """One write of data: where it ended in the session's bytes, when, and the delivery state then."""

    end: int
    sent_at: float
    delivered: int
    delivered_time: float
    first_sent: float
    app_limited: bool
    """Sent while the writer had room and nothing to send: its sample measures the sender, not the path."""


class LinkPacer:
    """The sending side of one paced session: how much may be written now, and how big a fragment is."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.sent = 0
        self.acked = 0
        self._writes: deque[_Write] = deque()
        # (when, bytes/s), falling: the window's maximum first (a sample under a newer one never is).
        self._rates: deque[tuple[float, float]] = deque()
        self.rate = 0.0
        self.min_rtt = 0.0
        self._rtts: deque[tuple[float, float]] = deque()  # (when, rtt), rising: the window's minimum first
        self._delivered_time = 0.0  # when the newest acknowledgement arrived
        self._first_sent = 0.0  # when the newest acknowledged write was sent
        self.startup = True
        self._flat_rounds = 0
        self._startup_best = 0.0
        self._startup_floor = 0  # a re-entered start-up never lowers the cap the controller had (set_flows)
        self._cap = INITIAL_INFLIGHT_BYTES
        # The controller's round: it ends when the write that was newest at its start is acknowledged.
        self._round_end = 0
        self._round_rtt = 0.0
        self._round_limited = False
        self._round_piece = 0  # the largest write of the round: the controller's unit on a fast link
        self._unit = 0
        # Application-limited writes (BBR's "app-limited" samples): from the writer finding nothing to send
        # until the bytes then written are acknowledged. Their rate samples may raise the estimate, never
        # lower it or end start-up; and until one sample was not application-limited (``_measured``) the
        # sizes below stay at least their initial ones. A link that carried only a job's small control
        # messages first otherwise ended start-up at a few kB/s, then cut the first bulk tensors into
        # 16 KiB fragments under a 128 KiB cap (on loopback a first GB cost twice the CPU of the next).
        self._app_limited = True  # as Linux TCP's: a session's first writes are, until one is acknowledged
        self._app_limited_end = 0
        self._measured = False
        # Acknowledged writes, oldest first, back to the newest that began a full sample (_delivery_sample).
        self._acked_writes: deque[_Write] = deque(maxlen=4096)
        #: Connections the session stripes over. Vegas keeps its queue per flow: each loss-limited
        #: connection holds a few fragments in its own send queue, so the target scales with them.
        self.flows = 1

    def set_flows(self, flows: int) -> None:
        """The session now stripes over ``flows`` connections; more re-enter start-up (module doc)."""
        if flows > self.flows and not self.startup and self._measured:
            self.startup = True
            self._startup_best = self.rate
            self._flat_rounds = 0
            self._startup_floor = self._cap
        self.flows = flows

    @property
    def inflight(self) -> int:
        return self.sent - self.acked

    @property
    def fragment_bytes(self) -> int:
        size = int(min(MAX_FRAGMENT_BYTES, max(MIN_FRAGMENT_BYTES, self.rate * FRAGMENT_TIME_S)))
        return size if self._measured else max(size, INITIAL_FRAGMENT_BYTES)

    @property
    def cut_above(self) -> int:
        """Items larger than this leave in fragments of ``fragment_bytes``."""
        if not self.rate:
            return INITIAL_FRAGMENT_BYTES
        return max(self.fragment_bytes, int(self.rate * CUT_ABOVE_S))

    def cap(self) -> int:
        if self.startup and self.rate and self.min_rtt:
            cap = int(max(MIN_INFLIGHT_BYTES, self._startup_floor, STARTUP_GAIN * self.rate * self.min_rtt))
            return cap if self._measured else max(cap, INITIAL_INFLIGHT_BYTES)
        return self._cap

    def has_room(self) -> bool:
        if self.inflight < self.cap():
            return True
        self._round_limited = True
        return False

    def lane_has_room(self, unacked: int) -> bool:
        """Whether one connection of ``flows``, holding ``unacked`` bytes the peer has not acknowledged
        reading there, may take more: its share of the cap and a fragment (see the module doc). A
        connection held at its share counts as the cap limiting the round: every share grows with it."""
        if self.flows <= 1 or unacked < self.cap() / self.flows + self.fragment_bytes:
            return True
        self._round_limited = True
        return False

    def fills_pipe(self, window: int) -> bool:
        """Whether what is written and not yet read fills the path, within a fragment: the cap, or each
        connection's transport ``window`` (a writer blocked in a write holds at least that much unread).
        Items that wait while it does wait for the link; items that wait while it does not wait for this
        switch to write them (a CPU it shares, a flood of tiny items), which more connections cannot
        speed up (``lane_tuner.py``)."""
        return self.inflight + self.fragment_bytes >= min(self.cap(), self.flows * window)

    def may_pass(self) -> bool:
        """Whether a sparse source's small message may still be written over a full cap: the overshoot of
        all of them together stays under one fragment (``LinkScheduler.sparse_next``)."""
        return self.inflight < self.cap() + self.fragment_bytes

    def on_idle(self) -> None:
        """The writer had room under the cap and nothing to send: what it writes until those bytes are
        acknowledged is application-limited."""
        self._app_limited = True
        self._app_limited_end = self.sent

    def on_sent(self, size: int) -> None:
        now = self._clock()
        if self.inflight == 0:
            # The link was idle: the next sample's interval starts now, not at the last acknowledgement.
            self._first_sent = self._delivered_time = now
        self.sent += size
        self._round_piece = max(self._round_piece, size)
        self._writes.append(
            _Write(self.sent, now, self.acked, self._delivered_time, self._first_sent, self._app_limited)
        )

    def on_ack(self, received: int) -> None:
        """The peer has read ``received`` bytes of this session's data messages (acknowledgements may
        arrive out of order on a session with several lanes: an older one is ignored)."""
        if received > self.sent:
            raise PacingError(f"the peer acknowledged {received} bytes, but only {self.sent} were sent")
        if received <= self.acked:
            return  # an older acknowledgement that crossed on another lane after a newer one
        now = self._clock()
        self.acked = received
        if self._app_limited and received > self._app_limited_end:
            self._app_limited = False  # what was written before the sender ran dry has arrived
        newest = None
        while self._writes and self._writes[0].end <= received:
            newest = self._writes.popleft()
            self._acked_writes.append(newest)
        if newest is None:
            return
        rtt = now - newest.sent_at
        self._rtt_sample(rtt, now)
        self._round_rtt = min(self._round_rtt, rtt) if self._round_rtt else rtt
        self._delivery_sample(newest, received, now)
        self._first_sent = newest.sent_at
        self._delivered_time = now
        if received >= self._round_end:
            self._end_round()

    def _end_round(self) -> None:
        """Once per round trip: in start-up, whether the rate still grows; after it, Vegas's step (keep
        one to two fragments queued)."""
        if self.startup and self._measured and not self._app_limited:
            if self.rate >= self._startup_best * STARTUP_GROWTH:
                self._startup_best = self.rate
                self._flat_rounds = 0
            else:
                self._flat_rounds += 1
                if self._flat_rounds >= STARTUP_ROUNDS:
                    # The controller starts from one bandwidth-delay product and finds the rest.
                    self.startup = False
                    self._cap = int(max(MIN_INFLIGHT_BYTES, self._startup_floor, self.rate * self.min_rtt))
                    self._startup_floor = 0
        elif not self.startup and self._round_rtt and self.min_rtt:
            queued = self._cap * (1.0 - self.min_rtt / self._round_rtt)
            # The unit is a fragment, or the largest item written whole (a fast link cuts nothing, and
            # a cap that cannot hold two of its items stalls between them).
            unit = max(self.fragment_bytes, self._unit) * self.flows
            if queued > QUEUE_HIGH_FRAGMENTS * unit:
                self._cap -= int((queued - QUEUE_HIGH_FRAGMENTS * unit) / 2)
            elif queued < QUEUE_LOW_FRAGMENTS * unit and self._round_limited:
                self._cap += unit
            self._cap = min(MAX_INFLIGHT_BYTES, max(MIN_INFLIGHT_BYTES, self._cap))
        self._round_end = self.sent
        self._round_rtt = 0.0
        self._round_limited = False
        self._unit, self._round_piece = self._round_piece, 0

    def _delivery_sample(self, newest: _Write, received: int, now: float) -> None:
        """A delivery-rate sample over at least ``MIN_RATE_INTERVAL_S`` (and the round trip) up to ``now``.

        It starts at the delivery state of the newest acknowledged write old enough for that span, not
        only at ``newest``'s: where acknowledgements come faster than the span (a fast link), samples
        from ``newest`` alone would be taken only after a stall, and the estimate would sit at the
        stalls' rate (on loopback about a tenth of what the link carried).
        """
        span = max(self.min_rtt, MIN_RATE_INTERVAL_S)
        acked = self._acked_writes
        app_limited = False
        for index in range(len(acked) - 1, -1, -1):
            start = acked[index]
            app_limited = app_limited or start.app_limited
            interval = max(newest.sent_at - start.first_sent, now - start.delivered_time)
            if interval >= span:
                for _ in range(index):  # later samples span longer from these: never needed again
                    acked.popleft()
                self._rate_sample((received - start.delivered) / interval, now, app_limited)
                return

    def _rtt_sample(self, rtt: float, now: float) -> None:
        """The lowest sample of the last ``MIN_RTT_WINDOW_S`` (a monotonic queue of the candidates)."""
        rtt = max(rtt, 1e-6)
        candidates = self._rtts
        while candidates and candidates[-1][1] >= rtt:
            candidates.pop()
        candidates.append((now, rtt))
        while now - candidates[0][0] > MIN_RTT_WINDOW_S:
            candidates.popleft()
        self.min_rtt = candidates[0][1]

    def _rate_sample(self, rate: float, now: float, app_limited: bool = False) -> None:
        if app_limited and rate <= self.rate:
            return  # a sender that ran dry measured itself: the path may carry more
        rates = self._rates  # a monotonic queue: one sample per acknowledgement, O(1) each
        while rates and rates[-1][1] <= rate:
            rates.pop()
        rates.append((now, rate))
        while len(rates) > 1 and now - rates[0][0] > RATE_WINDOW_S:
            rates.popleft()
        self.rate = rates[0][1]
        if app_limited:
            return  # it raised the estimate; only a sender with more to send may end start-up
        self._measured = True


@dataclass
class Fragment:
    """One piece of an outbound item (``whole``, on the first piece only: the item as it would have
    been written at once, for the link's counters)."""

    stream: int
    offset: int
    data: memoryview
    last: bool
    whole: object

    def encode(self) -> bytes:
        return link_pb2.LinkMessage(
            fragment=link_pb2.LinkFragment(
                stream=self.stream, offset=self.offset, data=bytes(self.data), last=self.last
            )
        ).SerializeToString()


class Reassembler:
    """Joins the fragments of each stream, in order, within ``MAX_STREAMS`` and ``MAX_PARTIAL_BYTES``."""

    def __init__(self) -> None:
        self._partial: dict[int, list[bytes]] = {}
        self._sizes: dict[int, int] = {}
        self.held = 0

    def add(self, fragment: link_pb2.LinkFragment) -> bytes | None:
        """The whole item once its last fragment arrived, else None; ``PacingError`` if out of order."""
        stream, data = fragment.stream, fragment.data
        if fragment.offset == 0:
            self._drop(stream)  # the sender gave up on an unfinished item (e.g. a replay replaced it)
            if fragment.last:
                return data
            if len(self._partial) >= MAX_STREAMS:
                raise PacingError(f"the peer opened more than {MAX_STREAMS} fragment streams at once")
            self._partial[stream] = []
            self._sizes[stream] = 0
        elif self._sizes.get(stream) != fragment.offset:
            raise PacingError(
                f"fragment of stream {stream} at offset {fragment.offset}, expected "
                f"{self._sizes.get(stream, 'a first fragment (offset 0)')}"
            )
        size = self._sizes[stream] + len(data)
        if size > MAX_ITEM_BYTES:
            raise PacingError(f"fragment stream {stream} grew past {MAX_ITEM_BYTES} bytes")
        if self.held + len(data) > MAX_PARTIAL_BYTES:
            raise PacingError(f"the peer's unfinished fragments exceed {MAX_PARTIAL_BYTES} bytes")
        self._partial[stream].append(data)
        self._sizes[stream] = size
        self.held += len(data)
        if not fragment.last:
            return None
        whole = b"".join(self._partial[stream])
        self._drop(stream)
        return whole

    def _drop(self, stream: int) -> None:
        parts = self._partial.pop(stream, None)
        if parts is not None:
            self.held -= self._sizes.pop(stream)
