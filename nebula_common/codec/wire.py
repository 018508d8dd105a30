"""The self-describing WAN wire format: a ``TensorHeader`` plus an encoded payload, cut into frames.

This module is the format's one import point; each part lives in a module of its own:
the header, its limits and CRC (``wire_header``), floating tensors (``wire_tensor``),
exact integer tensors (``wire_integers``), frames (``wire_frames``) and uncompressed
tensors (``raw_tensor``).
"""

from nebula_common.codec.raw_tensor import raw_to_tensor, tensor_to_raw
from nebula_common.codec.wire_frames import DEFAULT_CHUNK_SIZE, FrameAssembler, to_frames
from nebula_common.codec.wire_header import (
    CHECKSUM_VERSION,
    HEADER_FIELDS,
    MAX_DIMS,
    MAX_ELEMENTS,
    MAX_PAYLOAD_BYTES,
    EncodedTensor,
    WireFormatError,
    header_checksum,
    validate_dtype,
    validate_shape,
)
from nebula_common.codec.wire_integers import (
    INTEGER_DTYPES,
    decode_integer_tensor,
    encode_integer_tensor,
    is_integer_header,
)
from nebula_common.codec.wire_tensor import decode_tensor, encode_tensor

__all__ = [
    "CHECKSUM_VERSION",
    "DEFAULT_CHUNK_SIZE",
    "HEADER_FIELDS",
    "INTEGER_DTYPES",
    "MAX_DIMS",
    "MAX_ELEMENTS",
    "MAX_PAYLOAD_BYTES",
    "EncodedTensor",
    "FrameAssembler",
    "WireFormatError",
    "decode_integer_tensor",
    "decode_tensor",
    "encode_integer_tensor",
    "encode_tensor",
    "header_checksum",
    "is_integer_header",
    "raw_to_tensor",
    "tensor_to_raw",
    "to_frames",
    "validate_dtype",
    "validate_shape",
]
