"""A small transformer seq2seq model for the numbers task, cut at the encoder output into two stages.

Only the encoder's output states cross the WAN (forward), and only their
gradients come back (backward). Each cluster builds just its own stage (the
runtime seeds it); the two stages share nothing but their options.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from nebula_common.zoo.numbers import PAD, SOURCE_LEN, SOURCE_VOCAB, TARGET_LEN, TARGET_VOCAB


def _positional(length: int, d_model: int) -> torch.Tensor:
    position = torch.arange(length).unsqueeze(1)
    div = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
    table = torch.zeros(length, d_model)
    table[:, 0::2] = torch.sin(position * div)
    table[:, 1::2] = torch.cos(position * div)
    return table


class EncoderStage(nn.Module):
    """Source tokens -> contextual states [batch, SOURCE_LEN, d_model] (what crosses the WAN)."""

    def __init__(self, d_model: int, n_heads: int, n_layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(len(SOURCE_VOCAB), d_model, padding_idx=PAD)
        self.register_buffer("positions", _positional(SOURCE_LEN, d_model), persistent=False)
        layer = nn.TransformerEncoderLayer(d_model, n_heads, 4 * d_model, dropout=0.0, batch_first=True)
        self.layers = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)
        self.scale = math.sqrt(d_model)

    def forward(self, source: torch.Tensor) -> torch.Tensor:
        states = self.embed(source) * self.scale + self.positions
        return self.layers(states)


class DecoderStage(nn.Module):
    """Encoder states + target prefix -> next-token logits; owns the loss."""

    def __init__(self, d_model: int, n_heads: int, n_layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(len(TARGET_VOCAB), d_model, padding_idx=PAD)
        self.register_buffer("positions", _positional(TARGET_LEN, d_model), persistent=False)
        layer = nn.TransformerDecoderLayer(d_model, n_heads, 4 * d_model, dropout=0.0, batch_first=True)
        self.layers = nn.TransformerDecoder(layer, n_layers)
        self.out = nn.Linear(d_model, len(TARGET_VOCAB))
        self.scale = math.sqrt(d_model)
        self.register_buffer(
            "causal", nn.Transformer.generate_square_subsequent_mask(TARGET_LEN - 1), persistent=False
        )

    def forward(self, memory: torch.Tensor, target_in: torch.Tensor) -> torch.Tensor:
        length = target_in.shape[1]
        states = self.embed(target_in) * self.scale + self.positions[:length]
        hidden = self.layers(states, memory, tgt_mask=self.causal[:length, :length], tgt_is_causal=True)
        return self.out(hidden)

    def loss(self, memory: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Teacher-forced cross-entropy over the target words (padding ignored)."""
        logits = self(memory, target[:, :-1])
        return nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), target[:, 1:].reshape(-1), ignore_index=PAD
        )
