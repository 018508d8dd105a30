"""Stage 0 (cluster a): reads a 4-digit string, sends a summary vector down the chain."""

from typing import Any

import torch
from torch import nn


class Reader(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, width)
        self.position = nn.Parameter(torch.randn(4, width) * 0.1)
        self.mix = nn.Linear(4 * width, width)

    def forward(self, digits: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(digits) + self.position  # [batch, 4, width]
        return torch.tanh(self.mix(tokens.flatten(1)))  # [batch, width]: all that leaves cluster a


def build(options: dict[str, Any]) -> nn.Module:
    return Reader(options["width"])


def load_examples(options: dict[str, Any]) -> list[str]:
    return [f"{i:04d}" for i in range(10000)]


def collate(examples: list[str]) -> torch.Tensor:
    return torch.tensor([[int(ch) for ch in text] for text in examples])
