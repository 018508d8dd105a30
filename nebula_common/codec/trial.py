"""Pick a codec pair by a short trial: predicted step time from the measured link, quality from real steps.

The codec service's ranking (``advice``) predicts each direction's seconds from the
link and a relative-error budget on one tensor; it cannot say whether a codec
hurts *training*. This module closes that gap with a calibration the job runs
itself, before it starts:

1. **Time per candidate.** A few real training steps with the candidate's codecs
   in the loop measure the compute of a step (both stages' forward and backward
   plus encode/decode) and the frame sizes each way; the predicted step is
   ``compute + (forward bytes + backward bytes) * 8 / bandwidth + RTT`` (a
   synchronous step: the activations go one way, their gradients come back).
2. **Quality per candidate.** The same ``trial_steps`` from the same start, seed and
   data order as a ``none`` baseline; the candidate's *trial loss* (mean of the
   last half of its losses) must stay within ``tolerance`` (relative) of the
   baseline's. Same data and seed, so the difference is the codecs' doing.
   Optionally (``progress_tolerance``) the excess must also be a small share of
   what the baseline *learned* during the trial (its ``trial_progress``: mean loss
   of the first half minus the last half). A gap that opens only once training
   starts to pay is ~1% of the loss after a short trial but already a large share
   of the progress (Table 5: at 90 steps a bottleneck's loss was 1.6% over none's,
   21% of none's progress, and 2.7 BLEU short at 300 steps).
3. **The choice.** Candidates are tried fastest-predicted first; the first within
   tolerance wins (so at most ``max_trials`` are trained), and the reason names the
   link, the predicted speed-up, the trial losses and every faster candidate that
   was rejected and why. If none passes, the baseline wins and the report says so.

The training itself is the caller's (``run``): a job's own stage programs in the
SDK (``nebula_common.sdk.codec_advice``), the ABNet fine-tuning in the Table 5
benchmark. Nothing here is modelled except the link's transfer time.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from nebula_common.codec.base import CodecError

DEFAULT_LOSS_TOLERANCE = 0.02
"""Relative trial-loss excess over the ``none`` baseline a candidate may have (2%)."""
DEFAULT_PROGRESS_TOLERANCE = 0.10
"""The progress rule: a candidate's trial-loss gap over ``none`` at most 10% of what ``none`` learned."""
DEFAULT_TRIAL_STEPS = 30
DEFAULT_CALIBRATION_STEPS = 3
DEFAULT_MAX_TRIALS = 4


@dataclass(frozen=True)
class Candidate:
    """One codec pair to consider; ``label`` names it in the report (e.g. a benchmark row)."""

    forward: str
    backward: str
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or f"{self.forward} / {self.backward}"


@dataclass
class TrialRun:
    """What ``run`` measured: per-step losses, per-step compute seconds and the frame bytes each way."""

    losses: list[float]
    compute_seconds: list[float]
    forward_bytes: int
    backward_bytes: int


@dataclass(frozen=True)
class Link:
    """The measured link: bandwidth (bit/s) and round-trip time (s)."""

    bandwidth_bps: float
    rtt_seconds: float

    def __post_init__(self) -> None:
        if not (self.bandwidth_bps > 0 and math.isfinite(self.bandwidth_bps)):
            raise CodecError(f"link bandwidth must be a positive number of bit/s, got {self.bandwidth_bps!r}")
        if not (self.rtt_seconds >= 0 and math.isfinite(self.rtt_seconds)):
            raise CodecError(f"link RTT must be >= 0 s, got {self.rtt_seconds!r}")

    def transfer_seconds(self, forward_bytes: int, backward_bytes: int) -> float:
        return (forward_bytes + backward_bytes) * 8 / self.bandwidth_bps + self.rtt_seconds


@dataclass
class Assessment:
    """One candidate's calibration and (if it was tried) trial."""

    candidate: Candidate
    compute_seconds: float
    forward_bytes: int
    backward_bytes: int
    predicted_step_seconds: float
    trial_loss: float | None = None
    excess: float | None = None
    """Relative trial-loss excess over the baseline ((loss - base) / base); None if not tried."""
    progress_share: float | None = None
    """Trial-loss excess over the baseline as a share of the baseline's trial progress; None if not used."""
    within: bool | None = None


@dataclass
class TrialDecision:
    """The chosen pair, everything measured on the way, and the reasoning in one sentence per step."""

    chosen: Candidate
    link: Link
    tolerance: float
    trial_steps: int
    baseline: Assessment
    assessments: list[Assessment] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    progress_tolerance: float | None = None
    baseline_progress: float | None = None

    @property
    def chosen_assessment(self) -> Assessment:
        for item in [self.baseline, *self.assessments]:
            if item.candidate == self.chosen:
                return item
        raise KeyError(self.chosen.name)

    def record(self) -> dict[str, Any]:
        """JSON-ready: what a job report shows under the codec choice."""
        return {
            "forward": self.chosen.forward,
            "backward": self.chosen.backward,
            "label": self.chosen.name,
            "link": {"bandwidth_mbit": self.link.bandwidth_bps / 1e6, "rtt_ms": self.link.rtt_seconds * 1000},
            "loss_tolerance": self.tolerance,
            "progress_tolerance": self.progress_tolerance,
            "baseline_progress": self.baseline_progress,
            "trial_steps": self.trial_steps,
            "predicted_step_seconds": self.chosen_assessment.predicted_step_seconds,
            "baseline_step_seconds": self.baseline.predicted_step_seconds,
            "baseline_trial_loss": self.baseline.trial_loss,
            "candidates": [_assessment_record(a) for a in self.assessments],
            "reasons": list(self.reasons),
        }


def _assessment_record(item: Assessment) -> dict[str, Any]:
    out = asdict(item)
    out["candidate"] = item.candidate.name
    out["forward"], out["backward"] = item.candidate.forward, item.candidate.backward
    return out


def trial_loss(losses: Sequence[float]) -> float:
    """Mean of the last half of the losses (at least one): the trial's end point, less noisy than the last."""
    if not losses:
        raise CodecError("a trial produced no losses")
    tail = list(losses)[len(losses) // 2 :]
    value = statistics.fmean(tail)
    if not math.isfinite(value):
        raise CodecError(f"a trial's loss is not finite ({value})")
    return value


def trial_progress(losses: Sequence[float]) -> float:
    """What a trial learned: mean loss of its first half minus its ``trial_loss`` (the last half's mean)."""
    values = list(losses)
    if len(values) < 2:
        raise CodecError("a trial needs at least 2 losses to measure its progress")
    head = statistics.fmean(values[: len(values) // 2])
    return head - trial_loss(values)


def within_budget(
    loss: float,
    base_loss: float,
    *,
    tolerance: float,
    progress: float | None = None,
    progress_tolerance: float | None = None,
) -> tuple[bool, float, float | None]:
    """The decision rule on one candidate's trial numbers: (within?, relative excess, progress share).

    Within when the relative excess ``(loss - base) / |base|`` is at most ``tolerance`` and, with
    ``progress_tolerance``, the excess ``loss - base`` is at most that share of ``progress`` (the
    baseline's trial progress; a trial whose baseline learned nothing, progress <= 0, is judged on
    the relative excess alone).
    """
    excess = (loss - base_loss) / abs(base_loss) if base_loss else 0.0
    within = excess <= tolerance
    share = None
    if progress_tolerance is not None and progress is not None and progress > 0:
        share = (loss - base_loss) / progress
        within = within and share <= progress_tolerance
    return within, excess, share


def choose_by_trial(
    candidates: Sequence[Candidate],
    run: Callable[[Candidate, int], TrialRun],
    link: Link,
    *,
    tolerance: float = DEFAULT_LOSS_TOLERANCE,
    trial_steps: int = DEFAULT_TRIAL_STEPS,
    calibration_steps: int = DEFAULT_CALIBRATION_STEPS,
    max_trials: int = DEFAULT_MAX_TRIALS,
    baseline: Candidate = Candidate("none", "none", "none"),
    progress_tolerance: float | None = None,
    estimate: Callable[[Candidate], Assessment] | None = None,
) -> TrialDecision:
    """Calibrate every candidate, try the fastest-predicted ones, return the first within ``tolerance``.

    ``run(candidate, steps)`` trains ``steps`` steps from the job's start with the
    candidate's codecs in the loop (same seed and data for every call) and returns
    what it measured. ``progress_tolerance`` adds the progress rule (``within_budget``).
    ``estimate``, when given, predicts each candidate's step instead of the calibration runs
    (the product's pipelined step model: compute + transfer would ignore the overlap).
    """
    if not candidates:
        raise CodecError("give at least one candidate codec pair to choose from")
    if not (tolerance >= 0 and math.isfinite(tolerance)):
        raise CodecError(f"loss tolerance must be >= 0, got {tolerance!r}")
    if progress_tolerance is not None and not (progress_tolerance >= 0 and math.isfinite(progress_tolerance)):
        raise CodecError(f"progress tolerance must be >= 0, got {progress_tolerance!r}")
    if trial_steps < 2 or calibration_steps < 1 or max_trials < 1:
        raise CodecError("trial_steps must be >= 2, calibration_steps and max_trials >= 1")

    def assess(candidate: Candidate, measured: TrialRun) -> Assessment:
        skip = 1 if len(measured.compute_seconds) > 1 else 0  # the first step pays one-off allocations
        compute = statistics.median(measured.compute_seconds[skip:])
        return Assessment(
            candidate,
            compute,
            measured.forward_bytes,
            measured.backward_bytes,
            compute + link.transfer_seconds(measured.forward_bytes, measured.backward_bytes),
        )

    base_run = run(baseline, trial_steps)
    base = estimate(baseline) if estimate is not None else assess(baseline, base_run)
    base.trial_loss, base.excess, base.within = trial_loss(base_run.losses), 0.0, True
    others = [c for c in candidates if c != baseline]
    if estimate is not None:
        assessments = [estimate(c) for c in others]
    else:
        assessments = [assess(c, run(c, calibration_steps)) for c in others]
    assessments.sort(key=lambda a: a.predicted_step_seconds)
    progress = trial_progress(base_run.losses) if progress_tolerance is not None else None
    decision = TrialDecision(
        baseline,
        link,
        tolerance,
        trial_steps,
        base,
        assessments,
        progress_tolerance=progress_tolerance,
        baseline_progress=progress,
    )
    decision.reasons.append(
        f"link {link.bandwidth_bps / 1e6:g} Mbit/s, {link.rtt_seconds * 1000:g} ms RTT: "
        f"{baseline.name} predicted {base.predicted_step_seconds:.3f} s/step "
        f"({base.compute_seconds * 1000:.0f} ms compute, "
        f"{base.forward_bytes + base.backward_bytes:,} bytes a step), "
        f"trial loss {base.trial_loss:.4f} after {trial_steps} steps"
        + (
            f", progress {progress:.4f} (first half's mean loss minus the last half's)"
            if progress is not None
            else ""
        )
    )
    for tried, item in enumerate(assessments):
        if item.predicted_step_seconds >= base.predicted_step_seconds:
            break  # no faster than the baseline: not worth any quality risk
        if tried == max_trials:
            decision.reasons.append(f"stopped after {max_trials} trials (max_trials)")
            break
        losses = run(item.candidate, trial_steps).losses
        item.trial_loss = trial_loss(losses)
        item.within, item.excess, item.progress_share = within_budget(
            item.trial_loss,
            base.trial_loss,
            tolerance=tolerance,
            progress=progress,
            progress_tolerance=progress_tolerance,
        )
        speedup = base.predicted_step_seconds / item.predicted_step_seconds
        decision.reasons.append(
            f"{item.candidate.name}: predicted {item.predicted_step_seconds:.3f} s/step ({speedup:.1f}x), "
            f"trial loss {item.trial_loss:.4f} ({_verdict(item, tolerance, progress_tolerance)})"
        )
        if item.within:
            decision.chosen = item.candidate
            decision.reasons.append(f"chose {item.candidate.name}: the fastest predicted within tolerance")
            return decision
    decision.reasons.append(f"chose {baseline.name}: no faster candidate stayed within the tolerance")
    return decision


def _verdict(item: Assessment, tolerance: float, progress_tolerance: float | None) -> str:
    """Which rule(s) a tried candidate met or failed, in words (the report's "why")."""
    assert item.excess is not None
    relative = f"{'within' if item.excess <= tolerance else 'over'} the {tolerance:.0%} tolerance"
    if item.progress_share is None or progress_tolerance is None:
        return f"{item.excess:+.1%}, {relative}"
    progress_ok = item.progress_share <= progress_tolerance
    share = f"{item.progress_share:+.0%} of the baseline's progress"
    rule = f"the progress rule (at most {progress_tolerance:.0%})"
    if item.within:
        return f"{item.excess:+.1%}, {share}, {relative} and {rule}"
    if item.excess <= tolerance:  # rejected by the progress rule alone
        return f"{item.excess:+.1%}, {share}, {relative} but over {rule}"
    if progress_ok:
        return f"{item.excess:+.1%}, {share}, {relative}; within {rule}"
    return f"{item.excess:+.1%}, {share}, {relative} and over {rule}"
