"""Probe Table 5 rows (any codec pair, any bottleneck) at the full plan: BLEU, chrF, loss, CPU s per run.

Why: a full row of the table costs ~95 CPU s per seed plus its link clock; deciding which new
rows and bottleneck settings belong in the table needs their quality first, seed by seed, with
the same fine-tuning and decoding as ``run.py`` (``train.fine_tune``: the codecs in the loop,
greedy decoding with the repetition guard, all dev pairs by default). No link is measured
here: the rows' s/step come from ``run.py``. One JSON line per run.

    PYTHONPATH=$PWD .venv/bin/python bench/table5/probe_rows.py --rows "BOTTLENECK(16)+INT8" --seeds 0,1,2
    PYTHONPATH=$PWD .venv/bin/python bench/table5/probe_rows.py \
        --row "k16 slow=int8,int8,16" --set cut_lr=0.001 --seeds 0
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import corpus
import cotrain
import plan
import train

from nebula_common.codec.trial import trial_loss


def parse_row(text: str) -> train.Row:
    """``label=forward,backward,k[,flags]`` (k 0: no bottleneck; flags: ``1`` or ``u`` the up-projection's
        residual, ``dN`` the down-projection's residual of hidden width N (``d``: 256), ``uN`` the same
        for the up-projection, ``pN`` N steps of autoencoder pre-training of both halves, ``jN`` N steps of
        co-training the whole model with the cut in place (``cotrain.py``; with k 0 a co-trained row's
        control), ``tN`` distilling that control's next-token distributions at weight N% while
    co-training, ``w`` co-training from the control's halves; e.g. ``d256u256p3000j3000``, the co-trained
    row of the plan)."""
    label, _, spec = text.partition("=")
    parts = [part.strip() for part in spec.split(",")]
    if not label or len(parts) not in (3, 4):
        raise SystemExit(f"probe_rows: --row takes label=forward,backward,k[,residual], got {text!r}")
    try:
        k = int(parts[2])
    except ValueError:
        raise SystemExit(f"probe_rows: --row {text!r}: k must be an integer, got {parts[2]!r}") from None
    flags = parts[3] if len(parts) == 4 else ""
    width = {}
    for letter in "dupqjt":
        if letter in flags:
            digits = ""
            for char in flags.split(letter, 1)[1]:
                if not char.isdigit():
                    break
                digits += char
            width[letter] = int(digits or 256)
    if ("t" in width or "w" in flags) and not width.get("j"):
        raise SystemExit(f"probe_rows: --row {text!r}: t and w shape a co-training, so they need jN")
    if not 0 <= width.get("t", 0) <= 100:
        raise SystemExit(f"probe_rows: --row {text!r}: the distillation weight t is a percentage, 0 to 100")
    return train.Row(
        label,
        parts[0],
        parts[1],
        cut_k=k,
        residual=flags == "1" or "u" in flags,
        down_residual=width.get("d", 0),
        up_residual=width.get("u", 0),
        cut_pretrain=width.get("p", 0),
        cut_cotrain=width.get("j", 0),
        cut_teacher=width.get("t", 0),
        cut_warm="w" in flags,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path(".cache") / "table5")
    parser.add_argument("--rows", default="", help="comma-separated labels of plan.FULL_ROWS or EXTRA_ROWS")
    parser.add_argument("--row", action="append", default=[], help="label=forward,backward,k[,residual]")
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--steps", type=int, default=plan.FULL["steps"])
    parser.add_argument(
        "--cotrain-threads",
        type=int,
        default=train.PREPARE_THREADS,
        help="torch threads of a co-training (cached per count: two probes side by side take 1 each)",
    )
    parser.add_argument("--eval-pairs", type=int, default=0, help="0: all dev pairs")
    parser.add_argument(
        "--set", nargs="*", default=[], help="ModelConfig overrides of the full plan's, key=value"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    config = plan.FULL_MODEL
    for item in args.set:
        key, _, value = item.partition("=")
        if not hasattr(config, key):
            raise SystemExit(f"probe_rows: ModelConfig has no field {key!r}")
        kind = type(getattr(config, key))
        config = replace(config, **{key: kind(value) if kind is not bool else value == "1"})
    by_label = {row.label: row for row in (*plan.FULL_ROWS, *plan.EXTRA_ROWS)}
    rows = [parse_row(text) for text in args.row]
    for label in plan.row_labels(args.rows):
        if label not in by_label:
            raise SystemExit(f"probe_rows: no row {label!r}; rows: {sorted(by_label)}")
        rows.append(by_label[label])
    if not rows:
        raise SystemExit("probe_rows: give --rows or --row")
    manifest, train_pairs, dev = corpus.load(args.cache, "dev")  # tuning reads dev, never test
    prep = train.prepare(train_pairs, dev, config, args.cache / "models", manifest["sha256"]["train.tsv"])
    sha = manifest["sha256"]["train.tsv"]
    prep = cotrain.with_cut_states(
        prep, rows, args.cache / "models", sha, args.cotrain_threads, control_threads=train.PREPARE_THREADS
    )
    pairs = min(args.eval_pairs or len(dev), len(dev))
    for row in rows:
        for seed in (int(s) for s in args.seeds.split(",")):
            cpu = time.process_time()
            result = train.fine_tune(prep, row, seed, args.steps, pairs)
            print(
                json.dumps(
                    {
                        "row": row.label,
                        "forward": row.forward,
                        "backward": row.backward,
                        "cut_k": row.cut_k,
                        "residual": row.residual,
                        "down_residual": row.down_residual,
                        "cut_cotrain": row.cut_cotrain,
                        "cut_key": train.cut_key(row),
                        "set": args.set,
                        "seed": seed,
                        "bleu": round(result.bleu, 2),
                        "chrf": round(result.chrf, 1),
                        "loss": round(sum(result.losses[-20:]) / 20, 3),
                        # what the advisor's trial_loss (the last half's mean) gives after n steps
                        "trial_loss": {
                            n: round(trial_loss(result.losses[:n]), 4)
                            for n in (10, 20, 30, 45, 60, 90, 120, 150, 200, 300)
                            if n <= len(result.losses)
                        },
                        "first_loss": round(result.losses[0], 4),
                        "energy": round(result.energy, 3),
                        "cpu_s": round(time.process_time() - cpu, 1),
                        "fwd_bytes": result.forward_bytes[-1],
                        "bwd_bytes": result.backward_bytes[-1],
                        "compute_ms": round(1000 * statistics.median(result.compute_seconds[5:]), 1),
                        "losses": [round(loss, 5) for loss in result.losses],
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
