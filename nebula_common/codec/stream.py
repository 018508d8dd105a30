"""Per-edge, per-direction codec streams: the one import point for stream options and endpoints.

The parts live in modules of their own: the option spec values and ``StreamConfig``
(``stream_options``), the delta cache (``delta_cache``) and the encoder and decoder
(``stream_endpoints``).
"""

from nebula_common.codec.delta_cache import DeltaCache
from nebula_common.codec.stream_endpoints import (
    StreamEnd,
    StreamStats,
    TensorStreamDecoder,
    TensorStreamEncoder,
)
from nebula_common.codec.stream_options import (
    AUTO,
    DEFAULT_DELTA_CACHE,
    MAX_DELTA_CACHE,
    StreamConfig,
    StreamOption,
    StreamOptions,
    canonical_spec,
    parse_stream_spec,
)

__all__ = [
    "AUTO",
    "DEFAULT_DELTA_CACHE",
    "MAX_DELTA_CACHE",
    "DeltaCache",
    "StreamConfig",
    "StreamEnd",
    "StreamOption",
    "StreamOptions",
    "StreamStats",
    "TensorStreamDecoder",
    "TensorStreamEncoder",
    "canonical_spec",
    "parse_stream_spec",
]
