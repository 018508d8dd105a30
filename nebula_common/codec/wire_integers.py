"""Exact integer payloads (token ids and the like): codec ``none``, raw bytes, the same checksummed header.

Kept apart from the floating path because no codec may ever touch these tensors: an id that
arrives quantized is a wrong id, so they get their own encoder and a stricter decoder.
"""

from __future__ import annotations

from typing import Any

import torch

from nebula_common.codec.base import (
    CodecError,
    element_size,
    numel,
    tensor_bytes_view,
    tensor_from_bytes,
    tensor_to_bytes,
)
from nebula_common.codec.wire_header import (
    CHECKSUM_VERSION,
    HEADER_FIELDS,
    EncodedTensor,
    WireFormatError,
    header_checksum,
    validate_shape,
)
from nebula_common.proto.nebula.v1 import tensor_pb2

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
