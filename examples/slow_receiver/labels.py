"""Stage 2 (cluster b): the digit-sum head, sleeping ``sleep_s`` per micro-batch (a slow receiver)."""

import time
from typing import Any

import torch
from torch import nn


def build(options: dict[str, Any]) -> nn.Module:
    width = options["width"]
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, options["classes"]))
    model.sleep_s = float(options.get("sleep_s", 0.5))  # read by loss(); not a parameter
    return model


def load_examples(options: dict[str, Any]) -> list[int]:
    return [sum(int(ch) for ch in f"{i % 10000:04d}") for i in range(20000)]


def collate(examples: list[int]) -> torch.Tensor:
    return torch.tensor(examples)


def loss(model: nn.Module, received: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    time.sleep(model.sleep_s)  # off the CPU: slow, not busy
    return nn.functional.cross_entropy(model(received), labels)
