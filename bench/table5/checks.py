"""What a Table 5 run must show to count, in every mode: checks a broken model or advisor fails.

* **The models learned.** Each pre-trained half's loss fell by at least ``PRETRAIN_DROP`` from its
  first step to its last (a broken optimizer, data pipeline or model leaves it flat); in the full
  run codec none also scores at least ``BLEU_FLOOR`` (a model that translates nothing scores 0).
* **The advisor kept its rule.** Its pick is within the quality budget and at most 10% slower than
  the fastest row within it (``run.advisor_check``), in the quick mode too.
* **Figure 10's trend** (the paper: BLEU rises as compression starts later) is stated as reproduced
  or not, with the numbers, never left for the reader to notice.
"""

from __future__ import annotations

import itertools
import statistics
from typing import Any

PRETRAIN_DROP = 0.10
"""Each pre-trained half's last loss at most 90% of its first."""
BLEU_FLOOR = 1.0
"""Codec none's mean BLEU in a full run at least this (the quick run is too short to translate)."""


def failures(report: dict[str, Any]) -> list[str]:
    """Every check the report fails, each in one sentence naming the numbers."""
    failed = []
    for half, (first, last) in report.get("pretrain_losses", {}).items():
        if last > (1 - PRETRAIN_DROP) * first:
            failed.append(f"pre-training {half} did not learn: loss {first:.3f} -> {last:.3f}")
    rows = report.get("rows") or []
    if report.get("mode") == "full" and rows and statistics.mean(rows[0]["bleu"]) < BLEU_FLOOR:
        failed.append(f"codec none scores {statistics.mean(rows[0]['bleu']):.2f} BLEU, under {BLEU_FLOOR}")
    check = report.get("advisor_check")
    if report.get("advisor") and not (check and check["ok"]):
        failed.append(f"the advisor missed the 10% rule: {check}")
    return failed


def figure10_trend(points: list[dict[str, Any]]) -> str:
    """Whether the paper's Figure 10 trend shows: mean BLEU non-decreasing as the start moves later."""
    if len(points) < 2:
        return ""
    means = [statistics.mean(point["bleu"]) for point in points]
    listed = ", ".join(
        f"{mean:.2f} from {point['start_fraction']:.0%}" for mean, point in zip(means, points, strict=True)
    )
    rising = all(b >= a for a, b in itertools.pairwise(means)) and means[-1] > means[0]
    verdict = "reproduced" if rising else "not reproduced"
    trend = "The paper's Figure 10 trend (BLEU rises as compression starts later)"
    return f"{trend} is {verdict} here: {listed}."
