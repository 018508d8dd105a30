"""ABNet's adapters around pre-trained Hugging Face models (the ``encoder_dir``/``decoder_dir`` options).

The same recipe as ``adapters.py`` (frozen pre-trained model, trainable adapters that start as the
identity), on a model loaded from a local directory (``nebula_common.pretrained``): an encoder
(``AutoModel``, e.g. BERT) gets an ``Adapter`` after each of its layers, a causal LM
(``AutoModelForCausalLM``, e.g. GPT-2) a cross-attention ``CrossAdapter`` after each of its blocks.

Why forward hooks on the layers rather than a copy of each architecture's forward: the model runs
its own forward (its attention masks, positions, caches), whatever version of ``transformers``
wrote it; a hook only maps a layer's hidden states. The adapter lives on its layer as a submodule
(``nebula_adapter``) and the hook is a module-level function, so a deep copy, a state dict or a
sharded wrapper sees one ordinary module tree.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from nebula_common.pretrained import transformer_layers
from nebula_common.zoo.adapters import (
    Adapter,
    CrossAdapter,
    TranslationDecoding,
    freeze,
    memory_padding,
)
from nebula_common.zoo.text_data import PAD


def _hidden(output: Any) -> torch.Tensor:
    return output[0] if isinstance(output, tuple) else output


def _with_hidden(output: Any, hidden: torch.Tensor) -> Any:
    return (hidden, *output[1:]) if isinstance(output, tuple) else hidden


def _encoder_hook(layer: nn.Module, args: Any, output: Any) -> Any:
    return _with_hidden(output, layer.nebula_adapter(_hidden(output)))


def _decoder_hook(layer: nn.Module, args: Any, output: Any) -> Any:
    adapter = layer.nebula_adapter
    memory, padding = adapter.memory
    return _with_hidden(output, adapter(_hidden(output), memory, padding))


class PretrainedAdapterEncoder(nn.Module):
    """Cluster S: a frozen pre-trained encoder with a trainable adapter after each layer."""

    def __init__(self, model: nn.Module, bottleneck: int) -> None:
        super().__init__()
        self.model = freeze(model)
        d_model = model.config.hidden_size
        for layer in transformer_layers(model):
            layer.nebula_adapter = Adapter(d_model, bottleneck)
            layer.register_forward_hook(_encoder_hook)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Encoder states to send to T; padding rows are exactly zero (T masks them)."""
        keep = ids != PAD
        states = self.model(input_ids=ids, attention_mask=keep.long()).last_hidden_state
        return states * keep.unsqueeze(-1)


class PretrainedAdapterDecoder(TranslationDecoding, nn.Module):
    """Cluster T: a frozen pre-trained causal LM with a trainable cross-attention adapter per block."""

    def __init__(self, model: nn.Module, n_heads: int, bottleneck: int) -> None:
        super().__init__()
        self.model = freeze(model)
        d_model = model.config.hidden_size
        self.layers = transformer_layers(model)
        for layer in self.layers:
            layer.nebula_adapter = CrossAdapter(d_model, n_heads, bottleneck)
            layer.nebula_adapter.memory = None  # (states, padding) while this decoder runs
            layer.register_forward_hook(_decoder_hook)

    def forward(self, ids: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        """Vocabulary logits per position of ``ids`` given the encoder states ``memory``."""
        context = (memory, memory_padding(memory))
        for layer in self.layers:
            layer.nebula_adapter.memory = context
        try:
            return self.model(input_ids=ids, attention_mask=(ids != PAD).long(), use_cache=False).logits
        finally:
            for layer in self.layers:
                layer.nebula_adapter.memory = None
