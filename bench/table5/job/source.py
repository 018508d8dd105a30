"""Table 5 timing job, cluster S: the prepared Spanish encoder with its adapters; states go to T.

``weights``: the adapter-wrapped encoder's state dict (``Prepared.translation_state["encoder"]``);
``examples``: the training split's Spanish token ids, one row per pair (both files in this account's
directory). The LM's shape is read from the weights, so the job holds no copy of the bench's config.
"""

from typing import Any

import torch
from torch import nn

from nebula_common.zoo.adapters import AdapterTransformerEncoder, language_model_like
from nebula_common.zoo.cut_stages import CutEncoder, cut_half, cut_param_groups


def build(options: dict[str, Any]) -> nn.Module:
    state = torch.load(options["weights"], weights_only=True, map_location="cpu")
    encoder = AdapterTransformerEncoder(
        language_model_like(state, options["n_heads"], causal=False), options["adapter"]
    )
    encoder.load_state_dict(state)  # the LM stays frozen (AdapterTransformerEncoder froze it)
    down = cut_half(options, "down")
    return encoder if down is None else CutEncoder(encoder, down)


param_groups = cut_param_groups
"""The bottleneck's projection in its own optimizer group at ``cut_lr``, as in the benchmark."""


def load_examples(options: dict[str, Any]) -> list[torch.Tensor]:
    return list(torch.load(options["examples"], weights_only=True))


def collate(examples: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(examples)
