"""Per-account rate of items a switch reads from its local trainers (a token bucket per account).

Why: the route bounds cap what a switch *holds*, not what it *reads*. A flooder sending tiny
frames flat out made the switch read, buffer and drop hundreds of thousands of items a second,
costing its one event loop (and so every other job on it) most of a core. With a bucket per
account, an account over its rate simply is not read for a while: its streams stall in gRPC's
flow control, which pushes back on the flooder's own process, while every other account's
streams are read as before. Nothing is closed and no other account is slowed.

The bucket holds ``burst`` items and refills at ``rate`` items a second. It may go into debt:
each read takes one item and, once the debt is worth ``PAUSE_S`` of the rate, the reader sleeps
until it is repaid, so an account's streams together get ``rate`` items a second in the long run,
whichever of them reads. (Pausing per item instead cost the switch a timer per item of a flooder.)
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from services.switch.metrics import ITEMS_READ, THROTTLED_SECONDS

PAUSE_S = 0.02
"""Debt (in seconds of the account's rate) an account may run up before its reader pauses."""
SWEEP_ABOVE = 1024
"""Buckets kept before idle (full) ones are forgotten."""


@dataclass
class TokenBucket:
    """``rate`` items a second, up to ``burst`` at once; ``take`` says how long to wait after a read."""

    rate: float
    burst: float
    tokens: float = field(init=False)
    stamp: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.tokens = self.burst

    def take(self, now: float | None = None) -> float:
        """Take one item; return the seconds the reader must wait before reading again (0: none).

        A debt below ``PAUSE_S`` worth of items is let run; beyond it the whole debt is waited off.
        """
        now = time.monotonic() if now is None else now
        self.tokens = min(self.burst, self.tokens + (now - self.stamp) * self.rate)
        self.stamp = now
        self.tokens -= 1
        debt_s = -self.tokens / self.rate
        return debt_s if debt_s >= PAUSE_S else 0.0


class AccountThrottle:
    """One token bucket per account (created on first use); ``pace`` is awaited after each item read.

    Buckets of accounts that have been full for a while are forgotten (``sweep``), so the map
    grows with the accounts active at once, not with every account ever seen.
    """

    def __init__(self, rate: float, burst: float) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"item rate must be > 0 and burst >= 1, got rate {rate} and burst {burst}")
        self.rate, self.burst = rate, burst
        self._buckets: dict[str, TokenBucket] = {}

    async def pace(self, account: str) -> None:
        """Account for one item read for ``account``; sleep while the account is over its rate."""
        ITEMS_READ.labels(account).inc()
        bucket = self._buckets.get(account)
        if bucket is None:
            if len(self._buckets) >= SWEEP_ABOVE:
                self.sweep()
            bucket = self._buckets[account] = TokenBucket(self.rate, self.burst)
        wait = bucket.take()
        if wait > 0:
            THROTTLED_SECONDS.labels(account).inc(wait)
            await asyncio.sleep(wait)

    def sweep(self, now: float | None = None) -> None:
        """Forget buckets that are full again (idle accounts): a new one would start full too."""
        now = time.monotonic() if now is None else now
        idle = [a for a, b in self._buckets.items() if b.tokens + (now - b.stamp) * b.rate >= b.burst]
        for account in idle:
            del self._buckets[account]

    def __len__(self) -> int:
        return len(self._buckets)
