"""Target side of the numbers job (cluster b): English words, the decoder, the loss."""

from typing import Any

import torch

from nebula_common.zoo.numbers import BOS, EOS, MAX_NUMBER, PAD, TARGET_INDEX, TARGET_LEN, number_to_words
from nebula_common.zoo.seq2seq import DecoderStage


def build(options: dict[str, Any]) -> torch.nn.Module:
    return DecoderStage(options["d_model"], options["n_heads"], options["n_layers"])


def load_examples(options: dict[str, Any]) -> list[list[str]]:
    return [number_to_words(n) for n in range(MAX_NUMBER + 1)]


def collate(examples: list[list[str]]) -> torch.Tensor:
    rows = [[BOS, *(TARGET_INDEX[w] for w in words), EOS] for words in examples]
    return torch.tensor([r + [PAD] * (TARGET_LEN - len(r)) for r in rows], dtype=torch.long)


def loss(model: torch.nn.Module, memory: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return model.loss(memory, target)
