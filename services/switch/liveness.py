"""Liveness of the link from its measured round-trip time (RFC 6298), and the path's lowest RTT.

Each side sends a Ping, at most one outstanding,
at the keepalive interval; the peer answers with a Pong ahead of any queued item. Each Pong is an RTT
sample R: the first sets SRTT = R, RTTVAR = R/2; later ones RTTVAR = 3/4 RTTVAR + 1/4 |SRTT - R|,
SRTT = 7/8 SRTT + 1/8 R. Then RTO = SRTT + max(10 ms, 4 RTTVAR) (1 s before the first sample), and

    keepalive interval = clamp(4 RTO, 1 s, 10 s)
    dead-peer timeout  = clamp(3 x interval + 4 RTO, 10 s, 60 s)

The peer is dead when nothing at all (item, Ping or Pong) has arrived for the dead-peer timeout; the
session then ends and the routes get a LinkNotice (``Router.link_down``). The 10 s floor keeps a busy
2-core host's scheduling stalls from cutting a healthy link; the RTT lowers nothing below it but raises
it on slow or jittery paths (a 2 s RTT path waits 10 x 3 + 4 x RTO).

The lowest RTT sample of the last ``MIN_RTT_WINDOW_S`` (``RttEstimator.min_rtt``, as TCP keeps one
for its min-RTT filters) is the path's propagation delay without the queueing a busy link adds: what
``codec: auto`` predicts a step with. The smoothed RTT after a busy job still carries that job's
queueing for many keepalive intervals (it moves an eighth of the way per sample, one sample a second
or slower).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

MIN_RTT_WINDOW_S = 300.0
"""The lowest RTT is kept over this window (Linux TCP's min-RTT filter keeps 5 minutes)."""


def _clamp(value: float, low: float, high: float) -> float:
    return max(low, min(high, value))


@dataclass
class RttEstimator:
    """Smoothed round-trip time and its variation, as RFC 6298 section 2 computes them."""

    srtt: float | None = None
    rttvar: float = 0.0
    granularity: float = 0.010
    _window: deque[tuple[float, float]] = field(default_factory=deque)
    """(time, rtt) with rising RTTs: the front is the lowest sample of the window."""

    def sample(self, rtt: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        while self._window and self._window[-1][1] >= rtt:
            self._window.pop()  # a later sample at most as long makes it useless as a minimum
        self._window.append((now, rtt))
        while self._window[0][0] < now - MIN_RTT_WINDOW_S:
            self._window.popleft()
        if self.srtt is None:
            self.srtt, self.rttvar = rtt, rtt / 2
        else:
            self.rttvar = 0.75 * self.rttvar + 0.25 * abs(self.srtt - rtt)
            self.srtt = 0.875 * self.srtt + 0.125 * rtt

    @property
    def min_rtt(self) -> float | None:
        """The lowest sample of the last ``MIN_RTT_WINDOW_S`` (None before the first)."""
        return self._window[0][1] if self._window else None

    def rto(self) -> float:
        if self.srtt is None:
            return 1.0
        return self.srtt + max(self.granularity, 4 * self.rttvar)


@dataclass(frozen=True)
class LivenessPolicy:
    """Clamps around the RTT-derived keepalive interval and dead-peer timeout (see the module doc)."""

    interval_min_s: float = 1.0
    interval_max_s: float = 10.0
    dead_min_s: float = 10.0
    dead_max_s: float = 60.0

    def interval(self, rtt: RttEstimator) -> float:
        return _clamp(4 * rtt.rto(), self.interval_min_s, self.interval_max_s)

    def dead_after(self, rtt: RttEstimator) -> float:
        return _clamp(3 * self.interval(rtt) + 4 * rtt.rto(), self.dead_min_s, self.dead_max_s)
