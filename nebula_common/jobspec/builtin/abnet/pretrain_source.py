"""Pre-training, cluster S: a masked-LM encoder on the Spanish side of the training split only.

What crosses the WAN is only each example's MLM loss (one float per example),
so T can log how S is doing; Spanish text never leaves S. Examples are token
ids already (``load_examples`` has the options, ``collate`` does not).
"""

from typing import Any

import torch
from torch import nn

from nebula_common.zoo.adapters import LanguageModel, mlm_loss
from nebula_common.zoo.text_data import encode, side, side_tokenizer, split_pairs


def build(options: dict[str, Any]) -> nn.Module:
    vocab = side_tokenizer("es", options["vocab_size"], options["held_out_percent"]).get_vocab_size()
    model = LanguageModel(
        vocab, options["length"], options["d_model"], options["n_heads"], options["n_layers"], causal=False
    )
    model.mask_prob = float(options["mask_prob"])
    return model


def load_examples(options: dict[str, Any]) -> list[list[int]]:
    train, _ = split_pairs(options["held_out_percent"])
    tokenizer = side_tokenizer("es", options["vocab_size"], options["held_out_percent"])
    return encode(tokenizer, side(train, "es"), options["length"], bos=False)


def collate(examples: list[list[int]]) -> torch.Tensor:
    return torch.tensor(examples, dtype=torch.long)


def produce(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each example's MLM loss, to send; the batch's MLM loss, to train on)."""
    loss, per_example = mlm_loss(model, ids, model.mask_prob)
    return per_example, loss
