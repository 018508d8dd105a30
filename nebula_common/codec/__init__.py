"""Tensor codecs for the WAN: a plug-in family selected by spec strings ("fp16", "int8", "fp16(svd(0.6))").

Importing this package registers the built-in codecs: ``none``, ``fp16``, ``bf16``,
``int8`` (per-tensor/row/block, optional stochastic rounding), ``int4``, ``topk``,
``svd``, ``lowrank``, ``powersgd``, ``zstd``, and the stream options ``ef``,
``delta``, ``start`` and ``auto`` (see ``stream_options``). Further codecs plug in with
``register_codec``.
"""

from nebula_common.codec import entropy, floating, lowrank, quantization, sparse  # noqa: F401  (registers codecs)
from nebula_common.codec.base import Codec, CodecError, reconstruction_error
from nebula_common.codec.registry import available_codecs, get_codec, parse_direction_pair, register_codec
from nebula_common.codec.stream_endpoints import TensorStreamDecoder, TensorStreamEncoder
from nebula_common.codec.stream_options import StreamConfig, canonical_spec, parse_stream_spec
from nebula_common.codec.wire_frames import FrameAssembler, to_frames
from nebula_common.codec.wire_header import EncodedTensor, WireFormatError
from nebula_common.codec.wire_tensor import decode_tensor, encode_tensor

__all__ = [
    "Codec",
    "CodecError",
    "EncodedTensor",
    "FrameAssembler",
    "StreamConfig",
    "TensorStreamDecoder",
    "TensorStreamEncoder",
    "WireFormatError",
    "available_codecs",
    "canonical_spec",
    "decode_tensor",
    "encode_tensor",
    "get_codec",
    "parse_direction_pair",
    "parse_stream_spec",
    "reconstruction_error",
    "register_codec",
    "to_frames",
]
