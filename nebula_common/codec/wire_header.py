"""The WAN tensor header: what it may declare, how its CRC is computed, and the error a bad one raises.

Everything that crosses the WAN is untrusted in the sense that it may be truncated,
reordered or corrupted (or sent by a buggy peer), so the receiving side checks every
header field against every other before touching the payload. All failures are a
``WireFormatError`` naming the offending field: a bad frame must end as a clear
error, never as a crash in torch or numpy and never as a silently wrong tensor. The
limits and checks live here, apart from encoding and framing, because every reader of a
header (float, integer and raw payloads, the frame assembler) applies the same ones.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from nebula_common.codec.base import CodecError, dtype_from_name, numel
from nebula_common.codec.checksum import crc32
from nebula_common.proto.nebula.v1 import tensor_pb2

MAX_DIMS = 32
"""Most dimensions a header may declare."""

MAX_ELEMENTS = 1 << 32
"""Most elements a header may declare (16 GiB of float32); larger is treated as corruption."""

MAX_PAYLOAD_BYTES = MAX_ELEMENTS * 8
"""Most payload bytes a header may declare, so a corrupt size cannot make a receiver buffer forever."""

HEADER_FIELDS = frozenset({"job_id", "edge", "direction", "step", "micro_batch", "frame_id"})
"""Routing fields callers may set through ``encode_tensor``; the rest are derived from the tensor."""

CHECKSUM_VERSION = 1
"""``TensorHeader.checksum_version`` this library writes and requires: the CRC-32 covers the
decode-relevant header fields as well as the payload (``header_checksum``). Version 0 (the
payload-only CRC of earlier releases) let a header edited from shape [4,4] to [2,8], or from
float16 to bfloat16, decode silently wrong, so it is refused."""

_CHECKSUM_DOMAIN = b"nebula.v1.TensorHeader/crc1\0"
_ROWS_TAG = b"rows\0"
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")


def header_checksum(header: tensor_pb2.TensorHeader, payload: bytes | memoryview) -> int:
    """CRC-32 over the decode-relevant header fields, then the payload (checksum_version 1).

    Covered, in this order and encoding: a domain tag; dtype and codec as UTF-8, each
    NUL-terminated; the number of dimensions and each dimension (little-endian
    int64); payload_size and raw_size (little-endian uint64); delta (one byte) and
    delta_base_checksum (uint64); when rows were left out, a tag, the length of present_rows
    (uint64) and its bytes, so a frame without them is covered exactly as before. Routing fields
    (job, edge, direction, step, micro-batch, frame id) are not covered: the receiver checks them
    against its schedule, and switches may rely on them without recomputing the CRC.
    """
    meta = b"".join(
        [
            _CHECKSUM_DOMAIN,
            header.dtype.encode() + b"\0",
            header.codec.encode() + b"\0",
            _U64.pack(len(header.shape)),
            b"".join(_I64.pack(dim) for dim in header.shape),
            _U64.pack(header.payload_size),
            _U64.pack(header.raw_size),
            b"\1" if header.delta else b"\0",
            _U64.pack(header.delta_base_checksum),
            _rows_part(header.present_rows),
        ]
    )
    return crc32(payload, crc32(meta))


def _rows_part(present_rows: bytes) -> bytes:
    return _ROWS_TAG + _U64.pack(len(present_rows)) + present_rows if present_rows else b""


class WireFormatError(CodecError):
    """A header, payload or frame sequence is malformed; the message names the field."""


@dataclass
class EncodedTensor:
    """An encoded tensor ready for the WAN: the header describes the payload completely."""

    header: tensor_pb2.TensorHeader
    payload: bytes | bytearray | memoryview
    """The encoded bytes: ``bytes`` from a codec, a view of the tensor when encoded with ``borrow``,
    the edge's receive buffer (a ``bytearray``, adopted by the decoder) on the receiving side."""
    note: str = ""
    """Why the codec did not use its preferred layout (e.g. low rank fell back to its inner codec)."""

    @property
    def ratio(self) -> float:
        """Encoded bytes / raw bytes (0.25 for int8 of float32); 0 for an empty tensor."""
        raw = self.header.raw_size
        return self.header.payload_size / raw if raw else 0.0


def validate_shape(shape: Sequence[int], field: str = "shape") -> tuple[int, ...]:
    """Check a declared shape against the wire limits (dims, sign, element count); names ``field``."""
    dims = tuple(int(dim) for dim in shape)
    if len(dims) > MAX_DIMS:
        raise WireFormatError(f"{field}: {len(dims)} dimensions, more than the {MAX_DIMS} allowed")
    if any(dim < 0 for dim in dims):
        raise WireFormatError(f"{field}: {list(dims)} has a negative dimension")
    # Bounding each dimension first keeps the product small enough to compute even
    # for hostile headers; a zero dimension makes a tensor empty, however big the rest.
    if any(dim > MAX_ELEMENTS for dim in dims) or numel(dims) > MAX_ELEMENTS:
        raise WireFormatError(f"{field}: {list(dims)} has more than {MAX_ELEMENTS} elements")
    return dims


def validate_dtype(name: str, field: str = "dtype") -> torch.dtype:
    """Resolve a declared dtype name, as a WireFormatError naming ``field`` when unsupported."""
    try:
        return dtype_from_name(name)
    except CodecError as exc:
        raise WireFormatError(f"{field}: {exc}") from None
