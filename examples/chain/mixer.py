"""A middle stage (cluster b): a residual MLP block between the reader and the head.

A middle stage holds no labels and no features: it receives what the stage above sent,
sends its output to the stage below, and passes gradients back up. Its examples are only
ids here (``load_examples`` must still return ``data.examples`` items so ids line up).
"""

from typing import Any

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.hidden = nn.Linear(width, 2 * width)
        self.out = nn.Linear(2 * width, width)

    def forward(self, received: torch.Tensor) -> torch.Tensor:
        return received + self.out(torch.relu(self.hidden(self.norm(received))))


def build(options: dict[str, Any]) -> nn.Module:
    return Block(options["width"])


def load_examples(options: dict[str, Any]) -> range:
    return range(10000)


def collate(examples: list[int]) -> torch.Tensor:
    return torch.tensor(examples)
