"""Source side of the numbers job (cluster a): digit strings in, encoder states out."""

from typing import Any

import torch

from nebula_common.zoo.numbers import MAX_NUMBER, PAD, SOURCE_LEN, SOURCE_VOCAB
from nebula_common.zoo.seq2seq import EncoderStage


def build(options: dict[str, Any]) -> torch.nn.Module:
    return EncoderStage(options["d_model"], options["n_heads"], options["n_layers"])


def load_examples(options: dict[str, Any]) -> list[str]:
    return [str(n) for n in range(MAX_NUMBER + 1)]  # example id n is the number n


def collate(examples: list[str]) -> torch.Tensor:
    rows = [[SOURCE_VOCAB.index(ch) for ch in digits] for digits in examples]
    return torch.tensor([[PAD] * (SOURCE_LEN - len(r)) + r for r in rows], dtype=torch.long)
