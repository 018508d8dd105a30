"""Probes of the Table 5 model's BLEU (codec none, one seed): diagnostics and settings, CPU time measured.

Why: with codec none the benchmark's model must reach a BLEU that can tell 1 BLEU apart before any
row's BLEU means something. Each probe fine-tunes one setting for ``--steps`` steps (checkpoints at
``--every``), and prints JSON lines: step, CPU seconds (``time.process_time``, one torch thread),
mean loss of the last ``--every`` steps, BLEU/chrF of greedy decoding of the first ``--eval-pairs``
dev pairs. ``--diagnose`` also prints per-group gradient norms, the gates, a linear probe of the
encoder output (can it give back the source tokens?) and the loss with the sources shuffled (does the
decoder read the source at all?). ``--unfrozen`` is the ceiling: the same architecture, every weight
trainable from random initialisation.

    PYTHONPATH=$PWD nice -n 10 .venv/bin/python bench/table5/probe.py --steps 600 --every 200
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import corpus
import train

from nebula_common.zoo.adapters import NO_REPEAT_NGRAM
from nebula_common.zoo.text_data import PAD, decode


def evaluate(
    prep: train.Prepared, stages: train.Stages, pairs: int, no_repeat_ngram: int = NO_REPEAT_NGRAM
) -> tuple[float, float, list[str]]:
    hyps: list[str] = []
    with torch.no_grad():
        for begin in range(0, pairs, 256):
            ids = prep.eval_es[begin : min(begin + 256, pairs)]
            out = stages.decoder.greedy(
                stages.receive(stages.send(ids)),
                prep.config.length,
                ban_unknown=True,
                no_repeat_ngram=no_repeat_ngram,
            )
            hyps += [decode(prep.en, row[1:].tolist()) for row in out]
    bleu, chrf = train.score(hyps, prep.eval_en_text[:pairs])
    return bleu, chrf, hyps


def group_norms(stages: train.Stages) -> dict[str, float]:
    groups: dict[str, float] = {}
    for prefix, module in (("enc", stages.encoder), ("dec", stages.decoder)):
        for name, p in module.named_parameters():
            if p.grad is None:
                continue
            key = prefix + "." + ".".join(part for part in name.split(".")[:3] if not part.isdigit())
            groups[key] = groups.get(key, 0.0) + float(p.grad.norm() ** 2)
    return {k: round(v**0.5, 5) for k, v in sorted(groups.items())}


def linear_probe(prep: train.Prepared, stages: train.Stages, steps: int = 100) -> float:
    """Token accuracy of a linear layer reading the source token back from the encoder output."""
    with torch.no_grad():
        states = stages.send(prep.train_es[:512])
        evaluated = stages.send(prep.eval_es[:256])
    ids, eval_ids = prep.train_es[:512], prep.eval_es[:256]
    probe = nn.Linear(states.shape[-1], prep.es.get_vocab_size())
    opt = torch.optim.Adam(probe.parameters(), lr=1e-2)
    keep = ids != PAD
    for _ in range(steps):
        loss = nn.functional.cross_entropy(probe(states[keep]), ids[keep])
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        mask = eval_ids != PAD
        return float((probe(evaluated[mask]).argmax(-1) == eval_ids[mask]).float().mean())


def shuffled_gap(prep: train.Prepared, stages: train.Stages) -> tuple[float, float]:
    """Held-out teacher-forced loss with the right sources, and with the sources of other sentences."""
    with torch.no_grad():
        src = prep.eval_es[:512]
        from nebula_common.zoo.text_data import encode

        tgt = torch.tensor(encode(prep.en, prep.eval_en_text[:512], prep.config.length, bos=True))
        right = float(stages.decoder.loss(stages.receive(stages.send(src)), tgt))
        wrong = float(stages.decoder.loss(stages.receive(stages.send(src.roll(1, 0))), tgt))
    return right, wrong


def unfreeze(stages: train.Stages, lr: float) -> None:
    """The ceiling: every weight trainable, from a fresh random initialisation (no pre-training)."""
    for module in (stages.encoder.plm, stages.decoder.plm):
        for layer in module.modules():
            if hasattr(layer, "reset_parameters") and layer is not module:
                layer.reset_parameters()
        nn.init.normal_(module.position, std=0.02)
        for p in module.parameters():
            p.requires_grad_(True)
    stages.upstream_opt = torch.optim.Adam([{"params": stages.encoder.parameters(), "base_lr": lr}], lr=lr)
    stages.downstream_opt = torch.optim.Adam([{"params": stages.decoder.parameters(), "base_lr": lr}], lr=lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, default=Path(".cache") / "table5")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--every", type=int, default=200)
    parser.add_argument("--eval-pairs", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", nargs="*", default=[], help="ModelConfig overrides, key=value")
    parser.add_argument(
        "--batch", type=int, default=0, help="fine-tuning batch (0: the config's; pre-training keeps its own)"
    )
    parser.add_argument("--diagnose", action="store_true")
    parser.add_argument("--unfrozen", action="store_true")
    parser.add_argument(
        "--guards",
        default=f"0,{NO_REPEAT_NGRAM}",
        help="repetition guards to score at each checkpoint (greedy's no_repeat_ngram; 0: none)",
    )

    args = parser.parse_args()
    torch.set_num_threads(1)
    config = train.ModelConfig()
    for item in args.set:
        key, _, value = item.partition("=")
        kind = type(getattr(config, key))
        config = replace(config, **{key: kind(value) if kind is not bool else value == "1"})
    manifest, train_pairs, dev = corpus.load(args.cache, "dev")  # tuning reads dev, never test
    cpu = time.process_time()
    prep = train.prepare(train_pairs, dev, config, args.cache / "models", manifest["sha256"]["train.tsv"])
    print(
        json.dumps(
            {
                "prepare_cpu_s": round(time.process_time() - cpu, 1),
                "config": vars(config),
                "batch": args.batch or config.tune_batch,
            }
        )
    )
    stages = train.Stages(prep, train.Row("none"), args.seed)
    if args.unfrozen:
        unfreeze(stages, config.lr)
    if args.diagnose:
        print(
            json.dumps(
                {"probe_acc_start": linear_probe(prep, stages), "gap_start": shuffled_gap(prep, stages)}
            )
        )
    generator = torch.Generator().manual_seed(1000 + args.seed)
    losses: list[float] = []
    cpu_train = 0.0
    for step in range(1, args.steps + 1):
        index = torch.randint(len(prep.train_es), (args.batch or config.tune_batch,), generator=generator)
        started = time.process_time()
        stages.set_step(step - 1)
        sent = stages.send(prep.train_es[index])
        memory = sent.detach().requires_grad_(True)
        loss_t = stages.decoder.loss(stages.receive(memory), prep.train_en[index])
        stages.downstream_opt.zero_grad(set_to_none=True)
        stages.upstream_opt.zero_grad(set_to_none=True)
        loss_t.backward()
        sent.backward(memory.grad)
        if args.diagnose and step in (1, 2, 10, 100):
            print(json.dumps({"step": step, "grad_norms": group_norms(stages)}))
        stages.downstream_opt.step()
        stages.upstream_opt.step()
        loss = float(loss_t.detach())
        cpu_train += time.process_time() - started
        losses.append(loss)
        if step % args.every == 0:
            cpu = time.process_time()
            scores = {}
            for guard in (int(g) for g in args.guards.split(",")):
                bleu, chrf, hyps = evaluate(prep, stages, args.eval_pairs, guard)
                scores[f"guard{guard}"] = {"bleu": round(bleu, 2), "chrf": round(chrf, 1), "hyps": hyps[:4]}
            out = {
                "step": step,
                "train_cpu_s": round(cpu_train, 1),
                "eval_cpu_s": round(time.process_time() - cpu, 1),
                "loss": round(sum(losses[-args.every :]) / args.every, 3),
                **scores,
            }
            if args.diagnose:
                out["gates"] = [round(float(a.gate), 3) for a in stages.decoder.adapters]
                out["gap"] = shuffled_gap(prep, stages)
            print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
