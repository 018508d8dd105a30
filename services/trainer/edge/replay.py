"""When the sender resends: resume acks, a re-opened stream, and its own retransmit timeout.

After every ready and every link-up notice both ends send a resume ack, and a sender receiving one
resends every item after ``received``, in order. Beyond the contract's minimum: a receiver that sees
a gap (an item lost in flight without a link event) asks for a rewind with a resume ack, and a sender
whose unacknowledged items see no progress for its retransmit timeout (RTO) rewinds on its own, so a
lost last item or a lost ack cannot stall the edge. A rewind moves the send buffer's transmit pointer
(``send_window``) back to the first unacknowledged message.

The RTO derives from what the sender measures (``RetransmitTimer``): RFC 6298's SRTT and RTTVAR from
send -> ack of items never replayed (Karn), plus the time the bytes in flight need at the smoothed ack
throughput, so a large frame on a slow link is not rewound while it is still legitimately on the
wire. It is clamped to [``min_retransmit_s``, ``retransmit_s``] (the cap, also used before any
sample) and doubles on consecutive timeouts. After a timeout rewind, neither the timer nor a resume
ack rewinds again until the resent bytes had time to arrive at the measured throughput (unless the
link or the stream was re-established meanwhile): otherwise the receiver, restarting its assembly on
the replayed header, would see the original chunks as gaps and ask for a rewind of the rewind.

``EdgeReplay`` is one part of ``EdgeSession`` (``session``): its state is guarded by the session's
condition.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from services.trainer.edge.send_window import Outgoing
from services.trainer.edge.settings import EdgeSettings

log = logging.getLogger(__name__)


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


class EdgeReplay:
    """Rewinds of the send buffer and the retransmit timeout behind them (part of ``EdgeSession``)."""

    # Provided by the other parts of EdgeSession (annotations only: nothing here shadows them).
    name: str
    settings: EdgeSettings
    _clock: Callable[[], float]
    _cond: threading.Condition
    _link_up: bool
    _failed: str | None
    _pointer: int  # send_window
    _first_index: int  # send_window
    _pump_locked: Callable[[], None]  # send_window
    _in_flight_bytes_locked: Callable[[], int]  # send_window

    def _init_replay(self) -> None:
        self._last_progress = self._clock()
        self._timer_state = RetransmitTimer(self.settings.min_retransmit_s, self.settings.retransmit_s)
        self._backoff = 0  # consecutive retransmit timeouts without progress
        self._last_ack_at: float | None = None
        self._rewind_guard_until = float("-inf")  # after a timeout rewind: no further rewind before
        self.retransmitted_messages = 0

    def _rewind_locked(self) -> None:
        """Transmit again from the first unacknowledged message."""
        self.retransmitted_messages += self._pointer - self._first_index
        self._pointer = self._first_index

    def _start_timer_locked(self, now: float) -> None:
        """Nothing was in flight: the retransmit timer starts now, not at the last ack (which may be
        long ago after an idle spell)."""
        self._last_progress = max(self._last_progress, now)

    def _restart_timer_locked(self) -> None:
        """A fresh link: the timer starts over, and a resume ack must be honoured."""
        self._last_progress = self._clock()
        self._rewind_guard_until = float("-inf")

    def _rewind_for_new_stream_locked(self) -> None:
        """Our stream to the switch was re-opened: what we sent on the broken one may be lost, and the
        peer (whose link stayed up) gets no notice that would make it ask for a replay. Resend
        everything unacknowledged; the peer ignores what it already holds."""
        if self._pointer > self._first_index:
            self._rewind_locked()
            self._rewind_guard_until = float("-inf")

    def _after_ack_locked(self, resume: bool, progress: bool, now: float) -> None:
        """An ack's part in replay: a resume ack rewinds, and progress (or a rewind) restarts the timer."""
        rewind = resume
        if rewind and now < self._rewind_guard_until and not progress:
            # Right after our own timeout rewind: most likely the receiver restarted its assembly on
            # the replayed header and saw the original chunks as a gap. The replay is on its way; if
            # it is lost too, the timer rewinds again.
            rewind = False
        if rewind:
            self._rewind_locked()
        if progress or rewind:
            self._last_progress = now
            self._backoff = 0

    def _sample_locked(self, popped: list[Outgoing], now: float) -> None:
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
        self._rewind_locked()
        self._last_progress = now
        self._backoff += 1
        self._rewind_guard_until = now + timer.resend_seconds(in_flight)
        self._pump_locked()


__all__ = ["EdgeReplay", "RetransmitTimer"]
