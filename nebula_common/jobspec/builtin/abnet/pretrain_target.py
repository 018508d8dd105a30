"""Pre-training, cluster T: a causal LM decoder on the English side of the training split only.

The tensor S sends (its per-example MLM loss) carries no English and no
gradient; T only checks it belongs to the same examples (same batch size).
"""

from typing import Any

import torch
from torch import nn

from nebula_common.zoo.adapters import LanguageModel, lm_loss
from nebula_common.zoo.text_data import encode, side, side_tokenizer, split_pairs


def build(options: dict[str, Any]) -> nn.Module:
    vocab = side_tokenizer("en", options["vocab_size"], options["held_out_percent"]).get_vocab_size()
    return LanguageModel(
        vocab, options["length"], options["d_model"], options["n_heads"], options["n_layers"], causal=True
    )


def load_examples(options: dict[str, Any]) -> list[list[int]]:
    train, _ = split_pairs(options["held_out_percent"])
    tokenizer = side_tokenizer("en", options["vocab_size"], options["held_out_percent"])
    return encode(tokenizer, side(train, "en"), options["length"], bos=True)


def collate(examples: list[list[int]]) -> torch.Tensor:
    return torch.tensor(examples, dtype=torch.long)


def loss(model: nn.Module, source_losses: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    if source_losses.shape[0] != ids.shape[0]:
        raise ValueError(f"S sent {source_losses.shape[0]} values for a batch of {ids.shape[0]} examples")
    return lm_loss(model, ids)
