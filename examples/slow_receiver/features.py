"""Stage 1 (cluster a): reads a 4-digit string, sends a summary vector across the cut."""

from typing import Any

import torch
from torch import nn


class Reader(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, width)
        self.rnn = nn.GRU(width, width, batch_first=True)

    def forward(self, digits: torch.Tensor) -> torch.Tensor:
        _, hidden = self.rnn(self.embed(digits))
        return hidden[-1]  # [batch, width]: the only thing that leaves this cluster


def build(options: dict[str, Any]) -> nn.Module:
    return Reader(options["width"])


def load_examples(options: dict[str, Any]) -> list[str]:
    return [f"{i % 10000:04d}" for i in range(20000)]


def collate(examples: list[str]) -> torch.Tensor:
    return torch.tensor([[int(ch) for ch in text] for text in examples])
