"""The per-sample cache behind ``delta`` streams, kept identical on both ends, and its sample-id checks.

Both ends must apply the same operations in the same order and agree on which base a
difference was taken from, so the cache, the sample-id rules and the base's checksum live
together here, apart from the encoder and decoder that use them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import torch

from nebula_common.codec.base import CodecError, tensor_to_bytes
from nebula_common.codec.checksum import crc32


class DeltaCache:
    """Per-sample rows, LRU-bounded; both stream ends apply the same operations in the same order.

    Reads never change the LRU order (only ``store`` does), so the sender's
    lookups for encoding and the receiver's for decoding cannot make the two
    caches evict differently.
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._rows: OrderedDict[int, torch.Tensor] = OrderedDict()

    def __len__(self) -> int:
        return len(self._rows)

    def base(self, ids: Sequence[int], like: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Cached rows for ``ids`` stacked like ``like`` (zeros where absent or reshaped), and hits."""
        base = torch.zeros_like(like)
        hits = 0
        row_shape = tuple(like.shape[1:])
        for position, sample in enumerate(ids):
            row = self._rows.get(sample)
            if row is not None and tuple(row.shape) == row_shape and row.dtype == like.dtype:
                base[position] = row
                hits += 1
        return base, hits

    def store(self, ids: Sequence[int], rows: torch.Tensor) -> None:
        for position, sample in enumerate(ids):
            self._rows[sample] = rows[position].clone()
            self._rows.move_to_end(sample)
        while len(self._rows) > self.capacity:
            self._rows.popitem(last=False)


def _sample_ids(ids: Sequence[int] | None, tensor_rows: int, what: str) -> list[int]:
    if ids is None:
        raise CodecError(f"delta compression needs sample_ids to {what} (one id per row of dim 0)")
    ids = [int(sample) for sample in ids]
    if len(ids) != tensor_rows:
        raise CodecError(f"delta: {len(ids)} sample_ids for a tensor with {tensor_rows} rows in dim 0")
    if len(set(ids)) != len(ids):
        raise CodecError("delta: sample_ids contain duplicates; each row must be a distinct sample")
    return ids


def _base_checksum(base: torch.Tensor) -> int:
    """CRC-32 of the base's little-endian bytes: what ``TensorHeader.delta_base_checksum`` carries."""
    return crc32(tensor_to_bytes(base))
