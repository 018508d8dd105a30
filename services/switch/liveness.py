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

:class:`Keepalive` runs this on one link (``PeerLink``): it pings while nothing is outstanding, takes
each Pong of its own as an RTT sample, and ends the session with :class:`DeadPeerError` when the peer
has gone silent. Pings and Pongs go out ahead of every item (the link's priority queue); the link's
bandwidth probes (``bandwidth.py``) are Pings too, but the link hands their Pongs to its meter.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from nebula_common.proto.nebula.v1 import link_pb2

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


class DeadPeerError(Exception):
    """Nothing arrived from the peer for the dead-peer timeout."""


class Keepalive:
    """One link's pings, RTT samples and dead-peer timeout (see the module doc).

    ``send`` queues a message ahead of every item; ``ping_queued`` says whether a Ping already waits
    there (a bandwidth probe's counts too: then this interval sends none).
    """

    def __init__(
        self,
        policy: LivenessPolicy,
        send: Callable[[link_pb2.LinkMessage], None],
        ping_queued: Callable[[], bool],
    ) -> None:
        self.policy = policy
        self.rtt = RttEstimator()
        self._send = send
        self._ping_queued = ping_queued
        self._nonce = 0
        self._outstanding: tuple[int, float] | None = None
        self.last_received = 0.0

    def session_started(self) -> None:
        """A new session: no Ping outstanding, and the peer was just heard (its handshake)."""
        self._outstanding = None
        self.last_received = time.monotonic()

    def heard(self) -> None:
        """Something (an item, a Ping, a Pong) arrived from the peer."""
        self.last_received = time.monotonic()

    def ping_sent(self, nonce: int) -> None:
        """One of our Pings was written: its Pong times the round trip."""
        self._outstanding = (nonce, time.monotonic())

    def on_pong(self, nonce: int) -> bool:
        """The peer answered Ping ``nonce``; True if it was the outstanding one (a new RTT sample)."""
        outstanding = self._outstanding
        if outstanding is None or outstanding[0] != nonce:
            return False
        self._outstanding = None
        self.rtt.sample(time.monotonic() - outstanding[1])
        return True

    async def run(self, tick: Callable[[float], None]) -> None:
        """Ping at the RTT-derived interval; end the session when the peer has gone silent.

        ``tick`` is called with the time on every wake-up, for what else the link sends periodically
        (its witnessed audit head).
        """
        next_ping = time.monotonic()
        while True:
            now = time.monotonic()
            dead_after = self.policy.dead_after(self.rtt)
            silent = now - self.last_received
            if silent > dead_after:
                raise DeadPeerError(
                    f"nothing received from the peer switch for {silent:.1f} s (dead-peer timeout "
                    f"{dead_after:.1f} s from SRTT {self.rtt.srtt or 0:.3f} s)"
                )
            if now >= next_ping:
                if self._outstanding is None and not self._ping_queued():
                    self._nonce += 1
                    self._send(link_pb2.LinkMessage(ping=link_pb2.Ping(nonce=self._nonce)))
                next_ping = now + self.policy.interval(self.rtt)
            tick(now)
            await asyncio.sleep(max(0.01, min(next_ping, self.last_received + dead_after) - now))
