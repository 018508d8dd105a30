"""Table 5's checks fail the runs they should: flat pre-training, a full run that translates nothing,
an advisor off its rule; and Figure 10's trend is stated either way."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "table5"))

import checks

GOOD = {
    "mode": "full",
    "pretrain_losses": {"encoder_mlm": [7.9, 5.9], "decoder_lm": [7.8, 5.8]},
    "rows": [{"label": "none", "bleu": [6.5, 6.9]}],
    "advisor": {"label": "none"},
    "advisor_check": {"ok": True},
}


def test_a_run_that_learned_and_kept_the_rule_passes() -> None:
    assert checks.failures(GOOD) == []
    assert checks.failures({**GOOD, "mode": "quick", "rows": [{"label": "none", "bleu": [0.0]}]}) == []


def test_each_broken_part_is_named() -> None:
    flat = {**GOOD, "pretrain_losses": {"encoder_mlm": [7.9, 7.5], "decoder_lm": [7.8, 5.8]}}
    assert checks.failures(flat) == ["pre-training encoder_mlm did not learn: loss 7.900 -> 7.500"]
    mute = {**GOOD, "rows": [{"label": "none", "bleu": [0.0, 0.4]}]}
    assert checks.failures(mute) == ["codec none scores 0.20 BLEU, under 1.0"]
    off_rule = {**GOOD, "mode": "quick", "advisor_check": {"ok": False, "ratio": 1.4}}
    assert checks.failures(off_rule) == ["the advisor missed the 10% rule: {'ok': False, 'ratio': 1.4}"]


def test_figure_10_s_trend_is_stated_reproduced_or_not() -> None:
    points = [{"start_fraction": f, "bleu": [b]} for f, b in ((0.0, 3.00), (0.10, 3.15), (0.25, 2.56))]
    assert checks.figure10_trend(points).endswith(
        "is not reproduced here: 3.00 from 0%, 3.15 from 10%, 2.56 from 25%."
    )
    rising = [{"start_fraction": f, "bleu": [b]} for f, b in ((0.0, 3.0), (0.10, 3.2), (0.25, 3.3))]
    assert " is reproduced here" in checks.figure10_trend(rising)
    assert checks.figure10_trend(points[:1]) == ""
