"""ELECTRA discriminator (cluster b): replaced-token detection on the ids the generator sent.

This cluster holds the same corpus (aligned by example id), so it labels each
position itself: replaced where the received id differs from its own. No
gradient goes back; with `replicas: n` each data-parallel rank trains on its
rows of every micro-batch. The loss is a mean over *examples* (each row's summed
token loss over a fixed length), so the mean of the ranks' losses is exactly the
combined batch's loss; a mean over tokens would weight ranks by their lengths.
"""

from typing import Any

import torch
from torch import nn

from nebula_common.jobspec.builtin.electra.common import LENGTH, PAD, Encoder, corpus, token_ids


class Discriminator(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_layers: int) -> None:
        super().__init__()
        self.encoder = Encoder(d_model, n_heads, n_layers)
        self.head = nn.Linear(d_model, 1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(ids)).squeeze(-1)


def build(options: dict[str, Any]) -> nn.Module:
    return Discriminator(options["d_model"], options["n_heads"], options["n_layers"])


def load_examples(options: dict[str, Any]) -> list[list[str]]:
    return corpus()


def collate(examples: list[list[str]]) -> torch.Tensor:
    return token_ids(examples)


def loss(model: nn.Module, corrupted: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of "was this token replaced?" on the real (non-padding) tokens, per example."""
    if corrupted.shape != original.shape:
        raise ValueError(
            f"received ids {tuple(corrupted.shape)} do not match this shard's {tuple(original.shape)}"
        )
    logits = model(corrupted)
    real = original != PAD
    replaced = (corrupted != original).float()
    per_token = nn.functional.binary_cross_entropy_with_logits(logits, replaced, reduction="none")
    return (per_token * real).sum() / (corrupted.shape[0] * LENGTH)
