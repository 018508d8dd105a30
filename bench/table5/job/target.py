"""Table 5 timing job, cluster T: the prepared English decoder with its cross-attention adapters.

``weights``: the adapter-wrapped decoder's state dict (``Prepared.translation_state["decoder"]``);
``examples``: the training split's English token ids (BOS first), one row per pair. As in the
benchmark's fine-tuning, the LM stays frozen except its output layer (final norm and vocabulary head).
"""

from typing import Any

import torch
from torch import nn

from nebula_common.zoo.adapters import AdapterTransformerDecoder, language_model_like
from nebula_common.zoo.cut_stages import CutDecoder, cut_half, cut_param_groups


def build(options: dict[str, Any]) -> nn.Module:
    state = torch.load(options["weights"], weights_only=True, map_location="cpu")
    plm = language_model_like(state, options["n_heads"], causal=True)
    decoder = AdapterTransformerDecoder(plm, options["n_heads"], options["adapter"])
    decoder.load_state_dict(state)
    for parameter in (*plm.norm.parameters(), *plm.head.parameters()):
        parameter.requires_grad_(True)  # the output layer trains, as the benchmark's train_head
    up = cut_half(options, "up")
    return decoder if up is None else CutDecoder(decoder, up)


param_groups = cut_param_groups
"""The bottleneck's projection in its own optimizer group at ``cut_lr``, as in the benchmark."""


def load_examples(options: dict[str, Any]) -> list[torch.Tensor]:
    return list(torch.load(options["examples"], weights_only=True))


def collate(examples: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(examples)


def loss(model: nn.Module, memory: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return model.loss(memory, target)
