"""Uncompressed tensors as (dtype name, shape, bytes), checked against the same limits as WAN headers.

The codec service receives tensors this way (``RawTensor``); reusing the header limits means an
oversized or inconsistent request is refused before anything is allocated.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nebula_common.codec.base import (
    check_input,
    dtype_name,
    element_size,
    numel,
    tensor_from_bytes,
    tensor_to_bytes,
)
from nebula_common.codec.wire_header import WireFormatError, validate_dtype, validate_shape


def raw_to_tensor(dtype: str, shape: Sequence[int], data: bytes) -> torch.Tensor:
    """Build a tensor from raw little-endian row-major bytes, validating dtype, shape and length.

    Used where tensors arrive uncompressed (the codec service's ``RawTensor``), with
    the same limits as headers so an oversized or inconsistent request is rejected
    before anything is allocated.
    """
    torch_dtype = validate_dtype(dtype, "tensor.dtype")
    dims = validate_shape(shape, "tensor.shape")
    expected = numel(dims) * element_size(torch_dtype)
    if len(data) != expected:
        raise WireFormatError(
            f"tensor.data: shape {list(dims)} of {dtype} needs {expected} bytes, got {len(data)}"
        )
    return tensor_from_bytes(data, torch_dtype, dims)


def tensor_to_raw(tensor: torch.Tensor) -> tuple[str, list[int], bytes]:
    """Inverse of ``raw_to_tensor``: (dtype name, shape, little-endian row-major bytes)."""
    tensor = check_input(tensor)
    return dtype_name(tensor.dtype), list(tensor.shape), tensor_to_bytes(tensor)
