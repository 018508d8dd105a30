"""Table 5 analogue: ABNet Es->En over a WAN-bound link, BLEU/chrF against speed-up per codec.

Why this shape: the paper's Table 5 (60 Mbit/s Internet, V100s) is link-bound: codec
none spends most of its 4.42 s step on the WAN. Our CPUs compute ~100x slower, so the
link is scaled down instead (default 1 Mbit/s, 10 ms one-way) until codec none's step is
>= 6x its compute-only step, measured here, not assumed. None sends the real positions only (the
stream leaves padding rows out, ``nebula_common.codec.row_elision``), so it is an honest baseline:

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
seeds per row in the full run, greedy decoding of the test split (dev in quick and reduced runs:
tuning never reads test), sacrebleu BLEU/chrF, each row paired against none (``stats.py``), and the
lookup baseline (``lookup.py``) on the same pairs.
Writes ``table5.json``, ``table5.md`` and ``table5-pareto.png`` into ``--out``; with ``--doc``
also the results section of that markdown file.

    .venv/bin/python bench/table5/run.py [--quick] --out bench-results/table5 --doc docs/bench/table5.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import advisor
import checks
import corpus
import cotrain
import figure10
import lookup
import merge
import report as reporting
import train
from link_clock import link_seconds
from plan import (
    EXTRA_ROWS,
    FIGURE10_ROW,
    FIGURE10_SEEDS,
    FIGURE10_STARTS,
    FULL,
    FULL_ROWS,
    QUICK,
    QUICK_ROWS,
    Row,
    row_labels,
)

from nebula_common.wan import LinkShape
from nebula_common.zoo.adapters import NO_REPEAT_NGRAM


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
        "source_gap": [r.source_gap for r in runs],
        "hypotheses": [r.hypotheses for r in runs],
        "first_loss": [statistics.mean(r.losses[:3]) for r in runs],
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
        "samples": runs[0].hypotheses[:6],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="A smoke run (minutes): few rows, steps and pairs."
    )
    parser.add_argument("--cache", type=Path, default=Path(".cache") / "table5")
    parser.add_argument("--out", type=Path, default=Path("bench") / "results" / "table5")
    parser.add_argument("--doc", type=Path, help="Also rewrite this markdown file's results section.")
    parser.add_argument("--bandwidth-mbit", type=float, default=1.0)
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
        "--split",
        choices=("dev", "test"),
        help="The evaluated split (default: test in the full run, dev otherwise: tuning never reads test).",
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
        help="Comma-separated row labels (none first) for a reduced run of a few rows ('auto': the "
        "product's codec auto picks the row's pair)",
    )
    parser.add_argument(
        "--no-figure10", action="store_true", help="Skip the Figure 10 runs (compression started later)."
    )
    parser.add_argument(
        "--prepare-only", action="store_true", help="Fetch the corpus and pre-train (cached), then stop."
    )
    args = parser.parse_args()
    if args.merge:
        try:
            shards = merge.read_shards(args.merge)
            quick = bool(shards) and shards[0].get("mode") == "quick"
            report = merge.merge(shards, [row.label for row in (QUICK_ROWS if quick else FULL_ROWS)])
        except merge.MergeError as exc:
            sys.exit(f"table5: --merge: {exc}")
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
            args.rows,
            args.finetune_batch,
        )
    )
    mode = "quick" if args.quick else "reduced" if overridden else "full"
    torch.set_num_threads(args.threads)
    started, load_before = time.perf_counter(), os.getloadavg()
    split = args.split or ("test" if mode == "full" else "dev")
    try:
        manifest, train_pairs, evaluated = corpus.load(args.cache, split)
    except corpus.CorpusError as exc:
        sys.exit(f"table5: corpus: {exc}")
    eval_pairs = min(plan["eval_pairs"] or len(evaluated), len(evaluated))
    shape = LinkShape(bandwidth_mbit=args.bandwidth_mbit, delay_ms=args.delay_ms)
    prep = train.prepare(
        train_pairs, evaluated, plan["model"], args.cache / "models", manifest["sha256"]["train.tsv"]
    )
    mine = [row for i, row in enumerate(plan_rows) if i % count == index]
    # --prepare-only co-trains every co-trained row of the plan; a shard only its own rows
    cotrained = list(plan_rows if args.prepare_only else mine)
    prep = cotrain.with_cut_states(prep, cotrained, args.cache / "models", manifest["sha256"]["train.tsv"])
    if args.prepare_only:
        print(json.dumps({"pretrain_losses": {k: [v[0], v[-1]] for k, v in prep.pretrain_losses.items()}}))
        return
    rows = []
    for row in mine:
        choice = advisor.auto_pair(prep, shape, steps, args.cache) if row.label == advisor.LABEL else None
        if choice:
            row = replace(row, forward=choice["forward"], backward=choice["backward"])
        rows.append(run_row(prep, row, seeds, steps, eval_pairs, shape, repeats=3 if args.quick else 5))
        if choice:
            rows[-1]["advice"] = choice
    fig_runs = []
    if FIGURE10_ROW in mine and not args.no_figure10:
        fig_seeds = 1 if args.quick else min(seeds, FIGURE10_SEEDS)
        later = FIGURE10_STARTS[1:]
        fig_runs = figure10.figure10_runs(prep, FIGURE10_ROW, later, fig_seeds, steps, eval_pairs)
    report = {
        "mode": mode,
        "bandwidth_mbit": args.bandwidth_mbit,
        "delay_ms": args.delay_ms,
        "seeds": seeds,
        "steps": steps,
        "eval_pairs": eval_pairs,
        "split": split,
        "references": prep.eval_en_text[:eval_pairs],
        "lookup": lookup_baseline(train_pairs, evaluated[:eval_pairs]) if index == 0 else None,
        "model": asdict(plan["model"]),
        "corpus": {k: manifest[k] for k in ("train", "dev", "test", "moved_to_train", "sha256")},
        "pretrain_losses": {k: [v[0], v[-1]] for k, v in prep.pretrain_losses.items()},
        "cpus": os.cpu_count(),
        "threads": args.threads,
        "load_before": load_before,
        "load_after": os.getloadavg(),
        "wall_seconds": time.perf_counter() - started,
        "rows": rows,
        "figure10_runs": fig_runs,
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


def lookup_baseline(training: list[corpus.Pair], evaluated: list[corpus.Pair]) -> dict[str, Any]:
    """The lookup baseline's BLEU and chrF on the evaluated pairs (what codec none must beat)."""
    outputs = lookup.lookup(training, [pair.spanish for pair in evaluated])
    bleu, chrf = train.score(outputs, [pair.english for pair in evaluated])
    return {"bleu": bleu, "chrf": chrf, "hypotheses": outputs}


def finish(report: dict[str, Any], args: argparse.Namespace) -> None:
    """Speed-ups, paired statistics, Figure 10, the PNG, JSON and markdown (and the doc's results section)."""
    rows = report["rows"]
    for row in rows:
        row["speedup"] = rows[0]["step_seconds"] / row["step_seconds"]
    if "references" in report:
        checks.compare_rows(report)
    elif any("versus_none" not in row for row in rows):  # merged summaries: each run paired its own rows
        sys.exit("table5: --merge: a summary report's rows must carry their paired statistics (versus_none)")
    report["figure10"] = figure10.figure10_points(report, FIGURE10_ROW.label)
    report["advisor_check"] = checks.advisor_check(report)
    stem = "table5-quick" if report["mode"] == "quick" else "table5"
    report["png"] = f"{stem}-pareto.png"
    args.out.mkdir(parents=True, exist_ok=True)
    reporting.pareto_png(args.out / report["png"], rows)
    if "references" in report:  # a merge of summaries has no per-sentence outputs to write
        reporting.save_outputs(args.out / f"{stem}-outputs", report)
    (args.out / f"{stem}.json").write_text(
        json.dumps(reporting.summary(report), indent=2, ensure_ascii=False) + "\n"
    )
    text = reporting.markdown(report, FIGURE10_ROW.label)
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
