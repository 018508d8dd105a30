"""Halves trained with the learned bottleneck in place: the co-trained bottleneck rows' preparation.

Why: a bottleneck inserted into halves that learned to translate without it, then fine-tuned with the
halves frozen (the paper's recipe), cannot recover what a 16-wide code drops: on dev the calibrated
k = 16 row stays ~6 BLEU short of none after 2,000 steps (docs/bench/table5.md). A cut meant to be
narrow is a property of the model, so the model is trained with it: after the shared preparation
(LMs, then translation with codec none), the whole model (LMs, adapters and the bottleneck, started
as the calibrated autoencoder) trains ``cut_cotrain`` more steps on the training pairs with the
bottleneck in place. Fine-tuning then starts from those halves and that bottleneck, the LMs frozen as
for every row. Cached beside the prepared model, keyed by its digest and the row's bottleneck.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import replace
from pathlib import Path

import torch
import train
from torch import nn

from nebula_common.zoo.text_data import PAD

COTRAIN_LR = 1e-3
"""Peak Adam learning rate of the co-training (half the translation pre-training's: it starts from a model
that translates)."""
COTRAIN_WARMUP = 150
"""Steps of linear warm-up: the bottleneck's start is new to the halves."""


def cut_digest(prep: train.Prepared, row: train.Row, corpus_sha: str) -> str:
    """The cache key of ``row``'s co-trained halves: the prepared model's and the bottleneck's fields."""
    fields = {
        "model": prep.config.digest(corpus_sha),
        "key": train.cut_key(row),
        "lr": COTRAIN_LR,
        "warmup": COTRAIN_WARMUP,
        "batch": prep.config.translation_batch,
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:16]


def control_row(row: train.Row) -> train.Row:
    """The row whose halves ``row``'s co-training starts from or distils (none's, trained as long)."""
    return train.Row(f"control of {row.label}", cut_cotrain=row.cut_cotrain)


def _from_halves(prep: train.Prepared, halves: dict[str, dict[str, torch.Tensor]] | None) -> train.Prepared:
    """``prep`` whose translating halves are ``halves`` (a control's co-trained ones), or ``prep``."""
    if halves is None:
        return prep
    return replace(prep, translation_state={"encoder": halves["encoder"], "decoder": halves["decoder"]})


def distillation(student: torch.Tensor, teacher: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student) of the next-token distributions, averaged over the real target positions
    (Hinton et al., "Distilling the Knowledge in a Neural Network", 2015, at temperature 1)."""
    real = target != PAD
    teacher_log = nn.functional.log_softmax(teacher[real], dim=-1)
    student_log = nn.functional.log_softmax(student[real], dim=-1)
    return (teacher_log.exp() * (teacher_log - student_log)).sum(-1).mean()


def cotrain(
    prep: train.Prepared, row: train.Row, control: dict[str, dict[str, torch.Tensor]] | None = None
) -> dict[str, dict[str, torch.Tensor]]:
    """Train the whole model with ``row``'s bottleneck for ``row.cut_cotrain`` steps; the four states.

    ``control``: the control's co-trained halves, which a ``cut_warm`` row starts from and a
    ``cut_teacher`` row distils."""
    if (row.cut_warm or row.cut_teacher) and control is None:
        raise ValueError(f"row {row.label}: its control's halves are needed first")
    start = _from_halves(prep, control if row.cut_warm else None)
    stages = train.Stages(start, replace(row, cut_cotrain=0), seed=0)  # the calibrated start
    teacher = None
    if row.cut_teacher:  # the control's halves, loaded as the shared ones are
        teacher = train.Stages(_from_halves(prep, control), train.Row("teacher"), seed=0)
    weight = row.cut_teacher / 100
    modules = (stages.encoder, stages.decoder, stages.down, stages.up)
    parameters = [p for module in modules for p in module.parameters()]
    for parameter in parameters:
        parameter.requires_grad_(True)
    optimizer = torch.optim.Adam(parameters, lr=COTRAIN_LR)
    generator = torch.Generator().manual_seed(5)
    batch = prep.config.translation_batch
    for step in range(row.cut_cotrain):
        for group in optimizer.param_groups:
            group["lr"] = COTRAIN_LR * min(1.0, (step + 1) / COTRAIN_WARMUP)
        index = torch.randint(len(prep.train_es), (batch,), generator=generator)
        memory = stages.up(stages.down(stages.encoder(prep.train_es[index])))
        if teacher is None:
            loss = stages.decoder.loss(memory, prep.train_en[index])
        else:
            source, target = prep.train_en[index][:, :-1], prep.train_en[index][:, 1:]
            logits = stages.decoder(source, memory)
            with torch.no_grad():
                wanted = teacher.decoder(source, teacher.encoder(prep.train_es[index]))
            loss = (1 - weight) * nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=PAD
            ) + weight * distillation(logits, wanted, target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    names = ("encoder", "decoder", "down", "up")
    return {name: module.state_dict() for name, module in zip(names, modules, strict=True)}


def with_cut_states(
    prep: train.Prepared,
    rows: list[train.Row],
    cache: Path,
    corpus_sha: str,
    threads: int = train.PREPARE_THREADS,
    control_threads: int | None = None,
) -> train.Prepared:
    """``prep`` holding the co-trained halves of every co-trained row in ``rows`` (trained once on ``threads``
    torch threads, cached), and of the controls they start from or distil (on ``control_threads``,
    ``threads`` by default: a probe on one thread still reads the plan's controls)."""
    states = dict(prep.cut_states)
    needed = [control_row(row) for row in rows if row.cut_warm or row.cut_teacher]
    for row in [*needed, *rows]:  # a control before the rows that start from or distil it
        if not row.cut_cotrain or train.cut_key(row) in states:
            continue
        path = cache / f"cotrained-{cut_digest(prep, row, corpus_sha)}.pt"
        made_on = (control_threads or threads) if row in needed else threads
        saved = train.cached(path, made_on)
        if saved is not None:
            saved.pop("threads")
            states[train.cut_key(row)] = saved
            continue
        started = time.perf_counter()
        with train.torch_threads(made_on):
            control = states.get(train.cut_key(control_row(row))) if row.cut_warm or row.cut_teacher else None
            state = cotrain(prep, row, control)
        state["threads"] = torch.tensor(made_on)  # type: ignore[assignment]
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        torch.save(state, partial)
        partial.replace(path)  # an interrupted co-training leaves no cache entry to trust
        print(json.dumps({"cotrained": train.cut_key(row), "seconds": round(time.perf_counter() - started)}))
        state.pop("threads")
        states[train.cut_key(row)] = state
    return replace(prep, cut_states=states)
