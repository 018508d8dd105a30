"""Cluster a: widens 16 small features per row into 65,536 values, the tensor that crosses."""

from typing import Any

import torch
from torch import nn


def build(options: dict[str, Any]) -> nn.Module:
    return nn.Linear(16, options["width"])


def load_examples(options: dict[str, Any]) -> list[int]:
    return list(range(4096))


def collate(examples: list[int]) -> torch.Tensor:
    rows = torch.tensor(examples, dtype=torch.float32).unsqueeze(1)
    return torch.sin(rows * torch.arange(1, 17, dtype=torch.float32))
