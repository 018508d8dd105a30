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

Penalties (:class:`Penalties`): an account whose route was closed for a bound it exceeded as a sender
(this switch's ``credit``, or the peer switch's ``window``/``items``/``unattached_*`` named in its error
close) gets strikes: its new edges are refused for a backoff that doubles per strike (1 s ... 60 s,
forgotten after a quiet period), and the job whose route was closed reads at a fraction of the rate.
A flooder that re-opens after every close then costs the switch one refused call per attempt instead
of thousands of items read, buffered, relayed and dropped.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from prometheus_client import Counter

from services.switch.metrics import ITEMS_READ, OPENS_REFUSED, PENALTIES, THROTTLED_SECONDS

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
    read: Counter | None = None
    """The account's ``items_read`` series, looked up once (once per account, not per item)."""

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
    grows with the accounts active at once, not with every account ever seen. With ``penalties``, a
    penalized job also takes from a bucket of its own at ``rate x penalty rate_factor``.
    """

    def __init__(self, rate: float, burst: float, penalties: Penalties | None = None) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError(f"item rate must be > 0 and burst >= 1, got rate {rate} and burst {burst}")
        self.rate, self.burst = rate, burst
        self.penalties = penalties
        self._buckets: dict[str, TokenBucket] = {}
        self._job_buckets: dict[tuple[str, str], TokenBucket] = {}

    async def pace(self, account: str, job_id: str = "") -> None:
        """Account for one item read for ``account`` (its ``job_id``); sleep while over its rate."""
        bucket = self._buckets.get(account)
        if bucket is None:
            if len(self._buckets) >= SWEEP_ABOVE:
                self.sweep()
            bucket = self._buckets[account] = TokenBucket(
                self.rate, self.burst, read=ITEMS_READ.labels(account)
            )
        assert bucket.read is not None
        bucket.read.inc()
        wait = bucket.take()
        if self.penalties is not None and self.penalties.any_jobs():
            wait = max(wait, self._penalized_wait(account, job_id))
        if wait > 0:
            THROTTLED_SECONDS.labels(account).inc(wait)
            await asyncio.sleep(wait)

    def _penalized_wait(self, account: str, job_id: str) -> float:
        assert self.penalties is not None
        key = (account, job_id)
        if not self.penalties.job_penalized(account, job_id):
            self._job_buckets.pop(key, None)
            return 0.0
        bucket = self._job_buckets.get(key)
        if bucket is None:
            slow = self.rate * self.penalties.rules.rate_factor
            bucket = self._job_buckets[key] = TokenBucket(slow, max(1.0, slow * PAUSE_S * 2))
        return bucket.take()

    def sweep(self, now: float | None = None) -> None:
        """Forget buckets that are full again (idle accounts): a new one would start full too."""
        now = time.monotonic() if now is None else now
        idle = [a for a, b in self._buckets.items() if b.tokens + (now - b.stamp) * b.rate >= b.burst]
        for account in idle:
            del self._buckets[account]
        if self.penalties is not None:
            self.penalties.forget(now)
            for key in [k for k in self._job_buckets if not self.penalties.job_penalized(*k)]:
                del self._job_buckets[key]

    def __len__(self) -> int:
        return len(self._buckets)


# ----- penalties: a misbehaving account pays, not the others ---------------------------------------

BOUND_IN_REASON = re.compile(
    r"^switch '(?P<switch>[^']*)' closed edge '[^']*' of job '[^']*' \(bound (?P<bound>[a-z_]+)\): "
)
"""How ``Router.close_route`` names the bound in an error close (what the peer switch sends too)."""
SENDER_BOUNDS_AT_PEER = frozenset({"window", "items", "unattached_bytes", "unattached_items"})
"""Bounds of the *receiving* switch that only a sender of ours can exceed (beyond its credit, a flood of
tiny items, items for a receiver that never attaches). The timeouts and the route-count limits are not
here: a receiver that is slow to start or a crash is not misbehaviour of the sender."""
SENDER_BOUNDS_HERE = frozenset({"credit"})
"""Bounds of this switch that its own local trainer exceeded (it sent beyond its credit). ``window`` and
``items`` here are the *peer's* sender overrunning our receiver: not our account's fault."""


def closed_bound(reason: str) -> str | None:
    """The bound named by a switch's error close (``... (bound unattached_items): ...``), else None."""
    match = BOUND_IN_REASON.match(reason)
    return match.group("bound") if match else None


def is_offence(bound: str | None, by_peer: bool) -> bool:
    """Whether a route closed for ``bound`` (by the peer switch or by this one) is our sender's fault."""
    if bound is None:
        return False
    return bound in (SENDER_BOUNDS_AT_PEER if by_peer else SENDER_BOUNDS_HERE)


@dataclass(frozen=True)
class PenaltyRules:
    """How an account whose route was closed for a bound pays (``SwitchSettings.penalty_*``)."""

    rate_factor: float = 0.1
    backoff_min_s: float = 1.0
    backoff_max_s: float = 60.0
    quiet_s: float = 300.0

    def __post_init__(self) -> None:
        if not 0 < self.rate_factor <= 1:
            raise ValueError(f"penalty rate factor must be in (0, 1], got {self.rate_factor}")
        if not 0 < self.backoff_min_s <= self.backoff_max_s:
            raise ValueError(
                "penalty backoff must satisfy 0 < min <= max, got "
                f"{self.backoff_min_s} and {self.backoff_max_s}"
            )
        if self.quiet_s <= 0:
            raise ValueError(f"penalty quiet period must be > 0, got {self.quiet_s}")

    def backoff(self, strikes: int) -> float:
        """1 s, 2 s, 4 s ... (``backoff_min_s`` doubled per strike), capped at ``backoff_max_s``."""
        return min(self.backoff_max_s, self.backoff_min_s * 2.0 ** min(strikes - 1, 64))


@dataclass
class Strikes:
    """One account's penalty state: its strikes, the end of its open backoff, and what caused it."""

    strikes: int = 0
    until: float = 0.0
    backoff_s: float = 0.0
    bound: str = ""
    job_id: str = ""
    audited: bool = False


@dataclass(frozen=True)
class Refusal:
    """An open refused during a backoff; ``first`` is set on the first refusal of that backoff only."""

    account: str
    remaining_s: float
    backoff_s: float
    strikes: int
    bound: str
    job_id: str
    first: bool

    def message(self, cluster_id: str) -> str:
        return (
            f"account {self.account!r} is in a penalty backoff on switch {cluster_id!r} for "
            f"{self.remaining_s:.1f} s more (backoff {self.backoff_s:g} s, strike {self.strikes}): its edge "
            f"of job {self.job_id!r} was closed for exceeding a bound ({self.bound}); new edges of the "
            "account are refused until then"
        )


class Penalties:
    """Strikes per account (the open backoff) and a reduced item rate per (account, job).

    Why split: the backoff is per account because a flooder re-opens under a new job id each time it
    is closed (a per-job backoff would never bite), and it only refuses edges of jobs the account does
    not already have running (the relay's check, ``relay_penalties.py``), so a running job of the same
    account keeps its edges. The reduced item rate is per (account, job): only the job whose route was
    closed is slowed, not its owner's other jobs. A strike during a backoff does not double it again
    (the routes it closed were opened before the backoff began); strikes are forgotten after
    ``quiet_s`` past the end of the last backoff.
    """

    def __init__(self, rules: PenaltyRules, clock: Callable[[], float] = time.monotonic) -> None:
        self.rules = rules
        self._clock = clock
        self._accounts: dict[str, Strikes] = {}
        self._jobs: dict[tuple[str, str], float] = {}  # (account, job) -> when its reduced rate ends

    def offend(self, account: str, job_id: str, bound: str) -> Strikes:
        """Record that ``account``'s route of ``job_id`` was closed for ``bound``; returns its state."""
        now = self._clock()
        self.forget(now)
        state = self._accounts.setdefault(account, Strikes())
        self._jobs[(account, job_id)] = now + self.rules.quiet_s
        PENALTIES.labels(bound).inc()
        if now < state.until:
            return state  # already backing off: the same burst of closes, not a new strike
        state.strikes += 1
        state.backoff_s = self.rules.backoff(state.strikes)
        state.until = now + state.backoff_s
        state.bound, state.job_id, state.audited = bound, job_id, False
        return state

    def refusal(self, account: str) -> Refusal | None:
        """A refusal if ``account`` is backing off now (and whether it is the first of this backoff)."""
        state = self._accounts.get(account)
        if state is None:
            return None
        now = self._clock()
        if now >= state.until:
            return None
        first, state.audited = not state.audited, True
        OPENS_REFUSED.labels(account).inc()
        return Refusal(
            account, state.until - now, state.backoff_s, state.strikes, state.bound, state.job_id, first
        )

    def any_jobs(self) -> bool:
        """Whether any job is penalized (the per-item fast path when none is)."""
        return bool(self._jobs)

    def job_penalized(self, account: str, job_id: str) -> bool:
        """Whether ``job_id`` of ``account`` runs at the reduced item rate now."""
        until = self._jobs.get((account, job_id))
        if until is None:
            return False
        if self._clock() < until:
            return True
        del self._jobs[(account, job_id)]
        return False

    def strikes(self, account: str) -> int:
        state = self._accounts.get(account)
        return 0 if state is None else state.strikes

    def forget(self, now: float | None = None) -> None:
        """Drop accounts quiet for ``quiet_s`` after their last backoff, and expired job penalties."""
        now = self._clock() if now is None else now
        quiet = self.rules.quiet_s
        for account in [a for a, s in self._accounts.items() if now >= s.until + quiet]:
            del self._accounts[account]
        for key in [k for k, until in self._jobs.items() if now >= until]:
            del self._jobs[key]
