"""Fine-tuning, cluster T: frozen pre-trained English decoder + cross-attention adapters, loss, BLEU.

Only English sentences live here. With ``cut_k`` the stage starts with the learned
bottleneck's up-projection (``nebula_common.zoo.bottleneck``, ``cut_residual`` adds
its learned residual). Each example is (English text, token ids):
the ids train the decoder, the text is the BLEU reference. After training the
runtime hands ``decode`` each held-out batch's encoder states from S (sent once
per batch); decoding is greedy and stays in T, and so does ``score``.

``decoder_dir``: a local Hugging Face-format causal LM (``config.json`` + ``model.safetensors``, e.g. a
GPT-2 written by ``save_pretrained``) to start from instead of ``pretrained``; its ``hidden_size`` is
``d_model`` and its vocabulary covers the job's tokenizer (checked before the stage starts).
"""

from typing import Any

import sacrebleu
import torch
from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a
from torch import nn

from nebula_common.pretrained import load_dir
from nebula_common.zoo.adapters import AdapterTransformerDecoder, LanguageModel, load_pretrained
from nebula_common.zoo.cut_stages import CutDecoder, cut_half, cut_param_groups
from nebula_common.zoo.hf_adapters import PretrainedAdapterDecoder
from nebula_common.zoo.text_data import decode as decode_ids
from nebula_common.zoo.text_data import encode, side, side_tokenizer, split_pairs

Example = tuple[str, list[int]]
PRETRAINED_DIRS = {
    "decoder_dir": {
        "class": "AutoModelForCausalLM",
        "hidden_size": "== d_model",
        "vocab_size": ">= vocab_size",
        "max_position_embeddings": ">= length",
    }
}


def build(options: dict[str, Any]) -> nn.Module:
    tokenizer = side_tokenizer("en", options["vocab_size"], options["held_out_percent"])
    model: nn.Module
    if options.get("decoder_dir"):
        hf = load_dir(options["decoder_dir"], "AutoModelForCausalLM")
        model = PretrainedAdapterDecoder(hf, options["n_heads"], options["bottleneck"])
    else:
        plm = LanguageModel(
            tokenizer.get_vocab_size(),
            options["length"],
            options["d_model"],
            options["n_heads"],
            options["n_layers"],
            causal=True,
        )
        model = AdapterTransformerDecoder(
            load_pretrained(plm, options.get("pretrained")), options["n_heads"], options["bottleneck"]
        )
    up = cut_half(options, "up")
    if up is not None:
        model = CutDecoder(model, up)
    model.tokenizer = tokenizer
    model.max_length = options["length"]
    return model


def param_groups(model: nn.Module, options: dict[str, Any]) -> list[dict[str, Any]]:
    """With ``cut_k``: the bottleneck trains at its own rate ``cut_lr`` (default 1e-4), not the stage's."""
    return cut_param_groups(model, options)


def _examples(options: dict[str, Any], held_out: bool) -> list[Example]:
    train, held = split_pairs(options["held_out_percent"])
    english = side(held if held_out else train, "en")
    tokenizer = side_tokenizer("en", options["vocab_size"], options["held_out_percent"])
    return list(zip(english, encode(tokenizer, english, options["length"], bos=True), strict=True))


def load_examples(options: dict[str, Any]) -> list[Example]:
    return _examples(options, held_out=False)


def load_eval_examples(options: dict[str, Any]) -> list[Example]:
    return _examples(options, held_out=True)


def collate(examples: list[Example]) -> torch.Tensor:
    return torch.tensor([ids for _, ids in examples], dtype=torch.long)


def loss(model: nn.Module, memory: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return model.loss(memory, target)


def decode(model: nn.Module, memory: torch.Tensor, target: torch.Tensor) -> list[str]:
    """Greedy translations of one held-out batch (the target ids are not looked at)."""
    ids = model.greedy(memory, model.max_length)
    return [decode_ids(model.tokenizer, row[1:].tolist()) for row in ids]


def score(hypotheses: list[str], examples: list[Example]) -> dict[str, float]:
    """Corpus BLEU and chrF (sacrebleu, 13a tokenisation, both lower-cased: the tokenizer lower-cases the
    output, so a cased reference would cost every capital letter) against the references."""
    if len(hypotheses) != len(examples):
        raise ValueError(f"{len(hypotheses)} hypotheses for {len(examples)} references")
    references = [text for text, _ in examples]
    bleu = sacrebleu.corpus_bleu(hypotheses, [references], lowercase=True)
    chrf = sacrebleu.metrics.CHRF(lowercase=True).corpus_score(hypotheses, [references])
    tokenize = Tokenizer13a()  # "log out ." and "Log out." tokenise alike
    exact = sum(
        tokenize(h.lower()) == tokenize(r.lower()) for h, r in zip(hypotheses, references, strict=True)
    )
    return {"bleu": bleu.score, "chrf": chrf.score, "exact_match": exact / max(len(references), 1)}
