"""What fails a product run of Table 5 (``product.py``), each check one that a broken run would trip.

Kept apart from the runner so the rules can be read, and tested, without starting clusters.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from nebula_common.codec.entropy import ZstdCodec
from nebula_common.codec.registry import get_codec

PREDICTION_TOLERANCE = 0.25
"""How far ``auto``'s predicted step may be from its job's measured one before the run fails."""
AUTO_RULE = 1.10
"""``auto``'s step may be at most this times the fastest row's within the BLEU budget (the issue's 10%)."""
Judged = dict[tuple[str, str, int, int], tuple[str, bool]]
"""(forward, backward, cut_k, cut_cotrain) -> (run.py's row label, within the BLEU budget); specs by
``lossy_part``."""


def speedups(results: list[dict[str, Any]]) -> None:
    """Each row's speed-up over the first (none)."""
    none = results[0]["step_seconds"]
    for result in results:
        result["speedup"] = none / result["step_seconds"] if result["step_seconds"] > 0 else math.nan


def failures(results: list[dict[str, Any]], raw_step_bytes: int) -> list[str]:
    """What fails the run: a job that failed or has no finite loss, a padded none, a row slower than none,
    and an ``auto`` whose prediction is off by more than ``PREDICTION_TOLERANCE``."""
    found = []
    for result in results:
        label = result["label"]
        if not result["succeeded"]:
            found.append(f"{label}: the job did not succeed: {result['messages']}")
            continue
        losses = result["losses"]
        if not losses or not all(math.isfinite(x) for x in losses):
            found.append(f"{label}: a loss is missing or not finite")
    none = results[0]
    if none["succeeded"] and none["wan_bytes_per_step"] > raw_step_bytes / 2:
        found.append(
            f"none sent {none['wan_bytes_per_step']:,.0f} bytes a step, more than half the padded batch's "
            f"{raw_step_bytes:,} (both ways): the padding crosses the link"
        )
    for result in results[1:]:
        if result["succeeded"] and none["succeeded"] and result["speedup"] < 0.97:
            found.append(
                f"{result['label']}: {result['speedup']:.2f}x of none's step, slower by more than 3%"
            )
        predicted = result["advice"].get("predicted_step_seconds")
        off = abs(predicted / result["step_seconds"] - 1) if predicted and result["succeeded"] else 0.0
        if off > PREDICTION_TOLERANCE:
            found.append(
                f"{result['label']}: auto predicted {predicted:.3f} s a step, measured "
                f"{result['step_seconds']:.3f} (more than {PREDICTION_TOLERANCE:.0%} off)"
            )
    return found


def judged_rows(path: Path) -> Judged:
    """run.py's verdicts (its merged report at ``path``): which codec pairs are within the BLEU budget."""
    try:
        rows = json.loads(path.read_text())["rows"]
        return {_key(row): (row["label"], bool(row["versus_none"]["within_budget"])) for row in rows}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


def auto_rule(results: list[dict[str, Any]], judged: Judged, source: str) -> tuple[list[str], list[str]]:
    """(report lines, failures): each ``auto`` row against the fastest row run here that run.py's BLEU
    table found within budget (none always is). ``auto`` meets the rule when its pair is itself a row
    within budget and its step is at most ``AUTO_RULE`` times the fastest's; a pair the table has no
    row for is not judged, which fails too (its quality is unknown). Without a table: a line, no failure.
    """
    autos = [r for r in results if r.get("advice", {}).get("predicted_step_seconds") and r["succeeded"]]
    if not autos:
        return [], []
    if not judged:
        return [f"`auto` against the BLEU table: not judged (no run.py report at {source})."], []
    within = [results[0]] + [
        r
        for r in results[1:]
        if r not in autos and r["succeeded"] and not r.get("cut_k") and judged.get(_key(r), ("", False))[1]
    ]  # a bottleneck row changes the model (cut_k), which auto does not choose: not what it is judged by
    fastest = min(within, key=lambda r: r["step_seconds"])
    lines, found = [], []
    for auto in autos:
        label, ok = judged.get(_key(auto), ("", False))
        ratio = auto["step_seconds"] / fastest["step_seconds"]
        verdict = f"ratio **{ratio:.3f}** against {fastest['label']} ({fastest['step_seconds']:.3f} s/step)"
        if not label:
            problem = (
                f"its pair `{auto['forward']}` / `{auto['backward']}` has no row in {source}: not judged"
            )
        elif not ok:
            problem = f"its pair is {label}, outside the BLEU budget"
        elif ratio > AUTO_RULE:
            problem = f"{ratio:.3f}x the fastest row's step within the BLEU budget (rule: <= {AUTO_RULE:.2f})"
        else:
            problem = ""
        lines.append(
            f"`{auto['label']}` against the fastest row within the BLEU budget ({source}): "
            f"{verdict}, its pair's BLEU {'row: ' + label if label else 'row: none in the table'}: "
            + ("**NOT met**." if problem else "met.")
        )
        if problem:
            found.append(f"{auto['label']}: {problem}")
    return lines, found


def lossy_part(spec: str) -> str:
    """What decides a codec's effect on quality: ``spec`` without its lossless zstd stages (``zstd(int4)``
    decodes to exactly what ``int4`` does, so its BLEU row is theirs)."""
    codec = get_codec(spec)
    while isinstance(codec, ZstdCodec):
        codec = codec.inner
    return codec.spec


def _key(result: dict[str, Any]) -> tuple[str, str, int, int]:
    codecs = (lossy_part(result["forward"]), lossy_part(result["backward"]))
    return (*codecs, int(result.get("cut_k", 0)), int(result.get("cut_cotrain", 0)))
