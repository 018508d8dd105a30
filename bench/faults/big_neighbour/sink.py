"""Cluster b: a linear head over the 65,536 values it receives per row."""

from typing import Any

import torch
from torch import nn


def build(options: dict[str, Any]) -> nn.Module:
    return nn.Linear(options["width"], options["classes"])


def load_examples(options: dict[str, Any]) -> list[int]:
    return [i % 10 for i in range(4096)]


def collate(examples: list[int]) -> torch.Tensor:
    return torch.tensor(examples)


def loss(model: nn.Module, received: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(received), labels)
