"""Fine-tuning, cluster S: frozen pre-trained Spanish encoder + trainable adapters; states go to T.

Only Spanish sentences live here. With ``cut_k`` the stage ends in the learned
bottleneck's down-projection (``nebula_common.zoo.bottleneck``): states of width
``cut_k`` cross instead of ``d_model``, and so do their gradients. ``load_eval_examples`` is the held-out
split's Spanish side: after training, the runtime encodes each of its batches
once and sends the states to T, which decodes them.

``encoder_dir``: a local Hugging Face-format encoder (``config.json`` + ``model.safetensors``, e.g. a
BERT written by ``save_pretrained``) to start from instead of ``pretrained``; its ``hidden_size`` is
``d_model`` and its vocabulary covers the job's tokenizer (``nebula_common.pretrained`` checks both
before the stage starts).
"""

from typing import Any

import torch
from torch import nn

from nebula_common.pretrained import load_dir
from nebula_common.zoo.adapters import AdapterTransformerEncoder, LanguageModel, load_pretrained
from nebula_common.zoo.cut_stages import CutEncoder, cut_half, cut_param_groups
from nebula_common.zoo.hf_adapters import PretrainedAdapterEncoder
from nebula_common.zoo.text_data import encode, side, side_tokenizer, split_pairs

PRETRAINED_DIRS = {
    "encoder_dir": {
        "class": "AutoModel",
        "hidden_size": "== d_model",
        "vocab_size": ">= vocab_size",
        "max_position_embeddings": ">= length",
    }
}


def build(options: dict[str, Any]) -> nn.Module:
    encoder: nn.Module
    if options.get("encoder_dir"):
        encoder = PretrainedAdapterEncoder(
            load_dir(options["encoder_dir"], "AutoModel"), options["bottleneck"]
        )
    else:
        vocab = side_tokenizer("es", options["vocab_size"], options["held_out_percent"]).get_vocab_size()
        plm = LanguageModel(
            vocab,
            options["length"],
            options["d_model"],
            options["n_heads"],
            options["n_layers"],
            causal=False,
        )
        encoder = AdapterTransformerEncoder(
            load_pretrained(plm, options.get("pretrained")), options["bottleneck"]
        )
    down = cut_half(options, "down")
    return encoder if down is None else CutEncoder(encoder, down)


def _encoded(options: dict[str, Any], held_out: bool) -> list[list[int]]:
    train, held = split_pairs(options["held_out_percent"])
    tokenizer = side_tokenizer("es", options["vocab_size"], options["held_out_percent"])
    return encode(tokenizer, side(held if held_out else train, "es"), options["length"], bos=False)


def param_groups(model: nn.Module, options: dict[str, Any]) -> list[dict[str, Any]]:
    """With ``cut_k``: the bottleneck trains at its own rate ``cut_lr`` (default 1e-4), not the stage's."""
    return cut_param_groups(model, options)


def load_examples(options: dict[str, Any]) -> list[list[int]]:
    return _encoded(options, held_out=False)


def load_eval_examples(options: dict[str, Any]) -> list[list[int]]:
    return _encoded(options, held_out=True)


def collate(examples: list[list[int]]) -> torch.Tensor:
    return torch.tensor(examples, dtype=torch.long)
