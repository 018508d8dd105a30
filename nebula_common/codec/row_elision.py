"""Zero rows stay home: the rows of a tensor that are all zero are named in a bitmap, not sent.

Why: what crosses a cut is mostly padded. A batch of sentences is a tensor of shape
[batch, length, d] whose padding positions are exactly zero (the encoder zeroes them, and the
gradients that come back for them are zero too); in the Table 5 corpus 71% of the source positions
are padding. Sending them makes codec ``none`` pay for bytes no real system would send and flatters
every codec that compresses zeros well. So every stream leaves such rows out by default: one bit a
row (``TensorHeader.present_rows``), and the codec encodes only the rows that carry something. The
receiver puts zeros back, so the tensor it decodes is the tensor that was sent (``-0.0`` becomes
``0.0``, the only difference, and it compares equal).

A row is the last dimension: a tensor of shape [..., d] has numel / d rows. Elision applies to
floating tensors of at least two dimensions, and only when the zero rows outweigh the bitmap (their
raw bytes exceed ceil(rows / 8)), so a tensor with no padding goes exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from nebula_common.codec.wire_header import WireFormatError

_NARROWING_COLUMNS = 8


@dataclass(frozen=True)
class Rows:
    """Which rows of a tensor of ``shape`` are present: the mask and its wire form."""

    shape: tuple[int, ...]
    present: torch.Tensor
    """Boolean, one entry per row (numel / shape[-1] of them)."""
    bitmap: bytes
    """``present`` as ``TensorHeader.present_rows``: LSB first, ceil(rows / 8) bytes."""

    @property
    def packed_shape(self) -> tuple[int, int]:
        """The shape the codec sees: [present rows, d]."""
        return (int(self.present.sum()), self.shape[-1])


def zero_rows(tensor: torch.Tensor) -> Rows | None:
    """The rows of ``tensor`` worth sending, or None when every row must go (or elision does not apply)."""
    if tensor.dim() < 2 or not tensor.is_floating_point() or tensor.numel() == 0:
        return None
    flat = tensor.reshape(-1, tensor.shape[-1])
    # Only a row whose first elements are zero can be a zero row: narrowing the candidates a column at a
    # time (one element a candidate) keeps the check of a dense or ReLU-sparse tensor to a few strided
    # glances instead of a pass over all its bytes; only the survivors are read whole.
    candidates = (flat[:, 0] == 0).nonzero().squeeze(1)
    for column in range(1, min(flat.shape[1], _NARROWING_COLUMNS)):
        if candidates.numel() == 0:
            return None
        candidates = candidates[flat[candidates, column] == 0]
    if candidates.numel() == 0:
        return None
    if candidates.numel() * 4 > flat.shape[0]:
        present = flat.ne(0).any(dim=-1)  # mostly padding: one pass beats gathering the candidates
    else:
        present = torch.ones(flat.shape[0], dtype=torch.bool)
        present[candidates[flat[candidates].ne(0).any(dim=-1).logical_not()]] = False
    zeros = present.numel() - int(present.sum())
    if zeros * tensor.shape[-1] * tensor.element_size() <= -(-present.numel() // 8):
        return None  # nothing to leave out, or less than the bitmap would cost
    if not bool(present.any()):
        present[0] = True  # an all-zero tensor still sends one row: no codec is asked to encode nothing
    bits = np.packbits(present.numpy(), bitorder="little").tobytes()
    return Rows(tuple(tensor.shape), present, bits)


def pack(tensor: torch.Tensor, rows: Rows) -> torch.Tensor:
    """The present rows of ``tensor``, in order, as a [present rows, d] tensor (a copy)."""
    return tensor.reshape(-1, tensor.shape[-1])[rows.present]


def unpack(packed: torch.Tensor, rows: Rows) -> torch.Tensor:
    """The whole tensor: ``packed``'s rows where present, zeros elsewhere."""
    full = torch.zeros((rows.present.numel(), rows.shape[-1]), dtype=packed.dtype)
    full[rows.present] = packed
    return full.reshape(rows.shape)


def read_bitmap(bitmap: bytes, shape: tuple[int, ...]) -> Rows:
    """Validate a received ``present_rows`` against the header's shape; a bad one is a WireFormatError."""
    if len(shape) < 2 or shape[-1] == 0:
        raise WireFormatError(
            f"present_rows: set on shape {list(shape)}, but rows are only left out of non-empty tensors "
            "of at least 2 dimensions"
        )
    count = 1
    for dim in shape[:-1]:
        count *= dim
    expected = -(-count // 8)
    if len(bitmap) != expected:
        raise WireFormatError(
            f"present_rows: {len(bitmap)} bytes, but shape {list(shape)} has {count} rows, "
            f"so the bitmap is {expected} bytes"
        )
    bits = np.unpackbits(np.frombuffer(bitmap, dtype=np.uint8), bitorder="little")
    if bits[count:].any():
        raise WireFormatError(f"present_rows: bits set beyond the {count} rows of shape {list(shape)}")
    return Rows(shape, torch.from_numpy(bits[:count].astype(bool)), bytes(bitmap))


__all__ = ["Rows", "pack", "read_bitmap", "unpack", "zero_rows"]
