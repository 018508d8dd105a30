"""Table 5 analogue: ABNet Es->En over a WAN-bound link, BLEU/chrF against speed-up per codec.

Why this shape: the paper's Table 5 (60 Mbit/s Internet, V100s) is link-bound: codec
none spends most of its 4.42 s step on the WAN. Our CPUs compute ~100x slower, so the
link is scaled down instead (default 2 Mbit/s, 10 ms one-way) until codec none's step is
>= 6x its compute-only step, measured here, not assumed:

* compute-only step: the median CPU time (one torch thread) of a fine-tuning step in one
  process, both stages' forward and backward plus the row's real encode/decode at the cut
  (``train.fine_tune``), with no link: what the step computes on an idle core. Wall time is
  recorded beside it but not used: on a shared host it counts other processes' turns;
* link: the row's real frames of a step (serialized header + payload, forward then the
  gradient back) sent through ``nebula_common.wan.WanEmulator`` at the chosen shape
  between two loopback sockets, median of several exchanges;
* s/step = compute + link: a synchronous step with one micro-batch, as the paper's
  rows are (a pipelined schedule would hide part of the compute for every row alike).

Quality comes from full fine-tuning runs with the codecs in the loop (``train.py``), >= 3
seeds per row in the full run, greedy decoding of the held-out split, sacrebleu BLEU/chrF.
Writes ``table5.json``, ``table5.md`` and ``table5-pareto.png`` into ``--out``; with ``--doc``
also the results section of that markdown file.

    .venv/bin/python bench/table5/run.py [--quick] --out bench-results/table5 --doc docs/bench/table5.md
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import re
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import checks
import corpus
import train

from bench.faults.common import PALETTE, Canvas
from nebula_common.codec.trial import Candidate, Link, TrialRun, choose_by_trial
from nebula_common.wan import LinkShape, WanEmulator
from nebula_common.zoo.adapters import NO_REPEAT_NGRAM

Row = train.Row
CALIBRATED = {"down_residual": 256, "up_residual": 256, "cut_pretrain": 3000}
"""The calibrated bottleneck: residual paths of width 256 on both halves, trained 3,000 steps
as an autoencoder on the starting model's cut activations before fine-tuning (``pretrain_bottleneck``;
the product's ``calibrate`` + ``cut_init``). It keeps 88% of the cut's energy at k = 16, the linear
start 69%."""
FULL_ROWS = (
    Row("none"),
    Row("FP16+INT8", "fp16", "int8"),
    *(Row(f"FP16(SVD({r}))+INT8", f"fp16(svd({r}))", "int8") for r in (0.9, 0.6, 0.4, 0.2)),
    Row("FP16(LOWRANK(8))+INT8", "fp16(lowrank(8))", "int8"),
    Row("POWERSGD(8)+INT8", "fp16(powersgd(8))", "int8"),
    Row("EF(TOPK(0.1)) both", "ef(fp16(topk(0.1)))", "ef(fp16(topk(0.1)))"),
    Row("ZSTD(FP16)+ZSTD(INT8)", "zstd(fp16)", "zstd(int8)"),
    Row("ZSTD(INT8) both", "zstd(int8)", "zstd(int8)"),
    Row("BOTTLENECK(16,AE)+INT8", "int8", "int8", cut_k=16, **CALIBRATED),
    Row("BOTTLENECK(48)+ZSTD(INT8)", "zstd(int8)", "zstd(int8)", cut_k=48),
)
"""The full plan's rows: the paper's, lossless zstd over int8 (it takes out the padding rows), and the learned
bottleneck at 16x both ways (k = 16 calibrated, with int8; the linear start's k = 16 row, 2.2 BLEU short,
is in EXTRA_ROWS) and with zstd (k = 48). Two shards take the rows alternately:
shard 0 also runs the advisor and shard 1 the Figure 10 row's extra runs, so the row count keeps them even."""
EXTRA_ROWS = (
    Row("BOTTLENECK(16)+INT8", "int8", "int8", cut_k=16),
    Row("BOTTLENECK(16)", cut_k=16),
    Row("BOTTLENECK(32)+INT8", "int8", "int8", cut_k=32),
    Row("BOTTLENECK(16)+FP16", "fp16", "fp16", cut_k=16),
    Row("BOTTLENECK(16,residual)+INT8", "int8", "int8", cut_k=16, residual=True),
    Row("BOTTLENECK(32)+ZSTD(INT8)", "zstd(int8)", "zstd(int8)", cut_k=32),
    Row("BOTTLENECK(4)", cut_k=4),
    Row("BOTTLENECK(4)+INT8", "int8", "int8", cut_k=4),
    Row("BOTTLENECK(16,AE)+ZSTD(INT8)", "zstd(int8)", "zstd(int8)", cut_k=16, **CALIBRATED),
    Row("BOTTLENECK(8,AE)+INT8", "int8", "int8", cut_k=8, **CALIBRATED),
)
"""Rows of the probes (docs/bench/table5.md), not in the full plan: ``--rows`` can name them."""
_BY_LABEL = {row.label: row for row in (*FULL_ROWS, *EXTRA_ROWS)}
QUICK_ROWS = tuple(
    replace(_BY_LABEL[label], cut_pretrain=min(_BY_LABEL[label].cut_pretrain, 200))
    for label in ("none", "FP16+INT8", "FP16(SVD(0.2))+INT8", "BOTTLENECK(16,AE)+INT8")
)
"""A smoke run of every stage: the calibrated row's autoencoder pre-training shortened to 200 steps."""
FIGURE10_ROW = FULL_ROWS[5]  # the paper's fastest row, FP16(SVD(0.2))+INT8
FIGURE10_STARTS = (0.0, 0.10, 0.25)
FULL_MODEL = train.ModelConfig(
    pretrain_steps=400, lr=1e-2, warmup=50, train_head=True, finetune_batch=128, cut_lr=1e-4
)
"""The full plan's model: the best of the probes (docs/bench/table5.md): LMs pre-trained 400
steps a side (batch 32, the cached LMs); the adapters and the decoder's output layer fine-tuned with Adam
at 1e-2 after a 50-step linear warm-up, 128 sentence pairs a step (8.60 BLEU at 300 steps in the probe)."""
FULL = {"seeds": 3, "steps": 300, "eval_pairs": None, "advisor_steps": 90, "model": FULL_MODEL}
"""About 40 minutes on 2 cores (docs/bench/table5.md: 39.5 min measured end to end on a loaded host):
13 rows x 3 seeds + Figure 10's 2 starts x 2 seeds = 43 runs of ~95 CPU s, the advisor's trials (~200 CPU s)
and the link clock (~1 min), over 2 shards; pre-training (~90 CPU s) once, cached after."""
FIGURE10_SEEDS = 2
"""Seeds of each later-start Figure 10 point (the 0% point is the row itself, all seeds): even shards."""
QUICK = {
    "seeds": 2,
    "steps": 20,
    "eval_pairs": 64,
    "advisor_steps": 4,
    "model": replace(FULL_MODEL, vocab=2000, pretrain_steps=30, finetune_batch=0),
}


BLEU_BUDGET = 1.0
"""The quality budget the advisor's pick is checked against: mean BLEU within 1.0 of codec none's."""
ADVISOR_LOSS_TOLERANCE = 0.02
"""The advisor's own budget (it cannot decode BLEU in a calibration): trial loss within 2% of none's."""
ADVISOR_PROGRESS_TOLERANCE = 0.10
"""And the trial-loss gap may be at most 10% of what none's loss fell during the trial (the first half's
mean minus the last half's): a harmful row's gap opens as training starts to pay, when it is still ~1-2%
of the loss (the probes of docs/bench/table5.md: at 90 steps the bottleneck rows were +1.6-2.2% over none)."""
ADVISOR_MAX_TRIALS = 6
"""Rows trained in the trial at most, fastest-predicted first (several bottleneck rows are predicted fast)."""
ADVISOR_SPEED_RULE = 1.10
"""Its pick's measured s/step must be within 10% of the fastest row that meets the BLEU budget."""


def row_labels(text: str) -> list[str]:
    """``--rows``' labels: split at commas outside parentheses ("BOTTLENECK(16,residual)+INT8" is one)."""
    return [label.strip() for label in re.split(r",(?![^()]*\))", text) if label.strip()]


def advise(prep: train.Prepared, rows: tuple[Row, ...], shape: LinkShape, trial_steps: int) -> dict[str, Any]:
    """``codec: auto`` on the benchmark: the trial advisor (``nebula_common.codec.trial``) over the rows.

    It sees what a job would before it starts: the link's bandwidth and RTT, a few real steps per
    row (compute and frame bytes -> predicted s/step), and ``trial_steps`` steps of the
    fastest-predicted rows against none's (seed 0, same data), never the table's BLEU or timings.
    """
    by_label = {row.label: row for row in rows}

    def run(candidate: Candidate, steps: int) -> TrialRun:
        done = train.train_steps(prep, by_label[candidate.label], seed=0, steps=steps)
        return TrialRun(done.losses, done.compute_seconds, done.forward_bytes[-1], done.backward_bytes[-1])

    started = time.perf_counter()
    link = Link(bandwidth_bps=shape.bandwidth_mbit * 1e6, rtt_seconds=2 * shape.delay_ms / 1000)
    decision = choose_by_trial(
        [Candidate(row.forward, row.backward, row.label) for row in rows[1:]],
        run,
        link,
        tolerance=ADVISOR_LOSS_TOLERANCE,
        progress_tolerance=ADVISOR_PROGRESS_TOLERANCE,
        max_trials=ADVISOR_MAX_TRIALS,
        trial_steps=trial_steps,
        baseline=Candidate(rows[0].forward, rows[0].backward, rows[0].label),
    )
    record = {**decision.record(), "seconds": time.perf_counter() - started}
    print(json.dumps({"advisor": record["label"], "seconds": round(record["seconds"], 1)}), flush=True)
    return record


def advisor_check(report: dict[str, Any]) -> dict[str, Any] | None:
    """The 10% rule: the advisor's pick against the fastest row whose mean BLEU is within budget of none's."""
    advice = report.get("advisor")
    if not advice:
        return None
    rows = {row["label"]: row for row in report["rows"]}
    floor = statistics.mean(report["rows"][0]["bleu"]) - BLEU_BUDGET
    within = [row for row in report["rows"] if statistics.mean(row["bleu"]) >= floor]
    fastest = min(within, key=lambda row: row["step_seconds"])  # none itself is always within
    pick = rows[advice["label"]]
    ratio = pick["step_seconds"] / fastest["step_seconds"]
    pick_within = statistics.mean(pick["bleu"]) >= floor
    return {
        "advisor_pick": pick["label"],
        "advisor_pick_step_seconds": pick["step_seconds"],
        "advisor_pick_within_budget": pick_within,
        "fastest_within_budget": fastest["label"],
        "fastest_within_budget_step_seconds": fastest["step_seconds"],
        "ratio": ratio,
        "bleu_budget": BLEU_BUDGET,
        "ok": pick_within and ratio <= ADVISOR_SPEED_RULE,
    }


async def _link_seconds(shape: LinkShape, forward: bytes, backward: bytes, repeats: int) -> list[float]:
    """Seconds per (forward frame there, backward frame back) through a real emulated link."""

    done = asyncio.Event()

    async def peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while size := int.from_bytes(await reader.readexactly(4), "big"):  # 0: the sender is done
                await reader.readexactly(size)
                writer.write(len(backward).to_bytes(4, "big") + backward)
                await writer.drain()
        finally:
            writer.close()
            done.set()

    server = await asyncio.start_server(peer, "127.0.0.1", 0)
    try:
        target = server.sockets[0].getsockname()[1]
        async with WanEmulator("127.0.0.1", target, shape) as emulator:
            reader, writer = await asyncio.open_connection("127.0.0.1", emulator.port)
            times = []
            for attempt in range(repeats + 1):  # the first exchange opens the path; not counted
                started = time.perf_counter()
                writer.write(len(forward).to_bytes(4, "big") + forward)
                await writer.drain()
                size = int.from_bytes(await asyncio.wait_for(reader.readexactly(4), 120), "big")
                await asyncio.wait_for(reader.readexactly(size), 120)
                if attempt:
                    times.append(time.perf_counter() - started)
            writer.write((0).to_bytes(4, "big"))
            await writer.drain()
            await asyncio.wait_for(done.wait(), 60)  # the peer has read the end marker and closed
            writer.close()
            return times
    finally:
        server.close()
        await server.wait_closed()


def link_seconds(shape: LinkShape, forward: bytes, backward: bytes, repeats: int) -> float:
    return statistics.median(asyncio.run(_link_seconds(shape, forward, backward, repeats)))


def _spread(values: list[float]) -> float:
    return statistics.stdev(values) if len(values) > 1 else 0.0


def run_row(
    prep: train.Prepared, row: Row, seeds: int, steps: int, eval_pairs: int, shape: LinkShape, repeats: int
) -> dict[str, Any]:
    runs = []
    for seed in range(seeds):
        result = train.fine_tune(prep, row, seed, steps, eval_pairs)
        runs.append(result)
        print(
            json.dumps(
                {"row": row.label, "seed": seed, "bleu": round(result.bleu, 2), "loss": result.losses[-1]}
            ),
            flush=True,
        )
    frames = runs[0].last_frames
    skip = min(5, steps - 1)  # the first steps pay one-off allocations
    compute = statistics.median(s for r in runs for s in r.compute_seconds[skip:])
    wall = statistics.median(s for r in runs for s in r.wall_seconds[skip:])
    link = link_seconds(shape, frames[0], frames[1], repeats)
    raw = prep.config.tune_batch * prep.config.length * prep.config.d_model * 4
    return {
        **asdict(row),
        "bleu": [r.bleu for r in runs],
        "chrf": [r.chrf for r in runs],
        "final_loss": [statistics.mean(r.losses[-20:]) for r in runs],
        "forward_frame_bytes": len(frames[0]),
        "backward_frame_bytes": len(frames[1]),
        "forward_ratio": raw / len(frames[0]),
        "backward_ratio": raw / len(frames[1]),
        "compute_seconds": compute,
        "compute_wall_seconds": wall,
        "link_seconds": link,
        "step_seconds": compute + link,
        "captured_energy": runs[0].energy,
        "eval_seconds": statistics.mean(r.eval_seconds for r in runs),
        "samples": runs[0].hypotheses,
    }


def figure10_runs(prep: train.Prepared, seeds: int, steps: int, eval_pairs: int) -> list[dict[str, Any]]:
    """Compression from 10 / 25 % of training on (the paper's Figure 10); before it, codec none."""
    runs = []
    for fraction in FIGURE10_STARTS[1:]:
        start = round(fraction * steps)
        row = replace(
            FIGURE10_ROW,
            label=f"{FIGURE10_ROW.label} from {fraction:.0%}",
            forward=f"start({FIGURE10_ROW.forward},{start})",
            backward=f"start({FIGURE10_ROW.backward},{start})",
        )
        bleu = [train.fine_tune(prep, row, seed, steps, eval_pairs).bleu for seed in range(seeds)]
        runs.append({"start_fraction": fraction, "start": start, "bleu": bleu})
        print(json.dumps({"figure10": fraction, "bleu": bleu}), flush=True)
    return runs


def figure10_points(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Figure 10's points: BLEU, and the mean s/step of none before the start and the row's after it."""
    rows = {row["label"]: row for row in report["rows"]}
    if FIGURE10_ROW.label not in rows:  # a reduced run without that row
        return []
    base, none, steps = rows[FIGURE10_ROW.label], report["rows"][0], report["steps"]
    points = [{"start_fraction": 0.0, "bleu": base["bleu"], "step_seconds": base["step_seconds"]}]
    for run in report["figure10_runs"]:
        start = run["start"]
        mean_step = (start * none["step_seconds"] + (steps - start) * base["step_seconds"]) / steps
        points.append(
            {"start_fraction": run["start_fraction"], "bleu": run["bleu"], "step_seconds": mean_step}
        )
    return points


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


def markdown(report: dict[str, Any]) -> str:
    rows, fig = report["rows"], report["figure10"]
    none = rows[0]
    model = report["model"]
    head = (
        f"Link {report['bandwidth_mbit']:g} Mbit/s, {report['delay_ms']:g} ms one-way (the WAN emulator); "
        f"{report['mode']} run: {report['seeds']} seeds x {report['steps']} fine-tuning steps per row, "
        f"batch {model.get('finetune_batch') or model['batch']} x {model['length']} tokens "
        f"x d={model['d_model']} (pre-training batch {model['batch']}), "
        f"{report['eval_pairs']} held-out pairs, pre-training {model['pretrain_steps']} steps per side; "
        f"greedy decoding with no {report.get('no_repeat_ngram', 0)}-gram twice; "
        f"{report['wall_seconds'] / 60:.1f} min wall, load average {report['load_before'][0]:.1f} before / "
        f"{report['load_after'][0]:.1f} after on {report['cpus']} CPUs."
    )
    lines = [
        head,
        "",
        f"Codec none: compute-only step {1000 * none['compute_seconds']:.0f} ms (CPU time, one thread; "
        f"{1000 * none.get('compute_wall_seconds', 0):.0f} ms wall on the shared host), "
        f"link {1000 * none['link_seconds']:.0f} ms, "
        f"step / compute = **{none['step_seconds'] / none['compute_seconds']:.1f}x** (target >= 6x).",
        "",
        "| row | forward | backward | BLEU | chrF | fwd ratio | bwd ratio | compute ms (CPU) | link ms "
        "| s/step "
        "| speed-up |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['label']} | `{row['forward']}` | `{row['backward']}` | "
            f"{statistics.mean(row['bleu']):.2f} ± {_spread(row['bleu']):.2f} | "
            f"{statistics.mean(row['chrf']):.1f} ± {_spread(row['chrf']):.1f} | "
            f"{row['forward_ratio']:.1f}x | {row['backward_ratio']:.1f}x | "
            f"{1000 * row['compute_seconds']:.0f} | {1000 * row['link_seconds']:.0f} | "
            f"{row['step_seconds']:.3f} | {row['speedup']:.1f}x |"
        )
    lines += [
        "",
        "BLEU and chrF: mean ± sample standard deviation over the seeds (sacrebleu, BLEU lower-cased). "
        "Ratios: raw float32 bytes / frame bytes (header included). Bottleneck rows: the cut is k wide,"
        " so both ratios include d/k. `zstd` rows: the last step's frames (the size varies by step).",
    ]
    if len(fig) > 1:
        lines += [
            "",
            "Figure 10 analogue (" + FIGURE10_ROW.label + ", codec none before the start step):",
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


def advisor_markdown(report: dict[str, Any]) -> list[str]:
    """The advisor's reasoning (what ``codec: auto`` would record) and the 10% rule's verdict."""
    advice, check = report.get("advisor"), report.get("advisor_check")
    if not advice or not check:
        return []
    lines = [
        "",
        f"Advisor (`codec: auto`, `nebula_common/codec/trial.py`; {advice['trial_steps']} trial steps per "
        f"candidate, loss tolerance {advice['loss_tolerance']:.0%}"
        + (
            f", progress tolerance {advice['progress_tolerance']:.0%}"
            if advice.get("progress_tolerance") is not None
            else ""
        )
        + f", {advice['seconds']:.0f} s): "
        f"picked **{check['advisor_pick']}**.",
        "",
        *(f"- {reason}" for reason in advice["reasons"]),
        "",
        f"`advisor_pick` {check['advisor_pick']} ({check['advisor_pick_step_seconds']:.3f} s/step, "
        f"{'within' if check['advisor_pick_within_budget'] else 'outside'} the BLEU budget of "
        f"{check['bleu_budget']:g}); `fastest_within_budget` {check['fastest_within_budget']} "
        f"({check['fastest_within_budget_step_seconds']:.3f} s/step); ratio **{check['ratio']:.3f}** "
        f"(rule: <= {ADVISOR_SPEED_RULE:.2f} and within budget): **{'met' if check['ok'] else 'NOT met'}**.",
    ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="A smoke run (minutes): few rows, steps and pairs."
    )
    parser.add_argument("--cache", type=Path, default=Path(".cache") / "table5")
    parser.add_argument("--out", type=Path, default=Path("bench") / "results" / "table5")
    parser.add_argument("--doc", type=Path, help="Also rewrite this markdown file's results section.")
    parser.add_argument("--bandwidth-mbit", type=float, default=2.0)
    parser.add_argument("--delay-ms", type=float, default=10.0)
    parser.add_argument("--seeds", type=int)
    parser.add_argument("--steps", type=int)
    parser.add_argument("--pretrain-steps", type=int)
    parser.add_argument(
        "--finetune-batch",
        type=int,
        help="Sentence pairs per fine-tuning step (pre-training keeps its batch).",
    )
    parser.add_argument("--eval-pairs", type=int)
    parser.add_argument(
        "--advisor-steps", type=int, help="Trial steps per candidate of the advisor (codec auto)."
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: stable timings on a shared host)"
    )
    parser.add_argument(
        "--shard", help="I/N: run only rows I, I+N, ... (and Figure 10 with its row); --merge after"
    )
    parser.add_argument(
        "--merge", type=Path, nargs="+", help="Combine shard JSONs into the report; no training."
    )
    parser.add_argument(
        "--rows",
        help="Comma-separated row labels (none first) for a reduced run of a few rows; the advisor "
        "picks among them",
    )
    parser.add_argument(
        "--no-figure10", action="store_true", help="Skip the Figure 10 runs (compression started later)."
    )
    parser.add_argument(
        "--prepare-only", action="store_true", help="Fetch the corpus and pre-train (cached), then stop."
    )
    args = parser.parse_args()
    if args.merge:
        shards = [json.loads(path.read_text()) for path in args.merge]
        report = {**shards[0], "rows": [], "figure10_runs": [], "shards": len(shards)}
        order = report.get("row_labels") or [
            row.label for row in (QUICK_ROWS if report["mode"] == "quick" else FULL_ROWS)
        ]
        for shard in shards:
            report["rows"] += shard["rows"]
            report["figure10_runs"] += shard["figure10_runs"]
            report["advisor"] = report.get("advisor") or shard.get("advisor")
            report["wall_seconds"] = max(report["wall_seconds"], shard["wall_seconds"])
            report["load_after"] = max(report["load_after"], shard["load_after"])
        report["rows"].sort(key=lambda row: order.index(row["label"]))
        if [row["label"] for row in report["rows"]] != order:
            sys.exit(f"table5: the shards hold rows {[r['label'] for r in report['rows']]}, expected {order}")
        finish(report, args)
        return
    index, count = 0, 1
    if args.shard:
        try:
            index, count = (int(part) for part in args.shard.split("/"))
        except ValueError:
            sys.exit(f"table5: --shard takes I/N (e.g. 0/2), got {args.shard!r}")
        if not 0 <= index < count:
            sys.exit(f"table5: --shard {args.shard}: I must be in 0..N-1")
    plan = dict(QUICK if args.quick else FULL)
    seeds, steps = args.seeds or plan["seeds"], args.steps or plan["steps"]
    if seeds < 1 or steps < 2:
        sys.exit("table5: --seeds must be >= 1 and --steps >= 2")
    if args.pretrain_steps is not None:
        plan["model"] = replace(plan["model"], pretrain_steps=args.pretrain_steps)
    if args.eval_pairs is not None:
        plan["eval_pairs"] = args.eval_pairs
    if args.finetune_batch is not None:
        if args.finetune_batch < 1:
            sys.exit(f"table5: --finetune-batch must be >= 1, got {args.finetune_batch}")
        plan["model"] = replace(plan["model"], finetune_batch=args.finetune_batch)
    advisor_steps = args.advisor_steps or plan["advisor_steps"]
    if advisor_steps < 2:
        sys.exit("table5: --advisor-steps must be >= 2")
    plan_rows = QUICK_ROWS if args.quick else FULL_ROWS
    if args.rows:
        by_label = {row.label: row for row in (plan_rows if args.quick else (*FULL_ROWS, *EXTRA_ROWS))}
        labels = row_labels(args.rows)
        unknown = [label for label in labels if label not in by_label]
        if unknown or labels[0] != plan_rows[0].label:
            sys.exit(
                f"table5: --rows takes labels of {list(by_label)}, {plan_rows[0].label!r} first; got {labels}"
            )
        plan_rows = tuple(by_label[label] for label in labels)
    overridden = any(
        v is not None
        for v in (
            args.seeds,
            args.steps,
            args.pretrain_steps,
            args.eval_pairs,
            args.advisor_steps,
            args.rows,
            args.finetune_batch,
        )
    )
    mode = "quick" if args.quick else "reduced" if overridden else "full"
    torch.set_num_threads(args.threads)
    started, load_before = time.perf_counter(), os.getloadavg()
    try:
        manifest_path = args.cache / "corpus" / "manifest.json"
        manifest = (
            json.loads(manifest_path.read_text()) if manifest_path.exists() else corpus.build(args.cache)
        )
    except corpus.CorpusError as exc:
        sys.exit(f"table5: corpus: {exc}")
    train_pairs = corpus.read_split(args.cache / "corpus" / "train.tsv")
    held = corpus.read_split(args.cache / "corpus" / "held_out.tsv")
    eval_pairs = min(plan["eval_pairs"] or len(held), len(held))
    shape = LinkShape(bandwidth_mbit=args.bandwidth_mbit, delay_ms=args.delay_ms)
    prep = train.prepare(
        train_pairs, held, plan["model"], args.cache / "models", manifest["sha256"]["train.tsv"]
    )
    if args.prepare_only:
        print(json.dumps({"pretrain_losses": {k: [v[0], v[-1]] for k, v in prep.pretrain_losses.items()}}))
        return
    rows = []
    mine = [row for i, row in enumerate(plan_rows) if i % count == index]
    for row in mine:
        rows.append(run_row(prep, row, seeds, steps, eval_pairs, shape, repeats=3 if args.quick else 5))
    advisor = advise(prep, plan_rows, shape, advisor_steps) if index == 0 else None
    fig_runs = []
    if FIGURE10_ROW in mine and not args.no_figure10:
        fig_runs = figure10_runs(prep, 1 if args.quick else min(seeds, FIGURE10_SEEDS), steps, eval_pairs)
    report = {
        "mode": mode,
        "bandwidth_mbit": args.bandwidth_mbit,
        "delay_ms": args.delay_ms,
        "seeds": seeds,
        "steps": steps,
        "eval_pairs": eval_pairs,
        "model": asdict(plan["model"]),
        "corpus": {k: manifest[k] for k in ("train", "held_out", "sha256")},
        "pretrain_losses": {k: [v[0], v[-1]] for k, v in prep.pretrain_losses.items()},
        "cpus": os.cpu_count(),
        "threads": args.threads,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "wall_seconds": time.perf_counter() - started,
        "rows": rows,
        "figure10_runs": fig_runs,
        "advisor": advisor,
        "row_labels": [row.label for row in plan_rows],
        "no_repeat_ngram": NO_REPEAT_NGRAM,
    }
    if count > 1:
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"table5-{report['mode']}-shard{index}of{count}.json"
        path.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
        print(f"shard written: {path}; combine with --merge")
        return
    finish(report, args)


def finish(report: dict[str, Any], args: argparse.Namespace) -> None:
    """Speed-ups, Figure 10, the PNG, JSON and markdown (and the doc's results section)."""
    rows = report["rows"]
    for row in rows:
        row["speedup"] = rows[0]["step_seconds"] / row["step_seconds"]
    report["figure10"] = figure10_points(report)
    report["advisor_check"] = advisor_check(report)
    stem = "table5-quick" if report["mode"] == "quick" else "table5"
    report["png"] = f"{stem}-pareto.png"
    args.out.mkdir(parents=True, exist_ok=True)
    pareto_png(args.out / report["png"], rows)
    (args.out / f"{stem}.json").write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    text = markdown(report)
    (args.out / f"{stem}.md").write_text(text)
    if args.doc is not None:
        begin, end = "<!-- table5:results -->", "<!-- /table5:results -->"
        doc = args.doc.read_text()
        if begin not in doc or end not in doc:
            sys.exit(f"table5: {args.doc} has no {begin} ... {end} section to rewrite")
        relative = os.path.relpath(args.out / report["png"], args.doc.parent)
        section = text.replace(f"]({report['png']})", f"]({relative})")
        doc = doc[: doc.index(begin) + len(begin)] + "\n" + section + doc[doc.index(end) :]
        args.doc.write_text(doc)
    print(text)
    failed = checks.failures(report)
    if failed:
        sys.exit("table5: " + "; ".join(failed))


if __name__ == "__main__":
    main()
