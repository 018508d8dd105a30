"""Encode a floating tensor into a checksummed header plus payload, and validate and decode one.

The header is derived from the tensor and the payload here, in one place, so a sender
cannot build one that disagrees with its payload; the receiver checks every field against
every other (cheapest first, the checksum last) before a codec touches the bytes.
"""

from __future__ import annotations

from typing import Any

import torch

from nebula_common.codec.base import (
    CodecError,
    check_input,
    dtype_name,
    element_size,
    numel,
    tensor_bytes_view,
)
from nebula_common.codec.registry import get_codec
from nebula_common.codec.row_elision import Rows, read_bitmap, unpack
from nebula_common.codec.wire_header import (
    CHECKSUM_VERSION,
    HEADER_FIELDS,
    EncodedTensor,
    WireFormatError,
    header_checksum,
    validate_dtype,
    validate_shape,
)
from nebula_common.proto.nebula.v1 import tensor_pb2


def encode_tensor(
    tensor: torch.Tensor,
    spec: str,
    *,
    state: dict[str, object] | None = None,
    delta_base_checksum: int | None = None,
    borrow: bool = False,
    rows: Rows | None = None,
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
    ``rows``: ``tensor`` is the present rows of a larger tensor (``row_elision.pack``); the header
    describes the whole tensor and names the rows in ``present_rows``.
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
    if rows is not None and shape != rows.packed_shape:
        raise CodecError(f"packed rows have shape {list(shape)}, expected {list(rows.packed_shape)}")
    bound = codec.encoded_size(shape, tensor.dtype)
    if len(payload) > bound or (not codec.variable_size and len(payload) != bound):
        # A codec whose size prediction is wrong would have every receiver reject its frames.
        kind = "upper bound" if codec.variable_size else "encoded_size"
        raise CodecError(f"codec {codec.spec} produced {len(payload)} bytes but its {kind} is {bound}")
    whole = shape if rows is None else rows.shape
    header = tensor_pb2.TensorHeader(
        dtype=dtype_name(tensor.dtype),
        shape=whole,
        codec=codec.spec,
        payload_size=len(payload),
        raw_size=numel(whole) * tensor.element_size(),
        present_rows=b"" if rows is None else rows.bitmap,
        checksum_version=CHECKSUM_VERSION,
        delta=delta_base_checksum is not None,
        delta_base_checksum=delta_base_checksum or 0,
        **header_fields,
    )
    header.checksum = header_checksum(header, payload)
    return EncodedTensor(header=header, payload=payload, note=codec.plan_note(shape, tensor.dtype))


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
    rows = read_bitmap(header.present_rows, shape) if header.present_rows else None
    if rows is not None:
        shape = rows.packed_shape  # what the codec encoded: the present rows alone
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
        decoded = codec.decode(payload, shape, dtype)
        return decoded if rows is None else unpack(decoded, rows)
    except CodecError as exc:
        raise WireFormatError(f"payload: {exc}") from None
    except (RuntimeError, ValueError, IndexError, OverflowError) as exc:
        # Codecs validate their payloads explicitly; this net turns anything they
        # missed into the same named error instead of a crash in numpy or torch.
        raise WireFormatError(f"payload: {codec.spec} payload is inconsistent: {exc}") from None
