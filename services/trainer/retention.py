"""How long a trainer remembers finished stages: a bounded time and a bounded count.

A finished stage's runner is kept so ``WatchStage`` can still show how it ended and its id stays
taken; without a bound a trainer that runs jobs for weeks keeps every one of them (each runner
holds its status history and its spec). The oldest finished stages are forgotten first, when
they are older than ``ttl_s`` or when more than ``max_count`` are kept.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass
class FinishedStages:
    """Finished job ids in the order they ended; ``add`` says which ones to forget now."""

    ttl_s: float = 3600.0
    max_count: int = 1000
    _ended: OrderedDict[str, float] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if self.ttl_s <= 0 or self.max_count < 1:
            raise ValueError(
                f"finished stages need ttl_s > 0 and max_count >= 1, got {self.ttl_s} and {self.max_count}"
            )

    def add(self, job_id: str, now: float | None = None) -> list[str]:
        """Note that ``job_id`` ended; return the job ids to forget (expired or beyond the count)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._ended[job_id] = now
            self._ended.move_to_end(job_id)
            return self._expire_locked(now)

    def expire(self, now: float | None = None) -> list[str]:
        """The job ids past their time (also called on admission, when no stage ends for a while)."""
        with self._lock:
            return self._expire_locked(time.monotonic() if now is None else now)

    def _expire_locked(self, now: float) -> list[str]:
        gone = []
        while self._ended:
            job_id, ended = next(iter(self._ended.items()))
            if len(self._ended) <= self.max_count and now - ended < self.ttl_s:
                break
            del self._ended[job_id]
            gone.append(job_id)
        return gone

    def __len__(self) -> int:
        with self._lock:
            return len(self._ended)
