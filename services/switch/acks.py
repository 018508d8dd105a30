"""When a paced session's reader acknowledges what it read: every second data message on a connection (at
once for a large one), or soon after the first one left unacknowledged.

A paced sender (``pacing.py``) needs the peer's count of bytes read to free room under its cap and to
measure the path's rate. On a paced link each fragment arrives alone (the sender spreads them a few
milliseconds apart), so acknowledging each read sent one acknowledgement per fragment, and each costs
the two switches about what a fragment costs them. Acknowledging every second message, with a timer
for an odd one, is TCP's delayed acknowledgement (RFC 1122 section 4.2.3.2, RFC 5681 section 4.2) and
QUIC's default (RFC 9000 section 13.2.2, ``max_ack_delay``): half the acknowledgements, and the
sender's model of the path (``simulate`` in ``tests/unit/test_switch_pacing.py``) still fills the link
from 20 to 800 Mbit/s. Every third message would leave fast links short of acknowledgements.

A message of ``ACK_AT_ONCE_BYTES`` or more is acknowledged at once: on a fast link (loopback, a data
centre) items leave whole, a few per millisecond at most, and an acknowledgement held for the next one
reads to the pacer as a queue (it cut the cap, and the relay moved 10% less on loopback).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from typing import Protocol

ACK_EVERY = 2
"""Data messages read on one connection that make its acknowledgement due at once."""

ACK_AT_ONCE_BYTES = 32 << 10
"""A data message this large is acknowledged at once (two 2 ms fragments at 60 Mbit/s are 16 KiB each)."""

ACK_DELAY_S = 0.002
"""The longest a read data message waits for its acknowledgement (a few fragments' time at tens of
Mbit/s; far under any WAN round trip, so the sender's minimum RTT is the path's)."""


class Timer(Protocol):
    def cancel(self) -> None: ...


CallLater = Callable[[float, Callable[[], None]], Timer]
"""``loop.call_later``'s shape (the pacer's simulation passes one on its own clock)."""


class AckSchedule:
    """Counts data messages read per connection and says when acknowledgements are due.

    ``due(lanes)`` is called when acknowledgements are owed on ``lanes`` (connections that read data
    since their last one); the caller queues them. ``sent(lane)`` records one written on ``lane``
    (``None``: one that covers every connection, a session without per-connection counts)."""

    def __init__(
        self,
        due: Callable[[Iterable[int]], None],
        call_later: CallLater | None = None,
        every: int = ACK_EVERY,
        delay_s: float = ACK_DELAY_S,
        at_once_bytes: int = ACK_AT_ONCE_BYTES,
    ) -> None:
        if every < 1 or delay_s < 0:
            raise ValueError(f"acknowledge every >= 1 message within >= 0 s, got {every} and {delay_s}")
        self._due = due
        self._call_later = call_later
        self.every = every
        self.delay_s = delay_s
        self.at_once_bytes = at_once_bytes
        self._unacked: dict[int, int] = {}  # connection -> data messages read since its acknowledgement
        self._timer: Timer | None = None

    def read(self, lane: int, size: int = 0) -> None:
        """One data message of ``size`` bytes was read on ``lane``."""
        count = self._unacked.get(lane, 0) + 1
        if count >= self.every or size >= self.at_once_bytes:
            self._unacked.pop(lane, None)
            if not self._unacked:
                self._cancel()
            self._due((lane,))
            return
        self._unacked[lane] = count
        if self._timer is None:
            call_later = self._call_later or asyncio.get_running_loop().call_later
            self._timer = call_later(self.delay_s, self._expire)

    def sent(self, lane: int | None) -> None:
        """An acknowledgement was written on ``lane`` (``None``: for all): it covers what was read there."""
        if lane is None:
            self._unacked.clear()
        else:
            self._unacked.pop(lane, None)
        if not self._unacked:
            self._cancel()

    def reset(self) -> None:
        """A new session: nothing is owed, and no timer of the old one may fire into it."""
        self._unacked.clear()
        self._cancel()

    @property
    def pending(self) -> int:
        """Data messages read and not yet acknowledged (for tests and metrics)."""
        return sum(self._unacked.values())

    def _expire(self) -> None:
        self._timer = None
        lanes = list(self._unacked)
        self._unacked.clear()
        if lanes:
            self._due(lanes)

    def _cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
