"""Tensor codecs for the WAN: a small plug-in family selected by spec strings ("fp16", "int8").

Importing this package registers the built-in codecs (none, fp16, bf16, int8);
further codecs plug in with ``register_codec``.
"""

from nebula_common.codec import floating, quantization  # noqa: F401  (registers the built-in codecs)
from nebula_common.codec.base import Codec, CodecError
from nebula_common.codec.registry import available_codecs, get_codec, parse_direction_pair, register_codec
from nebula_common.codec.stream import TensorStreamDecoder, TensorStreamEncoder
from nebula_common.codec.wire import (
    EncodedTensor,
    FrameAssembler,
    WireFormatError,
    decode_tensor,
    encode_tensor,
    to_frames,
)

__all__ = [
    "Codec",
    "CodecError",
    "EncodedTensor",
    "FrameAssembler",
    "TensorStreamDecoder",
    "TensorStreamEncoder",
    "WireFormatError",
    "available_codecs",
    "decode_tensor",
    "encode_tensor",
    "get_codec",
    "parse_direction_pair",
    "register_codec",
    "to_frames",
]
