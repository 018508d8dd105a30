"""Combine shard reports of ``run.py`` into one report: rows in plan order, one of each.

A report may also grow by a later run of more rows on the same plan (same seeds, steps, split, model
and corpus): its shard's rows join the others', after them, and are paired against the same ``none``.
A later run that also ran ``none`` must have scored it exactly as the report did, seed for seed (the
same prepared halves; the preparation's thread count alone changes them), and its ``none`` is dropped.
Shards may be summaries (a committed ``table5.json``, without per-sentence outputs): each row then keeps
the paired statistics its own run computed, against a ``none`` equal to the report's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SAME_IN_SHARDS = (
    "mode",
    "seeds",
    "steps",
    "eval_pairs",
    "split",
    "model",
    "corpus",
    "bandwidth_mbit",
    "delay_ms",
)
"""What the shards of one report must share."""
BASELINE = "none"
"""The row every other is paired against; a later run repeats it, and must score exactly the same."""


class MergeError(ValueError):
    """Shards that do not make one report; the message names why."""


def read_shards(paths: list[Path]) -> list[dict[str, Any]]:
    """Each shard's JSON; a missing or malformed file is named."""
    shards = []
    for path in paths:
        try:
            shards.append(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            raise MergeError(f"{path}: not a shard report ({exc})") from None
    return shards


def merge(shards: list[dict[str, Any]], default_order: list[str]) -> dict[str, Any]:
    """One report of ``shards``; ``default_order``: the plan's labels for shards that do not name theirs."""
    if not shards:
        raise MergeError("no shards to merge")
    order: list[str] = []  # every shard's plan in turn: a later run's rows come after the first plan's
    for shard in shards:
        order += [label for label in shard.get("row_labels") or default_order if label not in order]
        differs = [key for key in SAME_IN_SHARDS if shard.get(key) != shards[0].get(key)]
        if differs:
            raise MergeError(f"the shards differ in {differs}: they are not runs of one plan")
    report = {**shards[0], "rows": [], "figure10_runs": [], "shards": len(shards), "row_labels": order}
    if any("references" not in shard for shard in shards):  # a summary among them: no outputs to pair
        report.pop("references", None)
        for shard in shards:
            shard["rows"] = [{k: v for k, v in row.items() if k != "hypotheses"} for row in shard["rows"]]
    report.pop("advisor", None)  # a shard of an older run: its trial advisor is no longer judged
    baseline: dict[str, Any] | None = None
    for shard in shards:
        rows = shard["rows"]
        again = [row for row in rows if row["label"] == BASELINE]
        if baseline is not None and again:  # a later run: its none proves it trained from the same halves
            if again[0].get("bleu") != baseline.get("bleu"):
                raise MergeError(
                    f"a later run's {BASELINE} scored {again[0].get('bleu')}, the report's "
                    f"{baseline.get('bleu')}: its rows did not start from the same prepared halves and "
                    "cannot be paired with the report's"
                )
            rows = [row for row in rows if row["label"] != BASELINE]
        baseline = baseline or (again[0] if again else None)
        report["rows"] += rows
        report["figure10_runs"] += shard["figure10_runs"]
        report["lookup"] = report.get("lookup") or shard.get("lookup")
        report["wall_seconds"] = max(report["wall_seconds"], shard["wall_seconds"])
        report["load_after"] = max(report["load_after"], shard["load_after"])
    report["rows"].sort(key=lambda row: order.index(row["label"]))
    held = [row["label"] for row in report["rows"]]
    if held != order:
        raise MergeError(f"the shards hold rows {held}, expected each of {order} once")
    return report
