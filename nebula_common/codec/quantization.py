"""``int8``: per-tensor absmax symmetric quantization, a 4x cut of float32 traffic.

Payload: the scale as a little-endian float32 (4 bytes), then one int8 per element.
``scale = absmax / 127`` and ``q = round(x / scale)``, so every finite value is
reproduced within ``scale / 2`` and the symmetric range [-127, 127] keeps zero
exact (-128 is never produced). An all-zero (or empty) tensor has scale 0 and
decodes to zeros.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import numpy as np
import torch

from nebula_common.codec.base import Codec, CodecError, numel, value_range
from nebula_common.codec.registry import register_codec

_SCALE = struct.Struct("<f")
_QMAX = 127
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)
_FLOAT32_SMALLEST_SUBNORMAL = float(np.finfo(np.float32).smallest_subnormal)
_NUMPY_WORK: dict[torch.dtype, type[np.floating]] = {torch.float32: np.float32, torch.float64: np.float64}


class Int8Codec(Codec):
    """Absmax int8 quantization; refuses nan/inf because one of them would wreck the scale for all."""

    spec = "int8"

    def encoded_size(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return _SCALE.size + numel(shape)

    def _encode(self, tensor: torch.Tensor) -> bytes:
        if tensor.numel() == 0:
            return _SCALE.pack(0.0)
        low, high = value_range(tensor)  # one reduction gives absmax and detects nan/inf
        if not (math.isfinite(low) and math.isfinite(high)):
            raise CodecError(f"int8 cannot encode non-finite values: {_describe_non_finite(tensor)}")
        absmax = max(-low, high)
        if absmax == 0.0:
            return _SCALE.pack(0.0) + bytes(tensor.numel())
        if absmax / _QMAX > _FLOAT32_MAX:
            raise CodecError(f"int8 cannot encode absmax {absmax:g}: its scale overflows float32")
        # Quantize with the float32 scale that is actually stored so encode and decode
        # agree exactly; a scale that underflows float32 is bumped to the smallest
        # subnormal, which still keeps |x / scale| well inside [-127, 127].
        scale = max(_SCALE.unpack(_SCALE.pack(absmax / _QMAX))[0], _FLOAT32_SMALLEST_SUBNORMAL)
        work = _work_dtype(tensor.dtype, scale)
        # numpy with one temporary updated in place: torch's out-of-place elementwise
        # ops allocate per step and were several times slower on CPU.
        source = tensor.to(work).reshape(-1).numpy()  # 1-d: numpy turns 0-d results into scalars
        scaled = np.divide(source, _NUMPY_WORK[work](scale))
        np.rint(scaled, out=scaled)  # round half to even
        np.clip(scaled, -_QMAX, _QMAX, out=scaled)
        return _SCALE.pack(scale) + scaled.astype(np.int8).tobytes()

    def _decode(self, payload: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        (scale,) = _SCALE.unpack_from(payload, 0)
        if not math.isfinite(scale) or scale < 0.0:
            raise CodecError(f"int8 payload has invalid scale {scale!r}; expected a finite value >= 0")
        work = _work_dtype(dtype, scale)
        values = np.frombuffer(payload, dtype=np.int8, offset=_SCALE.size).astype(_NUMPY_WORK[work])
        values *= _NUMPY_WORK[work](scale)
        return torch.from_numpy(values).reshape(shape).to(dtype)


def _work_dtype(dtype: torch.dtype, scale: float) -> torch.dtype:
    """float32 is exact enough for float32/half data; float64 data and subnormal scales need float64."""
    return torch.float64 if dtype == torch.float64 or scale < _FLOAT32_TINY else torch.float32


def _describe_non_finite(tensor: torch.Tensor) -> str:
    """Name what is wrong (nan and/or inf, how many) so the caller can find the bad gradient."""
    nan = int(torch.isnan(tensor).sum())
    inf = int(torch.isinf(tensor).sum())
    parts = [f"{count} {label}" for count, label in ((nan, "nan"), (inf, "inf")) if count]
    return f"tensor of {tensor.numel()} elements contains {' and '.join(parts)}"


register_codec("int8", Int8Codec)
