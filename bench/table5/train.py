"""ABNet Es->En for the Table 5 analogue: pre-training, codec-in-the-loop fine-tuning, greedy BLEU/chrF.

The model is the built-in ``abnet`` job's (``nebula_common.zoo.adapters``): a masked-LM
encoder (cluster S) and a causal-LM decoder (cluster T), each pre-trained on its own
side of the corpus's training split. The paper's halves come pre-trained on far more text
than a table row can afford to train, so preparation also trains the whole model (LMs and
adapters) on the training pairs for ``translation_steps`` (cached, ``make
bench-table5-prepare``): each row then starts from halves that translate, the LMs frozen,
and fine-tunes only the adapters (and the learned bottleneck, when a row has one) with its
codecs in the loop. A row therefore measures what its codec costs a model that translates.

What crosses the cut goes through the row's real codecs exactly as the trainer sends it:
``TensorStreamEncoder.encode`` -> header + payload -> ``TensorStreamDecoder.decode``, the
activations forward and their gradients backward (error feedback, warm-up and every other
stream option included), so the bytes counted here are the bytes a switch would carry and
the numerics are the split run's. The clock part of the step (the link) is measured separately in ``run.py``.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sacrebleu
import torch
from model_config import ModelConfig, Prepared, Row, cut_key
from torch import nn

from nebula_common.codec import TensorStreamDecoder, TensorStreamEncoder
from nebula_common.zoo.adapters import (
    AdapterTransformerDecoder,
    AdapterTransformerEncoder,
    LanguageModel,
    lm_loss,
    mlm_loss,
)
from nebula_common.zoo.bottleneck import (
    DownProjection,
    UpProjection,
    captured_energy,
    pretrain_bottleneck,
    principal_basis,
)
from nebula_common.zoo.catalogues import Pair
from nebula_common.zoo.text_data import decode, encode, train_tokenizer

__all__ = ["ModelConfig", "Prepared", "Row", "cut_key"]  # also read as train.Row and so on


def _language_model(config: ModelConfig, vocab: int, causal: bool) -> LanguageModel:
    return LanguageModel(vocab, config.length, config.d_model, config.n_heads, config.n_layers, causal=causal)


def _pretrain(model: LanguageModel, ids: torch.Tensor, config: ModelConfig, seed: int) -> list[float]:
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=config.pretrain_lr)
    losses = []
    for _ in range(config.pretrain_steps):
        batch = ids[torch.randint(len(ids), (2 * config.batch,), generator=generator)]
        loss = mlm_loss(model, batch, 0.2)[0] if not model.causal else lm_loss(model, batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return losses


def _pretrain_translation(
    encoder_plm: LanguageModel,
    decoder_plm: LanguageModel,
    train_es: torch.Tensor,
    train_en: torch.Tensor,
    config: ModelConfig,
) -> tuple[dict[str, dict[str, torch.Tensor]], list[float]]:
    """The whole model (LMs and adapters) trained on the training pairs; the LMs are updated in place."""
    encoder = AdapterTransformerEncoder(encoder_plm, config.adapter)
    decoder = AdapterTransformerDecoder(decoder_plm, config.n_heads, config.adapter)
    parameters = [*encoder.parameters(), *decoder.parameters()]
    for parameter in parameters:
        parameter.requires_grad_(True)
    optimizer = torch.optim.Adam(parameters, lr=config.translation_lr)
    generator = torch.Generator().manual_seed(3)
    warmup = min(200, max(1, config.translation_steps // 10))
    losses = []
    for step in range(config.translation_steps):
        for group in optimizer.param_groups:
            group["lr"] = config.translation_lr * min(1.0, (step + 1) / warmup)
        index = torch.randint(len(train_es), (config.translation_batch,), generator=generator)
        loss = decoder.loss(encoder(train_es[index]), train_en[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    return {"encoder": encoder.state_dict(), "decoder": decoder.state_dict()}, losses


def _pretrain_all(
    train_es: torch.Tensor, train_en: torch.Tensor, config: ModelConfig, es_vocab: int, en_vocab: int
) -> dict[str, Any]:
    """The LMs pre-trained on their sides, then the whole model on the pairs; what the cache keeps."""
    torch.manual_seed(0)
    encoder = _language_model(config, es_vocab, causal=False)
    decoder = _language_model(config, en_vocab, causal=True)
    started = time.perf_counter()
    losses = {
        "encoder_mlm": _pretrain(encoder, train_es, config, 1),
        "decoder_lm": _pretrain(decoder, train_en, config, 2),
    }
    translation: dict[str, dict[str, torch.Tensor]] = {}
    if config.translation_steps:
        translation, losses["translation"] = _pretrain_translation(
            encoder, decoder, train_es, train_en, config
        )
    return {
        "encoder": encoder.state_dict(),
        "decoder": decoder.state_dict(),
        "translation": translation,
        "losses": {k: torch.tensor(v) for k, v in losses.items()},
        "seconds": torch.tensor(time.perf_counter() - started),
    }


PREPARE_THREADS = 2
"""torch threads of every preparation (pre-training here, co-training in ``cotrain``), whatever the rows'
``--threads``: the halves' numbers depend on it (one thread and two differ in the loss's fourth digit,
and so in every row's BLEU), so a cached preparation is used only at the thread count it was made with."""


@contextmanager
def torch_threads(threads: int) -> Iterator[None]:
    """Run the block on ``threads`` torch threads, then restore the caller's count."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def cached(path: Path, threads: int) -> dict[str, Any] | None:
    """The preparation cached at ``path`` if it was made on ``threads`` threads, else None (made again)."""
    if not path.exists():
        return None
    saved = torch.load(path, weights_only=True)
    made_on = int(saved.get("threads", torch.tensor(0)))
    if made_on != threads:
        print(f"table5: {path.name} was prepared on {made_on or 'unrecorded'} threads, not {threads}: again")
        return None
    return saved


def prepare(
    train: list[Pair],
    evaluated: list[Pair],
    config: ModelConfig,
    cache: Path,
    corpus_sha: str,
    threads: int = PREPARE_THREADS,
) -> Prepared:
    """Tokenizers, pre-trained LMs and the translation-trained halves (cached by config and corpus digest,
    on ``threads`` torch threads: every row shares them).

    Both are built from ``train`` only; ``evaluated`` (dev or test) is only encoded for decoding.
    """
    es = train_tokenizer([p.spanish for p in train], config.vocab)
    en = train_tokenizer([p.english for p in train], config.vocab)
    train_es = torch.tensor(encode(es, [p.spanish for p in train], config.length, bos=False))
    train_en = torch.tensor(encode(en, [p.english for p in train], config.length, bos=True))
    eval_es = torch.tensor(encode(es, [p.spanish for p in evaluated], config.length, bos=False))
    path = cache / f"pretrained-{config.digest(corpus_sha)}.pt"
    saved = cached(path, threads)
    if saved is not None:
        saved.setdefault("translation", {})
    else:
        with torch_threads(threads):
            saved = _pretrain_all(train_es, train_en, config, es.get_vocab_size(), en.get_vocab_size())
        saved["threads"] = torch.tensor(threads)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(".partial")
        torch.save(saved, partial)
        partial.replace(path)  # an interrupted preparation leaves no cache entry to trust
    return Prepared(
        config,
        es,
        en,
        train_es,
        train_en,
        eval_es,
        [p.english for p in evaluated],
        saved["encoder"],
        saved["decoder"],
        {k: v.tolist() for k, v in saved["losses"].items()},
        saved["translation"],
    )


class Stages:
    """One fine-tuning run's two stages (S: encoder [+ down], T: [up +] decoder) and their optimizers."""

    def __init__(self, prep: Prepared, row: Row, seed: int) -> None:
        config = prep.config
        torch.manual_seed(seed)
        encoder_plm = _language_model(config, prep.es.get_vocab_size(), causal=False)
        encoder_plm.load_state_dict(prep.encoder_state)
        decoder_plm = _language_model(config, prep.en.get_vocab_size(), causal=True)
        decoder_plm.load_state_dict(prep.decoder_state)
        self.encoder = AdapterTransformerEncoder(encoder_plm, config.adapter)
        self.decoder = AdapterTransformerDecoder(decoder_plm, config.n_heads, config.adapter)
        if prep.translation_state:  # a model that translates: LMs frozen (as loaded), adapters from there
            self.encoder.load_state_dict(prep.translation_state["encoder"])
            self.decoder.load_state_dict(prep.translation_state["decoder"])
        self.down: nn.Module = nn.Identity()
        self.up: nn.Module = nn.Identity()
        self.energy = 1.0
        if row.cut_k:
            with torch.no_grad():  # calibration: the starting model's cut activations on 8 training batches
                calibration = self.encoder(prep.train_es[: 8 * config.batch])
            basis = principal_basis(calibration, row.cut_k)
            self.energy = captured_energy(calibration, basis)
            self.down = DownProjection(config.d_model, row.cut_k, basis, residual=row.down_residual)
            up_residual = row.up_residual or row.residual
            self.up = UpProjection(config.d_model, row.cut_k, basis, residual=up_residual)
            if row.cut_pretrain and not row.cut_cotrain:  # a co-trained row loads its trained halves below
                with torch.no_grad():
                    more = prep.train_es[: 128 * config.batch]  # 4,096 sentences (~28k non-zero rows)
                    rows = torch.cat([self.encoder(more[i : i + 256]) for i in range(0, len(more), 256)])
                self.energy = pretrain_bottleneck(self.down, self.up, rows, row.cut_pretrain, seed)
        if row.cut_cotrain:  # the halves (and bottleneck) trained on after preparation (cotrain.py)
            state = prep.cut_states.get(cut_key(row))
            if state is None:
                raise ValueError(f"row {row.label}: its co-trained halves are not prepared (cotrain.py)")
            modules = {"encoder": self.encoder, "decoder": self.decoder, "down": self.down, "up": self.up}
            for name, module in modules.items():
                module.load_state_dict(state[name])
        if config.train_head:
            for parameter in (*decoder_plm.norm.parameters(), *decoder_plm.head.parameters()):
                parameter.requires_grad_(True)
        for block in list(decoder_plm.blocks)[::-1][: config.train_top]:
            for parameter in block.parameters():
                parameter.requires_grad_(True)
        trainable = lambda *ms: [p for m in ms for p in m.parameters() if p.requires_grad]  # noqa: E731
        cut_lr = config.cut_lr or config.lr
        residual_lr = config.cut_residual_lr or cut_lr

        def groups(cut: nn.Module, stage: nn.Module) -> list[dict[str, Any]]:
            found = [{"params": trainable(stage), "base_lr": config.lr}]
            path = getattr(cut, "residual", None)
            extra = trainable(path) if path is not None else []
            linear = [p for p in trainable(cut) if all(p is not q for q in extra)]
            found += [{"params": linear, "base_lr": cut_lr}] if linear else []
            return found + ([{"params": extra, "base_lr": residual_lr}] if extra else [])

        self.upstream_opt = torch.optim.Adam(groups(self.down, self.encoder), lr=config.lr)
        self.downstream_opt = torch.optim.Adam(groups(self.up, self.decoder), lr=config.lr)
        self.warmup = config.warmup

    def set_step(self, step: int) -> None:
        """The lr of fine-tuning step ``step`` (0-based): linear warm-up over ``config.warmup`` steps."""
        scale = min(1.0, (step + 1) / self.warmup) if self.warmup else 1.0
        for optimizer in (self.upstream_opt, self.downstream_opt):
            for group in optimizer.param_groups:
                group["lr"] = group["base_lr"] * scale

    def send(self, ids: torch.Tensor) -> torch.Tensor:
        return self.down(self.encoder(ids))

    def receive(self, memory: torch.Tensor) -> torch.Tensor:
        return self.up(memory)


@dataclass
class RunResult:
    losses: list[float]
    compute_seconds: list[float]
    """CPU seconds per step (one torch thread): the step's compute on an idle core, whatever else runs."""
    wall_seconds: list[float]
    forward_bytes: list[int]
    backward_bytes: list[int]
    last_frames: tuple[bytes, bytes]
    bleu: float
    chrf: float
    energy: float
    eval_seconds: float
    source_gap: float
    """Loss with each target's encoder states swapped for another sentence's, minus the matched loss
    (256 training pairs, no codec): how much the decoder reads what crosses the cut (0: nothing)."""
    hypotheses: list[str]
    """One output per evaluated pair, in the split's order (saved for paired statistics)."""


def score(hypotheses: list[str], references: list[str]) -> tuple[float, float]:
    """Corpus BLEU and chrF (sacrebleu), both case-insensitive: the tokenizers lower-case the output.

    ``force``: the outputs are the word-level tokenizer's tokens joined by spaces ("open file ."), which
    sacrebleu's 13a tokenizer makes of the references too, so the counts are right; it only silences
    sacrebleu's warning about tokenized input.
    """
    bleu = sacrebleu.metrics.BLEU(lowercase=True, force=True).corpus_score(hypotheses, [references]).score
    chrf = sacrebleu.metrics.CHRF(lowercase=True).corpus_score(hypotheses, [references]).score
    return bleu, chrf


def _frame(encoded: Any) -> bytes:
    """What one tensor costs on the wire: its serialized header then its payload (the switch's frame body)."""
    return encoded.header.SerializeToString() + encoded.payload


@dataclass
class Trained:
    """A fine-tuning run's stages and streams after its steps, with what the steps measured."""

    stages: Stages
    forward: tuple[TensorStreamEncoder, TensorStreamDecoder]
    losses: list[float]
    compute_seconds: list[float]
    wall_seconds: list[float]
    forward_bytes: list[int]
    backward_bytes: list[int]
    frames: tuple[bytes, bytes]


def train_steps(prep: Prepared, row: Row, seed: int, steps: int) -> Trained:
    """Train ``steps`` steps with the row's codecs at the cut (one data order per seed, whatever the row)."""
    config = prep.config
    stages = Stages(prep, row, seed)
    fwd_enc, fwd_dec = TensorStreamEncoder(row.forward), TensorStreamDecoder(row.forward)
    bwd_enc, bwd_dec = TensorStreamEncoder(row.backward), TensorStreamDecoder(row.backward)
    generator = torch.Generator().manual_seed(1000 + seed)
    losses, seconds, walls, fwd_bytes, bwd_bytes = [], [], [], [], []
    frames = (b"", b"")
    for step in range(steps):
        index = torch.randint(len(prep.train_es), (config.tune_batch,), generator=generator)
        started, cpu_started = time.perf_counter(), time.process_time()
        stages.set_step(step)
        sent = stages.send(prep.train_es[index])  # cluster S
        encoded = fwd_enc.encode(sent.detach(), step=step)
        memory = fwd_dec.decode(encoded.header, encoded.payload).requires_grad_(True)  # cluster T
        loss = stages.decoder.loss(stages.receive(memory), prep.train_en[index])
        stages.downstream_opt.zero_grad(set_to_none=True)
        loss.backward()
        stages.downstream_opt.step()
        encoded_grad = bwd_enc.encode(memory.grad, step=step)
        grad = bwd_dec.decode(encoded_grad.header, encoded_grad.payload)  # back in cluster S
        stages.upstream_opt.zero_grad(set_to_none=True)
        sent.backward(grad)
        stages.upstream_opt.step()
        seconds.append(time.process_time() - cpu_started)
        walls.append(time.perf_counter() - started)
        losses.append(float(loss.detach()))
        frames = (_frame(encoded), _frame(encoded_grad))
        fwd_bytes.append(len(frames[0]))
        bwd_bytes.append(len(frames[1]))
    return Trained(stages, (fwd_enc, fwd_dec), losses, seconds, walls, fwd_bytes, bwd_bytes, frames)


def fine_tune(prep: Prepared, row: Row, seed: int, steps: int, eval_pairs: int) -> RunResult:
    """Train ``steps`` steps with the row's codecs at the cut, then decode the evaluated split greedily."""
    config = prep.config
    run = train_steps(prep, row, seed, steps)
    stages, (fwd_enc, fwd_dec) = run.stages, run.forward
    started = time.perf_counter()
    hypotheses = []
    with torch.no_grad():
        for begin in range(0, eval_pairs, 256):
            ids = prep.eval_es[begin : min(begin + 256, eval_pairs)]
            encoded = fwd_enc.encode(stages.send(ids), step=steps)  # the states cross once, compressed
            memory = stages.receive(fwd_dec.decode(encoded.header, encoded.payload))
            out = stages.decoder.greedy(memory, config.length, ban_unknown=True)
            hypotheses += [decode(prep.en, row_ids[1:].tolist()) for row_ids in out]
    bleu, chrf = score(hypotheses, prep.eval_en_text[:eval_pairs])
    with torch.no_grad():
        memory = stages.receive(stages.send(prep.train_es[:256]))
        target = prep.train_en[:256]
        gap = stages.decoder.loss(memory.roll(1, dims=0), target) - stages.decoder.loss(memory, target)
    return RunResult(
        run.losses,
        run.compute_seconds,
        run.wall_seconds,
        run.forward_bytes,
        run.backward_bytes,
        run.frames,
        bleu,
        chrf,
        stages.energy,
        time.perf_counter() - started,
        float(gap),
        hypotheses,
    )
