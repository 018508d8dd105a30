"""Per-edge, per-direction codec endpoints: the seam between a trainer and the codec library.

A trainer owns one ``TensorStreamEncoder`` for each (edge, direction) it sends on
and one ``TensorStreamDecoder`` for each it receives on. Stateful techniques
(error feedback keeps a residual per edge; delta compression keeps a per-sample
cache on both ends; warm-up switches codecs at a step) live behind these two
objects, so training code only ever says "send this tensor of step s for these
samples" and never touches codec state.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from nebula_common.codec.registry import get_codec
from nebula_common.codec.wire import EncodedTensor, decode_tensor, encode_tensor
from nebula_common.proto.nebula.v1 import tensor_pb2


class TensorStreamEncoder:
    """Encodes the successive tensors of one edge direction with one configured spec."""

    def __init__(self, spec: str) -> None:
        self.spec = get_codec(spec).spec  # validates now, not at the first send

    def encode(
        self,
        tensor: torch.Tensor,
        *,
        step: int,
        sample_ids: Sequence[int] | None = None,
        **header_fields: Any,
    ) -> EncodedTensor:
        """Encode one tensor of ``step``; ``sample_ids`` name the rows (for per-sample codecs)."""
        del sample_ids  # stateless codecs do not need them
        return encode_tensor(tensor.detach(), self.spec, step=step, **header_fields)


class TensorStreamDecoder:
    """Decodes the successive tensors of one edge direction (the mirror of the encoder)."""

    def __init__(self, spec: str) -> None:
        self.spec = get_codec(spec).spec

    def decode(
        self,
        header: tensor_pb2.TensorHeader,
        payload: bytes,
        *,
        sample_ids: Sequence[int] | None = None,
    ) -> torch.Tensor:
        """Validate and decode one received tensor; the header alone says how."""
        del sample_ids
        return decode_tensor(header, payload)
