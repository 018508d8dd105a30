"""A clock a test moves by hand, for code that takes ``clock=`` (edge sessions, switch penalties).

Thread-safe: an edge session's own timer thread reads it while the test advances it, so the timer can only
do what the test's explicit ``poll_timers`` would.
"""

from __future__ import annotations

import threading


class FakeClock:
    """Returns ``now`` when called; ``advance`` (or assigning ``now``) is the only way time passes."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds
