"""Table 5's checks fail the runs they should: flat pre-training or fine-tuning, a decoder that ignores
the cut, a full run under the BLEU floor or the lookup baseline, an advisor off its rule; and Figure
10's trend is stated either way."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench" / "table5"))

import checks

NONE = {"label": "none", "bleu": [24.5, 24.9], "first_loss": [5.6, 5.5], "final_loss": [3.1, 3.0]}
GOOD = {
    "mode": "full",
    "pretrain_losses": {"encoder_mlm": [7.9, 5.9], "decoder_lm": [7.8, 5.8], "translation": [6.1, 1.9]},
    "rows": [{**NONE, "source_gap": [1.2, 1.1]}],
    "lookup": {"bleu": 18.4},
    "advisor_check": {"ok": True},
}


def _none(**changed: object) -> dict:
    return {**GOOD, "rows": [{**GOOD["rows"][0], **changed}]}


def test_a_run_that_learned_and_kept_the_rule_passes() -> None:
    assert checks.failures(GOOD) == []
    # the quick run is too short to translate: no BLEU floor there, but it must still learn and read the cut
    assert checks.failures({**_none(bleu=[0.0]), "mode": "quick"}) == []
    # a full run fine-tunes halves that already translate: a flat fine-tuning loss is no failure there
    assert checks.failures(_none(first_loss=[1.28, 1.27], final_loss=[1.27, 1.26])) == []


def test_each_broken_part_is_named() -> None:
    flat = {**GOOD, "pretrain_losses": {"encoder_mlm": [7.9, 7.5], "decoder_lm": [7.8, 5.8]}}
    assert checks.failures(flat) == ["pre-training encoder_mlm did not learn: loss 7.900 -> 7.500"]
    untranslated = {**GOOD, "pretrain_losses": {**GOOD["pretrain_losses"], "translation": [6.1, 6.0]}}
    assert checks.failures(untranslated) == ["pre-training translation did not learn: loss 6.100 -> 6.000"]
    stuck = {**_none(final_loss=[5.4, 5.3]), "mode": "quick"}
    assert checks.failures(stuck) == ["codec none's fine-tuning did not learn: loss 5.550 -> 5.350"]
    diverged = {**_none(final_loss=[float("nan"), 3.0], source_gap=[float("nan"), 1.0]), "mode": "quick"}
    assert checks.failures(diverged) == [
        "codec none's fine-tuning did not learn: loss 5.550 -> nan",
        "codec none's decoder does not read the cut: mismatched sources raise the loss by nan, under 0.2",
    ]
    deaf = {**_none(source_gap=[0.01, 0.0]), "mode": "quick"}
    assert checks.failures(deaf) == [
        "codec none's decoder does not read the cut: mismatched sources raise the loss by 0.005, under 0.2"
    ]
    weak = _none(bleu=[6.5, 6.9])
    assert checks.failures(weak) == [
        "codec none scores 6.70 BLEU, under 20.0",
        "codec none's 6.70 BLEU does not beat the lookup's 18.40",
    ]
    recall = {**GOOD, "lookup": {"bleu": 28.5}}
    assert checks.failures(recall) == ["codec none's 24.70 BLEU does not beat the lookup's 28.50"]
    off_rule = {**GOOD, "mode": "quick", "advisor_check": {"ok": False, "ratio": 1.4}}
    assert checks.failures(off_rule) == ["auto missed the 10% rule: {'ok': False, 'ratio': 1.4}"]


def test_figure_10_s_trend_is_stated_reproduced_or_not() -> None:
    points = [{"start_fraction": f, "bleu": [b]} for f, b in ((0.0, 3.00), (0.10, 3.15), (0.25, 2.56))]
    assert checks.figure10_trend(points).endswith(
        "is not reproduced here: 3.00 from 0%, 3.15 from 10%, 2.56 from 25%."
    )
    rising = [{"start_fraction": f, "bleu": [b]} for f, b in ((0.0, 3.0), (0.10, 3.2), (0.25, 3.3))]
    assert " is reproduced here" in checks.figure10_trend(rising)
    assert checks.figure10_trend(points[:1]) == ""
