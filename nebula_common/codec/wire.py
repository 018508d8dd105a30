"""The self-describing WAN wire format: a ``TensorHeader`` plus an encoded payload, cut into frames.

Everything that crosses the WAN is untrusted in the sense that it may be truncated,
reordered or corrupted (or sent by a buggy peer), so the receiving side checks every
header field against every other before touching the payload. All failures are a
``WireFormatError`` naming the offending field: a bad frame must end as a clear
error, never as a crash in torch or numpy and never as a silently wrong tensor.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from nebula_common.codec.base import (
    CodecError,
    check_input,
    dtype_from_name,
    dtype_name,
    element_size,
    numel,
    tensor_from_bytes,
    tensor_to_bytes,
)
from nebula_common.codec.registry import get_codec
from nebula_common.proto.nebula.v1 import tensor_pb2

DEFAULT_CHUNK_SIZE = 256 * 1024
"""Chunk size used on the WAN: large enough to amortise per-message cost, small enough to interleave."""

MAX_DIMS = 32
"""Most dimensions a header may declare."""

MAX_ELEMENTS = 1 << 32
"""Most elements a header may declare (16 GiB of float32); larger is treated as corruption."""

MAX_PAYLOAD_BYTES = MAX_ELEMENTS * 8
"""Most payload bytes a header may declare, so a corrupt size cannot make a receiver buffer forever."""

HEADER_FIELDS = frozenset({"job_id", "edge", "direction", "step", "micro_batch", "frame_id"})
"""Routing fields callers may set through ``encode_tensor``; the rest are derived from the tensor."""


class WireFormatError(CodecError):
    """A header, payload or frame sequence is malformed; the message names the field."""


@dataclass
class EncodedTensor:
    """An encoded tensor ready for the WAN: the header describes the payload completely."""

    header: tensor_pb2.TensorHeader
    payload: bytes


def encode_tensor(tensor: torch.Tensor, spec: str, **header_fields: Any) -> EncodedTensor:
    """Encode ``tensor`` with the codec ``spec`` and build its header.

    dtype, shape, codec (canonical spec), payload_size, checksum and raw_size are
    derived here so they cannot disagree with the payload; routing fields (job_id,
    edge, direction, step, micro_batch, frame_id) come from ``header_fields``.
    """
    unknown = set(header_fields) - HEADER_FIELDS
    if unknown:
        raise TypeError(
            f"encode_tensor got unexpected header fields {sorted(unknown)}; allowed: {sorted(HEADER_FIELDS)}"
        )
    codec = get_codec(spec)
    tensor = check_input(tensor)
    payload = codec.encode(tensor)
    shape = tuple(tensor.shape)
    expected = codec.encoded_size(shape, tensor.dtype)
    if len(payload) != expected:
        # A codec whose size prediction is wrong would have every receiver reject its frames.
        raise CodecError(
            f"codec {codec.spec} produced {len(payload)} bytes but its encoded_size is {expected}"
        )
    header = tensor_pb2.TensorHeader(
        dtype=dtype_name(tensor.dtype),
        shape=shape,
        codec=codec.spec,
        payload_size=len(payload),
        checksum=zlib.crc32(payload),
        raw_size=tensor.numel() * tensor.element_size(),
        **header_fields,
    )
    return EncodedTensor(header=header, payload=payload)


def _validate_shape(shape: Sequence[int], field: str = "shape") -> tuple[int, ...]:
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


def _validate_dtype(name: str, field: str = "dtype") -> torch.dtype:
    try:
        return dtype_from_name(name)
    except CodecError as exc:
        raise WireFormatError(f"{field}: {exc}") from None


def decode_tensor(header: tensor_pb2.TensorHeader, payload: bytes) -> torch.Tensor:
    """Validate ``header`` against ``payload`` and decode it; any inconsistency is a WireFormatError.

    Checks run cheapest first and the checksum last, so a corrupt header is
    reported as such rather than as a checksum mismatch.
    """
    dtype = _validate_dtype(header.dtype)
    shape = _validate_shape(header.shape)
    try:
        codec = get_codec(header.codec)
    except CodecError as exc:
        raise WireFormatError(f"codec: {exc}") from None
    raw_size = numel(shape) * element_size(dtype)
    if header.raw_size != raw_size:
        raise WireFormatError(
            f"raw_size: header says {header.raw_size} but shape {list(shape)} of {header.dtype} "
            f"is {raw_size} bytes (shape or raw_size corrupt)"
        )
    if len(payload) != header.payload_size:
        raise WireFormatError(
            f"payload_size: header says {header.payload_size} bytes but the payload has {len(payload)}"
        )
    expected = codec.encoded_size(shape, dtype)
    if header.payload_size != expected:
        raise WireFormatError(
            f"payload_size: header says {header.payload_size} bytes but codec {codec.spec} encodes "
            f"shape {list(shape)} of {header.dtype} in {expected}"
        )
    checksum = zlib.crc32(payload)
    if checksum != header.checksum:
        raise WireFormatError(
            f"checksum: payload CRC-32 is {checksum:#010x} but header says {header.checksum:#010x}"
        )
    try:
        return codec.decode(payload, shape, dtype)
    except CodecError as exc:
        raise WireFormatError(f"payload: {exc}") from None


def to_frames(
    encoded: EncodedTensor, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> Iterator[tensor_pb2.TensorFrame]:
    """Yield the header frame, then the payload in ``chunk_size`` chunks, the final one marked ``last``.

    An empty payload still gets one empty chunk with ``last=True`` so the receiver
    always learns that the frame is complete from a chunk.
    """
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    header = encoded.header
    yield tensor_pb2.TensorFrame(header=header)
    payload = encoded.payload
    view = memoryview(payload)
    offset = 0
    while True:
        end = min(offset + chunk_size, len(payload))
        last = end >= len(payload)
        yield tensor_pb2.TensorFrame(
            chunk=tensor_pb2.TensorChunk(
                frame_id=header.frame_id, offset=offset, data=bytes(view[offset:end]), last=last
            )
        )
        if last:
            return
        offset = end


class FrameAssembler:
    """Reassemble one stream's frames into ``EncodedTensor``s, enforcing the framing rules.

    A stream carries one frame at a time: a header, then its chunks in order with
    contiguous offsets, the final one marked ``last`` and ending exactly at
    ``payload_size``. The assembler checks framing only; ``decode_tensor`` checks the
    content (codec, sizes, checksum). After an error the partial frame is dropped,
    so the caller may resynchronise on the next header or abort the stream.
    """

    def __init__(self) -> None:
        self._header: tensor_pb2.TensorHeader | None = None
        self._parts: list[bytes] = []
        self._received = 0

    @property
    def in_progress(self) -> bool:
        """True while a header has arrived and its last chunk has not."""
        return self._header is not None

    def reset(self) -> None:
        """Drop any partial frame (e.g. when the stream it came from broke)."""
        self._header = None
        self._parts = []
        self._received = 0

    def feed(self, frame: tensor_pb2.TensorFrame) -> EncodedTensor | None:
        """Consume one frame; return the completed tensor when its last chunk arrives, else None."""
        try:
            return self._feed(frame)
        except WireFormatError:
            self.reset()
            raise

    def _feed(self, frame: tensor_pb2.TensorFrame) -> EncodedTensor | None:
        if not isinstance(frame, tensor_pb2.TensorFrame):
            raise WireFormatError(f"frame: expected a TensorFrame, got {type(frame).__name__}")
        part = frame.WhichOneof("part")
        if part == "header":
            self._start(frame.header)
            return None
        if part == "chunk":
            return self._append(frame.chunk)
        raise WireFormatError("frame: carries neither a header nor a chunk")

    def _start(self, header: tensor_pb2.TensorHeader) -> None:
        if self._header is not None:
            raise WireFormatError(
                f"header: frame {header.frame_id} started while frame {self._header.frame_id} is incomplete "
                f"({self._received} of {self._header.payload_size} bytes received)"
            )
        if header.payload_size > MAX_PAYLOAD_BYTES:
            raise WireFormatError(
                f"payload_size: {header.payload_size} bytes exceeds the {MAX_PAYLOAD_BYTES} allowed"
            )
        self._header = tensor_pb2.TensorHeader()
        self._header.CopyFrom(header)

    def _append(self, chunk: tensor_pb2.TensorChunk) -> EncodedTensor | None:
        header = self._header
        if header is None:
            raise WireFormatError(f"chunk: chunk of frame {chunk.frame_id} arrived without a header")
        if chunk.frame_id != header.frame_id:
            raise WireFormatError(
                f"frame_id: chunk belongs to frame {chunk.frame_id} but frame {header.frame_id} is pending"
            )
        if chunk.offset != self._received:
            raise WireFormatError(
                f"offset: chunk of frame {header.frame_id} starts at {chunk.offset} but {self._received} "
                f"bytes have been received (chunks missing or reordered)"
            )
        end = self._received + len(chunk.data)
        if end > header.payload_size:
            raise WireFormatError(
                f"payload_size: chunks of frame {header.frame_id} carry {end} bytes, more than the "
                f"{header.payload_size} declared"
            )
        if chunk.data:
            self._parts.append(chunk.data)
        self._received = end
        if not chunk.last:
            return None
        if end != header.payload_size:
            raise WireFormatError(
                f"payload_size: last chunk of frame {header.frame_id} ends at {end} bytes but "
                f"{header.payload_size} were declared"
            )
        payload = b"".join(self._parts)
        self.reset()
        return EncodedTensor(header=header, payload=payload)


def raw_to_tensor(dtype: str, shape: Sequence[int], data: bytes) -> torch.Tensor:
    """Build a tensor from raw little-endian row-major bytes, validating dtype, shape and length.

    Used where tensors arrive uncompressed (the codec service's ``RawTensor``), with
    the same limits as headers so an oversized or inconsistent request is rejected
    before anything is allocated.
    """
    torch_dtype = _validate_dtype(dtype, "tensor.dtype")
    dims = _validate_shape(shape, "tensor.shape")
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
