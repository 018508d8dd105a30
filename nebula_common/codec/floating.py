"""Lossless and half-precision codecs: ``none``, ``fp16`` and ``bf16``.

``none`` is the baseline the compression ratios are measured against. ``fp16`` and
``bf16`` halve float32 traffic: fp16 keeps more mantissa (about 3 significant
digits) but has a narrow range, bf16 keeps float32's range with fewer digits.

``fp16(inner)`` / ``bf16(inner)`` store a transform codec's parts in half precision:
``fp16(svd(0.6))`` is the paper's formula (5), C_FP16(C_SVD(X)).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from nebula_common.codec.base import (
    Codec,
    element_size,
    numel,
    tensor_from_bytes,
    tensor_to_bytes,
    value_range,
)
from nebula_common.codec.registry import format_spec, register_codec
from nebula_common.codec.transform import check_inner, wrap_transform

FP16_MAX = torch.finfo(torch.float16).max
"""65504: the largest finite float16, where fp16 saturates."""


class NoneCodec(Codec):
    """Raw little-endian bytes of the input dtype: bit-exact, no compression."""

    spec = "none"

    def encoded_size(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return numel(shape) * element_size(dtype)

    def _encode(self, tensor: torch.Tensor) -> bytes:
        return tensor_to_bytes(tensor)

    def _decode(self, payload: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return tensor_from_bytes(payload, dtype, shape)


def _saturating_cast(tensor: torch.Tensor, target: torch.dtype) -> torch.Tensor:
    """Cast to a 2-byte float, clamping finite values the target cannot hold to its largest finite value.

    A plain cast turns e.g. 70000.0 into inf in float16, and a single inf in an
    activation or gradient poisons the whole step downstream (inf * 0 = nan). The
    clamp bounds the damage to that element's magnitude, the same choice hardware
    and mixed-precision libraries make for saturating conversions. Values that are
    already nan or +-inf are passed through unchanged: they were not produced by the
    codec, and hiding an upstream overflow would defeat loss-scaling overflow checks.
    """
    if tensor.dtype == target or tensor.numel() == 0:
        return tensor.to(target)
    limit = torch.finfo(target).max
    if torch.finfo(tensor.dtype).max <= limit:
        return tensor.to(target)
    # One reduction decides whether clamping is needed at all; in-range data (the
    # normal case) then costs a single cast. A nan makes the range nan, and nan
    # passes through a plain cast unchanged, so it also takes the fast path.
    low, high = value_range(tensor)
    if not (low < -limit or high > limit):
        return tensor.to(target)
    # Clamp in at least float32: in bfloat16 the bound 65504 itself rounds up to 65536,
    # which would overflow to inf again on the cast.
    wide = tensor if tensor.element_size() >= 4 else tensor.to(torch.float32)
    converted = wide.clamp(-limit, limit).to(target)
    infinite = torch.isinf(tensor)
    if bool(infinite.any()):
        converted[infinite] = tensor[infinite].to(target)
    return converted


class _HalfCodec(Codec):
    """Shared body of fp16/bf16: store each element as a 2-byte float, decode to the original dtype."""

    wire_dtype: torch.dtype

    def encoded_size(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return numel(shape) * 2

    def _encode(self, tensor: torch.Tensor) -> bytes:
        return tensor_to_bytes(_saturating_cast(tensor, self.wire_dtype))

    def _decode(self, payload: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        return tensor_from_bytes(payload, self.wire_dtype, shape).to(dtype)


class Fp16Codec(_HalfCodec):
    """IEEE half precision; finite values beyond +-65504 saturate to +-65504 instead of becoming inf."""

    spec = "fp16"
    wire_dtype = torch.float16


class Bf16Codec(_HalfCodec):
    """bfloat16: float32's exponent range with an 8-bit mantissa; saturates like fp16 at its own max."""

    spec = "bf16"
    wire_dtype = torch.bfloat16


def _fp16(inner: Codec | None = None) -> Codec:
    inner = check_inner("fp16", inner)
    if inner is None:
        return Fp16Codec()
    return wrap_transform("fp16", inner, Fp16Codec(), format_spec("fp16", inner.spec))


def _bf16(inner: Codec | None = None) -> Codec:
    inner = check_inner("bf16", inner)
    if inner is None:
        return Bf16Codec()
    return wrap_transform("bf16", inner, Bf16Codec(), format_spec("bf16", inner.spec))


register_codec("none", NoneCodec)
register_codec("fp16", _fp16)
register_codec("bf16", _bf16)
