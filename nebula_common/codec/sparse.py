"""``topk(f)``: keep the fraction f of entries with the largest magnitude, drop the rest to zero.

Sparsification suits gradients (heavy-tailed, most entries tiny) and is the usual
partner of error feedback, which re-sends what was dropped later. The kept values
are a float part stored by the leaf codec (``fp16(topk(0.01))``); their positions
are side bytes in whichever of two compact encodings is smaller for the shape:

* a bitmap of ``ceil(n / 8)`` bytes (best when f > 1 / bits-per-index), or
* the sorted indices bit-packed at ``b = bit_length(n - 1)`` bits each,
  ``ceil(k b / 8)`` bytes (best for small f: 1% of 4M entries is 22 bits x 42k).

Both are fixed by the shape, so ``topk`` is a fixed-size codec, and the decoder
validates them exactly: the bitmap must have exactly k bits set and zero padding;
the packed indices must be strictly increasing, below n, with zero padding.
"""

from __future__ import annotations

import numpy as np
import torch

from nebula_common.codec.base import Codec, CodecError, numel
from nebula_common.codec.floating import NoneCodec
from nebula_common.codec.registry import format_spec, register_codec
from nebula_common.codec.transform import Transform, TransformCodec, TransformPlan, round_half_up

BITMAP = "bitmap"
PACKED = "packed"


def index_encoding(n: int, k: int) -> tuple[str, int, int]:
    """(encoding, bits per index, side bytes) for k of n positions: the smaller of bitmap and packed."""
    bits = max(1, (n - 1).bit_length())
    bitmap = (n + 7) // 8
    packed = (k * bits + 7) // 8
    return (BITMAP, 1, bitmap) if bitmap <= packed else (PACKED, bits, packed)


def pack_indices(indices: np.ndarray, bits: int) -> bytes:
    """Big-endian bit-pack sorted uint64 indices at ``bits`` bits each (zero padding at the end)."""
    shifts = np.arange(bits - 1, -1, -1, dtype=np.uint64)
    matrix = ((indices.astype(np.uint64)[:, None] >> shifts) & np.uint64(1)).astype(np.uint8)
    return np.packbits(matrix.reshape(-1)).tobytes()


def unpack_indices(data: bytes, count: int, bits: int) -> np.ndarray:
    """Inverse of ``pack_indices``; padding bits must be zero (anything else is corruption)."""
    flat = np.unpackbits(np.frombuffer(data, dtype=np.uint8))
    if flat[count * bits :].any():
        raise CodecError("topk payload: index padding bits are not zero")
    matrix = flat[: count * bits].reshape(count, bits).astype(np.uint64)
    shifts = np.arange(bits - 1, -1, -1, dtype=np.uint64)
    return (matrix << shifts).sum(axis=1, dtype=np.uint64)


class TopkTransform(Transform):
    """Largest-magnitude selection; the part is the kept values in ascending index order."""

    def __init__(self, fraction: float) -> None:
        if isinstance(fraction, bool) or not isinstance(fraction, int | float) or not 0 < fraction <= 1:
            raise CodecError(f"topk takes the fraction of entries to keep, in (0, 1], got {fraction!r}")
        self.fraction = fraction
        self.spec = format_spec("topk", fraction)

    def count(self, n: int) -> int:
        """Entries kept out of n: ``round(f * n)``, at least 1."""
        return min(n, max(1, round_half_up(self.fraction * n)))

    def plan(self, shape: tuple[int, ...]) -> TransformPlan | None:
        n = numel(shape)
        if n == 0:
            return None
        k = self.count(n)
        encoding, _, side = index_encoding(n, k)
        detail = f"{k} of {n} values + {side} index bytes ({encoding})"
        return TransformPlan(((k,),), side, detail)

    def why_not(self, shape: tuple[int, ...]) -> str:
        return f"shape {list(shape)} is empty"

    def split(
        self, tensor: torch.Tensor, plan: TransformPlan, state: dict[str, object] | None
    ) -> tuple[list[torch.Tensor], bytes]:
        flat = tensor.reshape(-1)
        n = flat.numel()
        ((k,),) = plan.part_shapes
        magnitude = flat.abs().numpy()
        if k == n:
            chosen = np.arange(n, dtype=np.int64)
        else:
            # argpartition is O(n); torch.topk sorts within the selection as well.
            chosen = np.sort(np.argpartition(magnitude, n - k)[n - k :])
        values = flat[torch.from_numpy(chosen)]
        encoding, bits, _ = index_encoding(n, k)
        if encoding == BITMAP:
            mask = np.zeros(n, dtype=np.uint8)
            mask[chosen] = 1
            side = np.packbits(mask).tobytes()
        else:
            side = pack_indices(chosen.astype(np.uint64), bits)
        return [values.contiguous()], side

    def merge(
        self, parts: list[torch.Tensor], side: bytes, plan: TransformPlan, shape: tuple[int, ...]
    ) -> torch.Tensor:
        (values,) = parts
        n = numel(shape)
        k = values.numel()
        encoding, bits, _ = index_encoding(n, k)
        if encoding == BITMAP:
            mask = np.unpackbits(np.frombuffer(side, dtype=np.uint8))
            if mask[n:].any():
                raise CodecError("topk payload: bitmap padding bits are not zero")
            indices = np.flatnonzero(mask[:n])
            if indices.size != k:
                raise CodecError(f"topk payload: bitmap marks {indices.size} positions, expected {k}")
        else:
            packed = unpack_indices(side, k, bits)
            if k and int(packed[-1]) >= n:
                raise CodecError(f"topk payload: index {int(packed[-1])} is out of range for {n} entries")
            if k > 1 and not bool(np.all(packed[1:] > packed[:-1])):
                raise CodecError("topk payload: indices are not strictly increasing (duplicate or unsorted)")
            indices = packed.astype(np.int64)
        out = torch.zeros(n, dtype=values.dtype)
        out[torch.from_numpy(indices)] = values
        return out.reshape(shape)

    def cost_units(self, shape: tuple[int, ...]) -> float:
        return float(numel(shape))


def _topk(fraction: float) -> Codec:
    transform = TopkTransform(fraction)
    return TransformCodec(transform, NoneCodec(), transform.spec)


register_codec("topk", _topk)
