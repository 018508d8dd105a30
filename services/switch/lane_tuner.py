"""How many connections (lanes, ``lanes.py``) a link session stripes over: fixed, or tuned from throughput.

With ``NEBULA_SWITCH_LINK_CONNECTIONS=auto`` (the default; :class:`LaneTuner`): start with one and
double while the link scales, halve while it does not need them. Only intervals in which the link was
busy count (items waited for a lane in nine samples of ten or more: queued in the router, or a lane's
writer inside a write, while what is written and not yet read fills the path, ``PeerLink.link_busy``;
:func:`busy_interval`); the first busy intervals after an idle one are a start (slow start, partly idle),
neither judged nor a baseline. Items that wait while the path is not full wait for this switch: beside
a flooder's header-only frames on a loaded host, items waited in 17-19 samples of 19 with at most 36 kB
of a 128 kB cap in flight, and the tuner, judging doublings on noise, gave them 2-8 connections. A job
that leaves the link idle between its bursts (a pipeline computing, a link faster than the job) is
limited by its own pace, not by its connections: counted busy at half its samples, a job sending 4 MiB
micro-batches at 60 Mbit/s had the tuner add connections for 7-21% more throughput, and the switches'
CPU for them (0.42-0.73 cores against 0.26) slowed another tenant's small job on the same two cores
1.4-2.4x (``docs/bench/neighbour.md``). A link-bound sender, a loss-limited long path's above all, waits
on the link in every sample. A change is judged on the mean throughput of ``judge_intervals`` busy
intervals after it (the first ``settle_intervals`` after it skipped: new
connections dial, leave slow start, and the link's pacer grows its cap to carry them) against the mean
of as many before it, because on a lossy long path one interval's throughput moves with where the
losses fall by more than one connection adds.

* **Doubling.** Each connection of a loss-limited path gets what loss and RTT allow one TCP flow (about
  MSS / RTT x sqrt(3 / 2p)), so such a path takes as many connections as its capacity holds flows.
  A doubling is kept, and doubling goes on up to ``max_lanes``, while it raised throughput by more than
  ``gain`` (5%): on a loss-limited path the gain is about x2, far above the noise of where losses fall,
  on a full path about nothing. A doubling that gained no more than that is undone. One judged against
  the mean measured right after a kept doubling is judged once more before the undo stands: the count
  before it is measured afresh and the doubling tried again, kept only if both tries beat that mean.
  On a lossy long path the intervals after a doubling carry its new connections' slow-start overshoot
  (each runs far above its steady rate until its first losses halve it), so the mean that becomes the
  next doubling's baseline is inflated, and judged against it a doubling that scales the path can
  measure no gain; an undo then holds the path at a few connections for the next hold.
* **Halving**, after a hold: lanes added while the link was still ramping up, or a path that needs
  fewer later, are walked back while throughput stays within ``gain``; a halving that cost more is
  undone. Holds alternate the direction, so the count follows a path that changes either way, and each
  probe is a change large enough to stand out of the noise. A hold lasts ``hold_intervals`` (10 s)
  after a kept change and doubles with each probe undone in a row, up to ``max_hold_intervals``
  (2 min): a first doubling misjudged while one flow still ran above its steady rate is tried again
  soon, and a count that is right is probed less and less often.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_LANES = 32
"""Connections of one link at most: a lossy long path's capacity in loss-limited TCP flows, capped."""

BUSY_SHARE = 0.9
"""The share of an interval's samples in which items must wait for the link for it to count as busy."""


def busy_interval(busy_samples: int, samples: int) -> bool:
    """Whether an interval in which items waited for the link in ``busy_samples`` of ``samples`` is busy
    (the module doc: a sender that leaves the link idle between bursts sets its own pace)."""
    return samples > 0 and busy_samples >= BUSY_SHARE * samples


@dataclass
class LaneTuner:
    """Chooses the number of lanes from measured throughput (see the module doc)."""

    max_lanes: int = MAX_LANES
    gain: float = 0.05
    hold_intervals: int = 5
    """The hold after a first undone probe; each further one in a row doubles it, up to ``max_hold``."""
    max_hold_intervals: int = 60
    judge_intervals: int = 3
    start_intervals: int = 2
    """Busy intervals after an idle one that are only a start: slow start, and on a lossy path its
    overshoot (a flow runs far above its steady rate until the first few losses halve it)."""
    settle_intervals: int = 1
    """Busy intervals after a change that are not judged: new connections dial and leave slow start,
    and the link's pacer grows its cap to what they can carry (``pacing.py``)."""
    lanes: int = 1
    _window: list[float] = field(default_factory=list)  # busy intervals since the last change or hold
    _baseline: float | None = None  # mean throughput before the change being judged
    _previous: int = 1  # the lane count before that change
    _direction: int = 1  # where the next probe goes: +1 double, -1 halve
    _hold: int = 0
    _undone: int = 0  # probes undone in a row (each doubles the next hold); a kept change resets it
    _settle: int = 0  # intervals left before the change's judging intervals begin
    _busy_run: int = 0  # busy intervals since the last idle one
    _retry: bool = False  # a doubling was undone once: measure the count before it afresh, then retry
    _retrying: bool = False  # the doubling being judged is that retry: no gain undoes it for good
    _first_try: float = 0.0  # the mean the undone doubling measured
    _fresh: bool = False  # the mean just measured followed a kept doubling: its new connections' overshoot
    _suspect: bool = False  # the change being judged was measured against such a mean

    def observe(self, throughput: float, busy: bool) -> int:
        """One interval's throughput (bytes/s) and whether the link was busy; returns the lane count."""
        if not busy:
            self._busy_run = 0
            return self.lanes
        self._busy_run += 1
        if self._busy_run <= self.start_intervals:  # partly idle, ramping up: a start, not a measurement
            self._window.clear()
            return self.lanes
        if self._settle > 0:
            self._settle -= 1
            return self.lanes
        self._window.append(throughput)
        if self._hold > 0:
            self._hold -= 1
            return self.lanes
        if len(self._window) < self.judge_intervals:
            return self.lanes
        mean = sum(self._window[-self.judge_intervals :]) / self.judge_intervals
        self._window.clear()
        if self._baseline is not None:
            self._judge(mean)
            if self._hold > 0 or self._retry:
                return self.lanes  # a hold, or an undone doubling whose count is measured afresh first
        self._probe(mean)
        return self.lanes

    def _judge(self, mean: float) -> None:
        """Keep or undo the change made after ``_baseline`` was measured."""
        assert self._baseline is not None
        baseline, self._baseline = self._baseline, None
        ratio = mean / baseline if baseline > 0 else float("inf")
        retrying, self._retrying = self._retrying, False
        if retrying:
            # Kept only if both tries beat the fresh baseline: on a path the count already fills, two
            # tries must not double the odds that noise keeps a doubling.
            ratio = min(ratio, self._first_try / baseline if baseline > 0 else float("inf"))
        if self.lanes > self._previous:
            if ratio <= 1 + self.gain and self._suspect and not retrying:
                # No gain, judged once: undo it, measure the count before afresh, then try it again
                # against that (see the module doc), without a hold.
                self.lanes = self._previous
                self._settle = self.settle_intervals
                self._retry = True
                self._first_try = mean
                self._window.clear()
                return
            if ratio > 1 + self.gain:
                self._undone = 0
                if self.lanes < self.max_lanes:
                    self._fresh = True
                    return  # the path gives more with more connections: double again (from this mean)
            else:
                self.lanes = self._previous  # no gain: undo
            self._hold_then(-1)
        elif ratio < 1 - self.gain:
            self.lanes = self._previous  # the halving cost throughput: restore
            self._hold_then(1)
        else:
            self._undone = 0
            if self.lanes <= 1:
                self._hold_then(1)

    def _probe(self, baseline: float) -> None:
        """Double or halve from ``baseline``, the mean of the intervals just measured."""
        if self._direction < 0 and self.lanes <= 1:
            self._direction = 1
        if self._direction > 0 and self.lanes >= self.max_lanes:
            self._direction = -1
        self._retrying, self._retry = self._retry, False
        self._suspect, self._fresh = self._fresh, False
        if self._retrying:
            self._direction = 1
        self._previous = self.lanes
        if self._direction > 0:
            self.lanes = min(self.max_lanes, self.lanes * 2)
        else:
            self.lanes = max(1, self.lanes - self.lanes // 2)
        if self.lanes != self._previous:
            self._baseline = baseline
            self._settle = self.settle_intervals

    def _hold_then(self, direction: int) -> None:
        undone = self.lanes == self._previous
        self._settle = self.settle_intervals if undone else 0  # an undo changes the count again
        self._hold = min(self.max_hold_intervals, self.hold_intervals << self._undone)
        self._undone = min(self._undone + 1, 8) if undone else 0
        self._direction = direction
        self._window.clear()


def parse_connections(value: str) -> int | None:
    """``auto`` -> None (self-tuned), else a fixed count of 1 .. MAX_LANES (ValueError naming the value)."""
    text = value.strip().lower()
    if text == "auto":
        return None
    try:
        count = int(text)
    except ValueError:
        raise ValueError(
            f"link_connections must be 'auto' or a number of connections, got {value!r}"
        ) from None
    if not 1 <= count <= MAX_LANES:
        raise ValueError(f"link_connections must be between 1 and {MAX_LANES} (or 'auto'), got {count}")
    return count


__all__ = ["BUSY_SHARE", "MAX_LANES", "LaneTuner", "busy_interval", "parse_connections"]
