"""The demo's point in one table: the same job with ``none`` and with ``auto`` on the same link.

Both jobs run one after the other on one deployment, so they see the same emulated WAN and the
same host. ``auto``'s time includes everything it costs the user: probing the job, asking the codec
service and any trial, from submission to the last step. The losses are compared by their tail
(the mean of the last ``TAIL_SHARE`` of the steps, which one noisy step does not move) against a
stated relative tolerance.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from typing import Any

from rich.table import Table

from nebula_common.sdk.summary import JobSummary

LOSS_TOLERANCE = 0.05
"""``auto``'s tail loss may exceed ``none``'s by at most this share (5%)."""
TAIL_SHARE = 0.1


def tail_loss(losses: list[float]) -> float:
    """The mean of the last ``TAIL_SHARE`` of the losses (at least five, or all there are)."""
    count = min(len(losses), max(5, round(len(losses) * TAIL_SHARE)))
    return statistics.fmean(losses[-count:])


@dataclass
class Comparison:
    """``none`` against ``auto``: each job's summary and its wall time from submission to the end."""

    baseline: JobSummary
    baseline_seconds: float
    candidate: JobSummary
    candidate_seconds: float
    codec_choice: dict[str, Any]

    @property
    def missing(self) -> str:
        """Why the two jobs cannot be compared, or ``""``: a job that failed has no step times or loss."""
        jobs = (("none", self.baseline), ("auto", self.candidate))
        gone = [name for name, summary in jobs if not (summary.succeeded and summary.losses)]
        return f"no comparison: the {' and the '.join(gone)} job did not finish" if gone else ""

    @property
    def speedup(self) -> float:
        """Wall time of ``none`` over ``auto``'s, its probe, advice and trials included."""
        return self.baseline_seconds / self.candidate_seconds if self.candidate_seconds else 0.0

    @property
    def step_speedup(self) -> float:
        mean = self.candidate.mean_step_seconds
        return self.baseline.mean_step_seconds / mean if mean else 0.0

    @property
    def loss_excess(self) -> float:
        """(auto's tail loss - none's) / none's."""
        base = tail_loss(self.baseline.losses)
        return (tail_loss(self.candidate.losses) - base) / abs(base) if base else 0.0

    @property
    def within_tolerance(self) -> bool:
        return self.loss_excess <= LOSS_TOLERANCE

    def to_json(self) -> dict[str, Any]:
        if self.missing:
            return {
                "complete": False,
                "reason": self.missing,
                "none_seconds": self.baseline_seconds,
                "auto_seconds": self.candidate_seconds,
            }
        return {
            "complete": True,
            "speedup": self.speedup,
            "step_speedup": self.step_speedup,
            "none_seconds": self.baseline_seconds,
            "auto_seconds": self.candidate_seconds,
            "none_tail_loss": tail_loss(self.baseline.losses),
            "auto_tail_loss": tail_loss(self.candidate.losses),
            "loss_excess": self.loss_excess,
            "loss_tolerance": LOSS_TOLERANCE,
            "within_tolerance": self.within_tolerance,
            "auto_codecs": [self.codec_choice.get("forward"), self.codec_choice.get("backward")],
            "auto_predicted_step_seconds": self.codec_choice.get("predicted_step_seconds"),
            "none_predicted_step_seconds": self.codec_choice.get("baseline_step_seconds"),
        }

    def table(self) -> Table:
        table = Table(title="none against auto, one after the other on the same link", show_header=True)
        table.add_column("")
        table.add_column("none", justify="right")
        table.add_column("auto", justify="right")
        choice = self.codec_choice
        table.add_row(
            "codecs (forward / backward)", "none / none", f"{choice['forward']} / {choice['backward']}"
        )
        table.add_row(
            "mean step time",
            f"{self.baseline.mean_step_seconds * 1000:.0f} ms",
            f"{self.candidate.mean_step_seconds * 1000:.0f} ms",
        )
        predicted = choice.get("baseline_step_seconds"), choice.get("predicted_step_seconds")
        if all(isinstance(value, float) for value in predicted):
            table.add_row(
                "predicted by auto", f"{predicted[0] * 1000:.0f} ms", f"{predicted[1] * 1000:.0f} ms"
            )
        for direction in ("forward", "backward"):
            table.add_row(
                f"WAN {direction}",
                f"{_bytes(self.baseline, direction):,} B",
                f"{_bytes(self.candidate, direction):,} B",
            )
        table.add_row(
            "loss (mean of the last steps)",
            f"{tail_loss(self.baseline.losses):.4f}",
            f"{tail_loss(self.candidate.losses):.4f} ({self.loss_excess:+.1%})",
        )
        table.add_row(
            "submission to last step",
            f"{self.baseline_seconds:.1f} s",
            f"{self.candidate_seconds:.1f} s (advice and trial included)",
        )
        table.add_row("speed-up", "", f"{self.speedup:.2f}x (steps alone {self.step_speedup:.2f}x)")
        return table

    def verdict(self) -> str:
        loss = (
            f"loss within {LOSS_TOLERANCE:.0%} of none's ({self.loss_excess:+.1%})"
            if self.within_tolerance
            else f"loss {self.loss_excess:+.1%} over none's, beyond the {LOSS_TOLERANCE:.0%} tolerance"
        )
        return f"auto: {self.speedup:.2f}x faster than none from submission to the last step, {loss}"


def _bytes(summary: JobSummary, direction: str) -> int:
    wan = summary.wan.get(direction) or {}
    return int(wan.get("bytes", wan.get("payload_bytes", 0)))


def choice_of(codec_choice: str) -> dict[str, Any]:
    """The recorded ``auto`` choice of a job (``{}`` when its codecs were configured)."""
    return json.loads(codec_choice) if codec_choice else {}
