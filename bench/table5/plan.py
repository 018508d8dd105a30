"""The Table 5 plan: its rows (full, extra and quick), the model each mode trains, seeds and steps.

Read by ``run.py`` (the table), ``probe_rows.py`` (any row at the full plan) and ``product.py`` (the
rows through two clusters), so each names a row by the same label.
"""

from __future__ import annotations

import re
from dataclasses import replace

import advisor
import train

Row = train.Row
CALIBRATED = {"down_residual": 256, "up_residual": 256, "cut_pretrain": 3000}
"""The calibrated bottleneck: residual paths of width 256 on both halves, trained 3,000 steps
as an autoencoder on the starting model's cut activations before fine-tuning (``pretrain_bottleneck``;
the product's ``calibrate`` + ``cut_init``). It keeps 88% of the cut's energy at k = 16, the linear
start 69%."""
COTRAIN_STEPS = 3000
COTRAINED = {**CALIBRATED, "cut_cotrain": COTRAIN_STEPS, "control": f"NONE(+{COTRAIN_STEPS})"}
"""The co-trained bottleneck (``cotrain.py``): the calibrated start, then the whole model (LMs, adapters
and bottleneck) trained 3,000 more steps with it in place after preparation; fine-tuning starts there.
Judged against none and against its control, none's halves trained as many more steps without it."""
FULL_ROWS = (
    Row("none"),
    Row("FP16+INT8", "fp16", "int8"),
    *(Row(f"FP16(SVD({r}))+INT8", f"fp16(svd({r}))", "int8") for r in (0.9, 0.6, 0.4, 0.2)),
    Row("FP16(LOWRANK(8))+INT8", "fp16(lowrank(8))", "int8"),
    Row("EF(TOPK(0.1)) both", "ef(fp16(topk(0.1)))", "ef(fp16(topk(0.1)))"),
    Row("ZSTD(FP16)+ZSTD(INT8)", "zstd(fp16)", "zstd(int8)"),
    Row("ZSTD(INT8) both", "zstd(int8)", "zstd(int8)"),
    Row("INT4 both", "int4", "int4"),
    Row("ZSTD(INT4) both", "zstd(int4)", "zstd(int4)"),
    Row("BOTTLENECK(16,AE)+INT8", "int8", "int8", cut_k=16, **CALIBRATED),
    Row("BOTTLENECK(16,JOINT)+INT8", "int8", "int8", cut_k=16, **COTRAINED),
    Row(f"NONE(+{COTRAIN_STEPS})", cut_cotrain=COTRAIN_STEPS),
    Row(advisor.LABEL, "auto", "auto"),
)
"""The full plan's rows: the paper's, lossless zstd over int8, blockwise int4 (alone and under zstd), the
learned bottleneck at 16x both ways (k = 16 with int8: calibrated on the shared halves, and co-trained
with its halves, beside that row's control; the linear start's k = 16 row, 2.2 BLEU short, is in
EXTRA_ROWS), and last the pair the product's ``codec: auto`` picks for this job and link
(``advisor.py``). Two shards take the rows alternately."""
EXTRA_ROWS = (
    Row("POWERSGD(8)+INT8", "fp16(powersgd(8))", "int8"),
    Row("BOTTLENECK(48)+ZSTD(INT8)", "zstd(int8)", "zstd(int8)", cut_k=48),
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
    Row("ZSTD(INT8)+ZSTD(INT4)", "zstd(int8)", "zstd(int4)"),
    Row("ZSTD(INT8(ERROR=0.04))+ZSTD(INT8(ERROR=0.2))", "zstd(int8(error=0.04))", "zstd(int8(error=0.2))"),
    Row("ZSTD(INT8(ERROR=0.08))+ZSTD(INT8(ERROR=0.25))", "zstd(int8(error=0.08))", "zstd(int8(error=0.25))"),
    Row("ZSTD(INT8(ERROR=0.08))+ZSTD(INT8(ERROR=0.2))", "zstd(int8(error=0.08))", "zstd(int8(error=0.2))"),
)
"""Rows of the probes (docs/bench/table5.md), not in the full plan: ``--rows`` can name them. The pair the
product's ``auto`` picks for this job is among them (``bench/table5/product.py`` judges it by its BLEU):
``int8(error=E)`` entropy-coded, at 80% of the codec service's default budgets (10% forward, 25% back:
the last row; the 4% / 20% row is the pair of the earlier 5% forward budget)."""
_BY_LABEL = {row.label: row for row in (*FULL_ROWS, *EXTRA_ROWS)}
QUICK_ROWS = tuple(
    replace(
        _BY_LABEL[label],
        cut_pretrain=min(_BY_LABEL[label].cut_pretrain, 200),
        cut_cotrain=min(_BY_LABEL[label].cut_cotrain, 40),
    )
    for label in ("none", "FP16+INT8", "FP16(SVD(0.2))+INT8", "BOTTLENECK(16,JOINT)+INT8", advisor.LABEL)
)
"""A smoke run of every stage: the co-trained row's autoencoder pre-training shortened to 200 steps, its
co-training to 40."""
FIGURE10_ROW = FULL_ROWS[5]  # the paper's fastest row, FP16(SVD(0.2))+INT8
FIGURE10_STARTS = (0.0, 0.10, 0.25)
CUT_LR = 1e-3
"""The learned bottleneck's learning rate: it starts untrained on halves that already translate."""
FULL_MODEL = train.ModelConfig(
    vocab=8000,
    pretrain_steps=400,
    translation_steps=3000,
    translation_lr=2e-3,
    lr=3e-4,
    warmup=0,
    train_head=True,
    finetune_batch=64,
    cut_lr=CUT_LR,
)
"""The full plan's model, chosen on dev: word vocabularies of 8,000; each LM pre-trained 400 steps on
its own side (batch 32), then the whole model trained 3,000 steps on the training pairs (Adam 2e-3,
batch 128): the cached halves that translate (``make bench-table5-prepare``). Each row fine-tunes the
adapters and the decoder's output layer at 3e-4 (the bottleneck's projections at ``CUT_LR``), 64
sentence pairs a step, with its codecs in the loop (on dev, seed 0: none 21.64 BLEU at 64 pairs a step,
21.86 at 128 for half as much CPU again)."""
FULL = {"seeds": 5, "steps": 300, "eval_pairs": None, "model": FULL_MODEL}
"""15 rows x 5 seeds + Figure 10's 2 starts x 2 seeds = 79 runs of ~140 CPU s (300 steps of ~270 ms and the
greedy decoding of 3,750 test pairs), ``auto``'s decision (~15 s) and the link clock (~1 min), over 2
shards: about 95 minutes on 2 idle cores (docs/bench/table5.md); preparation once, cached after."""
FIGURE10_SEEDS = 2
"""Seeds of each later-start Figure 10 point (the 0% point is the row itself, all seeds): even shards."""
QUICK = {
    "seeds": 2,
    "steps": 80,
    "eval_pairs": 64,
    "model": replace(
        FULL_MODEL,
        vocab=2000,
        pretrain_steps=30,
        translation_steps=0,
        lr=1e-2,
        warmup=50,
        finetune_batch=0,
    ),
}
"""The smoke run: LMs barely pre-trained (30 steps each) and no translation training (from LMs that
young, 30-60 steps of it stay at the unigram loss), so fine-tuning at 1e-2 must visibly learn."""


def row_labels(text: str) -> list[str]:
    """``--rows``' labels: split at commas outside parentheses ("BOTTLENECK(16,residual)+INT8" is one)."""
    return [label.strip() for label in re.split(r",(?![^()]*\))", text) if label.strip()]
