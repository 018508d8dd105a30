"""``zstd``: a lossless outer stage over another codec's bytes (``zstd(int8)``, ``zstd(3)``).

Quantized activations (lots of small codes) and top-k side bytes compress further
with an entropy coder; float32 rarely does. zstd is the only variable-size codec,
so its contract is the upper-bound one (see ``base``): the payload is a 1-byte
mode then either the inner payload stored as-is (mode 0, used whenever zstd would
not shrink it, so ``zstd(x)`` never sends more than 1 byte over ``x``) or one zstd
frame (mode 1). The decoder reads the frame's declared content size *before*
decompressing and requires it to equal the inner codec's exact size, so a
decompression bomb or a truncated frame is rejected, and the inner codec then
validates its own payload.

Spellings: ``zstd(inner)``, ``zstd(level)``, ``zstd(inner, level)``; the inner
codec defaults to ``none`` and the level to 3 (zstd's default: ~300 MB/s per core).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import zstandard

from nebula_common.codec.base import Codec, CodecError
from nebula_common.codec.floating import NoneCodec
from nebula_common.codec.registry import format_spec, register_codec

DEFAULT_LEVEL = 3
MIN_LEVEL, MAX_LEVEL = 1, 19
_RAW = 0
_ZSTD = 1


class ZstdCodec(Codec):
    """zstd around a fixed-size inner codec; falls back to the raw inner payload when that is smaller."""

    variable_size = True

    def __init__(self, inner: Codec, level: int) -> None:
        if inner.variable_size or not inner.wire:
            raise CodecError(f"zstd needs a fixed-size inner codec, got {inner.spec!r}")
        self.inner = inner
        self.level = level
        args: list[str | int] = [] if inner.spec == "none" else [inner.spec]
        if level != DEFAULT_LEVEL or not args:
            args.append(level)
        self.spec = format_spec("zstd", *args)

    def encoded_size(self, shape: Sequence[int], dtype: torch.dtype) -> int:
        return 1 + self.inner.encoded_size(shape, dtype)

    def cost_terms(self, shape: Sequence[int], dtype: torch.dtype) -> list[tuple[str, float]]:
        inner_bytes = float(self.inner.encoded_size(shape, dtype))
        return [*self.inner.cost_terms(shape, dtype), (f"zstd-{self.level}", inner_bytes)]

    def plan_note(self, shape: Sequence[int], dtype: torch.dtype) -> str:
        return self.inner.plan_note(shape, dtype)

    def _encode(self, tensor: torch.Tensor) -> bytes:
        return self._encode_with_state(tensor, None)

    def _encode_with_state(self, tensor: torch.Tensor, state: dict[str, object] | None) -> bytes:
        inner = self.inner.encode(tensor, state)
        # zstandard's compressor objects are not thread-safe; a fresh one per call is cheap.
        packed = zstandard.ZstdCompressor(level=self.level, write_content_size=True).compress(inner)
        if len(packed) < len(inner):
            return bytes([_ZSTD]) + packed
        return bytes([_RAW]) + inner

    def _decode(self, payload: bytes, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        if not payload:
            raise CodecError(f"{self.spec} payload is empty; it needs at least its mode byte")
        expected = self.inner.encoded_size(shape, dtype)
        mode, body = payload[0], payload[1:]
        if mode == _RAW:
            return self.inner.decode(body, shape, dtype)
        if mode != _ZSTD:
            raise CodecError(f"{self.spec} payload has unknown mode byte {mode}")
        try:
            declared = zstandard.frame_content_size(body)
        except zstandard.ZstdError as exc:
            raise CodecError(f"{self.spec} payload is not a zstd frame: {exc}") from None
        if declared != expected:
            raise CodecError(
                f"{self.spec} frame declares {declared} bytes but {self.inner.spec} of shape {list(shape)} "
                f"is exactly {expected}"
            )
        try:
            inner = zstandard.ZstdDecompressor().decompress(body, max_output_size=expected)
        except zstandard.ZstdError as exc:
            raise CodecError(f"{self.spec} payload does not decompress: {exc}") from None
        return self.inner.decode(inner, shape, dtype)


def _zstd(inner: Codec | int | None = None, level: int | None = None) -> Codec:
    if isinstance(inner, int) and not isinstance(inner, bool):
        if level is not None:
            raise CodecError("zstd takes (inner codec, level) or (level), not two numbers")
        inner, level = None, inner
    if inner is not None and not isinstance(inner, Codec):
        raise CodecError(f"zstd's first argument must be a codec or a level, got {inner!r}")
    if level is None:
        level = DEFAULT_LEVEL
    if isinstance(level, bool) or not isinstance(level, int) or not MIN_LEVEL <= level <= MAX_LEVEL:
        raise CodecError(f"zstd level must be an integer in [{MIN_LEVEL}, {MAX_LEVEL}], got {level!r}")
    if isinstance(inner, ZstdCodec):
        raise CodecError("zstd inside zstd gains nothing: compressed bytes do not compress again")
    return ZstdCodec(inner if inner is not None else NoneCodec(), level)


register_codec("zstd", _zstd)
