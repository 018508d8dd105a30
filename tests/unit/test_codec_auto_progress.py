"""The job's ``auto`` (``decide_by_trial``) applies the progress rule when asked (recorded Table 5 trials)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nebula_common.codec.trial import DEFAULT_PROGRESS_TOLERANCE, Candidate, Link, TrialRun
from nebula_common.sdk.codec_advice import TrialSettings, decide_by_trial

RECORDED = json.loads((Path(__file__).parent / "data" / "table5_trials.json").read_text())
ROWS = {row["label"]: row for row in RECORDED["rows"]}
CANDIDATES = [Candidate(r["forward"], r["backward"], r["label"]) for r in RECORDED["rows"][1:]]
LINK = Link(**RECORDED["link"])


def replay(candidate: Candidate, steps: int) -> TrialRun:
    """The recorded losses, compute and frame bytes of that row (full plan, seed 0, 90 steps; no timing)."""
    row = ROWS[candidate.label]
    assert steps <= len(row["losses"]), "the recording holds 90 steps"
    return TrialRun(row["losses"][:steps], [row["compute_ms"] / 1000] * steps, *_bytes(row))


def _bytes(row: dict[str, Any]) -> tuple[int, int]:
    return int(row["forward_bytes"]), int(row["backward_bytes"])


def test_auto_rejects_the_bottleneck_by_the_progress_rule_and_says_so() -> None:
    assert TrialSettings().progress_tolerance is None  # opt-in: a short trial learns too little
    settings = TrialSettings(progress_tolerance=DEFAULT_PROGRESS_TOLERANCE)
    assert settings.progress_tolerance == 0.10
    decision = decide_by_trial(CANDIDATES, replay, LINK, settings, trial_steps=90)
    assert decision.chosen.label == "int8 both", decision.reasons
    record = decision.record()
    assert record["progress_tolerance"] == 0.10 and record["baseline_progress"] > 0.3
    by_label = {c["candidate"]: c for c in record["candidates"]}
    rejected = by_label["BOTTLENECK(32)+INT8"]
    assert (
        rejected["within"] is False and rejected["excess"] < 0.02 and 0.10 < rejected["progress_share"] < 0.2
    )
    # The "why" names the rule that rejected it: the relative loss passed, the progress rule did not.
    (why,) = [r for r in record["reasons"] if r.startswith("BOTTLENECK(32)+INT8:")]
    assert "within the 2% tolerance but over the progress rule (at most 10%)" in why, why
    (kept,) = [r for r in record["reasons"] if r.startswith("int8 both:")]
    assert "within the 2% tolerance and the progress rule" in kept, kept


def test_without_the_progress_rule_auto_keeps_the_old_pick() -> None:
    # The default (the relative loss only) picks the bottleneck, 1.1% over none at 90 steps.
    decision = decide_by_trial(CANDIDATES, replay, LINK, TrialSettings(), 90)
    assert decision.chosen.label == "BOTTLENECK(32)+INT8"
    assert decision.record()["progress_tolerance"] is None
    assert not any("progress" in reason for reason in decision.reasons)
