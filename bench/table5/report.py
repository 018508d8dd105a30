"""The Table 5 report: markdown (the doc's results section), the BLEU / speed-up PNG and the saved outputs.

Apart from ``run.py`` so the runner reads as the experiment (rows, runs, link clock) and this
file as what a reader sees; the checks the report states are ``checks.py``'s.
"""

from __future__ import annotations

import itertools
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import checks
import stats

from bench.faults.common import PALETTE, Canvas


def _spread(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def pareto_png(path: Path, rows: list[dict[str, Any]]) -> None:
    """BLEU (y) against speed-up (x, log2), one dot per row, the Pareto front joined in red."""
    width, height, margin = 640, 360, 30
    canvas = Canvas(width, height)
    xs = [row["speedup"] for row in rows]
    ys = [statistics.mean(row["bleu"]) for row in rows]
    x_hi = max(2.0, max(xs) * 1.1)
    y_lo, y_hi = min(ys) - 1, max(ys) + 1

    def px(x: float, y: float) -> tuple[int, int]:
        fx = (torch.log2(torch.tensor(max(x, 1.0))) / torch.log2(torch.tensor(x_hi))).item()
        return round(margin + fx * (width - 2 * margin)), round(
            height - margin - (y - y_lo) / (y_hi - y_lo) * (height - 2 * margin)
        )

    canvas.line(margin, height - margin, width - margin, height - margin, PALETTE["black"])
    canvas.line(margin, margin, margin, height - margin, PALETTE["black"])
    for tick in (1, 2, 4, 8, 16, 32):
        if tick <= x_hi:
            x, _ = px(tick, y_lo)
            canvas.line(x, height - margin, x, height - margin + 6, PALETTE["black"])
    front = sorted(
        (
            r
            for r in rows
            if not any(
                o["speedup"] >= r["speedup"] and statistics.mean(o["bleu"]) > statistics.mean(r["bleu"])
                for o in rows
            )
        ),
        key=lambda r: r["speedup"],
    )
    for a, b in itertools.pairwise(front):
        canvas.line(
            *px(a["speedup"], statistics.mean(a["bleu"])),
            *px(b["speedup"], statistics.mean(b["bleu"])),
            PALETTE["red"],
        )
    for row, x, y in zip(rows, xs, ys, strict=True):
        colour = (
            PALETTE["green"]
            if row["cut_k"]
            else PALETTE["blue"]
            if row["forward"] != "none"
            else PALETTE["black"]
        )
        canvas.dot(*px(x, y), colour, r=3)
    canvas.save(path)


def markdown(report: dict[str, Any], figure10_label: str) -> str:
    rows, fig = report["rows"], report["figure10"]
    none = rows[0]
    model = report["model"]
    head = (
        f"Link {report['bandwidth_mbit']:g} Mbit/s, {report['delay_ms']:g} ms one-way (the WAN emulator); "
        f"{report['mode']} run: {report['seeds']} seeds x {report['steps']} fine-tuning steps per row, "
        f"batch {model.get('finetune_batch') or model['batch']} x {model['length']} tokens "
        f"x d={model['d_model']} (pre-training batch {model['batch']}), "
        f"{report['eval_pairs']} {report['split']} pairs, "
        f"pre-training {model['pretrain_steps']} steps per side"
        + (
            f" then {model['translation_steps']} steps of the whole model on the training pairs; "
            if model.get("translation_steps")
            else "; "
        )
        + f"vocabularies of {model['vocab']} words per side, fine-tuning lr {model['lr']:g}; "
        + f"greedy decoding with no {report.get('no_repeat_ngram', 0)}-gram twice; "
        + f"{report['wall_seconds'] / 60:.1f} min wall, load average {report['load_before'][0]:.1f} before / "
        f"{report['load_after'][0]:.1f} after on {report['cpus']} CPUs."
    )
    lines = [
        head,
        "",
        f"Codec none: compute-only step {1000 * none['compute_seconds']:.0f} ms (CPU time, one thread; "
        f"{1000 * none.get('compute_wall_seconds', 0):.0f} ms wall on the shared host), "
        f"link {1000 * none['link_seconds']:.0f} ms, "
        f"step / compute = **{none['step_seconds'] / none['compute_seconds']:.1f}x** (target >= 6x).",
        *lookup_markdown(report),
        "",
        "| row | forward | backward | BLEU | chrF | BLEU - none [95%] | within budget "
        "| fwd ratio | bwd ratio | compute ms (CPU) | link ms | s/step | speed-up |",
        "|---|---|---|---:|---:|---:|:-:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        versus = row["versus_none"]
        lines.append(
            f"| {row['label']} | `{row['forward']}` | `{row['backward']}` | "
            f"{statistics.mean(row['bleu']):.2f} ± {_spread(row['bleu']):.2f} | "
            f"{statistics.mean(row['chrf']):.1f} ± {_spread(row['chrf']):.1f} | "
            f"{versus['difference']:+.2f} [{versus['low']:+.2f}, {versus['high']:+.2f}] | "
            f"{'yes' if versus['within_budget'] else 'no'} | "
            f"{row['forward_ratio']:.1f}x | {row['backward_ratio']:.1f}x | "
            f"{1000 * row['compute_seconds']:.0f} | {1000 * row['link_seconds']:.0f} | "
            f"{row['step_seconds']:.3f} | {row['speedup']:.1f}x |"
        )
    lines += [
        "",
        "BLEU and chrF: mean ± sample standard deviation over the seeds (sacrebleu, both lower-cased). "
        "BLEU - none: the mean paired difference and its 95% interval by a bootstrap over sentences and "
        f"seeds (`bench/table5/stats.py`, {stats.SAMPLES} replicates); within budget: the one-sided 95% "
        f"bound above -{stats.BUDGET_SHARE:.0%} of none's BLEU (-{none['versus_none']['budget']:.2f}), "
        "a non-inferiority test"
        + (
            f" (this quick run: final fine-tuning loss within {checks.QUICK_LOSS_BUDGET:.0%} of none's "
            "instead). "
            if report["mode"] == "quick"
            else ". "
        )
        + "Ratios: the padded batch's raw float32 bytes / frame bytes (header included). No row sends the"
        " padding (the stream leaves zero rows out, `present_rows`), so none's ratio is the padding's share."
        " Bottleneck rows: the cut is k wide, so both ratios include d/k. `zstd` rows: the last step's frames"
        " (the size varies by step).",
        *control_markdown(rows),
    ]
    if len(fig) > 1:
        lines += [
            "",
            "Figure 10 analogue (" + figure10_label + ", codec none before the start step):",
            "",
            "| compression from | BLEU | seeds | mean s/step |",
            "|---:|---:|---:|---:|",
        ]
    for point in fig if len(fig) > 1 else []:
        lines.append(
            f"| {point['start_fraction']:.0%} | {statistics.mean(point['bleu']):.2f} ± "
            f"{_spread(point['bleu']):.2f} | {len(point['bleu'])} | {point['step_seconds']:.3f} |"
        )
    if len(fig) > 1:
        lines += ["", checks.figure10_trend(fig)]
    lines += advisor_markdown(report)
    lines += [
        "",
        "![BLEU against speed-up]("
        + report["png"]
        + ") x: speed-up over none (log2 axis, ticks at 1, 2, 4, 8, 16, 32), "
        "y: mean BLEU; black: none, blue: wire codecs, green: learned bottleneck, red: the Pareto front.",
    ]
    return "\n".join(lines) + "\n"


def lookup_markdown(report: dict[str, Any]) -> list[str]:
    """The lookup baseline on the same pairs, paired against none."""
    found = report.get("lookup")
    if not found:
        return []
    versus = found["versus_none"]
    return [
        "",
        f"Lookup baseline (`bench/table5/lookup.py`: the English of the most similar Spanish training "
        f"source): BLEU **{found['bleu']:.2f}**, chrF {found['chrf']:.1f}; none - lookup "
        f"{-versus['difference']:+.2f} BLEU [{-versus['high']:+.2f}, {-versus['low']:+.2f}].",
    ]


def advisor_markdown(report: dict[str, Any]) -> list[str]:
    """How the product's ``auto`` chose the ``auto`` row's pair (what a job records) and the 10% rule."""
    check = report.get("advisor_check")
    pick = next((row for row in report["rows"] if row["label"] == checks.AUTO_LABEL), None)
    if not check or pick is None or "advice" not in pick:
        return []
    choice = pick["advice"]["choice"]
    trial = choice.get("trial") or {}
    return [
        "",
        f"`auto` (the product's `codec: auto` on this job: the micro-batch probe, the codec service's "
        f"ranking on this host's calibration, then the trial when the job pays for one; "
        f"`bench/table5/advisor.py`, {pick['advice']['seconds']:.0f} s) chose "
        f"**`{pick['forward']}` / `{pick['backward']}`**: predicted "
        f"{choice['predicted_step_seconds']:.3f} s a step, none {choice['baseline_step_seconds']:.3f} "
        f"(the job's pipeline of {pick['advice']['micro_batches']} micro-batches, not this table's "
        "synchronous model).",
        "",
        *(f"- {reason}" for reason in trial.get("reasons", [])),
        "",
        f"`auto` ({check['advisor_pick_step_seconds']:.3f} s/step here, "
        f"{'within' if check['advisor_pick_within_budget'] else 'outside'} the "
        + (
            f"loss budget of {checks.QUICK_LOSS_BUDGET:.0%}"
            if check.get("budget_basis") == "loss"
            else f"BLEU budget of {check['bleu_budget']:.2f}"
        )
        + f") against the fastest codec row within it, {check['fastest_within_budget']} "
        f"({check['fastest_within_budget_step_seconds']:.3f} s/step): ratio **{check['ratio']:.3f}** "
        f"(rule: <= {checks.ADVISOR_SPEED_RULE:.2f} and within budget): "
        f"**{'met' if check['ok'] else 'NOT met'}**.",
    ]


def save_outputs(folder: Path, report: dict[str, Any]) -> None:
    """Every run's per-sentence outputs, one file per row and seed (line i: pair i of the split)."""
    folder.mkdir(parents=True, exist_ok=True)
    runs = [("lookup", report["lookup"]["hypotheses"])] if report.get("lookup") else []
    for row in report["rows"]:
        slug = re.sub(r"[^A-Za-z0-9]+", "-", row["label"]).strip("-").lower()
        runs += [(f"{slug}.seed{seed}", lines) for seed, lines in enumerate(row["hypotheses"])]
    runs.append(("references", report["references"]))
    for name, lines in runs:
        (folder / f"{name}.txt").write_text("".join(f"{line}\n" for line in lines), encoding="utf-8")


def summary(report: dict[str, Any]) -> dict[str, Any]:
    """The report without its per-sentence outputs (those are the ``-outputs`` folder's files)."""
    rows = [{k: v for k, v in row.items() if k != "hypotheses"} for row in report["rows"]]
    found = report.get("lookup")
    lookup_found = {k: v for k, v in found.items() if k != "hypotheses"} if found else None
    kept = {k: v for k, v in report.items() if k != "references"}
    return {**kept, "rows": rows, "lookup": lookup_found}


def control_markdown(rows: list[dict[str, Any]]) -> list[str]:
    """A co-trained row against its control: the same extra training without the bottleneck."""
    lines = []
    for row in rows:
        versus = row.get("versus_control")
        if versus:
            lines += [
                "",
                f"{row['label']} against {versus['control']} (none's halves trained as many more steps, "
                f"without the bottleneck): BLEU {versus['difference']:+.2f} [{versus['low']:+.2f}, "
                f"{versus['high']:+.2f}], within budget (-{versus['budget']:.2f}): "
                f"**{'yes' if versus['within_budget'] else 'no'}**.",
            ]
    return lines
