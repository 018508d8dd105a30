"""What both ELECTRA stages share: the corpus, its vocabulary and a small transformer encoder.

Each stage module imports this file through the package, so the two clusters
tokenise the corpus identically (the discriminator compares the ids it receives
with its own copy of the example to learn which tokens were replaced).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from nebula_common.zoo.numbers import BOS, EOS, MAX_NUMBER, PAD, TARGET_INDEX, TARGET_VOCAB, number_to_words

MASK = len(TARGET_VOCAB)  # one extra id, only ever seen by the generator
VOCAB = len(TARGET_VOCAB) + 1
LENGTH = 8  # BOS + up to 6 words + EOS


def corpus() -> list[list[str]]:
    """Example id n is the number n written in English words."""
    return [number_to_words(n) for n in range(MAX_NUMBER + 1)]


def token_ids(examples: list[list[str]]) -> torch.Tensor:
    rows = [[BOS, *(TARGET_INDEX[w] for w in words), EOS] for words in examples]
    return torch.tensor([r + [PAD] * (LENGTH - len(r)) for r in rows], dtype=torch.long)


class Encoder(nn.Module):
    """Token ids -> per-token states; the generator and the discriminator are two sizes of it."""

    def __init__(self, d_model: int, n_heads: int, n_layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, d_model, padding_idx=PAD)
        self.position = nn.Parameter(torch.randn(LENGTH, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.0, batch_first=True)
        self.layers = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.scale = math.sqrt(d_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        states = self.embed(ids) * self.scale + self.position[: ids.shape[1]]
        return self.layers(states, src_key_padding_mask=ids == PAD)
