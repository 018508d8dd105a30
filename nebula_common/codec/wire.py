"""The self-describing WAN wire format: a ``TensorHeader`` plus an encoded payload, cut into frames.

Everything that crosses the WAN is untrusted in the sense that it may be truncated,
reordered or corrupted (or sent by a buggy peer), so the receiving side checks every
header field against every other before touching the payload. All failures are a
``WireFormatError`` naming the offending field: a bad frame must end as a clear
error, never as a crash in torch or numpy and never as a silently wrong tensor.
"""

from __future__ import annotations

import struct
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
    tensor_bytes_view,
    tensor_from_bytes,
    tensor_to_bytes,
)
from nebula_common.codec.checksum import crc32
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

CHECKSUM_VERSION = 1
"""``TensorHeader.checksum_version`` this library writes and requires: the CRC-32 covers the
decode-relevant header fields as well as the payload (``header_checksum``). Version 0 (the
payload-only CRC of earlier releases) let a header edited from shape [4,4] to [2,8], or from
float16 to bfloat16, decode silently wrong, so it is refused."""

_CHECKSUM_DOMAIN = b"nebula.v1.TensorHeader/crc1\0"
_U64 = struct.Struct("<Q")
_I64 = struct.Struct("<q")


def header_checksum(header: tensor_pb2.TensorHeader, payload: bytes | memoryview) -> int:
    """CRC-32 over the decode-relevant header fields, then the payload (checksum_version 1).

    Covered, in this order and encoding: a domain tag; dtype and codec as UTF-8, each
    NUL-terminated; the number of dimensions and each dimension (little-endian
    int64); payload_size and raw_size (little-endian uint64); delta (one byte) and
    delta_base_checksum (uint64). Routing fields (job, edge, direction, step,
    micro-batch, frame id) are not covered: the receiver checks them against its
    schedule, and switches may rely on them without recomputing the CRC.
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
        ]
    )
    return crc32(payload, crc32(meta))


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


def encode_tensor(
    tensor: torch.Tensor,
    spec: str,
    *,
    state: dict[str, object] | None = None,
    delta_base_checksum: int | None = None,
    borrow: bool = False,
    **header_fields: Any,
) -> EncodedTensor:
    """Encode ``tensor`` with the codec ``spec`` and build its header.

    dtype, shape, codec (canonical spec), payload_size, checksum and raw_size are
    derived here so they cannot disagree with the payload; routing fields (job_id,
    edge, direction, step, micro_batch, frame_id) come from ``header_fields``.
    ``state`` is the per-stream codec state (see ``Codec.encode``);
    ``delta_base_checksum`` marks the payload as a difference from the receiver's
    per-sample cache whose CRC-32 it is (set by ``TensorStreamEncoder``).
    ``borrow``: with codec ``none`` the payload is a read-only view of the tensor's memory
    (``tensor_bytes_view``) instead of a copy, for a caller that copies it before the tensor can
    change (the edge, which frames the whole payload while it queues it).
    """
    unknown = set(header_fields) - HEADER_FIELDS
    if unknown:
        raise TypeError(
            f"encode_tensor got unexpected header fields {sorted(unknown)}; allowed: {sorted(HEADER_FIELDS)}"
        )
    codec = get_codec(spec)
    tensor = check_input(tensor)
    if borrow and codec.spec == "none":
        payload: bytes | memoryview = tensor_bytes_view(tensor)
    else:
        payload = codec.encode(tensor, state)
    shape = tuple(tensor.shape)
    bound = codec.encoded_size(shape, tensor.dtype)
    if len(payload) > bound or (not codec.variable_size and len(payload) != bound):
        # A codec whose size prediction is wrong would have every receiver reject its frames.
        kind = "upper bound" if codec.variable_size else "encoded_size"
        raise CodecError(f"codec {codec.spec} produced {len(payload)} bytes but its {kind} is {bound}")
    header = tensor_pb2.TensorHeader(
        dtype=dtype_name(tensor.dtype),
        shape=shape,
        codec=codec.spec,
        payload_size=len(payload),
        raw_size=tensor.numel() * tensor.element_size(),
        checksum_version=CHECKSUM_VERSION,
        delta=delta_base_checksum is not None,
        delta_base_checksum=delta_base_checksum or 0,
        **header_fields,
    )
    header.checksum = header_checksum(header, payload)
    return EncodedTensor(header=header, payload=payload, note=codec.plan_note(shape, tensor.dtype))


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


def decode_tensor(header: tensor_pb2.TensorHeader, payload: bytes) -> torch.Tensor:
    """Validate ``header`` against ``payload`` and decode it; any inconsistency is a WireFormatError.

    Checks run cheapest first and the checksum last, so a corrupt header is
    reported as such rather than as a checksum mismatch.
    """
    if header.checksum_version != CHECKSUM_VERSION:
        raise WireFormatError(
            f"checksum_version: header has {header.checksum_version} but this receiver requires "
            f"{CHECKSUM_VERSION} (a CRC that also covers dtype, shape, codec and sizes)"
        )
    dtype = validate_dtype(header.dtype)
    shape = validate_shape(header.shape)
    try:
        codec = get_codec(header.codec)
    except CodecError as exc:
        raise WireFormatError(f"codec: {exc}") from None
    if not codec.wire:
        raise WireFormatError(
            f"codec: {codec.spec!r} configures a stream and never names a payload format; the sender "
            "must put the wire codec in the header"
        )
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
    try:
        expected = codec.encoded_size(shape, dtype)
    except CodecError as exc:
        raise WireFormatError(f"codec: {exc}") from None
    if codec.variable_size:
        if header.payload_size > expected:
            raise WireFormatError(
                f"payload_size: header says {header.payload_size} bytes but codec {codec.spec} encodes "
                f"shape {list(shape)} of {header.dtype} in at most {expected}"
            )
    elif header.payload_size != expected:
        raise WireFormatError(
            f"payload_size: header says {header.payload_size} bytes but codec {codec.spec} encodes "
            f"shape {list(shape)} of {header.dtype} in {expected}"
        )
    if not header.delta and header.delta_base_checksum:
        raise WireFormatError("delta_base_checksum: set on a frame whose delta flag is false")
    checksum = header_checksum(header, payload)
    if checksum != header.checksum:
        raise WireFormatError(
            f"checksum: CRC-32 of header fields and payload is {checksum:#010x} but header says "
            f"{header.checksum:#010x} (payload or a decode-relevant header field was altered)"
        )
    try:
        return codec.decode(payload, shape, dtype)
    except CodecError as exc:
        raise WireFormatError(f"payload: {exc}") from None
    except (RuntimeError, ValueError, IndexError, OverflowError) as exc:
        # Codecs validate their payloads explicitly; this net turns anything they
        # missed into the same named error instead of a crash in numpy or torch.
        raise WireFormatError(f"payload: {codec.spec} payload is inconsistent: {exc}") from None


INTEGER_DTYPES: dict[str, torch.dtype] = {"int64": torch.int64, "int32": torch.int32}
"""Integer dtypes that travel exactly (codec ``none``, raw little-endian bytes), e.g. token ids.

Codecs compress floating tensors only; an integer tensor is never quantized or
sparsified, whatever the edge's float codec is, so ids arrive bit-exact."""


def encode_integer_tensor(
    tensor: torch.Tensor, *, borrow: bool = False, **header_fields: Any
) -> EncodedTensor:
    """Encode an integer tensor exactly: codec ``none``, the raw bytes, the same checksummed header.

    ``borrow``: the payload is a view of the tensor's memory, as in ``encode_tensor``."""
    unknown = set(header_fields) - HEADER_FIELDS
    if unknown:
        raise TypeError(f"encode_integer_tensor got unexpected header fields {sorted(unknown)}")
    names = {dtype: name for name, dtype in INTEGER_DTYPES.items()}
    if not isinstance(tensor, torch.Tensor) or tensor.dtype not in names:
        got = tensor.dtype if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise CodecError(f"exact integer payloads are {', '.join(INTEGER_DTYPES)}, got {got}")
    if tensor.device.type != "cpu" or tensor.layout != torch.strided:
        raise CodecError(f"integer payloads must be dense CPU tensors, got {tensor.device} {tensor.layout}")
    payload = tensor_bytes_view(tensor) if borrow else tensor_to_bytes(tensor)
    header = tensor_pb2.TensorHeader(
        dtype=names[tensor.dtype],
        shape=tuple(tensor.shape),
        codec="none",
        payload_size=len(payload),
        raw_size=len(payload),
        checksum_version=CHECKSUM_VERSION,
        **header_fields,
    )
    header.checksum = header_checksum(header, payload)
    return EncodedTensor(header=header, payload=payload)


def is_integer_header(header: tensor_pb2.TensorHeader) -> bool:
    """True when the header announces an exact integer payload (see ``encode_integer_tensor``)."""
    return header.dtype in INTEGER_DTYPES


def decode_integer_tensor(header: tensor_pb2.TensorHeader, payload: bytes) -> torch.Tensor:
    """Validate and decode an exact integer payload; any inconsistency is a WireFormatError."""
    if header.checksum_version != CHECKSUM_VERSION:
        raise WireFormatError(
            f"checksum_version: header has {header.checksum_version}, need {CHECKSUM_VERSION}"
        )
    dtype = INTEGER_DTYPES.get(header.dtype)
    if dtype is None:
        raise WireFormatError(f"dtype: {header.dtype!r} is not an exact integer dtype")
    if header.codec != "none" or header.delta:
        raise WireFormatError(f"codec: integer payloads travel with codec none, got {header.codec!r}")
    shape = validate_shape(header.shape)
    raw_size = numel(shape) * element_size(dtype)
    if header.raw_size != raw_size or header.payload_size != raw_size or len(payload) != raw_size:
        raise WireFormatError(
            f"payload_size: shape {list(shape)} of {header.dtype} is {raw_size} bytes but the header says "
            f"{header.payload_size} (raw {header.raw_size}) and {len(payload)} arrived"
        )
    checksum = header_checksum(header, payload)
    if checksum != header.checksum:
        raise WireFormatError(f"checksum: CRC-32 is {checksum:#010x} but header says {header.checksum:#010x}")
    return tensor_from_bytes(payload, dtype, shape)


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
