"""ELECTRA generator (cluster a): masked-language model that corrupts token ids for the discriminator.

Only the corrupted ids leave this cluster (the paper drops the shared embeddings
so the link carries "only a small number of word indices"). Replacements are
sampled from the generator's own distribution with a random stream seeded by
the batch's content, so a re-run (or the unsplit reference run) draws the same
samples.
"""

from typing import Any

import torch
from torch import nn

from nebula_common.jobspec.builtin.electra.common import MASK, PAD, VOCAB, Encoder, corpus, token_ids


class Generator(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_layers: int) -> None:
        super().__init__()
        self.encoder = Encoder(d_model, n_heads, n_layers)
        self.head = nn.Linear(d_model, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(ids))


def build(options: dict[str, Any]) -> nn.Module:
    model = Generator(options["d_model"], options["n_heads"], options["n_layers"])
    model.mask_prob = float(options.get("mask_prob", 0.15))
    return model


def load_examples(options: dict[str, Any]) -> list[list[str]]:
    return corpus()


def collate(examples: list[list[str]]) -> torch.Tensor:
    return token_ids(examples)


def produce(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(corrupted ids to send, MLM loss on the masked positions)."""
    rng = torch.Generator().manual_seed(int((ids * torch.arange(1, ids.numel() + 1).view_as(ids)).sum()))
    real = ids != PAD
    masked = (torch.rand(ids.shape, generator=rng) < model.mask_prob) & real
    masked[:, 1] |= ~masked.any(dim=1)  # at least one masked token per row (position 1 is a word)
    logits = model(ids.masked_fill(masked, MASK))
    loss = nn.functional.cross_entropy(logits[masked], ids[masked])
    with torch.no_grad():
        logits = logits.detach().clone()
        logits[..., MASK] = float("-inf")  # never sample the mask token itself
        probs = torch.softmax(logits[masked], dim=-1)
        sampled = torch.multinomial(probs, 1, generator=rng).squeeze(1)
    corrupted = ids.clone()
    corrupted[masked] = sampled
    return corrupted, loss
