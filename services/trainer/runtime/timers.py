"""Where one step's time goes, per operation, across the stage thread and its transfer threads.

Why: with sends, receives and decoding moved off the stage thread, a step's wall time
no longer equals the sum of its parts. To see whether the overlap works (and what the
roofline benchmark divides by) each thread adds the seconds it spent per operation to
one ``StepTimer``; the stage takes a snapshot at each step boundary.

Operations (``OPS``):

* ``compute``: the stage thread's own work (forward, backward, optimizer, data);
* ``wait``: the stage thread blocked on the other cluster (a received item not yet
  there, or the send queue full);
* ``send``: the sender thread inside the edge's send (encoding plus handing the bytes
  to the edge session; the edge encodes inside its enqueue, so encoding is part of it);
* ``decode``: the receive thread decoding an arrived item into a tensor;
* ``receive_wait``: the receive thread waiting for the next item to arrive from the wire
  (overlaps the stage thread's compute when the receive runs ahead).

Background seconds count in the step during which they were spent (a receive thread
decoding step k+1's first activation during step k counts in step k).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

OPS = ("compute", "wait", "send", "decode", "receive_wait")


class StepTimer:
    """Thread-safe seconds per operation since the last ``take()``."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._seconds = dict.fromkeys(OPS, 0.0)
        self._totals = dict.fromkeys(OPS, 0.0)

    def add(self, op: str, seconds: float) -> None:
        if op not in self._seconds:
            raise ValueError(f"unknown step timer operation {op!r}; expected one of {', '.join(OPS)}")
        with self._lock:
            self._seconds[op] += seconds
            self._totals[op] += seconds

    @contextmanager
    def timing(self, op: str) -> Iterator[None]:
        """Add the seconds the ``with`` body takes to ``op``."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.add(op, time.perf_counter() - started)

    def take(self) -> dict[str, float]:
        """The seconds per operation since the previous ``take()``, and start counting afresh."""
        with self._lock:
            snapshot = dict(self._seconds)
            self._seconds = dict.fromkeys(OPS, 0.0)
        return snapshot

    def totals(self) -> dict[str, float]:
        """Seconds per operation since the timer was made (all steps)."""
        with self._lock:
            return dict(self._totals)


__all__ = ["OPS", "StepTimer"]
