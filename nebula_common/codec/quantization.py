"""Integer quantization: ``int8`` (per-tensor, per-row or blockwise absmax) and ``int4`` (blockwise).

Symmetric absmax scaling: ``scale = absmax / qmax`` and ``q = round(x / scale)``,
so every finite value is reproduced within ``scale / 2`` (nearest rounding) and
zero stays exact; the code ``-qmax - 1`` is never produced. One outlier channel
ruins a per-tensor scale for everything else, which is what per-row (one scale
per last-dim row) and blockwise (one scale per ``block`` consecutive elements)
scaling fix, at 4 bytes per scale.

Spellings and payloads (scales are little-endian float32, all first):

* ``int8``: 1 scale, then n int8 (the original layout);
* ``int8(error=E)``: the same layout with a coarser step chosen for a target relative L2 error E
  (0 < E <= 1): ``scale = max(absmax / 127, E * sqrt(12) * rms)``. Uniform rounding adds noise of
  ``scale**2 / 12`` per element when values spread over many steps, so such data decodes with a
  relative L2 error of about E (at most ``sqrt(3) * E`` for data sitting on half-steps), and far
  fewer distinct codes remain: ``zstd(int8(error=0.04))`` entropy-codes them into about 4.7 bits per
  element, where int4's fixed 4 bits give 11% error on the same activations. The step never drops
  below absmax / 127, so nothing clips; a tensor whose absmax is more than 127 such steps (a far
  outlier) gets plain ``int8``'s step and error, above E (the advisor measures what it gets);
* ``int8(scale=row)``: one scale per row of ``shape[-1]`` elements, then n int8;
* ``int8(scale=block)`` / ``int8(block=B)``: ``ceil(n / B)`` scales (B = 64 by default), then n int8;
* ``rounding=stochastic`` (any int8 mode): round up with probability equal to the
  fractional part, so the quantization is unbiased in expectation (useful for
  gradients); the payload layout is unchanged and decoding does not care;
* ``int4`` / ``int4(block=B)``: ``ceil(n / B)`` scales, then two 4-bit codes per byte
  (low nibble first, code + 8, so 1..15; an odd tail's spare nibble is 8 = zero).

``int8(svd(0.5))``/``int4(lowrank(8))`` store a transform codec's parts with that
quantizer. An all-zero (or empty) tensor or group has scale 0 and decodes to zeros.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import numpy as np
import torch

from nebula_common.codec.base import Codec, CodecError, numel, value_range
from nebula_common.codec.registry import format_spec, register_codec
from nebula_common.codec.transform import check_inner, wrap_transform

_SCALE = struct.Struct("<f")
_QMAX = 127
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_FLOAT32_TINY = float(np.finfo(np.float32).tiny)
_FLOAT32_SMALLEST_SUBNORMAL = float(np.finfo(np.float32).smallest_subnormal)
_NUMPY_WORK: dict[torch.dtype, type[np.floating]] = {torch.float32: np.float32, torch.float64: np.float64}
DEFAULT_BLOCK = 64
"""Elements per scale for blockwise modes: 0.5 bit/element of scale overhead for int8, a good error trade."""
MAX_BLOCK = 1 << 20
SCALE_MODES = ("tensor", "row", "block")
_UNIFORM_NOISE = math.sqrt(12.0)
"""Rounding to a step q adds noise of variance q**2 / 12: a relative error E needs the step E*sqrt(12)*rms."""
ROUNDING_MODES = ("nearest", "stochastic")


class Int8Codec(Codec):
    """Per-tensor int8 quantization; refuses nan/inf because one of them would wreck the scale.

    ``error`` (``int8(error=E)``) widens the step to ``E * sqrt(12) * rms`` when that is coarser than
    absmax / 127: the encoder trades precision the caller does not need for fewer distinct codes,
    which an outer ``zstd`` turns into bytes. The payload is plain ``int8``'s, so decoding is unchanged.
    """

    def __init__(self, error: float | None = None) -> None:
        self.error = error
        self.spec = format_spec("int8", error=error)

    def encoded_size(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return _SCALE.size + numel(shape)

    def cost_terms(self, shape: Sequence[int], dtype: torch.dtype) -> list[tuple[str, float]]:
        return [("int8", float(numel(shape)))]  # one calibration for every error target: the work is int8's

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
        step = absmax / _QMAX
        if self.error is not None:  # rms <= absmax, so this step never overflows where absmax's did not
            rms = float(torch.linalg.vector_norm(tensor.reshape(-1), dtype=torch.float64)) / math.sqrt(
                tensor.numel()
            )
            step = max(step, min(self.error * _UNIFORM_NOISE * rms, _FLOAT32_MAX))
        # Quantize with the float32 scale that is actually stored so encode and decode
        # agree exactly; a scale that underflows float32 is bumped to the smallest
        # subnormal, which still keeps |x / scale| well inside [-127, 127].
        scale = max(_SCALE.unpack(_SCALE.pack(step))[0], _FLOAT32_SMALLEST_SUBNORMAL)
        scale = min(scale, _scale_cap(tensor.dtype, _QMAX))
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
        codes = np.frombuffer(payload, dtype=np.int8, offset=_SCALE.size)
        if bool(np.any(codes == -128)):
            raise CodecError("int8 payload holds code -128, which the encoder never produces")
        values = codes.astype(_NUMPY_WORK[work])
        with np.errstate(over="ignore"):  # an overflow is refused just below
            values *= _NUMPY_WORK[work](scale)
        return _refuse_overflow(torch.from_numpy(values).reshape(shape).to(dtype), "int8", scale * _QMAX)


class GroupQuantCodec(Codec):
    """Absmax quantization with one float32 scale per group (row or block); int8 or packed int4."""

    def __init__(self, bits: int, scale: str, block: int, rounding: str, spec: str) -> None:
        self.bits = bits
        self.qmax = (1 << (bits - 1)) - 1
        self.scale_mode = scale
        self.block = block
        self.stochastic = rounding == "stochastic"
        self.spec = spec

    def _groups(self, shape: Sequence[int]) -> tuple[int, int]:
        """(number of groups, elements per group); the last block may be partly padding."""
        n = numel(shape)
        if n == 0:
            return 0, 0
        if self.scale_mode == "row":
            length = int(shape[-1]) if len(shape) else 1
            return n // length, length
        return (n + self.block - 1) // self.block, self.block

    def _code_bytes(self, n: int) -> int:
        return n if self.bits == 8 else (n + 1) // 2

    def encoded_size(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        groups, _ = self._groups(shape)
        return _SCALE.size * groups + self._code_bytes(numel(shape))

    def cost_terms(self, shape: Sequence[int], dtype: torch.dtype) -> list[tuple[str, float]]:
        return [(f"int{self.bits}-group", float(numel(shape)))]

    def _encode(self, tensor: torch.Tensor) -> bytes:
        n = tensor.numel()
        if n == 0:
            return b""
        low, high = value_range(tensor)
        if not (math.isfinite(low) and math.isfinite(high)):
            raise CodecError(f"{self.spec} cannot encode non-finite values: {_describe_non_finite(tensor)}")
        groups, length = self._groups(tuple(tensor.shape))
        work = np.float64 if tensor.dtype == torch.float64 else np.float32
        flat = tensor.to(torch.float64 if work is np.float64 else torch.float32).reshape(-1).numpy()
        padded = np.zeros(groups * length, dtype=work)
        padded[:n] = flat
        matrix = padded.reshape(groups, length)
        absmax = np.abs(matrix).max(axis=1).astype(np.float64)
        if float(absmax.max()) / self.qmax > _FLOAT32_MAX:
            raise CodecError(
                f"{self.spec} cannot encode absmax {float(absmax.max()):g}: its scale overflows float32"
            )
        scales = (absmax / self.qmax).astype(np.float32)
        scales[(scales == 0) & (absmax > 0)] = _FLOAT32_SMALLEST_SUBNORMAL
        np.minimum(scales, np.float32(_scale_cap(tensor.dtype, self.qmax)), out=scales)
        # Divide by the float32 scale actually stored so encoder and decoder agree exactly;
        # scale 0 only occurs for all-zero groups, whose quotient is 0 with divisor 1.
        divisor = np.where(scales == 0, 1.0, scales.astype(np.float64)).astype(work)
        scaled = matrix / divisor[:, None]
        if self.stochastic:
            scaled += np.random.default_rng().random(scaled.shape, dtype=work)
            np.floor(scaled, out=scaled)
        else:
            np.rint(scaled, out=scaled)
        np.clip(scaled, -self.qmax, self.qmax, out=scaled)
        codes = scaled.reshape(-1)[:n].astype(np.int8)
        if self.bits == 4:
            nibbles = (codes + 8).astype(np.uint8)
            if n % 2:
                nibbles = np.append(nibbles, np.uint8(8))
            codes = (nibbles[0::2] | (nibbles[1::2] << 4)).astype(np.uint8)
        return scales.astype("<f4").tobytes() + codes.tobytes()

    def _decode(self, payload: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = numel(shape)
        if n == 0:
            return torch.zeros(shape, dtype=dtype)
        groups, length = self._groups(shape)
        with np.errstate(invalid="ignore"):  # a signalling-nan scale is rejected just below
            scales = np.frombuffer(payload, dtype="<f4", count=groups).astype(np.float64)
        if not bool(np.all(np.isfinite(scales))) or bool(np.any(scales < 0)):
            raise CodecError(f"{self.spec} payload has an invalid scale; scales must be finite and >= 0")
        raw = np.frombuffer(
            payload, dtype=np.uint8 if self.bits == 4 else np.int8, offset=_SCALE.size * groups
        )
        if self.bits == 4:
            nibbles = np.empty(raw.size * 2, dtype=np.uint8)
            nibbles[0::2] = raw & 0x0F
            nibbles[1::2] = raw >> 4
            if n % 2 and nibbles[-1] != 8:
                raise CodecError(
                    f"{self.spec} payload: the spare nibble after an odd element count is not zero"
                )
            nibbles = nibbles[:n]
            if bool(np.any(nibbles == 0)):
                raise CodecError(f"{self.spec} payload holds code -8, which the encoder never produces")
            codes = nibbles.astype(np.int8) - 8
        else:
            codes = raw
            if bool(np.any(codes == -128)):
                raise CodecError(f"{self.spec} payload holds code -128, which the encoder never produces")
        work = np.float64 if dtype == torch.float64 or float(scales.min()) < _FLOAT32_TINY else np.float32
        padded = np.zeros(groups * length, dtype=work)
        padded[:n] = codes
        with np.errstate(over="ignore"):  # an overflow is refused just below
            values = padded.reshape(groups, length) * scales.astype(work)[:, None]
        decoded = torch.from_numpy(np.ascontiguousarray(values.reshape(-1)[:n])).reshape(shape).to(dtype)
        return _refuse_overflow(decoded, self.spec, float(scales.max()) * self.qmax)


def _check_options(name: str, scale: object, block: object, rounding: object) -> tuple[str, int, str]:
    if scale not in SCALE_MODES:
        raise CodecError(f"{name} scale must be one of {', '.join(SCALE_MODES)}, got {scale!r}")
    if rounding not in ROUNDING_MODES:
        raise CodecError(f"{name} rounding must be one of {', '.join(ROUNDING_MODES)}, got {rounding!r}")
    if block is not None and (
        isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= MAX_BLOCK
    ):
        raise CodecError(f"{name} block must be an integer in [1, {MAX_BLOCK}], got {block!r}")
    return str(scale), int(block) if block is not None else DEFAULT_BLOCK, str(rounding)


def _check_error(error: object, mode: str, rounding: str) -> float:
    """``error=E``: a number in (0, 1], for the per-tensor scale with nearest rounding only."""
    if isinstance(error, bool) or not isinstance(error, int | float) or not 0 < error <= 1:
        raise CodecError(f"int8 error must be a relative L2 error in (0, 1], got {error!r}")
    clash = f"scale={mode}" if mode != "tensor" else f"rounding={rounding}" if rounding != "nearest" else ""
    if clash:
        raise CodecError(f"int8 error={error} sets the per-tensor step; it does not combine with {clash}")
    return float(error)


def _int8(
    inner: Codec | None = None,
    *,
    scale: str | None = None,
    block: int | None = None,
    rounding: str = "nearest",
    error: float | None = None,
) -> Codec:
    inner = check_inner("int8", inner)
    if scale is None:
        scale = "block" if block is not None else "tensor"
    mode, size, rounding = _check_options("int8", scale, block, rounding)
    if block is not None and mode != "block":
        raise CodecError(f"int8 block={block} only applies to scale=block, not scale={mode}")
    if error is not None:
        error = _check_error(error, mode, rounding)
    spec = format_spec(
        "int8",
        *([inner.spec] if inner is not None else []),
        scale=None if mode == "tensor" else mode,
        block=size if mode == "block" and size != DEFAULT_BLOCK else None,
        rounding=None if rounding == "nearest" else rounding,
        error=error,
    )
    if mode == "tensor" and rounding == "nearest":
        leaf: Codec = Int8Codec(error)
    else:
        leaf_spec = (
            spec
            if inner is None
            else format_spec(
                "int8",
                scale=None if mode == "tensor" else mode,
                block=size if mode == "block" and size != DEFAULT_BLOCK else None,
                rounding=None if rounding == "nearest" else rounding,
            )
        )
        leaf = (
            PerTensorStochasticInt8(leaf_spec)
            if mode == "tensor"
            else GroupQuantCodec(8, mode, size, rounding, leaf_spec)
        )
    return leaf if inner is None else wrap_transform("int8", inner, leaf, spec)


class PerTensorStochasticInt8(GroupQuantCodec):
    """``int8(rounding=stochastic)``: the per-tensor layout (1 scale) with unbiased rounding."""

    def __init__(self, spec: str) -> None:
        super().__init__(8, "block", DEFAULT_BLOCK, "stochastic", spec)

    def _groups(self, shape: Sequence[int]) -> tuple[int, int]:
        n = numel(shape)
        return (1, n) if n else (0, 0)

    def encoded_size(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return _SCALE.size + numel(shape)

    def _encode(self, tensor: torch.Tensor) -> bytes:
        return _SCALE.pack(0.0) if tensor.numel() == 0 else super()._encode(tensor)

    def _decode(self, payload: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if numel(shape) == 0:
            return torch.zeros(shape, dtype=dtype)
        return super()._decode(payload, shape, dtype)


def _int4(inner: Codec | None = None, *, block: int | None = None) -> Codec:
    inner = check_inner("int4", inner)
    _, size, _ = _check_options("int4", "block", block, "nearest")
    leaf_spec = format_spec("int4", block=size if size != DEFAULT_BLOCK else None)
    leaf = GroupQuantCodec(4, "block", size, "nearest", leaf_spec)
    if inner is None:
        return leaf
    spec = format_spec("int4", inner.spec, block=size if size != DEFAULT_BLOCK else None)
    return wrap_transform("int4", inner, leaf, spec)


def _scale_cap(dtype: torch.dtype, qmax: int) -> float:
    """The largest float32 scale whose ``qmax`` codes stay finite in ``dtype`` once decoded.

    absmax / qmax rounded to float32 can round up, and for an absmax at the top of the dtype's range
    qmax times that scale is infinity; the encoder stores at most this scale (such values then
    lose one float32 step, where they would otherwise decode to infinity).
    """
    limit = float(torch.finfo(dtype).max)
    cap = np.float32(min(limit / qmax, _FLOAT32_MAX))
    while float(cap) * qmax > limit:
        cap = np.nextafter(cap, np.float32(0))
    return float(cap)


def _refuse_overflow(decoded: torch.Tensor, spec: str, bound: float) -> torch.Tensor:
    """``decoded``, unless a scale times a code overflowed its dtype to infinity.

    The encoders derive each scale from a finite absmax of the same dtype, so their codes times their
    scales stay finite; a peer's larger scale would hand the model infinities. Only a payload whose
    largest possible value (``bound``) is beyond the dtype's range pays for the check.
    """
    if bound > torch.finfo(decoded.dtype).max and not bool(torch.isfinite(decoded).all()):
        raise CodecError(
            f"{spec} payload's scales overflow {str(decoded.dtype).removeprefix('torch.')} "
            "to infinity, which the encoder never produces"
        )
    return decoded


def _work_dtype(dtype: torch.dtype, scale: float) -> torch.dtype:
    """float32 is exact enough for float32/half data; float64 data and subnormal scales need float64."""
    return torch.float64 if dtype == torch.float64 or scale < _FLOAT32_TINY else torch.float32


def _describe_non_finite(tensor: torch.Tensor) -> str:
    """Name what is wrong (nan and/or inf, how many) so the caller can find the bad gradient."""
    nan = int(torch.isnan(tensor).sum())
    inf = int(torch.isinf(tensor).sum())
    parts = [f"{count} {label}" for count, label in ((nan, "nan"), (inf, "inf")) if count]
    return f"tensor of {tensor.numel()} elements contains {' and '.join(parts)}"


register_codec("int8", _int8)
register_codec("int4", _int4)
