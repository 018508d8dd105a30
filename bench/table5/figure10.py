"""The paper's Figure 10 analogue: the fastest row with compression started later in training.

Each later start trains the row with codec none until the start step (``start(spec, step)``), then the
row's codecs; a point's s/step is the mean of none's step before the start and the row's after it.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import train

Row = train.Row


def figure10_runs(
    prep: train.Prepared, figure_row: Row, starts: tuple[float, ...], seeds: int, steps: int, eval_pairs: int
) -> list[dict[str, Any]]:
    """Compression from each later start (10 / 25 % of training) on; before it, codec none."""
    runs = []
    for fraction in starts:
        start = round(fraction * steps)
        row = replace(
            figure_row,
            label=f"{figure_row.label} from {fraction:.0%}",
            forward=f"start({figure_row.forward},{start})",
            backward=f"start({figure_row.backward},{start})",
        )
        bleu = [train.fine_tune(prep, row, seed, steps, eval_pairs).bleu for seed in range(seeds)]
        runs.append({"start_fraction": fraction, "start": start, "bleu": bleu})
        print(json.dumps({"figure10": fraction, "bleu": bleu}), flush=True)
    return runs


def figure10_points(report: dict[str, Any], label: str) -> list[dict[str, Any]]:
    """Figure 10's points: BLEU, and the mean s/step of none before the start and the row's after it."""
    rows = {row["label"]: row for row in report["rows"]}
    if label not in rows:  # a reduced run without that row
        return []
    base, none, steps = rows[label], report["rows"][0], report["steps"]
    points = [{"start_fraction": 0.0, "bleu": base["bleu"], "step_seconds": base["step_seconds"]}]
    for run in report["figure10_runs"]:
        start = run["start"]
        mean_step = (start * none["step_seconds"] + (steps - start) * base["step_seconds"]) / steps
        points.append(
            {"start_fraction": run["start_fraction"], "bleu": run["bleu"], "step_seconds": mean_step}
        )
    return points
